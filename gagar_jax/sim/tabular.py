"""Design A of round three: a tabular policy that makes the first-order channel measurable.

The policy is a table of logits, one row per position of a fixed-length trajectory over a
vocabulary of V tokens: positions 0 .. L-2 are *filler* (the outcome ignores them), position
L-1 is the *answer*. Filler rows start Zipf-shaped (top token 0.95, entropy ~0.4 nats); the
answer row puts mass on a few answer tokens whose tier and rank the grader table turns into
quality factors (pass rate ~0.5, mean pass factor f_bar ~0.55). A trajectory samples every
position independently, so the filler never affects the reward.

Why this shows the channel: the policy-gradient of a filler row is sum_i A_i (e_{y_i} - pi).
With a zero-sum arm (binary, sum-preserving) `sum_i A_i = 0` per group, so tokens nobody sampled
get exactly zero gradient; with a net-negative arm (downweight-only, the control) they get
`-net * pi_k > 0`: mass pushed onto them. Exact sampling makes that push cancel in expectation
against the sampled tokens (E[grad log pi] = 0); top-p sampling with untruncated behaviour
log-probs never samples the tail, so nothing cancels it.

The real math: advantages are `gagar_advantages` (the control through the library's
downweight-only mode with direct factors and rule-9 adjustments, as `sim/arms.py` does), the
loss is `policy_loss.policy_loss` (PPO objective, token-mean; one update per batch at ratio 1,
so no clip acts) and the updates are optax's adam / sgd. Every run of one optimizer is one
vmapped, jitted program: runs = arms x samplers x seeds; seeds share sampling noise across
arms (common random numbers). `run` is resumable in chunks (`scripts/miniature_tabular.py`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gagar_jax import grading
from gagar_jax.algo.advantage import broadcast_to_tokens, gagar_advantages
from gagar_jax.algo.loss import LossConfig
from gagar_jax.algo.policy_loss import policy_loss

# (name, library mode, lam_cap): every arm of Design A; the control is `mode=None`.
ARMS = (("binary", "binary", 1.5), ("sum_preserving", "sum_preserving", 1e9),
        ("sum_preserving_cap", "sum_preserving", 1.5), ("downweight_only", "downweight_only", 1.5),
        ("control", None, 1.5))
ARM_NAMES = tuple(a[0] for a in ARMS)
SAMPLERS = ("exact", "top_p")
OPTIMIZERS = ("adam", "sgd")
# Answer tokens 0..5 pass: (tier, rank) per the grader's table; token 6 and the tail fail.
ANSWER_TIERS = np.array([grading.STRONG, grading.STRONG, grading.INTERMEDIATE,
                         grading.INTERMEDIATE, grading.INTERMEDIATE, grading.DEFECTIVE], np.int32)
ANSWER_RANKS = np.array([1, 2, 1, 2, 3, 1], np.int32)
NUM_PASS = len(ANSWER_TIERS)
DEFAULT_TABLE = grading.FactorTable()


@dataclasses.dataclass(frozen=True)
class TabularConfig:
    """Design A's settings (pre-registered in docs/miniature.md, round three)."""
    vocab: int = 4096                # V
    length: int = 16                 # L: 15 filler positions + the answer
    groups: int = 16                 # groups per step
    group_size: int = 8              # rollouts per group
    steps: int = 200
    seeds: int = 8
    top_p: float = 0.9
    filler_top: float = 0.95         # initial top-token probability of a filler row
    filler_entropy: float = 0.4      # initial filler entropy (nats): sets the Zipf tail exponent
    # Initial answer masses of the pass tokens (strong r1, r2; intermediate r1-3; defective) and
    # of the top failing token; the rest of the row (the vocabulary's tail) fails too.
    answer_pass: tuple = (0.02, 0.02, 0.08, 0.09, 0.12, 0.17)
    answer_fail_top: float = 0.42
    lr: tuple = (("adam", 3e-3), ("sgd", 1.0))   # calibrated on binary, exact sampling
    chunk: int = 25                  # steps per jitted chunk (the resume granularity)
    arms: tuple = ARM_NAMES          # a subset for calibration (binary only)
    samplers: tuple = SAMPLERS

    @property
    def filler(self) -> int:
        return self.length - 1

    @property
    def trajectories(self) -> int:
        return self.groups * self.group_size

    def learning_rate(self, optimizer: str) -> float:
        return dict(self.lr)[optimizer]

    @classmethod
    def quick(cls) -> TabularConfig:
        """The test suite's variant: small vocabulary and batch, few steps and seeds."""
        return cls(vocab=512, length=8, groups=8, steps=12, seeds=2, chunk=6)


def zipf_tail_exponent(vocab: int, top: float, entropy: float) -> float:
    """s such that [top, (1 - top) k^-s / sum, k = 2..V] has the given entropy (bisection)."""
    k = np.arange(2, vocab + 1, dtype=np.float64)

    def ent(s: float) -> float:
        w = k ** -s
        p = np.concatenate([[top], (1 - top) * w / w.sum()])
        return float(-(p * np.log(p)).sum())
    lo, hi = 0.01, 20.0
    if not ent(hi) <= entropy <= ent(lo):
        raise ValueError(f"filler entropy {entropy} unreachable with top {top} over {vocab}")
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if ent(mid) > entropy else (lo, mid)
    return 0.5 * (lo + hi)


def initial_logits(cfg: TabularConfig) -> np.ndarray:
    """f32[L, V] log-probabilities: Zipf filler rows, the answer row last."""
    V = cfg.vocab
    s = zipf_tail_exponent(V, cfg.filler_top, cfg.filler_entropy)
    w = np.arange(2, V + 1, dtype=np.float64) ** -s
    filler = np.concatenate([[cfg.filler_top], (1 - cfg.filler_top) * w / w.sum()])
    head = np.array(cfg.answer_pass + (cfg.answer_fail_top,), np.float64)
    rest = 1.0 - head.sum()
    if rest <= 0:
        raise ValueError("answer masses must leave room for the failing tail")
    wt = np.arange(1, V - len(head) + 1, dtype=np.float64) ** -1.0
    answer = np.concatenate([head, rest * wt / wt.sum()])
    rows = np.stack([filler] * cfg.filler + [answer])
    return np.log(rows).astype(np.float32)


def entropy(logits_LxV: jax.Array) -> jax.Array:
    """f32[L] entropy of each row's softmax."""
    logp = jax.nn.log_softmax(logits_LxV, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def nucleus(probs_LxV: jax.Array, top_p: float) -> jax.Array:
    """bool[L, V]: the smallest set of most likely tokens of each row with mass >= top_p (as
    `sim/sampler.py`; ties at the threshold are kept)."""
    s = -jnp.sort(-probs_LxV, axis=-1)
    keep = (jnp.cumsum(s, axis=-1) - s) < top_p
    thr = jnp.min(jnp.where(keep, s, jnp.inf), axis=-1, keepdims=True)
    return probs_LxV >= thr


def sample(probs_LxV: jax.Array, u_NxL: jax.Array) -> jax.Array:
    """int32[N, L] tokens by inverse CDF of each row (u uniform in [0, 1))."""
    cdf = jnp.cumsum(probs_LxV, axis=-1)
    cdf = cdf / cdf[:, -1:]
    idx = jax.vmap(lambda c, u: jnp.searchsorted(c, u, side="right"), in_axes=(0, 1),
                   out_axes=1)(cdf, u_NxL)
    return jnp.minimum(idx, probs_LxV.shape[-1] - 1).astype(jnp.int32)


def table_factors(tier_T: jax.Array, rank_T: jax.Array, passed_T: jax.Array, gid_T: jax.Array,
                  num_groups: int, table: grading.FactorTable = DEFAULT_TABLE) -> jax.Array:
    """The grader table's factors in jnp (same rule as `grading.quality_factors`): r_min / r_max
    per (group, tier) over passes; 1 for non-passes."""
    seg = jnp.where(passed_T, gid_T * 3 + tier_T, num_groups * 3)
    r = rank_T.astype(jnp.float32)
    r_min = jax.ops.segment_min(jnp.where(passed_T, r, jnp.inf), seg, num_groups * 3 + 1)[seg]
    r_max = jax.ops.segment_max(jnp.where(passed_T, r, -jnp.inf), seg, num_groups * 3 + 1)[seg]
    frac = jnp.where(r_max > r_min, (r - r_min) / jnp.where(r_max > r_min, r_max - r_min, 1.0),
                     0.0)
    strong = jnp.where(r == r_min, table.strong_best, table.strong_other)
    inter = table.intermediate_best - (table.intermediate_best - table.intermediate_worst) * frac
    f = jnp.select([tier_T == grading.STRONG, tier_T == grading.INTERMEDIATE],
                   [strong, inter], table.defective)
    return jnp.where(passed_T, f, 1.0).astype(jnp.float32)


def arm_advantages(rewards_T: jax.Array, factors_T: jax.Array, gid_T: jax.Array,
                   num_groups: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per arm (`ARMS` order): advantages [A, T], lambda [A, G], capped [A, G]."""
    T = rewards_T.shape[0]
    valid, hacked = jnp.ones((T,), bool), jnp.zeros((T,), bool)
    ok = jnp.ones((num_groups,), bool)
    seg = functools.partial(jax.ops.segment_sum, segment_ids=gid_T, num_segments=num_groups)
    k, n = seg(rewards_T), seg(jnp.ones_like(rewards_T))
    p = (k / n)[gid_T]
    fbar = (seg(rewards_T * factors_T) / jnp.maximum(k, 1.0))[gid_T]
    advs, lams, caps = [], [], []
    for _, mode, cap in ARMS:
        if mode is None:     # the control: downweight-only with f_bar and a zero-mean shift
            out = gagar_advantages(rewards_T, gid_T, jnp.where(rewards_T > 0, fbar, 1.0), valid,
                                   hacked, ok, num_groups=num_groups, lam_cap=cap,
                                   mode="downweight_only",
                                   adjustments=(1.0 - fbar) * (1.0 - p) * (rewards_T - p))
        else:
            out = gagar_advantages(rewards_T, gid_T, factors_T, valid, hacked, ok,
                                   num_groups=num_groups, lam_cap=cap, mode=mode)
        advs.append(out.advantages)
        lams.append(out.lam)
        caps.append(out.capped)
    return jnp.stack(advs), jnp.stack(lams), jnp.stack(caps)


LOSS_CFG = LossConfig(aggregation="token-mean")


def loss_fn(logits_LxV: jax.Array, tokens_NxL: jax.Array, adv_T: jax.Array
            ) -> tuple[jax.Array, dict]:
    """The library's policy loss of one batch; behaviour log-probs = the untruncated policy."""
    N, L = tokens_NxL.shape
    logp_LxV = jax.nn.log_softmax(logits_LxV, axis=-1)
    logp_NxL = jnp.take_along_axis(logp_LxV.T, tokens_NxL, axis=0)  # [V, L] gathered by rows
    mask = jnp.ones((N, L), jnp.float32)
    traj = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32)[:, None], (N, L))
    adv_NxL = broadcast_to_tokens(adv_T, traj, mask)
    return policy_loss(logp_NxL, jax.lax.stop_gradient(logp_NxL), adv_NxL, mask, LOSS_CFG)


def make_optimizer(name: str, lr: float) -> optax.GradientTransformation:
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")
    return optax.adam(lr) if name == "adam" else optax.sgd(lr)


def run_index(cfg: TabularConfig) -> dict:
    """Per run r of one optimizer's program: arm index, sampler index (0 exact, 1 top-p), seed."""
    arms = [ARM_NAMES.index(a) for a in cfg.arms]
    samplers = [SAMPLERS.index(s) for s in cfg.samplers]
    a, s, seed = np.meshgrid(arms, samplers, np.arange(cfg.seeds), indexing="ij")
    return {"arm": a.ravel().astype(np.int32), "sampler": s.ravel().astype(np.int32),
            "seed": seed.ravel().astype(np.int32)}


def _one_step(cfg: TabularConfig, opt: optax.GradientTransformation, key: jax.Array,
              t: jax.Array, logits: jax.Array, opt_state: optax.OptState, arm: jax.Array,
              topp: jax.Array, seed: jax.Array) -> tuple:
    """One RL step of one run: sample, grade, advantages, loss, update; returns metrics."""
    L, N, G, n = cfg.length, cfg.trajectories, cfg.groups, cfg.group_size
    probs = jax.nn.softmax(logits, axis=-1)
    keep = jnp.where(topp, nucleus(probs, cfg.top_p), True)
    z_L = jnp.sum(jnp.where(keep, probs, 0.0), axis=-1)          # nucleus mass = IS weight pi/q
    q = jnp.where(keep, probs, 0.0)
    u = jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, seed), t), (N, L))
    tokens = sample(q, u)
    ans = tokens[:, -1]
    passed = ans < NUM_PASS
    tier = jnp.asarray(ANSWER_TIERS)[jnp.minimum(ans, NUM_PASS - 1)]
    rank = jnp.asarray(ANSWER_RANKS)[jnp.minimum(ans, NUM_PASS - 1)]
    gid = jnp.arange(N, dtype=jnp.int32) // n
    rewards = passed.astype(jnp.float32)
    factors = table_factors(tier, rank, passed, gid, G)
    advs, lams, caps = arm_advantages(rewards, factors, gid, G)
    adv = advs[arm]
    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(logits, tokens, adv)
    updates, opt_state = opt.update(grads, opt_state, logits)
    new_logits = optax.apply_updates(logits, updates)
    seg = functools.partial(jax.ops.segment_sum, segment_ids=gid, num_segments=G)
    k = seg(rewards)
    mixed = (k > 0) & (k < n)
    n_mixed = jnp.maximum(jnp.sum(mixed), 1)
    fbar_G = seg(rewards * factors) / jnp.maximum(k, 1.0)
    ent = entropy(logits)
    # Mass the update moved onto filler tokens no rollout sampled this step.
    sampled = jnp.zeros((L, cfg.vocab), bool).at[jnp.arange(L)[None, :], tokens].set(True)
    gain = jnp.sum(jnp.where(sampled, 0.0, jax.nn.softmax(new_logits, -1) - probs), -1)
    pass_prob = jnp.sum(q[-1, :NUM_PASS]) / jnp.sum(q[-1])
    strong = jnp.sum(q[-1, :2]) / jnp.maximum(jnp.sum(q[-1, :NUM_PASS]), 1e-12)
    metrics = {
        "entropy_filler": jnp.mean(ent[:-1]), "entropy_answer": ent[-1],
        "top_filler": jnp.mean(probs[:-1, 0]),
        "unproposed_filler": 1.0 - jnp.mean(z_L[:-1]),     # pi mass outside the nucleus
        "unproposed_answer": 1.0 - z_L[-1],
        "nucleus_filler": jnp.mean(jnp.sum(keep[:-1], -1).astype(jnp.float32)),
        "log_is_seq": jnp.sum(jnp.log(z_L)),                # log prod_t pi/q of every sequence
        "is_token_filler": jnp.mean(z_L[:-1]), "is_token_answer": z_L[-1],
        "unsampled_gain_filler": jnp.mean(gain[:-1]),
        "pass_rate": jnp.mean(rewards), "pass_prob": pass_prob, "strong_share": strong,
        "mixed_groups": jnp.sum(mixed).astype(jnp.float32),
        "fbar": jnp.sum(jnp.where(mixed, fbar_G, 0.0)) / n_mixed,
        "net_credit_per_seq": jnp.mean(adv),
        "lam_mean": jnp.sum(jnp.where(mixed, lams[arm], 0.0)) / n_mixed,
        "cap_rate": jnp.sum(caps[arm]) / n_mixed,
        "loss": loss, "grad_norm": optax.tree.norm(grads),
    }
    return new_logits, opt_state, metrics


def _chunk_fn(cfg: TabularConfig, optimizer: str) -> tuple:
    # The step count and the run subset do not change the compiled chunk: one cache entry.
    return _chunk_fn_cached(dataclasses.replace(cfg, steps=cfg.chunk, arms=ARM_NAMES,
                                                samplers=SAMPLERS), optimizer)


@functools.lru_cache(maxsize=8)
def _chunk_fn_cached(cfg: TabularConfig, optimizer: str) -> tuple:
    opt = make_optimizer(optimizer, cfg.learning_rate(optimizer))

    def per_run(*args: jax.Array) -> tuple:
        key, t, logits, opt_state, arm, topp, seed = args
        return _one_step(cfg, opt, key, t, logits, opt_state, arm, topp, seed)

    vstep = jax.vmap(per_run, in_axes=(None, None, 0, 0, 0, 0, 0))

    @jax.jit
    def chunk(*args: jax.Array) -> tuple:
        key, t0, logits, opt_state, arm, topp, seed = args

        def body(carry: tuple, t: jax.Array) -> tuple:
            lg, st = carry
            lg, st, m = vstep(key, t, lg, st, arm, topp, seed)
            return (lg, st), m
        (logits, opt_state), ms = jax.lax.scan(body, (logits, opt_state),
                                               t0 + jnp.arange(cfg.chunk))
        return logits, opt_state, ms
    return chunk, opt


def run(cfg: TabularConfig, optimizer: str, workdir: str | None = None, *, key_seed: int = 0,
        log: Callable[[str], None] = print) -> dict:
    """Every run of one optimizer (`run_index`), `cfg.steps` steps; resumable per chunk.

    Returns:
      {"index": run_index, "metrics": {name: f32[R, steps]}, "final_entropy_filler": f32[R],
       "final_entropy_answer": f32[R], "seconds": float}.
    """
    if cfg.steps % cfg.chunk:
        raise ValueError(f"steps ({cfg.steps}) must be a multiple of chunk ({cfg.chunk})")
    idx = run_index(cfg)
    R = idx["arm"].size
    chunk, opt = _chunk_fn(cfg, optimizer)
    logits = jnp.broadcast_to(jnp.asarray(initial_logits(cfg)), (R, cfg.length, cfg.vocab))
    opt_state = jax.vmap(opt.init)(logits)
    done, hist, seconds = 0, [], 0.0
    path = None if workdir is None else os.path.join(workdir, f"tabular-{optimizer}.npz")
    if path and os.path.exists(path):
        with np.load(path, allow_pickle=False) as z:
            done, seconds = int(z["done"]), float(z["seconds"])
            logits = jnp.asarray(z["logits"])
            leaves = [jnp.asarray(z[f"opt_{i}"]) for i in range(int(z["opt_leaves"]))]
            opt_state = jax.tree.unflatten(jax.tree.structure(opt_state), leaves)
            hist = [{k[2:]: z[k] for k in z.files if k.startswith("m_")}]
        log(f"{optimizer}: resumed at step {done}")
    key = jax.random.key(key_seed)
    args = tuple(jnp.asarray(idx[k]) for k in ("arm", "sampler", "seed"))
    while done < cfg.steps:
        t0 = time.perf_counter()
        logits, opt_state, ms = chunk(key, jnp.int32(done), logits, opt_state, args[0],
                                      args[1].astype(bool), args[2])
        hist.append({k: np.asarray(v).T for k, v in ms.items()})   # [R, chunk]
        done += cfg.chunk
        seconds += time.perf_counter() - t0
        if path:
            merged = {k: np.concatenate([h[k] for h in hist], 1) for k in hist[0]}
            hist = [merged]
            leaves = jax.tree.leaves(opt_state)
            os.makedirs(workdir, exist_ok=True)
            with open(path + ".tmp", "wb") as f:
                np.savez(f, done=done, seconds=seconds, logits=np.asarray(logits),
                         opt_leaves=len(leaves),
                         **{f"opt_{i}": np.asarray(x) for i, x in enumerate(leaves)},
                         **{f"m_{k}": v for k, v in merged.items()})
            os.replace(path + ".tmp", path)
        log(f"{optimizer}: step {done}/{cfg.steps} ({time.perf_counter() - t0:.1f} s)")
    metrics = {k: np.concatenate([h[k] for h in hist], 1) for k in hist[0]}
    final = np.asarray(jax.vmap(entropy)(logits))
    return {"index": idx, "metrics": metrics, "final_entropy_filler": final[:, :-1].mean(1),
            "final_entropy_answer": final[:, -1], "seconds": seconds}


@functools.partial(jax.jit, static_argnums=1)
def _step0_arrays(lg: jax.Array, top_p: float) -> tuple:
    """(policy, entropy, nucleus, nucleus-truncated policy) of the logits: one program (op by op,
    each op would be a compile of its own)."""
    p = jax.nn.softmax(lg, -1)
    keep = nucleus(p, top_p)
    return p, entropy(lg), keep, jnp.where(keep, p, 0.0)


def step0_report(cfg: TabularConfig) -> dict:
    """The initial policy's analytic figures (entropy, pass probability under each sampler)."""
    p, ent, keep, q = _step0_arrays(jnp.asarray(initial_logits(cfg)), cfg.top_p)
    out = {"entropy_filler": float(ent[:-1].mean()), "entropy_answer": float(ent[-1]),
           "top_filler": float(p[0, 0]), "pass_prob_exact": float(p[-1, :NUM_PASS].sum())}
    out["pass_prob_top_p"] = float(q[-1, :NUM_PASS].sum() / q[-1].sum())
    out["nucleus_filler"] = int(keep[0].sum())
    out["nucleus_answer"] = int(keep[-1].sum())
    out["zipf_exponent"] = zipf_tail_exponent(cfg.vocab, cfg.filler_top, cfg.filler_entropy)
    return {k: (round(v, 4) if isinstance(v, float) and math.isfinite(v) else v)
            for k, v in out.items()}

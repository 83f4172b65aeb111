"""Round four's tabular dose-response (docs/miniature.md, "Round four", item 4).

Round three's Design A (`sim/tabular.py`) put a net-negative credit of about -0.1 per trajectory
on a table of logits and measured the entropy of the filler rows the nucleus never proposes.
Here the net credit is the dose: the arm `shift c` is binary's outcome advantages plus a
constant c on every trajectory of a mixed group (net credit c per trajectory there; no quality
signal, so it isolates the net-credit channel), compared with `binary` (c = 0) under common
random numbers, for c in `SHIFTS`. Two parameterisations of the logits:

* `table`: round three's f32[L, V] table (every token its own parameter);
* `factor`: logits = base + h_LxD @ U_DxV with D = 32, base = round three's initial table
  (frozen), h random unit rows (trained), U = 0 (trained): the same initial policy, but every
  token's logit moves through a column of U that all positions share.

Everything else is round three's Design A (sampling, grader, loss, optimizers and their frozen
learning rates). One vmapped, jitted program per (optimizer, parameterisation): runs = arms x
samplers x seeds.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gagar_jax.algo.advantage import gagar_advantages
from gagar_jax.sim import tabular as T

SHIFTS = (-0.025, -0.05, -0.1, -0.2)
ARM_NAMES = ("binary",) + tuple(f"shift{c:g}" for c in SHIFTS)
PARAMS = ("table", "factor")


@dataclasses.dataclass(frozen=True)
class DoseConfig:
    """The dose-response design (pre-registered in docs/miniature.md, round four)."""
    tab: T.TabularConfig = T.TabularConfig(seeds=4)
    shifts: tuple = SHIFTS
    dim: int = 32                    # D of the factorised unembedding

    @classmethod
    def quick(cls) -> DoseConfig:
        return cls(tab=T.TabularConfig.quick(), dim=8)

    @property
    def offsets(self) -> np.ndarray:
        """f32[A]: each arm's constant (binary first)."""
        return np.array((0.0,) + tuple(self.shifts), np.float32)


def shift_advantages(rewards_T: jax.Array, gid_T: jax.Array, num_groups: int,
                     c: jax.Array) -> jax.Array:
    """f32[T]: binary's advantages plus c on every trajectory of a mixed group."""
    T_ = rewards_T.shape[0]
    out = gagar_advantages(rewards_T, gid_T, jnp.ones((T_,), jnp.float32), jnp.ones((T_,), bool),
                           jnp.zeros((T_,), bool), jnp.ones((num_groups,), bool),
                           num_groups=num_groups, mode="binary")
    seg = functools.partial(jax.ops.segment_sum, segment_ids=gid_T, num_segments=num_groups)
    k, n = seg(rewards_T), seg(jnp.ones_like(rewards_T))
    mixed_T = ((k > 0) & (k < n))[gid_T]
    return out.advantages + jnp.where(mixed_T, c, 0.0)


def init_params(cfg: DoseConfig, param: str) -> dict:
    """The trained parameters of one run (identical for every run)."""
    L, V = cfg.tab.length, cfg.tab.vocab
    if param == "table":
        return {"logits": jnp.asarray(T.initial_logits(cfg.tab))}
    if param != "factor":
        raise ValueError(f"param must be one of {PARAMS}, got {param!r}")
    h = np.random.default_rng(0).standard_normal((L, cfg.dim)).astype(np.float32)
    h /= np.linalg.norm(h, axis=1, keepdims=True)
    return {"h": jnp.asarray(h), "U": jnp.zeros((cfg.dim, V), jnp.float32)}


def logits_of(cfg: DoseConfig, params: dict) -> jax.Array:
    """f32[L, V] logits of one run's parameters."""
    if "logits" in params:
        return params["logits"]
    return jnp.asarray(T.initial_logits(cfg.tab)) + params["h"] @ params["U"]


def _one_step(cfg: DoseConfig, opt: optax.GradientTransformation, key: jax.Array, t: jax.Array,
              params: dict, opt_state: optax.OptState, c: jax.Array, topp: jax.Array,
              seed: jax.Array) -> tuple:
    tc = cfg.tab
    N, G, n = tc.trajectories, tc.groups, tc.group_size
    logits = logits_of(cfg, params)
    probs = jax.nn.softmax(logits, axis=-1)
    keep = jnp.where(topp, T.nucleus(probs, tc.top_p), True)
    q = jnp.where(keep, probs, 0.0)
    u = jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, seed), t), (N, tc.length))
    tokens = T.sample(q, u)
    passed = tokens[:, -1] < T.NUM_PASS
    gid = jnp.arange(N, dtype=jnp.int32) // n
    rewards = passed.astype(jnp.float32)
    adv = shift_advantages(rewards, gid, G, c)

    def loss(p: dict) -> jax.Array:
        return T.loss_fn(logits_of(cfg, p), tokens, adv)[0]
    grads = jax.grad(loss)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    ent = T.entropy(logits)
    metrics = {"entropy_filler": jnp.mean(ent[:-1]), "entropy_answer": ent[-1],
               "top_filler": jnp.mean(probs[:-1, 0]),
               "unproposed_filler": 1.0 - jnp.mean(jnp.sum(q[:-1], -1)),
               "pass_prob": jnp.sum(q[-1, :T.NUM_PASS]) / jnp.sum(q[-1]),
               "net_credit_per_seq": jnp.mean(adv)}
    return params, opt_state, metrics


@functools.lru_cache(maxsize=8)
def _program(cfg: DoseConfig, optimizer: str, param: str) -> tuple:
    opt = T.make_optimizer(optimizer, cfg.tab.learning_rate(optimizer))
    step = functools.partial(_one_step, cfg, opt)
    vstep = jax.vmap(step, in_axes=(None, None, 0, 0, 0, 0, 0))

    @jax.jit
    def program(key: jax.Array, params: dict, opt_state: optax.OptState, c: jax.Array,
                topp: jax.Array, seed: jax.Array) -> tuple:
        def body(carry: tuple, t: jax.Array) -> tuple:
            p, s = carry
            p, s, m = vstep(key, t, p, s, c, topp, seed)
            return (p, s), m
        (params, _), ms = jax.lax.scan(body, (params, opt_state), jnp.arange(cfg.tab.steps))
        return params, ms
    return program, opt


def run_index(cfg: DoseConfig) -> dict:
    """Per run r of one program: arm index (0 = binary), sampler (0 exact, 1 top-p), seed."""
    a, s, seed = np.meshgrid(np.arange(len(cfg.offsets)), np.arange(len(T.SAMPLERS)),
                             np.arange(cfg.tab.seeds), indexing="ij")
    return {"arm": a.ravel().astype(np.int32), "sampler": s.ravel().astype(np.int32),
            "seed": seed.ravel().astype(np.int32)}


def run(cfg: DoseConfig, optimizer: str, param: str, *, key_seed: int = 0,
        log: Callable[[str], None] = print) -> dict:
    """Every run of one (optimizer, parameterisation), `cfg.tab.steps` steps.

    Returns:
      {"index": run_index, "metrics": {name: f32[R, steps]}, "final_entropy_filler": f32[R],
       "seconds": float}.
    """
    idx = run_index(cfg)
    R = idx["arm"].size
    program, opt = _program(cfg, optimizer, param)
    params = jax.tree.map(lambda x: jnp.broadcast_to(x, (R,) + x.shape), init_params(cfg, param))
    opt_state = jax.vmap(opt.init)(params)
    t0 = time.perf_counter()
    params, ms = program(jax.random.key(key_seed), params, opt_state,
                         jnp.asarray(cfg.offsets[idx["arm"]]), jnp.asarray(idx["sampler"] == 1),
                         jnp.asarray(idx["seed"]))
    final = np.asarray(jax.vmap(lambda p: T.entropy(logits_of(cfg, p)))(params))
    seconds = time.perf_counter() - t0
    log(f"{optimizer}/{param}: {R} runs x {cfg.tab.steps} steps ({seconds:.0f} s)")
    return {"index": idx, "metrics": {k: np.asarray(v).T for k, v in ms.items()},
            "final_entropy_filler": final[:, :-1].mean(1), "seconds": seconds}


def window_effects(cfg: DoseConfig, result: dict, key: str = "entropy_filler",
                   width: int = 10) -> dict:
    """Paired (same seed, same sampler) shift-minus-binary differences of `key` averaged over
    the last `width` steps: {(sampler, c): f32[seeds]}."""
    idx, m = result["index"], result["metrics"][key][:, -width:].mean(1)
    out = {}
    for s, sampler in enumerate(T.SAMPLERS):
        base = {int(sd): m[r] for r, sd in enumerate(idx["seed"])
                if idx["arm"][r] == 0 and idx["sampler"][r] == s}
        for a, c in enumerate(cfg.shifts, start=1):
            rows = [r for r in range(len(m)) if idx["arm"][r] == a and idx["sampler"][r] == s]
            out[(sampler, float(c))] = np.array([m[r] - base[int(idx["seed"][r])] for r in rows])
    return out

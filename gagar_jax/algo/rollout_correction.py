"""Rollout-mismatch correction: IS weights and rejection masks from learner vs rollout log-probs.

verl's `rollout_corr_helper` (volcengine/verl@b178a3cd), decoupled mode: with l_old the learner's
recomputed pre-update log-probs and l_ro the rollout engine's, lr = l_old - l_ro per token.
  IS weights (`loss.rollout_is`, cap `loss.rollout_is_threshold` C; weights truncated above only):
    token:     w_t = min(exp(clip(lr_t, -20, 20)), C)
    sequence:  w_t = min(exp(clip(sum_{t in i} lr_t, -20, 20)), C)          (product of ratios)
    geometric: w_t = min(exp(clip(sum_{t in i} lr_t / n_i, -20, 20)), C)    (geometric mean; the
               level verl had until Dec 2025)
  Rejection (`loss.rollout_rs`, comma-separated, ANDed; `loss.rollout_rs_threshold`), on
  lr' = clip(lr, -20, 20) with k1 = -lr', k2 = lr'^2 / 2, k3 = exp(lr') - 1 - lr':
    token_kX (per token), seq_sum_kX / seq_mean_kX (sum / mean over the trajectory),
    seq_max_k2 / seq_max_k3 (max over it); keep iff log(lo) <= stat <= log(hi) for k1, stat <= hi
    for k2 / k3. seq_mean_k1 is the "geo-mask" (geometric-mean ratio inside a band).
  IcePop (`loss.icepop_low / icepop_high`, not in verl): w_t = k_t if low <= k_t <= high else 0
    with k_t = exp(lr'_t); tokens keep their place in the aggregation denominators.
Weights come from the ORIGINAL mask, the rejection replaces the mask (advantages, every
aggregation denominator, entropy and KL then use it), as in verl. Sequences are trajectories.
"""
from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from gagar_jax.algo.aggregation import rows_as_sequences
from gagar_jax.algo.policy_loss import SAFETY_BOUND

# `cfg` is a gagar_jax.algo.loss.LossConfig; loss.py imports this module, so it is typed `Any`.
LossConfigLike = Any

IS_LEVELS = ("token", "sequence", "geometric")
_K = ("k1", "k2", "k3")
RS_OPTIONS = (tuple(f"token_{k}" for k in _K) + tuple(f"seq_sum_{k}" for k in _K)
              + tuple(f"seq_mean_{k}" for k in _K) + ("seq_max_k2", "seq_max_k3"))


@flax.struct.dataclass
class RolloutCorrMetrics:
    """Learner-vs-rollout diagnostics of a batch (over its trained tokens, before rejection)."""
    logp_abs_diff_mean: jax.Array   # mean |l_old - l_ro|
    logp_abs_diff_max: jax.Array    # max |l_old - l_ro|
    kl: jax.Array                   # k1: mean(l_ro - l_old), KL(rollout || learner)
    k3_kl: jax.Array                # mean(exp(lr) - lr - 1), unclamped (verl's k3_kl)
    masked_token_frac: jax.Array    # trained tokens rejected (rollout_rs) or zeroed (IcePop)
    masked_traj_frac: jax.Array     # trajectories with at least one such token
    is_weight_mean: jax.Array       # IS weight before truncation (verl), 1 when off
    is_weight_max: jax.Array


def rs_options(rollout_rs: str | None, threshold: Any) -> tuple:
    """Parses verl's `rollout_rs` / `rollout_rs_threshold` into ((option, lo, hi), ...).

    A threshold is "lo_hi" (k1 only) or a number x (k1: hi = x, lo = 1/x; k2 / k3: hi = x); a single
    threshold is used for every option, otherwise one per option.
    """
    if rollout_rs is None:
        if threshold is not None:   # a threshold alone would silently reject nothing
            raise ValueError(f"loss.rollout_rs_threshold={threshold!r} is set but loss.rollout_rs "
                             "is not: set the rejection option too (e.g. \"seq_mean_k1\"), or "
                             "unset the threshold")
        return ()
    opts = [o.strip() for o in str(rollout_rs).split(",") if o.strip()]
    bad = [o for o in opts if o not in RS_OPTIONS]
    if bad or not opts:
        raise ValueError(f"loss.rollout_rs options must be among {RS_OPTIONS}, got {rollout_rs!r}")
    if threshold is None:
        raise ValueError("loss.rollout_rs needs loss.rollout_rs_threshold")
    ths = [t.strip() for t in threshold.split(",")] if isinstance(threshold, str) else [threshold]
    if len(ths) == 1:
        ths = ths * len(opts)
    if len(ths) != len(opts):
        raise ValueError(
            f"loss.rollout_rs_threshold: {len(ths)} thresholds for {len(opts)} options"
        )
    out = []
    for o, t in zip(opts, ths, strict=True):
        if isinstance(t, str) and "_" in t:
            if not o.endswith("k1"):
                raise ValueError(f"loss.rollout_rs_threshold: {o} takes one upper bound, got {t!r}")
            lo, hi = (float(x) for x in t.split("_"))
        else:
            hi = float(t)
            lo = 1.0 / hi if o.endswith("k1") and hi > 0 else 0.0
        if hi <= 0 or (o.endswith("k1") and not 0 < lo <= hi):
            raise ValueError(f"loss.rollout_rs_threshold {t!r} is not a valid band for {o}")
        out.append((o, lo, hi))
    return tuple(out)


def is_level(cfg: LossConfigLike) -> tuple[str | None, float]:
    """(level or None, cap): `rollout_is`, or the older `tis_cap` (= token level)."""
    if cfg.tis_cap is not None:
        return "token", float(cfg.tis_cap)
    return cfg.rollout_is, float(cfg.rollout_is_threshold)


def corrects(cfg: LossConfigLike) -> bool:
    """Whether any weight or mask of this module is on."""
    return (is_level(cfg)[0] is not None or cfg.rollout_rs is not None
            or cfg.icepop_low is not None)


def _rs_stat(opt: str, stat_BxS: jax.Array, m: jax.Array, traj: jax.Array, T: int,
             n_T: jax.Array) -> jax.Array:
    if opt.startswith("token"):
        return stat_BxS
    flat = traj.reshape(-1)
    if opt.startswith("seq_sum"):
        return jax.ops.segment_sum((m * stat_BxS).reshape(-1), flat, num_segments=T)[traj]
    if opt.startswith("seq_mean"):
        tot = jax.ops.segment_sum((m * stat_BxS).reshape(-1), flat, num_segments=T)
        return (tot / (n_T + 1e-8))[traj]
    mx = jax.ops.segment_max(jnp.where(m > 0, stat_BxS, -jnp.inf).reshape(-1), flat,
                             num_segments=T)
    return jnp.where(n_T > 0, mx, 0.0)[traj]


def rollout_correction(old_logprobs: jax.Array, rollout_logprobs: jax.Array, mask: jax.Array,
                       cfg: LossConfigLike, *, traj_index_BxS: jax.Array | None = None,
                       num_trajectories: int | None = None,
                       ) -> tuple[jax.Array, jax.Array, RolloutCorrMetrics]:
    """IS weights, rejection mask and diagnostics (pure; padded [B, S] arrays).

    Args:
      old_logprobs: the learner's log-probs l_old (stop-gradient).
      rollout_logprobs: the rollout engine's log-probs l_ro.
      mask: 1 on trained tokens.
      cfg: a LossConfig (`rollout_is`, `rollout_is_threshold`, `tis_cap`, `rollout_rs`,
        `rollout_rs_threshold`, `icepop_low`, `icepop_high`).
      traj_index_BxS, num_trajectories: packed trajectories; default one sequence per row.
    Returns:
      (weights [B, S] (1 off the mask), mask [B, S] after rejection, RolloutCorrMetrics).
    """
    traj, T = rows_as_sequences(mask, traj_index_BxS, num_trajectories)
    sg = jax.lax.stop_gradient
    m = mask.astype(jnp.float32)
    lr_raw = jnp.where(m > 0, sg(old_logprobs) - sg(rollout_logprobs), 0.0)
    lr = jnp.clip(lr_raw, -SAFETY_BOUND, SAFETY_BOUND)
    flat = traj.reshape(-1)
    n_T = jax.ops.segment_sum(m.reshape(-1), flat, num_segments=T)
    sum_T = jax.ops.segment_sum(lr_raw.reshape(-1), flat, num_segments=T)
    level, cap = is_level(cfg)
    clip = lambda x: jnp.clip(x, -SAFETY_BOUND, SAFETY_BOUND)
    if level == "token":
        w_raw = jnp.exp(lr)
    elif level == "sequence":
        w_raw = jnp.exp(clip(sum_T))[traj]
    elif level == "geometric":
        w_raw = jnp.exp(clip(sum_T / (n_T + 1e-8)))[traj]
    else:
        w_raw = jnp.ones_like(m)
    w = jnp.minimum(w_raw, cap) if level is not None else w_raw
    zeroed = jnp.zeros_like(m)
    if cfg.icepop_low is not None:
        k = jnp.exp(lr)
        band = (k >= cfg.icepop_low) & (k <= cfg.icepop_high)
        w_raw = w = jnp.where(band, k, 0.0)
        zeroed = (~band).astype(jnp.float32) * m
    keep = jnp.ones_like(m)
    stats = {"k1": -lr, "k2": 0.5 * lr * lr, "k3": jnp.expm1(lr) - lr}
    for opt, lo, hi in rs_options(cfg.rollout_rs, cfg.rollout_rs_threshold):
        stat = _rs_stat(opt, stats[opt[-2:]], m, traj, T, n_T)
        if opt.endswith("k1"):
            ok = (stat >= math.log(lo)) & (stat <= math.log(hi))
        else:
            ok = stat <= hi
        keep = keep * ok.astype(jnp.float32)
    new_mask = m * keep
    n = jnp.maximum(jnp.sum(m), 1.0)
    dropped = jnp.maximum(m - new_mask, zeroed)
    traj_dropped = jax.ops.segment_max(dropped.reshape(-1), flat, num_segments=T) > 0
    metrics = RolloutCorrMetrics(
        logp_abs_diff_mean=jnp.sum(jnp.abs(lr_raw)) / n,
        logp_abs_diff_max=jnp.max(jnp.abs(lr_raw)),
        kl=-jnp.sum(lr_raw) / n,
        k3_kl=jnp.sum(m * (jnp.expm1(lr_raw) - lr_raw)) / n,
        masked_token_frac=jnp.sum(dropped) / n,
        masked_traj_frac=jnp.sum(traj_dropped) / jnp.maximum(jnp.sum(n_T > 0), 1),
        is_weight_mean=jnp.sum(m * w_raw) / n,
        is_weight_max=jnp.max(jnp.where(m > 0, w_raw, 0.0)))
    return jnp.where(m > 0, sg(w), 1.0), new_mask, metrics


def zero_metrics() -> RolloutCorrMetrics:
    """The metrics when the learner's log-probs are not recomputed (no comparison possible)."""
    z = jnp.zeros((), jnp.float32)
    return RolloutCorrMetrics(z, z, z, z, z, z, z + 1.0, z + 1.0)

"""The policy objectives (`loss.policy_loss`): PPO, GSPO and CISPO, as in verl's core_algos.

Each objective maps padded [B, S] arrays to per-token losses (`TokenTerms`); `policy_loss`
aggregates them over one mini-batch. The train step (`loss.pg_loss`) calls the same
`token_terms` on each micro-batch and weights them with mini-batch-global weights.

Definitions (verl volcengine/verl@b178a3cd, `compute_policy_loss_{vanilla,gspo,cispo}`), with
l = log pi, l_old the ratio denominator, m the mask, A the advantage, sg stop-gradient:
  ppo:   d = clip(l - l_old, -20, 20), r = exp(d)
         pg = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), then the dual clip for A < 0.
  gspo:  lbar_i = sum_{t in i} m (l - l_old) / max(n_i, 1)            (no +-20 clamp)
         s_t = exp(min(l_t - sg(l_t) + sg(lbar_i), 10))               (value s_i, d s_t/d l_t = s_i)
         pg = max(-A s, -A clip(s, 1 - clip_low, 1 + clip_high))      (no dual clip)
  cispo: r = exp(clip(l - l_old, -20, 20)), pg = -sg(clip(r, 1 - clip_low, 1 + clip_high)) A l
         (every token keeps its gradient; clip_low >= 1 means no lower clip).
A "sequence" is a trajectory: `traj_index_BxS` (packed rows hold several), or one per row.
A trajectory never straddles rows and rows go whole to micro-batches, so GSPO's per-trajectory
mean over a micro-batch's rows is the whole trajectory's.
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from gagar_jax.algo.aggregation import aggregation_weights, rows_as_sequences

# `cfg` is a gagar_jax.algo.loss.LossConfig; loss.py imports this module, so it is typed `Any`.
LossConfigLike = Any

Seq = tuple[jax.Array, int]   # (traj_index_BxS, number of trajectories)

SAFETY_BOUND = 20.0        # |log ratio| clamp before exp (verl: PPO, CISPO, rollout IS / RS)
GSPO_LOG_RATIO_MAX = 10.0  # GSPO clamps its combined log ratio from above only (verl)


@flax.struct.dataclass
class TokenTerms:
    """Per-token results of an objective, all [B, S] (0 off the mask)."""
    pg_BxS: jax.Array          # per-token policy loss (before IS weights and aggregation)
    clip_low_BxS: jax.Array    # 1 where clipped below (no gradient for ppo/gspo)
    clip_high_BxS: jax.Array   # 1 where clipped above
    dual_BxS: jax.Array        # 1 where the dual clip holds the loss (ppo only)
    log_ratio_BxS: jax.Array   # token log ratio l - l_old (stop-gradient; for approx_kl)


def _clip_flags(ratio: jax.Array, adv: jax.Array, mask: jax.Array, cfg: LossConfigLike):
    low = ((adv < 0) & (ratio < 1.0 - cfg.clip_low)).astype(jnp.float32) * mask
    high = ((adv > 0) & (ratio > 1.0 + cfg.clip_high)).astype(jnp.float32) * mask
    return low, high


def ppo_terms(logp: jax.Array, old: jax.Array, adv: jax.Array, mask: jax.Array,
              cfg: LossConfigLike, seq: Seq) -> TokenTerms:
    """Clipped surrogate with clip-higher and the optional dual clip (verl `vanilla`)."""
    del seq
    # Zero the log-ratio off the mask, so garbage there can never overflow exp.
    log_ratio = jnp.clip((logp - old) * mask, -SAFETY_BOUND, SAFETY_BOUND)
    ratio = jnp.exp(log_ratio)
    pg = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high))
    dual = jnp.zeros_like(mask)
    if cfg.dual_clip is not None:
        bound = -adv * cfg.dual_clip
        dual = ((adv < 0) & (pg > bound)).astype(jnp.float32) * mask
        pg = jnp.where(adv < 0, jnp.minimum(pg, bound), pg)
    sg = jax.lax.stop_gradient
    low, high = _clip_flags(sg(ratio), sg(adv), mask, cfg)
    return TokenTerms(pg * mask, low, high, sg(dual), sg(log_ratio))


def gspo_terms(logp: jax.Array, old: jax.Array, adv: jax.Array, mask: jax.Array,
               cfg: LossConfigLike, seq: Seq) -> TokenTerms:
    """GSPO-token (verl `gspo`): the sequence's geometric-mean ratio, clipped per sequence."""
    traj, T = seq
    sg = jax.lax.stop_gradient
    lp = jnp.where(mask > 0, logp, 0.0)
    log_ratio = jnp.where(mask > 0, logp - old, 0.0)
    n_T = jax.ops.segment_sum(mask.reshape(-1), traj.reshape(-1), num_segments=T)
    sum_T = jax.ops.segment_sum(log_ratio.reshape(-1), traj.reshape(-1), num_segments=T)
    lbar_BxS = (sum_T / jnp.maximum(n_T, 1.0))[traj]
    lam = jnp.minimum(lp - sg(lp) + sg(lbar_BxS), GSPO_LOG_RATIO_MAX)
    s = jnp.exp(lam)
    pg = jnp.maximum(-adv * s, -adv * jnp.clip(s, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high))
    low, high = _clip_flags(sg(s), sg(adv), mask, cfg)
    return TokenTerms(pg * mask, low, high, jnp.zeros_like(mask), sg(log_ratio))


def cispo_terms(logp: jax.Array, old: jax.Array, adv: jax.Array, mask: jax.Array,
                cfg: LossConfigLike, seq: Seq) -> TokenTerms:
    """CISPO (verl `cispo`, MiniMax-M1): REINFORCE with a clipped, stop-gradient IS weight."""
    del seq
    sg = jax.lax.stop_gradient
    lp = jnp.where(mask > 0, logp, 0.0)
    log_ratio = sg(jnp.clip(jnp.where(mask > 0, logp - old, 0.0), -SAFETY_BOUND, SAFETY_BOUND))
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = -sg(clipped) * adv * lp
    low = (ratio < 1.0 - cfg.clip_low).astype(jnp.float32) * mask
    high = (ratio > 1.0 + cfg.clip_high).astype(jnp.float32) * mask
    return TokenTerms(pg * mask, low, high, jnp.zeros_like(mask), log_ratio)


# The registry `loss.policy_loss` chooses from (one table, no names built at run time).
OBJECTIVES = {"ppo": ppo_terms, "gspo": gspo_terms, "cispo": cispo_terms}
POLICY_LOSSES = tuple(OBJECTIVES)


def policy_aggregation(cfg: LossConfigLike) -> str:
    """The aggregation of the policy term: verl forces seq-mean-token-mean for GSPO."""
    return "seq-mean-token-mean" if cfg.policy_loss == "gspo" else cfg.aggregation


def token_terms(logprobs_BxS: jax.Array, old_logprobs_BxS: jax.Array,
                advantages_BxS: jax.Array, mask_BxS: jax.Array, cfg: LossConfigLike, *,
                traj_index_BxS: jax.Array | None = None,
                num_trajectories: int | None = None) -> TokenTerms:
    """Per-token terms of `cfg.policy_loss` (rows as sequences unless traj_index is given)."""
    seq = rows_as_sequences(mask_BxS, traj_index_BxS, num_trajectories)
    mask = mask_BxS.astype(jnp.float32)
    return OBJECTIVES[cfg.policy_loss](logprobs_BxS, old_logprobs_BxS, advantages_BxS * mask,
                                       mask, cfg, seq)


def policy_loss(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
                mask: jax.Array, cfg: LossConfigLike, *, is_weights: jax.Array | None = None,
                traj_index_BxS: jax.Array | None = None, num_trajectories: int | None = None,
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The objective of one mini-batch on padded [B, S] arrays.

    Args:
      logprobs: current log-probs (differentiable).
      old_logprobs: the ratio denominator.
      advantages: per-token advantages.
      mask: 1 on trained tokens.
      cfg: a LossConfig (`policy_loss`, clips, `dual_clip`, `aggregation`, `max_response_len`).
      is_weights: optional per-token rollout-correction weights (multiply the per-token loss).
      traj_index_BxS, num_trajectories: packed trajectories; default one sequence per row.
    Returns:
      (loss, metrics) with metrics a dict of scalars: pg_loss, clip_frac_low, clip_frac_high,
      dual_clip_frac (fractions of trained tokens), approx_kl (k3 of KL(old || current)), and
      under verl's names pg_clipfrac (= clip_frac_low + clip_frac_high) and ppo_kl (k1: the
      mean of old - current log-probs).
    """
    traj, T = rows_as_sequences(mask, traj_index_BxS, num_trajectories)
    mask = mask.astype(jnp.float32)
    terms = token_terms(logprobs, old_logprobs, advantages, mask, cfg, traj_index_BxS=traj,
                        num_trajectories=T)
    w = aggregation_weights(mask, traj, T, cfg, aggregation=policy_aggregation(cfg))
    pg = terms.pg_BxS if is_weights is None else terms.pg_BxS * jax.lax.stop_gradient(is_weights)
    loss = jnp.sum(pg * w)
    n = jnp.maximum(jnp.sum(mask), 1.0)
    lr = terms.log_ratio_BxS
    metrics = dict(pg_loss=loss, clip_frac_low=jnp.sum(terms.clip_low_BxS) / n,
                   clip_frac_high=jnp.sum(terms.clip_high_BxS) / n,
                   dual_clip_frac=jnp.sum(terms.dual_BxS) / n,
                   approx_kl=jnp.sum(mask * (jnp.expm1(lr) - lr)) / n,
                   pg_clipfrac=(jnp.sum(terms.clip_low_BxS) + jnp.sum(terms.clip_high_BxS)) / n,
                   ppo_kl=jnp.sum(mask * -lr) / n)
    return loss, metrics

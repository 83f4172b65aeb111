"""Clipped policy-gradient loss fused with Gagar advantages.

Two pure stages (see docs/loss.md):
  * `prepare(batch, cfg, ...)` runs ONCE per feed batch, before any mini/micro-batch loop:
    Gagar advantages, their token broadcast, the ratio denominator, the truncated IS weight, and
    per-token aggregation weights whose denominators are global over each mini-batch.
  * `pg_loss(logprobs, entropy, inputs, cfg)` runs per micro-batch: a weighted SUM of per-token
    losses. Because every weight already carries its mini-batch's denominator, summing the
    micro-batch losses (and their gradients) gives exactly the single-shot mini-batch loss, and a
    group may straddle micro-batches.

Rows are split along B: with M mini-batches of U micro-batches each, row b belongs to mini-batch
b % M and micro-batch (b // M) % U (strided, so each data-parallel shard keeps its own rows).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp

from gagar_jax.algo.advantage import (
    MODES,
    AdvantageOutput,
    GroupOutcomes,
    advantages_of,
    broadcast_to_tokens,
)
from gagar_jax.batch import Batch
from gagar_jax.config import section_dict

AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Policy-loss settings (the `loss` section of a config).

    Attributes:
      clip_low: PPO clip below, ratio >= 1 - clip_low for negative advantages.
      clip_high: clip above (clip-higher, DAPO), ratio <= 1 + clip_high for positive advantages.
      dual_clip: None, or c > 1: the loss of a negative-advantage token is capped at c * |A|.
      tis_cap: None, or the cap of the truncated importance-sampling weight
        min(exp(learner_old - behavior), tis_cap); needs `recompute_old_logprobs`.
      kl_coef: weight of the KL to a frozen reference policy; 0 = off (Dr. GRPO).
      kl_estimator: k1 | k2 | k3 (Schulman's estimators of KL(pi || ref)).
      aggregation: one of AGGREGATIONS (see docs/loss.md).
      max_response_len: the constant normalizer of `seq-mean-token-sum-norm`.
      lam_cap: Gagar's lambda cap (>= 1).
      mode: sum_preserving | downweight_only | binary.
      router_aux_coef, router_z_coef: weights of the MoE load-balancing and router z losses.
      recompute_old_logprobs: the learner recomputes pre-update log-probs once per batch and uses
        them as the ratio denominator; the feed's log-probs then only drive the TIS weight.
    """
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: Optional[float] = None
    tis_cap: Optional[float] = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    aggregation: str = "token-mean"
    max_response_len: int = 1024
    lam_cap: float = 1.5
    mode: str = "sum_preserving"
    router_aux_coef: float = 0.0
    router_z_coef: float = 0.0
    recompute_old_logprobs: bool = False

    def __post_init__(self):
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"loss.clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0.0:
            raise ValueError(f"loss.clip_high must be >= 0, got {self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"loss.dual_clip must be None or > 1, got {self.dual_clip}")
        if self.tis_cap is not None:
            if self.tis_cap <= 0.0:
                raise ValueError(f"loss.tis_cap must be None or > 0, got {self.tis_cap}")
            if not self.recompute_old_logprobs:
                raise ValueError("loss.tis_cap needs loss.recompute_old_logprobs=True: without the "
                                 "learner's own log-probs the IS weight is identically 1")
        if self.kl_coef < 0.0:
            raise ValueError(f"loss.kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"loss.kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}"
            )
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"loss.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}"
            )
        if self.max_response_len <= 0:
            raise ValueError(f"loss.max_response_len must be > 0, got {self.max_response_len}")
        if self.lam_cap < 1.0:
            raise ValueError(f"loss.lam_cap must be >= 1 (lambda >= 1 always), got {self.lam_cap}")
        if self.mode not in MODES:
            raise ValueError(f"loss.mode must be one of {MODES}, got {self.mode!r}")

    @classmethod
    def from_config(cls, section: Any, model: Any = None) -> LossConfig:
        """Builds the frozen config from the `loss` section (ConfigDict or dict).

        The router loss weights live in the model section (`router_aux_loss_coef`,
        `router_z_loss_coef`); pass it as `model` to pick them up.
        """
        d = section_dict(section, cls, "loss")
        if model is not None:
            d.setdefault("router_aux_coef", float(model.router_aux_loss_coef))
            d.setdefault("router_z_coef", float(model.router_z_loss_coef))
        return cls(**d)


@flax.struct.dataclass
class LossInputs:
    """Per-token inputs of `pg_loss`, computed once per batch; all [B, S] (slice rows freely)."""
    adv_BxS: jax.Array             # final Gagar advantage on trained tokens, 0 elsewhere
    mask_BxS: jax.Array            # 1 on trained tokens (generated, valid trajectory)
    weight_BxS: jax.Array          # aggregation weight, mini-batch denominator included
    old_logprobs_BxS: jax.Array    # ratio denominator (behavior, or the learner's pre-update)
    tis_weight_BxS: jax.Array      # truncated IS weight (1 when off)
    ref_logprobs_BxS: jax.Array    # frozen reference log-probs (0 when KL is off)


@flax.struct.dataclass
class LossAux:
    """Additive per-micro-batch sums: add them over micro-batches, normalize once at the end."""
    loss: jax.Array                # the weighted loss (pg + kl), same as the returned loss
    pg_loss: jax.Array             # weighted policy-gradient part
    kl_loss: jax.Array             # weighted KL part (before kl_coef)
    tokens: jax.Array              # trained tokens
    clip_low_count: jax.Array      # tokens with A < 0 and ratio < 1 - clip_low (no gradient)
    clip_high_count: jax.Array     # tokens with A > 0 and ratio > 1 + clip_high (no gradient)
    dual_clip_count: jax.Array     # tokens held by the dual clip
    approx_kl_sum: jax.Array       # k3 estimate of KL(old || current), summed over tokens
    entropy_sum: jax.Array         # policy entropy summed over trained tokens


def split_rows(x: jax.Array, mini_batches: int, micro_batches: int) -> jax.Array:
    """[B, ...] -> [M, U, B / (M U), ...]: row b goes to mini b % M, micro (b // M) % U."""
    M, U = mini_batches, micro_batches
    B = x.shape[0]
    if B % (M * U):
        raise ValueError(
            f"batch rows B={B} must be divisible by mini_batches * micro_batches = {M * U}"
        )
    y = x.reshape((B // (M * U), U, M) + x.shape[1:])
    return jnp.moveaxis(y, (0, 1, 2), (2, 1, 0))


def merge_rows(y: jax.Array) -> jax.Array:
    """Inverse of `split_rows`: [M, U, B / (M U), ...] -> [B, ...]."""
    x = jnp.moveaxis(y, (2, 1, 0), (0, 1, 2))
    return x.reshape((-1,) + y.shape[3:])


def aggregation_weights(mask_BxS: jax.Array, traj_index_BxS: jax.Array, num_trajectories: int,
                        cfg: LossConfig, mini_batches: int = 1) -> jax.Array:
    """Per-token weights w such that each mini-batch's loss is sum_t w_t * loss_t.

    Denominators are global over a mini-batch (row split as in `split_rows`).
      token-mean:              1 / (trained tokens in the mini-batch)
      seq-mean-token-mean:     1 / (n_i * N)   n_i tokens of trajectory i, N trajectories
      seq-mean-token-sum:      1 / N
      seq-mean-token-sum-norm: 1 / (N * max_response_len)   (Dr. GRPO's constant normalizer)
    N counts trajectories with at least one trained token in the mini-batch.
    """
    n_T = jax.ops.segment_sum(mask_BxS.reshape(-1), traj_index_BxS.reshape(-1),
                              num_segments=num_trajectories)
    inv_n_BxS = mask_BxS / jnp.maximum(n_T[traj_index_BxS], 1.0)

    mini_B = jnp.arange(mask_BxS.shape[0]) % mini_batches  # the mini-batch of each row

    def per_mini(x_BxS: jax.Array):  # mini-batch totals broadcast back to [B, S]
        tot_M = jax.ops.segment_sum(x_BxS.sum(axis=1), mini_B, num_segments=mini_batches)
        return tot_M[mini_B][:, None]

    tokens = per_mini(mask_BxS)
    # Each trajectory's 1/n_i sums to exactly 1 over its tokens; round away float error.
    n_traj = jnp.round(per_mini(inv_n_BxS))
    safe = lambda d: jnp.where(d > 0, d, 1.0)  # noqa: E731  (empty mini-batch: weights stay 0)
    if cfg.aggregation == "token-mean":
        return mask_BxS / safe(tokens)
    if cfg.aggregation == "seq-mean-token-mean":
        return inv_n_BxS / safe(n_traj)
    if cfg.aggregation == "seq-mean-token-sum":
        return mask_BxS / safe(n_traj)
    return mask_BxS / (safe(n_traj) * cfg.max_response_len)


def prepare(batch: Batch, cfg: LossConfig, *, mini_batches: int = 1,
            learner_old_logprobs_BxS: Optional[jax.Array] = None,
            ref_logprobs_BxS: Optional[jax.Array] = None) -> tuple[LossInputs, AdvantageOutput]:
    """Once-per-batch loss inputs: advantages, denominators, ratio denominator, IS weight.

    Args:
      batch: the packed feed batch.
      cfg: loss settings.
      mini_batches: number of optimizer updates per epoch; denominators are per mini-batch.
      learner_old_logprobs_BxS: the learner's pre-update log-probs (needed iff
        `cfg.recompute_old_logprobs`).
      ref_logprobs_BxS: frozen reference log-probs (needed iff `cfg.kl_coef > 0`).
    Returns:
      (LossInputs, AdvantageOutput).
    """
    if cfg.recompute_old_logprobs != (learner_old_logprobs_BxS is not None):
        raise ValueError("learner_old_logprobs_BxS must be given iff cfg.recompute_old_logprobs")
    if (cfg.kl_coef > 0) != (ref_logprobs_BxS is not None):
        raise ValueError("ref_logprobs_BxS must be given iff cfg.kl_coef > 0")
    adv_out = advantages_of(GroupOutcomes.of_batch(batch), lam_cap=cfg.lam_cap, mode=cfg.mode)
    # Invalid trajectories (infra errors) take no part in the loss at all, KL included.
    valid_BxS = batch.valid_T[batch.traj_index_BxS].astype(jnp.float32)
    mask_BxS = batch.loss_mask_BxS.astype(jnp.float32) * valid_BxS
    adv_BxS = broadcast_to_tokens(adv_out.advantages, batch.traj_index_BxS, mask_BxS)
    weight_BxS = aggregation_weights(mask_BxS, batch.traj_index_BxS, batch.num_trajectories, cfg,
                                     mini_batches)
    behavior_BxS = batch.old_logprobs_BxS * mask_BxS
    if cfg.recompute_old_logprobs:
        old_BxS = jax.lax.stop_gradient(learner_old_logprobs_BxS) * mask_BxS
        if cfg.tis_cap is not None:
            tis_BxS = jnp.minimum(jnp.exp(old_BxS - behavior_BxS), cfg.tis_cap)
        else:
            tis_BxS = jnp.ones_like(mask_BxS)
    else:
        old_BxS, tis_BxS = behavior_BxS, jnp.ones_like(mask_BxS)
    ref_BxS = (jnp.zeros_like(mask_BxS) if ref_logprobs_BxS is None
               else jax.lax.stop_gradient(ref_logprobs_BxS) * mask_BxS)
    inputs = LossInputs(adv_BxS=adv_BxS, mask_BxS=mask_BxS, weight_BxS=weight_BxS,
                        old_logprobs_BxS=old_BxS, tis_weight_BxS=jax.lax.stop_gradient(tis_BxS),
                        ref_logprobs_BxS=ref_BxS)
    return inputs, adv_out


def kl_penalty(logprobs_BxS: jax.Array, ref_logprobs_BxS: jax.Array, estimator: str) -> jax.Array:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1/k2/k3)."""
    log_r = ref_logprobs_BxS - logprobs_BxS
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * jnp.square(log_r)
    if estimator == "k3":
        return jnp.expm1(log_r) - log_r
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def pg_loss(logprobs_BxS: jax.Array, entropy_BxS: jax.Array, inputs: LossInputs,
            cfg: LossConfig) -> tuple[jax.Array, LossAux]:
    """Clipped surrogate of one micro-batch as a weighted sum (see module docstring).

    Args:
      logprobs_BxS: current policy log-probs of the tokens (differentiable).
      entropy_BxS: current policy entropy per position (metric only).
      inputs: this micro-batch's rows of `prepare`'s LossInputs.
      cfg: loss settings.
    Returns:
      (loss, LossAux) with loss = sum_t w_t [pg_t + kl_coef * kl_t].
    """
    mask, adv, w = inputs.mask_BxS, inputs.adv_BxS, inputs.weight_BxS
    # Zero the log-ratio off the mask, so garbage there can never overflow exp.
    log_ratio = (logprobs_BxS - inputs.old_logprobs_BxS) * mask
    ratio = jnp.exp(log_ratio)
    surr = -adv * ratio
    surr_clipped = -adv * jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = jnp.maximum(surr, surr_clipped)
    dual_held = jnp.zeros_like(mask)
    if cfg.dual_clip is not None:
        bound = -adv * cfg.dual_clip
        dual_held = ((adv < 0) & (pg > bound)).astype(jnp.float32) * mask
        pg = jnp.where(adv < 0, jnp.minimum(pg, bound), pg)
    pg = pg * inputs.tis_weight_BxS
    pg_sum = jnp.sum(pg * w)
    if cfg.kl_coef > 0:
        kl = kl_penalty(logprobs_BxS, inputs.ref_logprobs_BxS, cfg.kl_estimator) * mask
        kl_sum = jnp.sum(kl * w)
    else:
        kl_sum = jnp.zeros((), jnp.float32)
    loss = pg_sum + cfg.kl_coef * kl_sum
    sg = jax.lax.stop_gradient
    ratio_sg, adv_sg = sg(ratio), sg(adv)
    aux = LossAux(
        loss=loss, pg_loss=pg_sum, kl_loss=kl_sum, tokens=jnp.sum(mask),
        clip_low_count=jnp.sum(mask * ((adv_sg < 0) & (ratio_sg < 1.0 - cfg.clip_low))),
        clip_high_count=jnp.sum(mask * ((adv_sg > 0) & (ratio_sg > 1.0 + cfg.clip_high))),
        dual_clip_count=jnp.sum(sg(dual_held)),
        approx_kl_sum=jnp.sum(mask * (jnp.expm1(sg(log_ratio)) - sg(log_ratio))),
        entropy_sum=jnp.sum(mask * sg(entropy_BxS)))
    return loss, aux

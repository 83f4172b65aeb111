"""Clipped policy-gradient loss fused with Gagar advantages.

Two pure stages (see docs/loss.md):
  * `prepare_batch(batch, cfg, ...)` runs ONCE per feed batch, before any mini/micro-batch loop:
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

from gagar_jax.algo import policy_loss as objectives
from gagar_jax.algo import rollout_correction as rc
from gagar_jax.algo.advantage import (
    MODES,
    WEIGHTED_MODES,
    AdvantageOutput,
    GroupOutcomes,
    advantages_of,
    broadcast_to_tokens,
)
from gagar_jax.algo.aggregation import AGGREGATIONS, aggregation_weights
from gagar_jax.batch import Batch
from gagar_jax.config import VERL_LOSS_ALIASES, section_dict

KL_ESTIMATORS = ("k1", "k2", "k3")
ROUTING_REPLAYS = ("r3", "r2")


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
      mode: sum_preserving | downweight_only | binary | length_aware (sum-preserving in
        token-weighted credit: each trajectory weighs what its tokens' aggregation weights sum
        to; docs/advantage.md section 9).
      norm_adv_by_std: divide each group's outcome advantages by its rewards' standard deviation
        (+1e-6) before the redistribution (verl's norm_adv_by_std_in_grpo, plain GRPO
        baselines; SPEC section 2 rule 4); off by default (Dr. GRPO).
      router_aux_coef, router_z_coef: weights of the MoE load-balancing and router z losses.
      recompute_old_logprobs: the learner recomputes pre-update log-probs once per batch and uses
        them as the ratio denominator; the feed's log-probs then only drive the TIS weight.
      policy_loss: ppo | gspo | cispo (see policy_loss.py; verl's vanilla / gspo / cispo).
      entropy_coef: entropy bonus, loss -= entropy_coef * aggregated entropy; 0 = off.
      rollout_is: None | token | sequence | geometric: rollout-correction IS weight level.
      rollout_is_threshold: its cap (truncated above).
      rollout_rs: None, or verl's comma-separated rejection options (rollout_correction.py).
      rollout_rs_threshold: "lo_hi" or a number, one for all options or one per option.
      icepop_low, icepop_high: IcePop's band on the token ratio (both or neither).
      routing_replay: r3 (replay the feed's routed_experts when the batch has them) | r2 (record
        the learner's own top-k in the recompute pass, replay it in every update; the feed's
        routed_experts are then ignored). r2 needs recompute_old_logprobs.
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
    norm_adv_by_std: bool = False
    router_aux_coef: float = 0.0
    router_z_coef: float = 0.0
    recompute_old_logprobs: bool = False
    policy_loss: str = "ppo"
    entropy_coef: float = 0.0
    rollout_is: Optional[str] = None
    rollout_is_threshold: float = 2.0
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Optional[str] = None
    icepop_low: Optional[float] = None
    icepop_high: Optional[float] = None
    routing_replay: str = "r3"

    def __post_init__(self):
        if self.policy_loss not in objectives.POLICY_LOSSES:
            raise ValueError(f"loss.policy_loss must be one of {objectives.POLICY_LOSSES}, "
                             f"got {self.policy_loss!r}")
        # CISPO's lower clip may be switched off with clip_low >= 1 (verl's example uses 10).
        if self.clip_low < 0.0 or (self.clip_low >= 1.0 and self.policy_loss != "cispo"):
            raise ValueError(f"loss.clip_low must be in [0, 1) (any >= 0 with cispo), "
                             f"got {self.clip_low}")
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
        if self.entropy_coef < 0.0:
            raise ValueError(f"loss.entropy_coef must be >= 0, got {self.entropy_coef}")
        if self.rollout_is is not None and self.rollout_is not in rc.IS_LEVELS:
            raise ValueError(f"loss.rollout_is must be None or one of {rc.IS_LEVELS}, "
                             f"got {self.rollout_is!r}")
        if self.rollout_is_threshold <= 0.0:
            raise ValueError(
                f"loss.rollout_is_threshold must be > 0, got {self.rollout_is_threshold}"
            )
        rc.rs_options(self.rollout_rs, self.rollout_rs_threshold)   # raises on a bad option
        if (self.icepop_low is None) != (self.icepop_high is None) or (
                self.icepop_low is not None and not 0 <= self.icepop_low <= self.icepop_high):
            raise ValueError("loss.icepop_low / icepop_high: both or neither, 0 <= low <= high")
        n_is = sum(x is not None for x in (self.tis_cap, self.rollout_is, self.icepop_low))
        if n_is > 1:
            raise ValueError("loss.tis_cap, loss.rollout_is and loss.icepop_* each set an IS "
                             "weight: choose one")
        if rc.corrects(self) and not self.recompute_old_logprobs:
            raise ValueError("loss.rollout_is / rollout_rs / icepop need "
                             "loss.recompute_old_logprobs=True: they compare the learner's "
                             "log-probs with the rollout engine's")
        if self.routing_replay not in ROUTING_REPLAYS:
            raise ValueError(f"loss.routing_replay must be one of {ROUTING_REPLAYS}, "
                             f"got {self.routing_replay!r}")
        if self.routing_replay == "r2" and not self.recompute_old_logprobs:
            raise ValueError("loss.routing_replay='r2' needs loss.recompute_old_logprobs=True: "
                             "the routing is recorded in that pass")

    @classmethod
    def from_config(cls, section: Any, model: Any = None) -> LossConfig:
        """Builds the frozen config from the `loss` section (ConfigDict or dict).

        The router loss weights live in the model section (`router_aux_loss_coef`,
        `router_z_loss_coef`); pass it as `model` to pick them up. verl's names of four keys
        (`config.VERL_LOSS_ALIASES`: clip_ratio_low / high / c, loss_agg_mode) are accepted.
        """
        d = dict(section.to_dict() if hasattr(section, "to_dict") else section)
        for verl, ours in VERL_LOSS_ALIASES.items():
            if verl in d:
                if ours in d and d[ours] != d[verl]:
                    raise ValueError(f"loss.{verl} (verl's name of loss.{ours}) = {d[verl]!r} "
                                     f"and loss.{ours} = {d[ours]!r}: give one")
                d[ours] = d.pop(verl)
        d = section_dict(d, cls, "loss")
        if model is not None:
            d.setdefault("router_aux_coef", float(model.router_aux_loss_coef))
            d.setdefault("router_z_coef", float(model.router_z_loss_coef))
        return cls(**d)


@flax.struct.dataclass
class LossInputs:
    """Per-token inputs of `pg_loss`, computed once per batch; all [B, S] (slice rows freely)."""
    adv_BxS: jax.Array             # final Gagar advantage on trained tokens, 0 elsewhere
    mask_BxS: jax.Array            # 1 on trained tokens (generated, valid, not rejected)
    weight_BxS: jax.Array          # aggregation weight, mini-batch denominator included
    old_logprobs_BxS: jax.Array    # ratio denominator (behavior, or the learner's pre-update)
    tis_weight_BxS: jax.Array      # rollout-correction IS weight (1 when off)
    ref_logprobs_BxS: jax.Array    # frozen reference log-probs (0 when KL is off)
    pg_weight_BxS: Optional[jax.Array] = None    # the policy term's weight when it differs (GSPO)
    traj_index_BxS: Optional[jax.Array] = None   # global trajectory index (GSPO's sequences)
    num_trajectories: int = flax.struct.field(pytree_node=False, default=0)


@flax.struct.dataclass
class LossAux:
    """Additive per-micro-batch sums: add them over micro-batches, normalize once at the end."""
    loss: jax.Array                # the weighted loss (pg + kl - entropy bonus)
    pg_loss: jax.Array             # weighted policy-gradient part
    kl_loss: jax.Array             # weighted KL part (before kl_coef)
    tokens: jax.Array              # trained tokens
    clip_low_count: jax.Array      # tokens clipped below (see policy_loss.py per objective)
    clip_high_count: jax.Array     # tokens clipped above
    dual_clip_count: jax.Array     # tokens held by the dual clip
    approx_kl_sum: jax.Array       # k3 estimate of KL(old || current), summed over tokens
    ppo_kl_sum: jax.Array          # k1 (old - current log-prob, verl's ppo_kl), summed
    entropy_sum: jax.Array         # policy entropy summed over trained tokens
    entropy_loss: jax.Array        # weighted (aggregated) entropy, before entropy_coef


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


@flax.struct.dataclass
class Prepared:
    """Everything `prepare_batch` computes once per batch (`traj_weights_T`: each trajectory's
    summed policy-term weight, computed only for the modes that need it)."""
    inputs: LossInputs
    adv: AdvantageOutput
    rollout: rc.RolloutCorrMetrics
    traj_weights_T: Optional[jax.Array] = None


def prepare_batch(batch: Batch, cfg: LossConfig, *, mini_batches: int = 1,
                  learner_old_logprobs_BxS: jax.Array | None = None,
                  ref_logprobs_BxS: jax.Array | None = None) -> Prepared:
    """Once-per-batch loss inputs: advantages, denominators, ratio denominator, IS weight, masks.

    Args:
      batch: the packed feed batch.
      cfg: loss settings.
      mini_batches: number of optimizer updates per epoch; denominators are per mini-batch.
      learner_old_logprobs_BxS: the learner's pre-update log-probs (needed iff
        `cfg.recompute_old_logprobs`).
      ref_logprobs_BxS: frozen reference log-probs (needed iff `cfg.kl_coef > 0`).
    Returns:
      Prepared(inputs, adv, rollout-correction metrics).
    """
    if cfg.recompute_old_logprobs != (learner_old_logprobs_BxS is not None):
        raise ValueError("learner_old_logprobs_BxS must be given iff cfg.recompute_old_logprobs")
    if (cfg.kl_coef > 0) != (ref_logprobs_BxS is not None):
        raise ValueError("ref_logprobs_BxS must be given iff cfg.kl_coef > 0")
    traj, T = batch.traj_index_BxS, batch.num_trajectories
    # Invalid trajectories (infra errors) take no part in the loss at all, KL included.
    valid_BxS = batch.valid_T[traj].astype(jnp.float32)
    mask_BxS = batch.loss_mask_BxS.astype(jnp.float32) * valid_BxS
    behavior_BxS = batch.old_logprobs_BxS * mask_BxS
    if cfg.recompute_old_logprobs:
        old_BxS = jax.lax.stop_gradient(learner_old_logprobs_BxS) * mask_BxS
        # Over the whole batch, before the split: a trajectory's sums are always complete.
        tis_BxS, mask_BxS, rollout = rc.rollout_correction(
            old_BxS, behavior_BxS, mask_BxS, cfg, traj_index_BxS=traj, num_trajectories=T)
    else:
        old_BxS, tis_BxS, rollout = behavior_BxS, jnp.ones_like(mask_BxS), rc.zero_metrics()
    # Rejected tokens leave the mask before the broadcast and the denominators (as in verl).
    weight_BxS = aggregation_weights(mask_BxS, traj, T, cfg, mini_batches)
    pg_agg = objectives.policy_aggregation(cfg)
    pg_weight_BxS = (None if pg_agg == cfg.aggregation else
                     aggregation_weights(mask_BxS, traj, T, cfg, mini_batches, aggregation=pg_agg))
    traj_weights_T = None
    if cfg.mode in WEIGHTED_MODES:   # a trajectory weighs what its tokens' policy weights sum to
        pw_BxS = weight_BxS if pg_weight_BxS is None else pg_weight_BxS
        traj_weights_T = jax.ops.segment_sum(pw_BxS.reshape(-1), traj.reshape(-1),
                                             num_segments=T)
    adv_out = advantages_of(GroupOutcomes.of_batch(batch), lam_cap=cfg.lam_cap, mode=cfg.mode,
                            std_norm=cfg.norm_adv_by_std, weights=traj_weights_T)
    adv_BxS = broadcast_to_tokens(adv_out.advantages, traj, mask_BxS)
    ref_BxS = (jnp.zeros_like(mask_BxS) if ref_logprobs_BxS is None
               else jax.lax.stop_gradient(ref_logprobs_BxS) * mask_BxS)
    inputs = LossInputs(adv_BxS=adv_BxS, mask_BxS=mask_BxS, weight_BxS=weight_BxS,
                        old_logprobs_BxS=old_BxS * mask_BxS,
                        tis_weight_BxS=jax.lax.stop_gradient(tis_BxS), ref_logprobs_BxS=ref_BxS,
                        pg_weight_BxS=pg_weight_BxS,
                        traj_index_BxS=traj if cfg.policy_loss == "gspo" else None,
                        num_trajectories=T if cfg.policy_loss == "gspo" else 0)
    return Prepared(inputs=inputs, adv=adv_out, rollout=rollout, traj_weights_T=traj_weights_T)


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
    """The objective of one micro-batch as a weighted sum (see module docstring).

    Args:
      logprobs_BxS: current policy log-probs of the tokens (differentiable).
      entropy_BxS: current policy entropy per position (differentiable; a metric unless
        `cfg.entropy_coef > 0`).
      inputs: this micro-batch's rows of `prepare_batch`'s LossInputs.
      cfg: loss settings.
    Returns:
      (loss, LossAux) with
        loss = sum_t pw_t w^IS_t pg_t + sum_t w_t [kl_coef kl_t - entropy_coef H_t]
      (pw = w except for GSPO, whose policy term is seq-mean-token-mean).
    """
    mask, w = inputs.mask_BxS, inputs.weight_BxS
    seq = {} if inputs.traj_index_BxS is None else dict(
        traj_index_BxS=inputs.traj_index_BxS, num_trajectories=inputs.num_trajectories)
    terms = objectives.token_terms(logprobs_BxS, inputs.old_logprobs_BxS, inputs.adv_BxS, mask,
                                   cfg, **seq)
    pw = w if inputs.pg_weight_BxS is None else inputs.pg_weight_BxS
    pg_sum = jnp.sum(terms.pg_BxS * inputs.tis_weight_BxS * pw)
    if cfg.kl_coef > 0:
        kl = kl_penalty(logprobs_BxS, inputs.ref_logprobs_BxS, cfg.kl_estimator) * mask
        kl_sum = jnp.sum(kl * w)
    else:
        kl_sum = jnp.zeros((), jnp.float32)
    sg = jax.lax.stop_gradient
    ent = entropy_BxS if cfg.entropy_coef > 0 else sg(entropy_BxS)
    ent_sum = jnp.sum(mask * ent * w)
    loss = pg_sum + cfg.kl_coef * kl_sum - cfg.entropy_coef * ent_sum
    lr = terms.log_ratio_BxS
    aux = LossAux(
        loss=loss, pg_loss=pg_sum, kl_loss=kl_sum, tokens=jnp.sum(mask),
        clip_low_count=jnp.sum(terms.clip_low_BxS), clip_high_count=jnp.sum(terms.clip_high_BxS),
        dual_clip_count=jnp.sum(terms.dual_BxS),
        approx_kl_sum=jnp.sum(mask * (jnp.expm1(lr) - lr)), ppo_kl_sum=jnp.sum(mask * -lr),
        entropy_sum=jnp.sum(mask * sg(entropy_BxS)), entropy_loss=sg(ent_sum))
    return loss, aux

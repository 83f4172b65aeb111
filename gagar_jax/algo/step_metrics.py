"""One train step's metrics: the per-update statistics and the advantage output, reduced on device.

`train_step` returns a `StepMetrics` (device arrays); the loop reads it on the host one step
later (`metrics.to_host`), after the next step is dispatched. `GroupAudit` carries the
per-group / per-trajectory values that `metrics.group_records` writes to `groups.jsonl`.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from gagar_jax.algo import loss as loss_lib
from gagar_jax.algo.advantage import AdvantageOutput, broadcast_to_tokens
from gagar_jax.algo.rollout_correction import RolloutCorrMetrics, zero_metrics
from gagar_jax.batch import Batch


@flax.struct.dataclass
class RouterStats:
    """Router statistics of a forward pass, averaged over micro-batches (no routed ids)."""
    aux_loss: jax.Array
    z_loss: jax.Array
    expert_load_LxE: jax.Array


@flax.struct.dataclass
class UpdateStats:
    """One optimizer update (stacked to [epochs, mini_batches] by the step's scans)."""
    loss: jax.Array
    grad_norm: jax.Array
    learning_rate: jax.Array
    finite: jax.Array
    aux: loss_lib.LossAux
    router: RouterStats


@flax.struct.dataclass
class GroupAudit:
    """Per-group / per-trajectory results for `groups.jsonl` and the ledger counts."""
    lam_G: jax.Array
    capped_G: jax.Array
    fallback_G: jax.Array
    mixed_G: jax.Array
    advantages_T: jax.Array
    outcome_advantages_T: jax.Array


@flax.struct.dataclass
class StepMetrics:
    """One train step's metrics (device arrays; `metrics.to_host` flattens them).

    Loss terms and grad_norm average over the step's optimizer updates; clip fractions, approx_kl
    (k3 of KL(old || current)), ppo_kl (k1) and entropy are per trained token over all updates;
    learning_rate is the last update's. Credits sum over groups; lam_mean / lam_max are over
    mixed groups; `net_credit_per_traj` is their net (pos_credit_after + neg_credit) per valid
    trajectory. The token-weighted credits weigh each trained token's final advantage by its
    policy-term aggregation weight w_t (what multiplies it in the loss at ratio 1):
    `token_net_credit` = sum w A / sum w (the aggregation's mean advantage; its sign is that of
    the push onto tokens the sampler never proposes, docs/miniature.md), `token_net_frac` =
    sum w A / sum w |A| (in [-1, 1], what `run/guardrails.py` watches) and
    `token_outcome_credit` = sum w A_outcome / sum w (the binary outcome advantages' part: the
    outcome's own length bias, which no redistribution mode changes).
    entropy_loss is the aggregated entropy (the bonus before entropy_coef), mean
    over updates; `rollout` the learner-vs-rollout diagnostics of the batch
    (rollout_correction.py; zeros and IS weight 1 without recompute_old_logprobs), written as
    `rollout/<name>`.
    """
    loss: jax.Array
    pg_loss: jax.Array
    kl_loss: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array
    clip_frac_low: jax.Array
    clip_frac_high: jax.Array
    dual_clip_frac: jax.Array
    approx_kl: jax.Array
    pg_clipfrac: jax.Array        # verl's name: clip_frac_low + clip_frac_high
    ppo_kl: jax.Array             # verl's name: k1, mean of old - current log-prob per token
    entropy: jax.Array
    entropy_loss: jax.Array
    grad_norm: jax.Array
    learning_rate: jax.Array
    tokens: jax.Array
    trajectories: jax.Array
    groups: jax.Array
    mixed_groups: jax.Array
    lam_mean: jax.Array
    lam_max: jax.Array
    capped_groups: jax.Array
    fallback_groups: jax.Array
    pos_credit_before: jax.Array
    pos_credit_after: jax.Array
    neg_credit: jax.Array
    net_credit_per_traj: jax.Array
    token_net_credit: jax.Array
    token_net_frac: jax.Array
    token_outcome_credit: jax.Array
    mean_response_len: jax.Array
    updates: jax.Array
    skipped: jax.Array
    expert_load_LxE: jax.Array
    rollout: RolloutCorrMetrics
    audit: GroupAudit


def step_metrics(batch: Batch, inputs: loss_lib.LossInputs, adv: AdvantageOutput,
                 stats: UpdateStats, load_LxE: jax.Array,
                 rollout: RolloutCorrMetrics | None = None) -> StepMetrics:
    """Reduces the per-update stats [epochs, mini_batches] and the advantage output to metrics."""
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    a = stats.aux
    tok = jnp.maximum(jnp.sum(a.tokens), 1.0)
    mixed = adv.mixed
    n_mixed = jnp.sum(mixed)
    tokens_T = jax.ops.segment_sum(inputs.mask_BxS.reshape(-1), batch.traj_index_BxS.reshape(-1),
                                   num_segments=batch.num_trajectories)
    finite = stats.finite.astype(jnp.int32)
    w_BxS = inputs.weight_BxS if inputs.pg_weight_BxS is None else inputs.pg_weight_BxS
    w_sum = jnp.maximum(jnp.sum(w_BxS), 1e-30)
    wa = jnp.sum(w_BxS * inputs.adv_BxS)
    w_abs = jnp.sum(w_BxS * jnp.abs(inputs.adv_BxS))
    outcome_BxS = broadcast_to_tokens(adv.outcome_advantages, batch.traj_index_BxS,
                                      inputs.mask_BxS)
    n_valid = jnp.maximum(jnp.sum(batch.valid_T), 1)
    return StepMetrics(
        loss=jnp.mean(stats.loss),
        pg_loss=jnp.mean(a.pg_loss),
        kl_loss=jnp.mean(a.kl_loss),
        aux_loss=jnp.mean(stats.router.aux_loss),
        z_loss=jnp.mean(stats.router.z_loss),
        clip_frac_low=jnp.sum(a.clip_low_count) / tok,
        clip_frac_high=jnp.sum(a.clip_high_count) / tok,
        dual_clip_frac=jnp.sum(a.dual_clip_count) / tok,
        approx_kl=jnp.sum(a.approx_kl_sum) / tok,
        pg_clipfrac=(jnp.sum(a.clip_low_count) + jnp.sum(a.clip_high_count)) / tok,
        ppo_kl=jnp.sum(a.ppo_kl_sum) / tok,
        entropy=jnp.sum(a.entropy_sum) / tok,
        entropy_loss=jnp.mean(a.entropy_loss),
        grad_norm=jnp.mean(stats.grad_norm),
        learning_rate=stats.learning_rate.reshape(-1)[-1],
        tokens=jnp.sum(inputs.mask_BxS),
        trajectories=f32(jnp.sum(batch.valid_T)),
        groups=f32(jnp.sum(adv.num_valid > 0)),
        mixed_groups=f32(n_mixed),
        lam_mean=jnp.sum(jnp.where(mixed, adv.lam, 0.0)) / jnp.maximum(n_mixed, 1),
        lam_max=jnp.max(jnp.where(mixed, adv.lam, 0.0)),
        capped_groups=f32(jnp.sum(adv.capped)),
        fallback_groups=f32(jnp.sum(adv.fallback)),
        pos_credit_before=jnp.sum(adv.pos_credit_before),
        pos_credit_after=jnp.sum(adv.pos_credit_after),
        neg_credit=jnp.sum(adv.neg_credit),
        net_credit_per_traj=(jnp.sum(adv.pos_credit_after) + jnp.sum(adv.neg_credit)) / n_valid,
        token_net_credit=wa / w_sum,
        token_net_frac=jnp.where(w_abs > 0, wa / jnp.maximum(w_abs, 1e-30), 0.0),
        token_outcome_credit=jnp.sum(w_BxS * outcome_BxS) / w_sum,
        mean_response_len=jnp.sum(tokens_T) / jnp.maximum(jnp.sum(tokens_T > 0), 1),
        updates=f32(jnp.sum(finite)),
        skipped=f32(jnp.sum(1 - finite)),
        expert_load_LxE=load_LxE,
        rollout=zero_metrics() if rollout is None else rollout,
        audit=GroupAudit(
            lam_G=adv.lam,
            capped_G=adv.capped,
            fallback_G=adv.fallback,
            mixed_G=mixed,
            advantages_T=adv.advantages,
            outcome_advantages_T=adv.outcome_advantages,
        ),
    )

"""One batch from selected groups: the [T]/[G] arrays, the packed rows, and its `BatchInfo`.

Pure given its inputs (no feed state), so the batcher's selection and this assembly read apart.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from gagar_jax import batch as batch_lib
from gagar_jax import grading
from gagar_jax.feed import packing
from gagar_jax.feed.buckets import BucketPlan
from gagar_jax.feed.config import FeedConfig
from gagar_jax.feed.validate import ModelShape

NO_GRADE = -2     # tier code for "not graded" (fails, hacked passes, padding)


@dataclasses.dataclass(frozen=True)
class BatchInfo:
    """Host-side facts about one batch, for the trainer's groups.jsonl audit log and metrics.

    Per-group tuples are indexed by group slot g (the values of `Batch.group_ids_T`); slots
    >= num_groups are padding. `traj_slots[g]` are group g's indices into the [T] arrays.
    """

    group_ids: tuple
    task_ids: tuple
    policy_versions: tuple
    trajectory_ids: tuple       # per group: its trajectory ids, in traj-slot order
    infra_ids: tuple            # per group: ids of its infra_error trajectories (not in the batch)
    traj_slots: tuple           # per group: its trajectory slots
    num_infra: tuple            # per group: infra-error trajectories left out of the batch
    num_groups: int
    num_trajectories: int
    num_tokens: int
    num_generated_tokens: int
    rows_used: int
    packing_efficiency: float   # tokens / token_slots
    counts: dict                # ledger deltas during this call (received, filtered, quarantined)
    token_slots: int = 0        # B x S, or with length buckets the live micro-batches' slots
    bucket_micro_batches: tuple = ()   # live micro-batches per length bucket (with buckets)


def assemble(groups: list, plan: packing.PackPlan | BucketPlan, cfg: FeedConfig,
             shape: ModelShape, factor_table: Any, row_block: slice | Sequence[slice],
             col_block: slice | Sequence[slice],
             ) -> tuple[batch_lib.Batch | batch_lib.BucketedBatch, BatchInfo, dict]:
    """The batch (this process's block of the rows), its `BatchInfo` (counts filled by the
    caller) and this process's row-build failures, {group_id: [reason, detail]}.

    Args:
      groups: the selected `ParsedGroup`s, in slot order; plan: their packing into rows (a
        `BucketPlan` with length buckets: the batch is then a `BucketedBatch`).
      cfg: the feed settings (T, G, S); shape: the model's routing shape.
      factor_table: grading's tier -> factor table.
      row_block, col_block: this process's slices of the rows and columns (one per bucket with
        buckets).
    """
    T, G = cfg.max_trajectories, cfg.groups_per_batch
    trajs = [t for pg in groups for t in pg.trajectories]
    n = len(trajs)
    slot_G = np.repeat(np.arange(len(groups)), [len(pg.trajectories) for pg in groups])

    def per_traj(values: Sequence | np.ndarray, dtype: type, fill: float):
        out = np.full((T,), fill, dtype)
        out[:n] = np.asarray(values, dtype)
        return out

    group_ids_T = per_traj(slot_G, np.int32, 0)
    reward_T = per_traj([t.reward for t in trajs], np.float32, 0.0)
    valid_T = per_traj([True] * n, np.bool_, False)
    hacked_T = per_traj([t.hacked for t in trajs], np.bool_, False)
    # Only passes after hack zeroing carry a grade; their (group, tier) rank range must not
    # see anyone else. A pass without a usable grade gets NaN, so the loss's grading
    # fallback (docs/advantage.md rule 5) applies to its group.
    scored_T = valid_T & (reward_T > 0) & ~hacked_T
    tier_T = np.where(scored_T, per_traj([t.tier for t in trajs], np.int32, 0), NO_GRADE)
    factors_T = grading.quality_factors(
        tier_T, per_traj([t.rank for t in trajs], np.int32, 0), group_ids_T,
        per_traj([t.factor for t in trajs], np.float32, 1.0),
        table=factor_table, num_groups=G)
    factors_T = np.where(scored_T, factors_T, 1.0).astype(np.float32)
    grading_ok_G = np.zeros((G,), np.bool_)
    grading_ok_G[:len(groups)] = [pg.grading_ok for pg in groups]
    routed_shape = ((shape.num_moe_layers, shape.top_k)
                    if cfg.routing_replay else None)
    per_step = dict(group_ids_T=group_ids_T, rewards_T=reward_T, valid_T=valid_T,
                    hacked_T=hacked_T, factors_T=factors_T,
                    adjustments_T=per_traj([t.adjustment for t in trajs], np.float32, 0.0),
                    grading_ok_G=grading_ok_G)
    failed: dict = {}

    def rows_of(p: packing.PackPlan, rows: slice, cols: slice, seq_len: int) -> batch_lib.Batch:
        built = packing.build_rows(p, trajs, rows, seq_len, routed_shape, cols)
        failed.update(built.failures)
        return batch_lib.Batch(
            tokens_BxS=built.tokens, segment_ids_BxS=built.segment_ids,
            positions_BxS=built.positions, traj_index_BxS=built.traj_index,
            loss_mask_BxS=built.loss_mask, old_logprobs_BxS=built.old_logprobs,
            routed_experts_BxSxLxK=built.routed, **per_step)

    if isinstance(plan, BucketPlan):    # row_block / col_block: one slice per bucket
        batch = batch_lib.BucketedBatch(buckets=tuple(
            rows_of(plan.for_bucket(k), row_block[k], col_block[k], size)
            for k, size in enumerate(cfg.buckets)))
        rows_used = cfg.bucket_rows * sum(plan.micro_K)
        slots = plan.slots
    else:
        batch = rows_of(plan, row_block, col_block, cfg.seq_len)
        rows_used, slots = plan.rows_used, cfg.batch_tokens
    num_tokens = int(sum(t.length for t in trajs))
    offsets = np.cumsum([0] + [len(pg.trajectories) for pg in groups])
    info = BatchInfo(
        group_ids=tuple(pg.group_id for pg in groups),
        task_ids=tuple(pg.record.task_id for pg in groups),
        policy_versions=tuple(pg.policy_version for pg in groups),
        trajectory_ids=tuple(tuple(t.trajectory_id for t in pg.trajectories) for pg in groups),
        infra_ids=tuple(tuple(t.trajectory_id for t in pg.record.trajectories
                              if t.outcome == "infra_error") for pg in groups),
        traj_slots=tuple(tuple(range(offsets[g], offsets[g + 1])) for g in range(len(groups))),
        num_infra=tuple(pg.num_infra for pg in groups),
        num_groups=len(groups), num_trajectories=n, num_tokens=num_tokens,
        num_generated_tokens=int(sum(t.loss_mask.sum() for t in trajs)),
        rows_used=rows_used, packing_efficiency=num_tokens / slots, counts={},
        token_slots=slots,
        bucket_micro_batches=tuple(plan.micro_K) if isinstance(plan, BucketPlan) else ())
    failures: dict = {}
    for i, (reason, detail) in sorted(failed.items()):
        failures.setdefault(groups[int(slot_G[i])].group_id, [reason, detail])
    return batch, info, failures

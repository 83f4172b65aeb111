"""Packing trajectories into fixed [B, S] rows, and the per-process row split.

The packing plan depends only on trajectory lengths (the records' headers), so every process
computes the same plan and builds only its own rows of the token arrays.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Optional

import jax
import numpy as np

from gagar_jax.batch import Batch, BucketedBatch
from gagar_jax.feed import packed


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Where each trajectory goes: `row_T[i]`, `offset_T[i]` (start column), `segment_T[i]`
    (its 1-based segment id within the row)."""

    row_T: np.ndarray
    offset_T: np.ndarray
    segment_T: np.ndarray
    rows_used: int


def first_fit_decreasing(lengths: Sequence[int], num_rows: int, seq_len: int) -> Optional[PackPlan]:
    """Packs items longest-first into the first row with room (ties: input order).

    Args:
      lengths: token count per trajectory, each in [1, seq_len].
      num_rows: B, rows available.
      seq_len: S, capacity per row.
    Returns:
      The `PackPlan`, or None when the items do not fit in `num_rows` rows.
    """
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and (lengths.min() < 1 or lengths.max() > seq_len):
        raise ValueError(f"lengths must lie in [1, seq_len={seq_len}], got "
                         f"[{lengths.min()}, {lengths.max()}]")
    order = np.argsort(-lengths, kind="stable").tolist()
    sizes = lengths.tolist()
    used = [0] * num_rows            # plain lists: this runs per candidate group, on the host
    count = [0] * num_rows
    row_T = np.zeros(lengths.size, np.int64)
    offset_T = np.zeros(lengths.size, np.int64)
    segment_T = np.zeros(lengths.size, np.int64)
    rows_used = 0
    for i in order:
        n = sizes[i]
        r = next((r for r in range(num_rows) if used[r] + n <= seq_len), None)
        if r is None:
            return None
        row_T[i], offset_T[i] = r, used[r]
        count[r] += 1
        segment_T[i] = count[r]
        used[r] += n
        rows_used = max(rows_used, r + 1)
    return PackPlan(row_T=row_T, offset_T=offset_T, segment_T=segment_T, rows_used=rows_used)


def local_row_slice(num_rows: int, process_index: int, process_count: int) -> slice:
    """The contiguous rows process `process_index` builds (rows split evenly, in order).

    Matches a batch sharding whose row axis is split over processes in process order, which
    is what `jax.make_array_from_process_local_data` expects for the global [B, ...] array.
    """
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    if num_rows % process_count:
        raise ValueError(f"rows_per_batch ({num_rows}) must be divisible by the process count "
                         f"({process_count})")
    per = num_rows // process_count
    return slice(process_index * per, (process_index + 1) * per)


@dataclasses.dataclass
class RowArrays:
    """The token arrays of rows [start, stop) of one batch."""

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    traj_index: np.ndarray
    loss_mask: np.ndarray
    old_logprobs: np.ndarray
    routed: Optional[np.ndarray]
    # trajectory index -> (reason, detail) for payloads that failed to decode while building
    # these rows (their tokens are in place, their routing left at -1).
    failures: dict = dataclasses.field(default_factory=dict)


def build_rows(plan: PackPlan, trajectories: Sequence, rows: slice, seq_len: int,
               routed_shape: Optional[tuple[int, int]], cols: Optional[slice] = None) -> RowArrays:
    """Fills the token arrays of the block `rows` x `cols` from the trajectories placed there.

    Only the trajectories that overlap the block are touched, and only on their overlap with
    `cols`: that part of their lazy payloads (compact tokens, log-probs, routed_experts) is
    decoded, checked and copied. One that fails to decode is reported in `failures`, never
    raised (the batcher agrees on failures across processes, so a bad value is caught by the
    host whose block holds it and acted on by all).

    Args:
      plan: the batch's `PackPlan` (trajectory i is `trajectories[i]`, traj index i).
      trajectories: `ParsedTrajectory`s in per-trajectory-array order.
      rows: the rows to build (a process's `local_row_slice` or `process_row_block` rows).
      seq_len: S.
      routed_shape: (L, K) to build routed_experts (-1 where not recorded), or None.
      cols: the columns [s0, s1) of S to build (`process_row_block`'s S range when the context
        axis spans hosts); default all of S.
    Returns:
      `RowArrays` of shape [rows, s1 - s0, ...]: column j holds global column s0 + j.
    """
    c0, c1 = (0, seq_len) if cols is None else (cols.start or 0, seq_len if cols.stop is None
                                               else cols.stop)
    if not 0 <= c0 < c1 <= seq_len or cols is not None and cols.step not in (None, 1):
        raise ValueError(f"cols must be a slice within [0, seq_len={seq_len}), got {cols}")
    shape = (rows.stop - rows.start, c1 - c0)
    out = RowArrays(
        tokens=np.zeros(shape, np.int32), segment_ids=np.zeros(shape, np.int32),
        positions=np.zeros(shape, np.int32), traj_index=np.zeros(shape, np.int32),
        loss_mask=np.zeros(shape, np.float32), old_logprobs=np.zeros(shape, np.float32),
        routed=None if routed_shape is None else np.full(shape + tuple(routed_shape), -1, np.int32))
    for i, traj in enumerate(trajectories):
        r = int(plan.row_T[i])
        a = int(plan.offset_T[i])
        lo, hi = max(a, c0), min(a + traj.length, c1)   # the overlap, in row columns
        if not rows.start <= r < rows.stop or lo >= hi:
            continue
        r -= rows.start
        dst, src = slice(lo - c0, hi - c0), slice(lo - a, hi - a)
        mask = traj.loss_mask[src]
        try:            # compact payloads are decoded (and checked) here, for this block only
            out.tokens[r, dst] = traj.token_rows(src)
            out.old_logprobs[r, dst] = traj.logprob_rows(src) * mask
            if out.routed is not None and traj.routed is not None:
                traj.routed_rows(out.routed[r, dst], src)     # decoded in place
        except packed.PayloadError as e:
            out.failures[i] = (e.reason, f"trajectory {traj.trajectory_id!r}: {e.detail}")
        out.segment_ids[r, dst] = plan.segment_T[i]
        out.positions[r, dst] = np.arange(src.start, src.stop)
        out.traj_index[r, dst] = i
        out.loss_mask[r, dst] = mask
    return out


def global_shapes(local_batch: Batch | BucketedBatch, global_rows: int | tuple,
                  seq_len: int = 0) -> Batch | BucketedBatch:
    """`jax.ShapeDtypeStruct`s of the global batch whose local block `local_batch` holds.

    Shardings are chosen from these (`sharding.batch_shardings`), never from a process's block:
    a mesh axis that divides B or S may not divide the block. A `BucketedBatch` takes
    `global_rows` = its buckets' (rows, row length) (`FeedConfig.bucket_shapes`).
    """
    if isinstance(local_batch, BucketedBatch):
        return BucketedBatch(buckets=tuple(
            global_shapes(b, r, s) for b, (r, s) in zip(local_batch.buckets, global_rows,
                                                        strict=True)))

    def one(x: np.ndarray):
        x = np.asarray(x)
        shape = (global_rows, seq_len) + x.shape[2:] if x.ndim >= 2 else x.shape
        return jax.ShapeDtypeStruct(shape, x.dtype)
    return jax.tree.map(one, local_batch)


def make_global_batch(local_batch: Batch | BucketedBatch,
                      shardings: jax.sharding.Sharding | Batch | BucketedBatch,
                      global_rows: int | tuple, seq_len: Optional[int] = None
                      ) -> Batch | BucketedBatch:
    """Assembles global `jax.Array`s from each process's block plus replicated arrays.

    Args:
      local_batch: a `Batch` of numpy arrays as `Feed.next_batch` returns it (token arrays hold
        this process's block of rows and columns; per-trajectory and per-group arrays are
        complete everywhere).
      shardings: a `Batch`-shaped pytree of `jax.sharding.Sharding` (or one sharding for all).
      global_rows: B, rows of the global batch.
      seq_len: S of the global batch; default the block's width (whole rows per process).
    Returns:
      The `Batch` with global `jax.Array` leaves.
    """
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, local_batch)
    if isinstance(local_batch, BucketedBatch):   # global_rows: the buckets' (rows, length)
        shapes = global_shapes(local_batch, global_rows)
    else:
        shapes = global_shapes(local_batch, global_rows, seq_len if seq_len is not None
                               else np.shape(local_batch.tokens_BxS)[1])

    def one(x: np.ndarray, sharding: jax.sharding.Sharding, shape: jax.ShapeDtypeStruct):
        # Token arrays ([B, S, ...]) are this process's block: each of its devices takes its
        # part, by offset within the block; per-trajectory/per-group ones are whole.
        return jax.make_array_from_process_local_data(sharding, np.asarray(x), shape.shape)

    return jax.tree.map(one, local_batch, shardings, shapes)

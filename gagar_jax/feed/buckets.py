"""Length buckets: one step's trajectories packed into micro-batches of a few row lengths.

A single row length either drops long agent trajectories (a group with one trajectory over it
loses the whole group) or pads short ones. With `feed.buckets` the step holds micro-batches of
several compiled row lengths instead: each micro-batch is `feed.bucket_rows` rows of one
bucket's length, a bucket has at most `bucket_micro_batches[k]` of them, and the live ones
together stay within the step's token budget (`feed.tokens_per_batch`). A group's trajectories
may land in different micro-batches and buckets of the same step (the loss's denominators are
global over the step, `run/bucket_step.py`).

`bucket_pack` places trajectories longest first: into the open row with the least room that
fits it (several shorter trajectories share a row), else it opens a micro-batch. Which bucket
to open is decided by a look-ahead: the bucket whose `bucket_rows` rows the next trajectories
would fill best (first-fit), so two 110k trajectories open a 256k micro-batch rather than a
128k one each. Every micro-batch costs its whole rows (a row's compute does not shrink with
its padding), so filling the rows of an open micro-batch is free and opening one is not.

Rows of micro-batch u of bucket k are rows u, u + U, u + 2U, ... of that bucket's [U x r, S]
arrays (U = its `bucket_micro_batches`): `loss.split_rows` takes micro-batch u from every
batch shard, one row each.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Optional

import numpy as np

from gagar_jax.feed.packing import PackPlan

LOOKAHEAD_ROWS = 4   # the look-ahead tries this many rows' worth of the next trajectories per row


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """Where each trajectory goes: bucket `bucket_T[i]`, row `row_T[i]` of that bucket's arrays,
    start column `offset_T[i]`, 1-based segment `segment_T[i]` within its row; `micro_K[k]`
    live micro-batches of bucket k, `slots` = the token slots they hold."""

    bucket_T: np.ndarray
    row_T: np.ndarray
    offset_T: np.ndarray
    segment_T: np.ndarray
    micro_K: tuple
    slots: int

    def for_bucket(self, k: int) -> PackPlan:
        """The `PackPlan` of bucket k (trajectories elsewhere get row -1: never built)."""
        here = self.bucket_T == k
        return PackPlan(row_T=np.where(here, self.row_T, -1), offset_T=self.offset_T,
                        segment_T=self.segment_T, rows_used=int(self.micro_K[k]))


def _lookahead_fill(rest: Sequence[int], size: int, rows: int) -> int:
    """Tokens of `rest` (longest first) that first-fit puts into `rows` empty rows of `size`."""
    room = np.full(rows, size, np.int64)
    fill = 0
    for x in rest[: LOOKAHEAD_ROWS * rows]:
        fits = np.nonzero(room >= x)[0]
        if fits.size:
            room[fits[0]] -= x
            fill += x
    return fill


def bucket_pack(lengths: Sequence[int], buckets: Sequence[int], rows_per_micro: int,
                max_micro: Sequence[int], budget: int) -> Optional[BucketPlan]:
    """Packs trajectories into micro-batches of bucketed rows (module docstring).

    Args:
      lengths: tokens per trajectory, each in [1, max(buckets)].
      buckets: the row lengths, ascending.
      rows_per_micro: rows of every micro-batch.
      max_micro: per bucket, the most micro-batches a step may hold (its static array size).
      budget: most token slots (rows x length over the live micro-batches) of one step.
    Returns:
      The `BucketPlan`, or None when they do not fit.
    """
    lengths = [int(x) for x in lengths]
    if lengths and (min(lengths) < 1 or max(lengths) > buckets[-1]):
        raise ValueError(f"lengths must lie in [1, {buckets[-1]}], got "
                         f"[{min(lengths)}, {max(lengths)}]")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])     # stable: ties in order
    room = np.zeros(0, np.int64)          # per open row: tokens left
    row_bucket = np.zeros(0, np.int64)
    row_index: list[int] = []             # per open row: its row in the bucket's arrays
    count = np.zeros(0, np.int64)         # per open row: segments so far
    micro = [0] * len(buckets)
    slots = 0
    n = len(lengths)
    bucket_T, row_T = np.zeros(n, np.int64), np.zeros(n, np.int64)
    offset_T, segment_T = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for pos, i in enumerate(order):
        x = lengths[i]
        fits = np.nonzero(room >= x)[0]
        if fits.size:
            r = int(fits[np.argmin(room[fits])])
        else:
            rest = [lengths[j] for j in order[pos:]]
            best = None
            for k, size in enumerate(buckets):
                if size < x or micro[k] >= max_micro[k] or slots + rows_per_micro * size > budget:
                    continue
                score = _lookahead_fill(rest, size, rows_per_micro) / (rows_per_micro * size)
                if best is None or score > best[0] + 1e-12:
                    best = (score, k)
            if best is None:
                return None
            k = best[1]
            u, per = micro[k], max_micro[k]
            micro[k] += 1
            slots += rows_per_micro * buckets[k]
            r = len(room)
            room = np.concatenate([room, np.full(rows_per_micro, buckets[k], np.int64)])
            row_bucket = np.concatenate([row_bucket, np.full(rows_per_micro, k, np.int64)])
            count = np.concatenate([count, np.zeros(rows_per_micro, np.int64)])
            row_index += [u + per * j for j in range(rows_per_micro)]
        k = int(row_bucket[r])
        bucket_T[i], row_T[i] = k, row_index[r]
        offset_T[i] = buckets[k] - room[r]
        count[r] += 1
        segment_T[i] = count[r]
        room[r] -= x
    return BucketPlan(bucket_T=bucket_T, row_T=row_T, offset_T=offset_T, segment_T=segment_T,
                      micro_K=tuple(micro), slots=slots)


def max_micro_batches(buckets: Sequence[int], rows_per_micro: int, budget: int,
                      given: Sequence[int] = ()) -> tuple[int, ...]:
    """Per bucket, the most micro-batches a step may hold: `given`, else as many as the budget
    allows (every bucket could take the whole step)."""
    if given:
        if len(given) != len(buckets) or any(int(u) < 1 for u in given):
            raise ValueError(f"feed.bucket_micro_batches needs one count >= 1 per bucket "
                             f"({len(buckets)}), got {tuple(given)}")
        return tuple(int(u) for u in given)
    out = tuple(budget // (rows_per_micro * s) for s in buckets)
    if min(out) < 1:
        raise ValueError(f"feed.tokens_per_batch ({budget}) holds no micro-batch of "
                         f"{rows_per_micro} rows of {max(buckets)} tokens")
    return out

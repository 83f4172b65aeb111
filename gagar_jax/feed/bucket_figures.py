"""How many groups a bucketed feed trains whole, and its padding, for a length distribution.

Pure host code (NumPy): draws groups of trajectory lengths, then forms steps as
`batcher.Feed._select` does (groups in arrival order, a group is never split across steps, one
that does not fit waits for the next step, at most `groups_per_batch` groups and
`max_trajectories` trajectories a step) with the feed's own packer (`buckets.bucket_pack`, or
`packing.first_fit_decreasing` without buckets). A trajectory over `max_traj_tokens` follows
the one overlong policy (`feed.overlong`, docs/feed.md): `reject` quarantines its group,
`drop` keeps the group but takes the trajectory out of the loss, `truncate` trains it cut. A
group is *whole* when it is trained with every trajectory in the loss, uncut.
`scripts/bench_feed.py` prints these figures (docs/scaling.md).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from gagar_jax.feed import buckets, packing
from gagar_jax.feed.config import FeedConfig


@dataclasses.dataclass(frozen=True)
class Figures:
    """groups drawn, trained whole, trained at all, quarantined; steps; groups, real tokens and
    token slots of those steps (the last, partial step excluded); micro-batches per bucket."""

    groups: int
    whole: int
    trained: int
    quarantined: int
    steps: int
    step_groups: int
    tokens: int
    slots: int
    micro_K: tuple

    @property
    def whole_share(self) -> float:
        return self.whole / max(1, self.groups)

    @property
    def padding(self) -> float:
        return 1.0 - self.tokens / max(1, self.slots)


def lognormal_lengths(rng: np.random.Generator, num_groups: int, group_size: int,
                      mean_G: float | np.ndarray, spread: float) -> np.ndarray:
    """[G, n] int lengths from a log-normal of mean `mean_G` (per group, or one float) and
    standard deviation `spread` x mean (at least 1 token)."""
    sigma = np.sqrt(np.log1p(spread ** 2))
    mu_G = np.log(np.broadcast_to(np.asarray(mean_G, np.float64), (num_groups,))) - sigma ** 2 / 2
    x = rng.lognormal(mu_G[:, None], sigma, size=(num_groups, group_size))
    return np.maximum(1, np.rint(x)).astype(np.int64)


def _plan(cfg: FeedConfig, lengths: list):
    if cfg.buckets:
        return buckets.bucket_pack(lengths, cfg.buckets, cfg.bucket_rows,
                                   cfg.bucket_micro_batches, cfg.tokens_per_batch)
    return packing.first_fit_decreasing(lengths, cfg.rows_per_batch, cfg.seq_len)


def _slots(cfg: FeedConfig, plan: buckets.BucketPlan | packing.PackPlan) -> tuple:
    if cfg.buckets:
        return plan.slots, plan.micro_K
    return cfg.rows_per_batch * cfg.seq_len, (1,)


def simulate(cfg: FeedConfig, lengths_GxN: np.ndarray) -> Figures:
    """Steps of `cfg`'s feed over the groups of `lengths_GxN` (module docstring).

    Args:
      cfg: the feed config (buckets, bucket_rows, tokens_per_batch or rows x seq_len,
        groups_per_batch, max_trajectories, max_traj_tokens, overlong).
      lengths_GxN: tokens per trajectory, one group per row.
    Returns:
      The `Figures`.
    """
    cap = cfg.max_traj_tokens
    queue, quarantined = [], 0
    for row in np.asarray(lengths_GxN):
        row = [int(x) for x in row]
        over = any(x > cap for x in row)
        if over and cfg.overlong == "reject":
            quarantined += 1
            continue
        cut = [min(x, cap) for x in row]
        if _plan(cfg, cut) is None:             # does not fit even alone: quarantined
            quarantined += 1
            continue
        queue.append((cut, not over))
    whole = trained = steps = step_groups = tokens = slots = 0
    micro = None
    while queue:
        selected, deferred, lengths, plan = [], [], [], None
        rest, waiting = [], 0               # waiting: tokens of the deferred groups
        for pos, (g, ok) in enumerate(queue):
            if (len(selected) >= cfg.groups_per_batch or len(deferred) >= cfg.groups_per_batch
                    or waiting >= cfg.batch_tokens):
                rest = queue[pos:]
                break
            new = None
            if len(lengths) + len(g) <= cfg.max_trajectories:
                new = _plan(cfg, lengths + g)
            if new is None:
                deferred.append((g, ok))
                waiting += sum(g)
                continue
            selected.append((g, ok))
            lengths, plan = lengths + g, new
        queue = deferred + rest
        trained += len(selected)
        whole += sum(ok for _, ok in selected)
        if queue:                           # the last step may be partial: not in the padding
            steps += 1
            step_groups += len(selected)
            s, k = _slots(cfg, plan)
            tokens += sum(lengths)
            slots += s
            micro = k if micro is None else tuple(a + b for a, b in zip(micro, k, strict=True))
    return Figures(groups=len(lengths_GxN), whole=whole, trained=trained,
                   quarantined=quarantined, steps=steps,
                   step_groups=step_groups, tokens=tokens, slots=slots,
                   micro_K=micro or ())

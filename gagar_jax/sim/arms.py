"""The miniature's arms: the three advantage modes and the *control* (a sim-only ablation).

Arms `binary`, `downweight_only` and `sum_preserving` are the library's advantage modes
(`gagar_jax.algo.advantage.MODES`). The control gives every mixed group downweight-only's net credit
with no quality signal:

    A_i - c_g,   c_g = sum_{passes} (1 - f_i) A_i / n_g          (A_i = r_i - p_g, binary)

so that if downweight-only destabilises the policy while the control does too, the cause is the
net-negative credit, not what the factors prefer. It is not a library mode: `control_records`
rewrites a step's feed records so that the *unchanged* train step in `downweight_only` mode
computes exactly these advantages. With every pass's factor set to the group's mean pass factor
f_bar (a direct factor) downweight-only gives passes f_bar (1 - p) and failures -p; adding the
per-trajectory adjustment (1 - f_bar)(1 - p) A_i (zero-mean in the group, so the loss's rule-9
centring leaves it as is) gives passes (1 - p) - c_g and failures -p - c_g, because here
c_g = k (1 - p)(1 - f_bar) / n = p (1 - p)(1 - f_bar). `tests/test_sim.py` checks the train
step's advantages against `control_advantages`, a direct NumPy computation.
"""
from __future__ import annotations

from collections.abc import Iterable

import msgspec
import numpy as np

from gagar_jax import grading
from gagar_jax.algo.advantage import MODES
from gagar_jax.feed import schema

ARMS = MODES + ("control",)


def arm_mode(arm: str) -> str:
    """The library advantage mode an arm trains with."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    return "downweight_only" if arm == "control" else arm


def _clean_pass(t: schema.Trajectory) -> bool:
    return t.outcome == "pass" and not t.hacked


def pass_factors(group: schema.Group, table: grading.FactorTable) -> np.ndarray:
    """The factor the feed gives each trajectory of `group` (NaN for non-passes)."""
    tiers = np.array([grading.tier_code(t.quality.tier) if _clean_pass(t) else -9
                      for t in group.trajectories], np.int32)
    ranks = np.array([t.quality.rank if _clean_pass(t) else 0 for t in group.trajectories],
                     np.int32)
    f = grading.quality_factors(tiers, ranks, np.zeros_like(tiers), table=table, num_groups=1)
    return np.where(tiers >= 0, f, np.nan)


def control_advantages(group: schema.Group, table: grading.FactorTable) -> np.ndarray:
    """The control's advantages A_i - c_g of one group, directly (a reference for tests)."""
    r = np.array([_clean_pass(t) for t in group.trajectories], np.float64)
    n, k = len(r), r.sum()
    if not 0 < k < n:
        return np.zeros(n)
    A = r - k / n
    f = np.where(r > 0, pass_factors(group, table), 1.0)
    return A - np.sum((1 - f) * A * r) / n


def control_record(group: schema.Group, table: grading.FactorTable) -> schema.Group:
    """`group` rewritten so downweight-only advantages become the control's (module doc)."""
    r = np.array([_clean_pass(t) for t in group.trajectories], np.float64)
    n, k = len(r), r.sum()
    if not 0 < k < n or group.grading.status != "ok":
        return group
    f = pass_factors(group, table)
    fbar = float(np.mean(f[r > 0]))
    p = k / n
    trajs = []
    for t, ri in zip(group.trajectories, r, strict=False):
        adj = (1.0 - fbar) * (1.0 - p) * (ri - p)
        q = schema.Quality(factor=fbar) if ri > 0 else t.quality
        trajs.append(msgspec.structs.replace(t, quality=q, adjustment=float(t.adjustment + adj)))
    return msgspec.structs.replace(group, trajectories=trajs)


def transform(arm: str, records: Iterable[schema.Group], table: grading.FactorTable) -> list:
    """The records an arm trains on: unchanged, or rewritten for the control."""
    if arm_mode(arm) != "downweight_only" or arm == "downweight_only":
        return list(records)
    return [control_record(g, table) for g in records]

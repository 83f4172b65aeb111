"""Tier / rank -> quality factor (docs/advantage.md section 6), plain NumPy in the ground layer:
the feed maps grades with it, and a grader beside the rollout engine (no JAX) shares the table.

The grader ranks each group's passing candidates into tiers with a within-tier rank (smaller =
better; ties share a rank). The feed batcher maps them to factors once per batch, on host numpy
arrays, with one vectorized pass: a segment min/max of the rank over (group, tier) and a few
element-wise selects. No loop over groups or trajectories.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

STRONG, INTERMEDIATE, DEFECTIVE = 0, 1, 2
DIRECT = -1        # the grader sent the factor itself: pass it through
TIER_NAMES = {"strong": STRONG, "intermediate": INTERMEDIATE, "defective": DEFECTIVE}
_NUM_TIERS = 3


@dataclasses.dataclass(frozen=True)
class FactorTable:
    """Factors per tier; every one must lie in (0, 1] (checked at construction).

    Attributes:
      strong_best: a strong candidate with the best strong rank in its group.
      strong_other: any worse-ranked strong candidate.
      intermediate_best: an intermediate candidate at the best intermediate rank r_min.
      intermediate_worst: one at the worst rank r_max; ranks in between interpolate linearly,
        `best - (best - worst) * (r - r_min) / (r_max - r_min)`; all get `best` if r_min = r_max.
      defective: every defective candidate.
    """
    strong_best: float = 1.0
    strong_other: float = 0.9
    intermediate_best: float = 0.85
    intermediate_worst: float = 0.40
    defective: float = 0.2

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"FactorTable.{field.name} must be a number, got {value!r}")
            if not (math.isfinite(value) and 0.0 < value <= 1.0):
                raise ValueError(f"FactorTable.{field.name} must lie in (0, 1], got {value!r}")

    @classmethod
    def from_config(cls, cfg: Optional[Mapping[str, Any]]) -> FactorTable:
        """Builds the table from a ConfigDict / mapping of field overrides (None = defaults).

        Raises:
          ValueError on an unknown key or a factor outside (0, 1].
        """
        if cfg is None:
            return cls()
        items = dict(cfg.items())
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(items) - known)
        if unknown:
            raise ValueError(f"unknown grading factor key(s) {unknown}; known: {sorted(known)}")
        return cls(**{k: float(v) for k, v in items.items()})


def tier_code(name: str) -> int:
    """Integer code of a tier name ("strong", "intermediate", "defective")."""
    try:
        return TIER_NAMES[name]
    except KeyError:
        raise ValueError(f"tier must be one of {sorted(TIER_NAMES)}, got {name!r}") from None


def quality_factors(tiers: np.ndarray, ranks: np.ndarray, group_ids: np.ndarray,
                    direct_factors: Optional[np.ndarray] = None, *,
                    table: FactorTable = FactorTable(),
                    num_groups: Optional[int] = None) -> np.ndarray:
    """Factors for graded candidates, vectorized over trajectories.

    Args:
      tiers: int[T] STRONG / INTERMEDIATE / DEFECTIVE, DIRECT (-1: take `direct_factors`), or
        any other value for "no quality" (gives NaN, which triggers the grading fallback).
      ranks: int[T] within-tier rank, smaller = better; ties share a rank. Read for tiers 0-2.
      group_ids: int[T] in [0, num_groups): r_min / r_max are taken per (group, tier).
      direct_factors: optional float[T], read where the tier is DIRECT (NaN there if absent).
      table: the factor table.
      num_groups: number of groups (default: max group id + 1).

    Returns:
      float32[T] factors; NaN where no quality is available. Out-of-range direct factors pass
      through unchanged (the advantage's fallback rule handles them).
    """
    tiers = np.asarray(tiers)
    ranks = np.asarray(ranks)
    group_ids = np.asarray(group_ids)
    if tiers.ndim != 1:
        raise ValueError(f"tiers must have rank 1 (shape [T]), got shape {tiers.shape}")
    for name, arr in (("ranks", ranks), ("group_ids", group_ids)):
        if arr.shape != tiers.shape:
            raise ValueError(f"{name} must have shape {tiers.shape}, got {arr.shape}")
    for name, arr in (("tiers", tiers), ("ranks", ranks), ("group_ids", group_ids)):
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must have an integer dtype, got {arr.dtype}")
    if direct_factors is None:
        direct = np.full(tiers.shape, np.nan, np.float32)
    else:
        direct = np.asarray(direct_factors, np.float32)
        if direct.shape != tiers.shape:
            raise ValueError(f"direct_factors must have shape {tiers.shape}, got {direct.shape}")
    T = tiers.shape[0]
    if T == 0:
        return np.zeros((0,), np.float32)
    ranked = (tiers >= 0) & (tiers < _NUM_TIERS)
    if num_groups is None:
        num_groups = int(group_ids[ranked].max()) + 1 if ranked.any() else 1
    if ranked.any() and (group_ids[ranked].min() < 0 or group_ids[ranked].max() >= num_groups):
        raise ValueError(f"group_ids of ranked candidates must lie in [0, {num_groups})")

    # One segment per (group, tier); unranked rows go to a spare segment that is never read.
    seg = np.where(ranked, group_ids * _NUM_TIERS + np.clip(tiers, 0, _NUM_TIERS - 1),
                   num_groups * _NUM_TIERS).astype(np.int64)
    r = ranks.astype(np.float64)
    r_min = np.full(num_groups * _NUM_TIERS + 1, np.inf)
    r_max = np.full(num_groups * _NUM_TIERS + 1, -np.inf)
    np.minimum.at(r_min, seg, r)
    np.maximum.at(r_max, seg, r)
    lo, hi = r_min[seg], r_max[seg]

    span = np.where(hi > lo, hi - lo, 1.0)
    frac = np.where(hi > lo, (r - lo) / span, 0.0)
    t = table
    strong = np.where(r == lo, t.strong_best, t.strong_other)
    inter = t.intermediate_best - (t.intermediate_best - t.intermediate_worst) * frac
    out = np.select(
        [tiers == STRONG, tiers == INTERMEDIATE, tiers == DEFECTIVE, tiers == DIRECT],
        [strong, inter, np.full(T, t.defective), direct],
        default=np.nan,
    )
    return out.astype(np.float32)

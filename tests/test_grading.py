"""Tier / rank -> factor mapping: hand-worked values, ties, the table's validation, \
a loop reference."""

import math

import ml_collections
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gagar_jax.grading import (
    DEFECTIVE,
    DIRECT,
    INTERMEDIATE,
    STRONG,
    FactorTable,
    quality_factors,
    tier_code,
)


def test_defaults_match_spec():
    t = FactorTable()
    assert (t.strong_best, t.strong_other, t.intermediate_best, t.intermediate_worst,
            t.defective) == (1.0, 0.9, 0.85, 0.40, 0.2)


def test_hand_worked_one_group():
    # strong ranks 1,1,2; intermediate ranks 1,2,2,4 (r_min 1, r_max 4); two defective.
    tiers = [STRONG, STRONG, STRONG, INTERMEDIATE, INTERMEDIATE, INTERMEDIATE, INTERMEDIATE,
             DEFECTIVE, DEFECTIVE]
    ranks = [1, 1, 2, 1, 2, 2, 4, 1, 7]
    f = quality_factors(tiers, ranks, np.zeros(9, np.int32))
    # intermediate: 0.85 - 0.45 * (r - 1) / 3  ->  0.85, 0.70, 0.70, 0.40
    np.testing.assert_allclose(f, [1.0, 1.0, 0.9, 0.85, 0.70, 0.70, 0.40, 0.2, 0.2], rtol=1e-6)
    assert f.dtype == np.float32


def test_single_rank_tier_and_groups_are_separate():
    # Group 0 intermediate ranks all 3 -> 0.85 (r_min = r_max); group 1 ranks 0 and 5.
    # Group 1's strong rank 2 is its best strong rank even though group 0 has a strong rank 1.
    tiers = [INTERMEDIATE, INTERMEDIATE, STRONG, INTERMEDIATE, INTERMEDIATE, STRONG]
    ranks = [3, 3, 1, 0, 5, 2]
    gids = [0, 0, 0, 1, 1, 1]
    np.testing.assert_allclose(quality_factors(tiers, ranks, gids),
                               [0.85, 0.85, 1.0, 0.85, 0.40, 1.0], rtol=1e-6)


def test_direct_factors_pass_through_and_missing_is_nan():
    tiers = [DIRECT, DIRECT, STRONG, -2, 7]
    direct = [0.37, 1.7, np.nan, 0.5, 0.5]   # out-of-range direct factors pass through too
    f = quality_factors(tiers, [0, 0, 4, 0, 0], [0, 0, 0, 0, 0], direct)
    np.testing.assert_allclose(f[:3], [0.37, 1.7, 1.0], rtol=1e-6)
    assert np.isnan(f[3]) and np.isnan(f[4])
    assert np.isnan(quality_factors([DIRECT], [0], [0])[0])   # no direct factors given


def test_custom_table_and_from_config():
    cfg = ml_collections.ConfigDict(dict(strong_other=0.95, intermediate_worst=0.5, defective=0.3))
    t = FactorTable.from_config(cfg)
    assert t == FactorTable(strong_other=0.95, intermediate_worst=0.5, defective=0.3)
    assert FactorTable.from_config(None) == FactorTable()
    f = quality_factors([STRONG, STRONG, INTERMEDIATE, INTERMEDIATE, DEFECTIVE],
                        [0, 1, 0, 2, 0], [0] * 5, table=t)
    np.testing.assert_allclose(f, [1.0, 0.95, 0.85, 0.5, 0.3], rtol=1e-6)


@pytest.mark.parametrize("field,value", [("defective", 0.0), ("strong_best", 1.01),
                                         ("intermediate_worst", -0.1), ("strong_other", math.nan)])
def test_table_rejects_factors_outside_unit_interval(field, value):
    with pytest.raises(ValueError, match=field):
        FactorTable(**{field: value})


def test_from_config_rejects_unknown_key():
    with pytest.raises(ValueError, match="defective_factor"):
        FactorTable.from_config({"defective_factor": 0.1})


def test_tier_code_and_input_errors():
    assert [tier_code(n) for n in ("strong", "intermediate", "defective")] == [0, 1, 2]
    with pytest.raises(ValueError, match="tier"):
        tier_code("middling")
    with pytest.raises(ValueError, match="ranks"):
        quality_factors([0, 0], [1], [0, 0])
    with pytest.raises(TypeError, match="ranks"):
        quality_factors([0, 0], [1.0, 2.0], [0, 0])
    with pytest.raises(ValueError, match="group_ids"):
        quality_factors([0, 0], [1, 2], [0, 3], num_groups=2)
    assert quality_factors([], np.zeros(0, int), np.zeros(0, int)).shape == (0,)


def _loop_reference(tiers, ranks, gids, table):
    out = []
    for _i, (t, r, g) in enumerate(zip(tiers, ranks, gids, strict=False)):
        same = [ranks[j] for j in range(len(tiers)) if tiers[j] == t and gids[j] == g]
        if t == STRONG:
            out.append(table.strong_best if r == min(same) else table.strong_other)
        elif t == INTERMEDIATE:
            lo, hi = min(same), max(same)
            x = 0.0 if hi == lo else (r - lo) / (hi - lo)
            out.append(
                table.intermediate_best - (table.intermediate_best - table.intermediate_worst) * x
            )
        elif t == DEFECTIVE:
            out.append(table.defective)
        else:
            out.append(math.nan)
    return np.array(out)


candidates = st.lists(st.tuples(st.integers(-2, 2), st.integers(0, 5), st.integers(0, 3)),
                      min_size=1, max_size=40)


@given(candidates)
def test_matches_loop_reference_ties_identical_and_order_free(rows):
    tiers, ranks, gids = (np.array(c) for c in zip(*rows, strict=False))
    tiers = np.where(tiers == DIRECT, -2, tiers)   # no direct factors here: -1 and -2 both NaN
    f = quality_factors(tiers, ranks, gids)
    ref = _loop_reference(tiers, ranks, gids, FactorTable())
    np.testing.assert_allclose(f, ref, rtol=1e-6)
    # Ties (same group, tier, rank) get bit-identical factors; a better rank never gets less.
    for i in range(len(rows)):
        for j in range(len(rows)):
            if tiers[i] == tiers[j] >= 0 and gids[i] == gids[j]:
                if ranks[i] == ranks[j]:
                    assert f[i] == f[j]
                elif ranks[i] < ranks[j]:
                    assert f[i] >= f[j]
    perm = np.random.default_rng(len(rows)).permutation(len(rows))
    np.testing.assert_array_equal(quality_factors(tiers[perm], ranks[perm], gids[perm]), f[perm])

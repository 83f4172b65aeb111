"""Gagar advantages: hand-worked values, INV-1..INV-9 as hypothesis properties, a plain-NumPy loop
reference, jit vs no jit, 8-device sharding vs one device, no recompiles, trace-time errors and
the in-jit conservation checks.

Every batch is padded to one shape (T, G) so all examples share a handful of compilations.
"""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from support.reference_advantage import reference_advantages

from gagar_jax.algo import advantage as adv
from gagar_jax.algo import advantage_checks as chk
from gagar_jax.grading import DEFECTIVE, INTERMEDIATE, STRONG, quality_factors

T, G = 64, 12
CAP = 1.5
ARGS = ("rewards", "group_ids", "factors", "valid", "hacked", "grading_ok")
# Good factors sit off every cap boundary (mean factor = 1 / cap) for the caps tested here, so
# float32 and the float64 reference always agree on which groups are capped.
GRID = [m / 20 - 0.0013 for m in range(1, 20)] + [1.0]
BAD = [np.nan, 0.0, -0.5, 1.5, np.inf]


def pad(rewards, group_ids, factors, valid=None, hacked=None, grading_ok=None, adjustments=None,
        pad_gid=-1, weights=None):
    """A batch dict padded to (T, G): padding is invalid, \
with a junk reward, NaN factor and weight, pad_gid.
    Weights default to 1e-3 x (trajectory index mod 7 + 1): lengths of a token-mean batch."""
    n = len(rewards)
    full = lambda x, fill, dt: np.concatenate([np.asarray(x, dt), np.full(T - n, fill, dt)])
    if weights is None:
        weights = 1e-3 * (np.arange(n) % 7 + 1)
    return dict(
        weights=full(weights, np.nan, np.float32),
        rewards=full(rewards, 1.0, np.float32), group_ids=full(group_ids, pad_gid, np.int32),
        factors=full(factors, np.nan, np.float32),
        valid=full(np.ones(n, bool) if valid is None else valid, False, bool),
        hacked=full(np.zeros(n, bool) if hacked is None else hacked, False, bool),
        grading_ok=np.ones(G, bool) if grading_ok is None else np.asarray(grading_ok, bool),
        adjustments=full(np.zeros(n) if adjustments is None else adjustments, 0.0, np.float32))


def args(b):
    return tuple(b[k] for k in ARGS)


# One trace per static (mode, lam_cap, weights or not) the tests use: 4 modes + 2 extra caps (x2
# for the length-aware mode's), + 3 with weights in the other modes. Every batch here has the
# same shapes and dtypes, so any retrace is a bug that assert_max_traces turns into an error.
@functools.partial(jax.jit, static_argnames=("mode", "lam_cap"))
@chex.assert_max_traces(n=11)
def jitted(rewards, group_ids, factors, valid, hacked, grading_ok, adjustments, weights, *, mode,
           lam_cap):
    return adv.gagar_advantages(rewards, group_ids, factors, valid, hacked, grading_ok,
                                num_groups=G, lam_cap=lam_cap, mode=mode, adjustments=adjustments,
                                weights=weights)


def run(b, mode="sum_preserving", lam_cap=CAP, weights=None):
    """The jitted advantages; the length-aware mode gets the batch's weights (others none,
    unless `weights=True`)."""
    w = b["weights"] if (weights or mode in adv.WEIGHTED_MODES) else None
    out = jitted(*args(b), b["adjustments"], w, mode=mode, lam_cap=lam_cap)
    return jax.tree.map(lambda x: None if x is None else np.asarray(x), out)


@functools.cache
def jitted_equiv(mode):
    return jax.jit(functools.partial(adv.equivalent_rewards, num_groups=G, lam_cap=CAP, mode=mode))


def reference(b, mode="sum_preserving", lam_cap=CAP):
    return reference_advantages(*args(b), num_groups=G, lam_cap=lam_cap, mode=mode,
                                adjustments=b["adjustments"], weights=b["weights"])


@st.composite
def batches(draw):
    """Uneven groups (0-8 members, some empty), invalid members, hacks, bad and NaN factors,
    failed grading, adjustments; trajectories of different groups interleaved."""
    rows = []
    kinds = {"any": ["pass", "pass", "pass", "fail", "fail", "hack", "invalid"],
             "all_pass": ["pass", "pass", "pass", "invalid"], "all_fail": ["fail", "hack"]}
    for g in range(draw(st.integers(1, G))):
        shared_f = draw(st.one_of(st.none(), st.sampled_from(GRID)))   # equal factors: INV-6
        group_kind = draw(st.sampled_from(["any", "any", "any", "all_pass", "all_fail"]))
        for _ in range(draw(st.integers(0, 8))):
            kind = draw(st.sampled_from(kinds[group_kind]))
            f = shared_f if shared_f is not None else draw(st.sampled_from(GRID * 2 + BAD))
            adj = draw(st.sampled_from([0.0, 0.0, -0.1, -0.25, -1.0, 0.3]))
            # Token weights: lengths x a token-mean denominator; 0 = no trained token; an
            # invalid member's weight is junk that must never be read.
            wt = draw(st.sampled_from([0.0, 1.0, 3.0, 12.0, 40.0, 40.0, 100.0])) * 1e-3
            wt = np.nan if kind == "invalid" and draw(st.booleans()) else wt
            rows.append((float(kind in ("pass", "hack") or (kind == "invalid" and g % 2)),
                         g, f, kind != "invalid", kind == "hack", adj, wt))
    rows = rows[:T]
    ok = [draw(st.sampled_from([True, True, True, True, False])) for _ in range(G)]
    r, gid, f, valid, hacked, adj, wt = (
        (list(c) for c in zip(*rows, strict=False)) if rows else ([],) * 7
    )
    b = pad(r, gid, f, valid, hacked, ok, adj, pad_gid=draw(st.sampled_from([-1, 0, 3, G, 999])),
            weights=wt)
    perm = np.array(draw(st.permutations(range(T))))
    return {k: (v if k == "grading_ok" else v[perm]) for k, v in b.items()}


def masks(b, out):
    """Per-trajectory numpy masks: members, passes, failures, \
and members of uncapped mixed groups."""
    gid = np.clip(np.where(b["valid"], b["group_ids"], 0), 0, G - 1)
    member = b["valid"] & (b["group_ids"] >= 0) & (b["group_ids"] < G)
    passed = member & ~b["hacked"] & (b["rewards"] == 1)
    uncapped = member & out.mixed[gid] & ~out.capped[gid]
    return gid, member, passed, member & ~passed, uncapped


# ---------------------------------------------------------------- hand-worked examples (docs)

def hand_example():
    """One group of 6: passes graded strong (rank 1), intermediate (rank 1), defective; 3 fails."""
    f_pass = quality_factors([STRONG, INTERMEDIATE, DEFECTIVE], [1, 1, 1], [0, 0, 0])
    factors = np.concatenate([f_pass, [np.nan] * 3])   # failures' factors are never read
    return pad([1, 1, 1, 0, 0, 0], [0] * 6, factors, adjustments=[-0.1, 0, 0, -0.2, 0, 0])


def test_hand_worked_group_of_six():
    b = hand_example()
    np.testing.assert_allclose(b["factors"][:3], [1.0, 0.85, 0.2], rtol=1e-6)
    out = run(b)
    # p = 3/6 = 1/2, so A = +1/2 for passes, -1/2 for failures; sum f = 2.05;
    # lambda = 3 / 2.05 = 1.4634... < 1.5 (uncapped); A'_i = lambda * f_i / 2.
    lam = 3 / 2.05
    np.testing.assert_allclose(out.lam[0], lam, rtol=1e-6)
    expect = [1.5 / 2.05, 1.275 / 2.05, 0.3 / 2.05, -0.5, -0.5, -0.5]   # 0.7317, 0.6220, 0.1463
    np.testing.assert_allclose(out.redistributed_advantages[:6], expect, rtol=1e-6)
    np.testing.assert_allclose(out.outcome_advantages[:6], [0.5] * 3 + [-0.5] * 3)
    assert not out.capped[0] and out.mixed[0] and not out.fallback[0]
    np.testing.assert_allclose([out.pos_credit_before[0], out.pos_credit_after[0],
                                out.neg_credit[0]], [1.5, 1.5, -1.5], rtol=1e-6)
    # Length penalties c = (-0.1, 0, 0, -0.2, 0, 0): mean -0.05, added after centring.
    np.testing.assert_allclose(out.advantages[:6] - out.redistributed_advantages[:6],
                               [-0.05, 0.05, 0.05, -0.15, 0.05, 0.05], atol=1e-7)
    assert np.all(out.advantages[6:] == 0) and np.all(out.lam[1:] == 1)
    # Equivalent rewards r' = p + A': 1.2317, 1.1220, 0.6463, and exactly 0 for failures.
    r_eq = np.asarray(jitted_equiv("sum_preserving")(*args(b)))
    np.testing.assert_allclose(r_eq[:3], [0.5 + e for e in expect[:3]], rtol=1e-6)
    assert np.all(r_eq[3:] == 0)
    # Ablations: downweight_only gives f * A (net credit 1.025 - 1.5 < 0); binary gives A.
    np.testing.assert_allclose(run(b, "downweight_only").redistributed_advantages[:6],
                               [0.5, 0.425, 0.1, -0.5, -0.5, -0.5], rtol=1e-6)
    np.testing.assert_allclose(run(b, "binary").redistributed_advantages[:6],
                               [0.5] * 3 + [-0.5] * 3)


def test_hand_worked_capped_group():
    # 2 defective passes (f = 0.2) and 2 failures: lambda = 2 / 0.4 = 5 > 1.5, capped.
    # A' = 1.5 * 0.2 * 0.5 = 0.15 for passes, -0.5 for failures; mean -0.175; re-centred:
    # +0.325 / -0.325. Positive credit falls from 1.0 to 0.65 and failures move: INV-2/3 break.
    out = run(pad([1, 1, 0, 0], [5] * 4, [0.2, 0.2, np.nan, np.nan]))
    np.testing.assert_allclose(out.redistributed_advantages[:4], [0.325, 0.325, -0.325, -0.325],
                               rtol=1e-6)
    assert out.capped[5] and out.lam[5] == np.float32(1.5)
    # A lone pass with f = 0.6 < 2/3 is capped too (lambda would be 1/0.6).
    lone = run(pad([1, 0, 0], [2] * 3, [0.6, 0.9, 0.9]))
    assert lone.capped[2] and lone.lam[2] == np.float32(1.5)


def test_hacks_invalid_and_fallback_by_hand():
    # Group 0: a hacked pass counts as a failure -> n=4, k=1 (p=1/4); the invalid member is out.
    # Group 1: grading failed -> every pass uses f = 1 (outcome advantages kept).
    # Group 2: one pass has a NaN factor -> fallback; a failure's NaN factor is never read.
    # Group 3: all pass -> not mixed, advantage 0; its NaN factor is never read either.
    b = pad([1, 1, 0, 0, 1, 1, 0, 1, 1, 0, 1, 1],
            [0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 3, 3],
            [0.9, 0.9, 1, 1, 0.3, 0.2, 1, np.nan, 0.5, np.nan, np.nan, 0.5],
            valid=[1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1], hacked=[0, 1] + [0] * 10,
            grading_ok=[1, 0] + [1] * 10)
    out = run(b)
    np.testing.assert_allclose(
        out.redistributed_advantages[:12],
        [0.75, -0.25, -0.25, -0.25, 0, 0.5, -0.5, 1 / 3, 1 / 3, -2 / 3, 0, 0],
        rtol=1e-6,
        atol=1e-7,
    )
    np.testing.assert_array_equal(out.fallback[:4], [False, True, True, False])
    np.testing.assert_array_equal(out.mixed[:4], [True, True, True, False])
    np.testing.assert_array_equal(out.effective_rewards[:12], [1, 0, 0, 0, 0, 1, 0, 1, 1, 0, 1, 1])
    for mode in adv.MODES:
        o = run(b, mode)
        assert np.all(np.isfinite(o.advantages)) and np.all(o.advantages[10:] == 0), mode


# ---------------------------------------------------------------- INV-1 .. INV-9 (properties)

@given(batches())
def test_inv1_zero_mean(b):
    out = run(b)
    gid, member, *_ = masks(b, out)
    sums = np.bincount(gid[member], out.redistributed_advantages[member], minlength=G)
    np.testing.assert_allclose(sums, 0.0, atol=1e-5)


@given(batches())
def test_inv2_positive_credit_preserved(b):
    out, ref = run(b), reference(b)
    gid, member, passed, fail, uncapped = masks(b, out)
    m = passed & uncapped
    after = np.bincount(gid[m], out.redistributed_advantages[m], minlength=G)
    before = np.bincount(gid[m], ref["outcome_advantages"][m], minlength=G)
    np.testing.assert_allclose(after, before, atol=1e-5)
    np.testing.assert_allclose(out.pos_credit_after[~out.capped], after[~out.capped], atol=1e-5)


@given(batches())
def test_inv3_failures_untouched(b):
    for mode in ("sum_preserving", "downweight_only"):
        out = run(b, mode)
        gid, member, passed, fail, uncapped = masks(b, out)
        m = fail & uncapped
        np.testing.assert_array_equal(out.redistributed_advantages[m], out.outcome_advantages[m])
        np.testing.assert_allclose(out.outcome_advantages, reference(b, mode)["outcome_advantages"],
                                   atol=1e-6)


@given(batches())
def test_inv4_ratios_preserved(b):
    for mode in ("sum_preserving", "downweight_only"):
        out = run(b, mode)
        gid, member, passed, fail, uncapped = masks(b, out)
        f = reference(b, mode)["factors_used"]
        a = out.redistributed_advantages
        idx = np.flatnonzero(passed & uncapped)
        for i in idx:
            for j in idx[gid[idx] == gid[i]]:
                # A'_i / A'_j = f_i / f_j, written without division.
                np.testing.assert_allclose(a[i] * f[j], a[j] * f[i], atol=1e-6)


@given(batches())
def test_inv5_zero_sum_shift(b):
    out, ref = run(b), reference(b)
    gid, member, passed, fail, uncapped = masks(b, out)
    f, A, a = ref["factors_used"], ref["outcome_advantages"], out.redistributed_advantages
    k = np.bincount(gid[passed], minlength=G)
    fbar = np.bincount(gid[passed], f[passed], minlength=G) / np.maximum(k, 1)
    m = passed & uncapped
    np.testing.assert_allclose(a[m] - A[m], A[m] * (f[m] - fbar[gid[m]]) / fbar[gid[m]], atol=1e-6)
    m = fail & uncapped
    np.testing.assert_array_equal(a[m] - out.outcome_advantages[m], 0.0)


@given(batches())
def test_inv6_reduction(b):
    out, ref = run(b), reference(b)
    gid, member, passed, fail, uncapped = masks(b, out)
    f = ref["factors_used"]
    for g in range(G):
        fp = f[passed & (gid == g)]
        if out.mixed[g] and (len(fp) == 1 or np.all(fp == fp[0])):
            in_g = member & (gid == g)
            if out.capped[g]:   # only possible when the (common) factor is below 1 / cap
                assert fp[0] * CAP < 1
            else:
                np.testing.assert_allclose(out.redistributed_advantages[in_g],
                                           out.outcome_advantages[in_g], atol=1e-6)


@pytest.mark.parametrize("lam_cap", [1.0, 1.2, CAP])
@given(b=batches())
def test_inv7_cap(lam_cap, b):
    out = run(b, lam_cap=lam_cap)
    assert np.all(out.lam <= np.float32(lam_cap)) and np.all(out.lam >= 1 - 1e-6)
    assert np.all(out.lam[~out.mixed] == 1) and not np.any(out.capped & ~out.mixed)
    assert not np.any(out.fallback & ~out.mixed)
    np.testing.assert_array_equal(out.capped, reference(b, lam_cap=lam_cap)["capped"])
    for mode in ("downweight_only", "binary"):
        o = run(b, mode)
        assert np.all(o.lam == 1) and not o.capped.any()


@given(batches())
def test_inv8_equivalent_rewards(b):
    out = run(b)
    r_eq = np.asarray(jitted_equiv("sum_preserving")(*args(b)))
    gid, member, passed, fail, uncapped = masks(b, out)
    p = out.pass_rate[gid]
    in_mixed = member & out.mixed[gid]
    np.testing.assert_allclose(r_eq[in_mixed], p[in_mixed] + out.redistributed_advantages[in_mixed],
                               rtol=1e-6)
    m = passed & uncapped
    np.testing.assert_allclose(r_eq[m], p[m] + out.lam[gid[m]] * out.factors_used[m] * (1 - p[m]),
                               rtol=1e-5)
    assert np.all(r_eq[fail & uncapped] == 0.0)  # exactly
    np.testing.assert_array_equal(
        r_eq[member & ~in_mixed], out.effective_rewards[member & ~in_mixed]
    )
    assert np.all(r_eq[~member] == 0)
    # Mean-centring r' per group over valid members reproduces A' (capped groups included).
    n = np.maximum(np.bincount(gid[member], minlength=G), 1)
    mean = np.bincount(gid[member], r_eq[member], minlength=G) / n
    np.testing.assert_allclose(np.where(member, r_eq - mean[gid], 0), out.redistributed_advantages,
                               atol=1e-6)


@given(batches(), st.randoms(use_true_random=False))
def test_inv9_order_independence(b, rnd):
    perm = np.array(rnd.sample(range(T), T))
    pb = {k: (v if k == "grading_ok" else v[perm]) for k, v in b.items()}
    for mode in adv.MODES:
        out, pout = run(b, mode), run(pb, mode)
        for name in (
            "advantages",
            "redistributed_advantages",
            "outcome_advantages",
            "factors_used",
        ):
            np.testing.assert_allclose(getattr(pout, name), getattr(out, name)[perm],
                                       rtol=1e-6, atol=1e-7)
        for name in ("lam", "capped", "mixed", "fallback", "pos_credit_after", "neg_credit"):
            np.testing.assert_allclose(
                getattr(pout, name), getattr(out, name), rtol=1e-6, atol=1e-7
            )


# ---------------------------------------------------------------- reference, jit, sharding

@given(batches())
def test_matches_numpy_loop_reference_all_modes(b):
    for mode in adv.MODES:
        out, ref = run(b, mode), reference(b, mode)
        for name in ("advantages", "redistributed_advantages", "outcome_advantages",
                     "effective_rewards", "lam"):
            np.testing.assert_allclose(getattr(out, name), ref[name], atol=2e-6, err_msg=name)
        for name in ("capped", "mixed", "fallback"):
            np.testing.assert_array_equal(getattr(out, name), ref[name], err_msg=name)
        if mode not in adv.WEIGHTED_MODES:   # equivalent_rewards takes no weights
            r_eq = np.asarray(jitted_equiv(mode)(*args(b)))
            np.testing.assert_allclose(r_eq, ref["equivalent_rewards"], atol=2e-6)
        gid, member, passed, fail, _ = masks(b, out)
        a = ref["redistributed_advantages"]
        np.testing.assert_allclose(
            out.pos_credit_after, np.bincount(gid[passed], a[passed], minlength=G), atol=1e-5
        )
        np.testing.assert_allclose(
            out.neg_credit, np.bincount(gid[fail], a[fail], minlength=G), atol=1e-5
        )
        np.testing.assert_allclose(
            out.pos_credit_before,
            np.bincount(gid[passed], ref["outcome_advantages"][passed], minlength=G), atol=1e-5)


def random_batch(seed):
    """A seeded batch dense in edge cases: all-pass / all-fail groups, bad and NaN factors,
    hacks, invalid members (with out-of-range ids), failed grading, uneven and empty groups."""
    rng = np.random.default_rng(seed)
    gid = rng.integers(0, G - 2, T).astype(np.int32)   # the last two groups stay empty
    uniform = rng.choice(3, G, p=[0.6, 0.2, 0.2])        # 0 any, 1 all pass, 2 all fail
    rewards = np.select([uniform[gid] == 1, uniform[gid] == 2], [1.0, 0.0],
                        (rng.random(T) < 0.5).astype(np.float32))
    factors = rng.choice(np.array(GRID * 2 + BAD, np.float32), T)
    valid = rng.random(T) < 0.9
    gid = np.where(valid | (rng.random(T) < 0.5), gid, rng.choice([-1, G, 99], T)).astype(np.int32)
    weights = rng.choice([0.0, 2.0, 5.0, 30.0, 200.0], T) * 1e-3
    return pad(rewards, gid, factors, valid=valid, hacked=rng.random(T) < 0.05,
               grading_ok=rng.random(G) < 0.9, adjustments=rng.normal(0, 0.1, T),
               weights=np.where(valid, weights, np.nan))


@pytest.mark.parametrize("seed", range(30))
def test_seeded_edge_case_batches_match_reference_and_pass_checks(seed):
    b = random_batch(100 + seed)
    for mode in adv.MODES:
        out, ref = run(b, mode), reference(b, mode)
        for name in ("advantages", "redistributed_advantages", "factors_used", "lam"):
            np.testing.assert_allclose(getattr(out, name), ref[name], atol=2e-6, err_msg=name)
        for name in ("capped", "mixed", "fallback"):
            np.testing.assert_array_equal(getattr(out, name), ref[name], err_msg=name)
        checker(mode)(out, *args(b), weights=_weights(b, mode))


def _weights(b, mode):
    return b["weights"] if mode in adv.WEIGHTED_MODES else None


def test_jit_matches_no_jit_and_does_not_retrace():
    for seed in range(3):
        b = random_batch(seed)
        for mode in adv.MODES:
            eager = adv.gagar_advantages(*args(b), num_groups=G, lam_cap=CAP, mode=mode,
                                         adjustments=b["adjustments"], weights=_weights(b, mode))
            chex.assert_trees_all_close(run(b, mode), jax.tree.map(np.asarray, eager), rtol=1e-6,
                                        atol=1e-7)
    # Same shapes and dtypes -> no new trace or executable for new values.
    before = jitted._cache_size()
    for seed in range(3, 6):
        run(random_batch(seed))
    assert jitted._cache_size() == before


def test_sharded_over_8_devices_matches_single_device(devices):
    mesh = Mesh(np.array(devices), ("data",))
    on_T, repl = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    b = random_batch(7)
    sharded = {k: jax.device_put(v, repl if k == "grading_ok" else on_T) for k, v in b.items()}
    for mode in adv.MODES:
        fn = jax.jit(functools.partial(adv.gagar_advantages, num_groups=G, lam_cap=CAP, mode=mode))
        out = fn(*args(sharded), adjustments=sharded["adjustments"],
                 weights=_weights(sharded, mode))
        assert out.advantages.sharding.is_equivalent_to(on_T, 1)
        chex.assert_trees_all_close(jax.tree.map(np.asarray, out), run(b, mode), rtol=1e-6,
                                    atol=1e-7)


def test_broadcast_to_tokens():
    adv_T = jnp.array([0.5, -0.25, 2.0], jnp.float32)
    traj_BxS = jnp.array([[0, 0, 0, 1, 1, 0], [2, 2, 2, 2, 0, 0]], jnp.int32)
    mask_BxS = jnp.array([[0, 1, 1, 0, 1, 0], [0, 0, 1, 1, 0, 0]], jnp.float32)
    expect = [[0, 0.5, 0.5, 0, -0.25, 0], [0, 0, 2.0, 2.0, 0, 0]]
    np.testing.assert_array_equal(adv.broadcast_to_tokens(adv_T, traj_BxS, mask_BxS), expect)
    np.testing.assert_array_equal(
        jax.jit(adv.broadcast_to_tokens)(adv_T, traj_BxS, mask_BxS > 0), expect)
    with pytest.raises(ValueError, match="adv_T"):
        adv.broadcast_to_tokens(adv_T[None], traj_BxS, mask_BxS)
    with pytest.raises(TypeError, match="traj_index_BxS"):
        adv.broadcast_to_tokens(adv_T, traj_BxS.astype(jnp.float32), mask_BxS)
    with pytest.raises(ValueError, match="loss_mask_BxS"):
        adv.broadcast_to_tokens(adv_T, traj_BxS, mask_BxS[:, :3])


@pytest.mark.parametrize("name,value,error", [
    ("rewards", np.zeros((T, 1), np.float32), ValueError),
    ("rewards", np.zeros(T, np.int32), TypeError),
    ("group_ids", np.zeros(T, np.float32), TypeError),
    ("factors", np.zeros(T - 1, np.float32), ValueError),
    ("valid", np.zeros(T, np.int32), TypeError),
    ("hacked", np.zeros(T + 1, bool), ValueError),
    ("grading_ok", np.ones(G + 1, bool), ValueError),
    ("adjustments", np.zeros(T, np.int32), TypeError),
    ("mode", "sum-preserving", ValueError),
    ("lam_cap", 0.9, ValueError),
    ("num_groups", 0, ValueError),
])
def test_trace_time_errors_name_the_argument(name, value, error):
    b = hand_example()
    kw = dict(num_groups=G, lam_cap=CAP, mode="sum_preserving", adjustments=b["adjustments"])
    positional = dict(zip(ARGS, args(b), strict=False))
    (positional if name in positional else kw)[name] = value
    with pytest.raises(error, match=name):
        jax.eval_shape(lambda *a: adv.gagar_advantages(*a, **kw), *positional.values())


# ---------------------------------------------------------------- conservation checks in jit

@functools.cache
def checker(mode, lam_cap=CAP):
    def check(out, *inputs, weights=None):
        chk.check_invariants(out, *inputs, num_groups=G, lam_cap=lam_cap, mode=mode,
                             weights=weights)
    return chex.chexify(jax.jit(check), async_check=False)


@given(batches())
def test_checks_quiet_on_correct_outputs_in_every_mode(b):
    for mode in adv.MODES:
        checker(mode)(run(b, mode), *args(b), weights=_weights(b, mode))


def _perturb(out, i, delta):
    bump = delta * (np.arange(T) == i)
    return out.replace(advantages=out.advantages + bump,
                       redistributed_advantages=out.redistributed_advantages + bump)


def _swap(out, i, j):
    def sw(x):
        x = x.copy()
        x[[i, j]] = x[[j, i]]
        return x
    return out.replace(advantages=sw(out.advantages),
                       redistributed_advantages=sw(out.redistributed_advantages))


@pytest.mark.parametrize("mode,broken,match", [
    ("sum_preserving", lambda o: _perturb(o, 4, 0.01), "INV-1"),        # a failure moved
    ("sum_preserving", lambda o: _swap(o, 0, 1), "INV-4"),              # sums kept, ratios not
    ("sum_preserving", lambda o: o.replace(lam=o.lam * 1.1), "INV-7"),  # 1.46 * 1.1 > 1.5
    ("sum_preserving", lambda o: o.replace(capped=o.capped | (np.arange(G) == 0)), "cap fires"),
    ("sum_preserving", lambda o: o.replace(fallback=o.fallback | (np.arange(G) == 0)), "fallback"),
    ("sum_preserving", lambda o: o.replace(advantages=o.advantages + 0.1 * (np.arange(T) < 6)),
     "adjustments are centred"),
    ("downweight_only", lambda o: _perturb(o, 3, 0.01), "INV-3"),
    ("downweight_only", lambda o: _swap(o, 0, 2), "INV-4"),
    ("binary", lambda o: _swap(o, 0, 3), "binary"),
])
def test_checks_trip_on_broken_advantages(mode, broken, match):
    b = hand_example()
    good = run(b, mode)
    checker(mode)(good, *args(b))
    with pytest.raises(Exception, match=match):
        checker(mode)(broken(good), *args(b))


@pytest.mark.parametrize("field,index,value,match", [
    ("rewards", 0, 0.5, "rewards of valid members are 0 or 1"),
    ("group_ids", 2, G, "group ids lie in"),
    ("group_ids", 2, -3, "group ids lie in"),
])
def test_checks_trip_on_broken_input_contract(field, index, value, match):
    b = hand_example()
    b[field] = b[field].copy()
    b[field][index] = value
    with pytest.raises(Exception, match=match):
        checker("sum_preserving")(run(b), *args(b))


def test_fused_compute_and_check_in_one_jitted_step():
    """How the loss uses it: advantages and checks in one jitted function, wrapped by chexify."""
    def step(rewards, group_ids, factors, valid, hacked, grading_ok):
        out = adv.gagar_advantages(rewards, group_ids, factors, valid, hacked, grading_ok,
                                   num_groups=G, lam_cap=CAP)
        chk.check_invariants(out, rewards, group_ids, factors, valid, hacked, grading_ok,
                             num_groups=G, lam_cap=CAP)
        return out.advantages.sum()
    fused = chex.chexify(jax.jit(step))
    b = random_batch(3)
    fused(*args(b))
    fused.wait_checks()
    b["rewards"][np.flatnonzero(b["valid"])[0]] = 2.0
    with pytest.raises(Exception, match="rewards of valid members"):
        fused(*args(b))
        fused.wait_checks()


def test_eager_checks_raise_assertion_error():
    b = hand_example()
    out = run(b)
    chk.check_invariants(out, *args(b), num_groups=G, lam_cap=CAP)
    with pytest.raises(AssertionError, match="INV-4"):
        chk.check_invariants(_swap(out, 0, 1), *args(b), num_groups=G, lam_cap=CAP)


def test_struct_form_equals_the_documented_signature():
    """`advantages_of(GroupOutcomes)` is `gagar_advantages(...)`; its checks pass on it."""
    from gagar_jax import GroupOutcomes, advantages_of, check_invariants_of
    rng = np.random.default_rng(3)
    T, G = 12, 3
    o = GroupOutcomes(rewards_T=jnp.asarray(rng.integers(0, 2, T), jnp.float32),
                      group_ids_T=jnp.asarray(rng.integers(0, G, T), jnp.int32),
                      factors_T=jnp.asarray(rng.uniform(0.2, 1.0, T), jnp.float32),
                      valid_T=jnp.asarray(rng.random(T) < 0.9), hacked_T=jnp.zeros(T, bool),
                      grading_ok_G=jnp.ones(G, bool),
                      adjustments_T=jnp.asarray(rng.normal(size=T), jnp.float32))
    a = advantages_of(o, lam_cap=1.5, mode="sum_preserving")
    b = adv.gagar_advantages(o.rewards_T, o.group_ids_T, o.factors_T, o.valid_T, o.hacked_T,
                         o.grading_ok_G, num_groups=G, adjustments=o.adjustments_T)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=False):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    check_invariants_of(a, o)
    with pytest.raises(ValueError, match="group_ids"):
        advantages_of(o.replace(group_ids_T=o.group_ids_T[:5]))


# -- opt-in: std-normalised outcome advantages (verl's norm_adv_by_std_in_grpo, SPEC rule 4) --


def _std_scales(b):
    """Per group 1 / (std + 1e-6) of the valid members' hack-zeroed rewards, n - 1 as torch's
    std, by a plain loop (1 where the group is not mixed)."""
    scales = np.ones(G)
    for g in range(G):
        idx = [i for i in range(T) if b["valid"][i] and b["group_ids"][i] == g]
        r = np.array([0.0 if b["hacked"][i] else b["rewards"][i] for i in idx])
        if len(r) and 0 < r.sum() < len(r):
            scales[g] = 1.0 / (np.std(r, ddof=1) + 1e-6)
    return scales


def test_std_norm_by_hand():
    # The group of six: p = 1/2, std (n - 1) = sqrt(6 * 1/4 / 5) = 0.5477, A = +-0.5 / 0.5477.
    b = hand_example()
    out = jax.tree.map(np.asarray, _jitted_std("sum_preserving")(*args(b)))
    s = 1.0 / (np.sqrt(1.5 / 5) + 1e-6)
    np.testing.assert_allclose(out.outcome_advantages[:6], [0.5 * s] * 3 + [-0.5 * s] * 3,
                               rtol=1e-6)
    # lambda = k / sum f is unchanged (3 / 2.05), the redistribution scales with A
    np.testing.assert_allclose(out.lam[0], 3 / 2.05, rtol=1e-6)
    np.testing.assert_allclose(out.redistributed_advantages[:6],
                               s * np.array([1.5 / 2.05, 1.275 / 2.05, 0.3 / 2.05, -0.5, -0.5,
                                             -0.5]), rtol=1e-6)


@functools.cache
def _std_checker(mode):
    def check(out, *inputs, weights=None):
        chk.check_invariants(out, *inputs, num_groups=G, lam_cap=CAP, mode=mode, atol=2e-5,
                             std_norm=True, weights=weights)
    return chex.chexify(jax.jit(check), async_check=False)


@functools.cache
def _jitted_std(mode):
    return jax.jit(functools.partial(adv.gagar_advantages, num_groups=G, lam_cap=CAP, mode=mode,
                                     std_norm=True))


@pytest.mark.parametrize("seed", range(6))
def test_std_norm_is_a_positive_per_group_scale_and_the_checks_hold(seed):
    b = random_batch(300 + seed)
    b["adjustments"] = np.zeros(T, np.float32)         # rule 9's part is not scaled
    scale_T = np.where(b["valid"] & (b["group_ids"] >= 0) & (b["group_ids"] < G),
                       _std_scales(b)[np.clip(b["group_ids"], 0, G - 1)], 1.0)
    for mode in adv.MODES:
        out = jax.tree.map(np.asarray, _jitted_std(mode)(*args(b), weights=_weights(b, mode)))
        plain = run(b, mode)
        for name in ("outcome_advantages", "redistributed_advantages", "advantages"):
            np.testing.assert_allclose(getattr(out, name), getattr(plain, name) * scale_T,
                                       rtol=2e-5, atol=2e-5, err_msg=name)
        for name in ("lam", "capped", "mixed", "fallback"):
            np.testing.assert_array_equal(getattr(out, name), getattr(plain, name), err_msg=name)
        if mode in ("sum_preserving", "length_aware"):   # every invariant, on the scaled A
            _std_checker(mode)(out, *args(b), weights=_weights(b, mode))


# -- per-trajectory weights and the length-aware mode (docs/advantage.md section 9) ----------


def test_weights_leave_every_other_mode_bit_identical_and_add_the_token_credits():
    """`weights=` changes nothing in sum_preserving / downweight_only / binary (today's output,
    bit for bit) and adds sum_valid W A' and sum_valid W A per group (by a NumPy loop)."""
    for seed in range(3):
        b = random_batch(500 + seed)
        for mode in ("sum_preserving", "downweight_only", "binary"):
            plain, weighted = run(b, mode), run(b, mode, weights=True)
            assert plain.token_credit is None and plain.token_outcome_credit is None
            for name in adv.AdvantageOutput.__dataclass_fields__:
                if name not in ("token_credit", "token_outcome_credit"):
                    np.testing.assert_array_equal(getattr(weighted, name), getattr(plain, name),
                                                  err_msg=name)
            gid, member, *_ = masks(b, plain)
            w = np.where(member, b["weights"], 0.0)
            np.testing.assert_allclose(
                weighted.token_credit,
                np.bincount(gid[member], (w * plain.redistributed_advantages)[member],
                            minlength=G), atol=1e-7)
            np.testing.assert_allclose(
                weighted.token_outcome_credit,
                np.bincount(gid[member], (w * plain.outcome_advantages)[member], minlength=G),
                atol=1e-7)


def test_length_aware_hand_worked_group_of_six():
    # The group of six with lengths: strong 40 tokens, intermediate 20, defective 10, failures
    # 5, 5, 50 (token-mean weights: length / 130). Weighted pass mass 70, weighted factor mass
    # 40 + 17 + 2 = 59: lambda = 70 / 59 = 1.18644 (sum_preserving's: 3 / 2.05 = 1.46341).
    lengths = np.array([40, 20, 10, 5, 5, 50], np.float32)
    b = hand_example()
    b["weights"] = np.concatenate([lengths / 130, np.full(T - 6, np.nan)]).astype(np.float32)
    out = run(b, "length_aware")
    lam = 70 / 59
    np.testing.assert_allclose(out.lam[0], lam, rtol=1e-6)
    expect = [lam * 0.5, lam * 0.85 * 0.5, lam * 0.2 * 0.5, -0.5, -0.5, -0.5]
    np.testing.assert_allclose(out.redistributed_advantages[:6], expect, rtol=1e-6)
    assert not out.capped[0]
    # Weighted positive credit preserved: 40 x 0.59322 + 20 x 0.50424 + 10 x 0.11864 = 35.
    np.testing.assert_allclose(np.dot(lengths[:3], expect[:3]), 35.0, rtol=1e-6)
    # ... so per trajectory it is net-negative here (the strong pass is the long one).
    np.testing.assert_allclose(sum(expect), lam * 1.025 - 1.5, rtol=1e-5)     # -0.284
    # The token credits: sum W A' = sum W A = (70 x 0.5 - 60 x 0.5) / 130.
    np.testing.assert_allclose(out.token_credit[0], 5 / 130, rtol=1e-5)
    np.testing.assert_allclose(out.token_outcome_credit[0], 5 / 130, rtol=1e-5)
    # Equal weights within the group: sum_preserving's numbers.
    b["weights"][:6] = 0.25
    np.testing.assert_allclose(run(b, "length_aware").redistributed_advantages[:6],
                               [1.5 / 2.05, 1.275 / 2.05, 0.3 / 2.05, -0.5, -0.5, -0.5],
                               rtol=1e-6)


def test_length_aware_hand_worked_capped_group():
    # Passes: strong (f 1, 1 token) and defective (f 0.2, 9 tokens); failures 5 and 5 tokens.
    # Weighted mean pass factor (1 + 1.8) / 10 = 0.28 < 2/3: capped (sum_preserving's mean
    # factor 0.6 would be capped too). A' = 1.5 f / 2: 0.75, 0.15; failures -0.5. The shift
    # keeps sum W A' = sum W A: sum W (A' - A) = 1 x 0.25 + 9 x (-0.35) = -2.9 over 20 tokens:
    # every member moves by +0.145.
    b = pad([1, 1, 0, 0], [4] * 4, [1.0, 0.2, np.nan, np.nan], weights=[1, 9, 5, 5])
    out = run(b, "length_aware")
    assert out.capped[4] and out.lam[4] == np.float32(1.5)
    np.testing.assert_allclose(out.redistributed_advantages[:4],
                               [0.75 + 0.145, 0.15 + 0.145, -0.5 + 0.145, -0.5 + 0.145],
                               rtol=1e-6)
    np.testing.assert_allclose(np.dot([1, 9, 5, 5], out.redistributed_advantages[:4]), 0.0,
                               atol=1e-6)
    # Every pass weighs 0: unit weights, i.e. sum_preserving's answer for the group.
    b0 = pad([1, 1, 0, 0], [4] * 4, [1.0, 0.2, np.nan, np.nan], weights=[0, 0, 5, 5])
    np.testing.assert_allclose(run(b0, "length_aware").redistributed_advantages[:4],
                               run(b0).redistributed_advantages[:4], rtol=1e-6)


def _unit_masks(b, out):
    gid, member, passed, fail, uncapped = masks(b, out)
    w = np.where(member, b["weights"], 0.0).astype(np.float64)
    pass_mass = np.bincount(gid[passed], w[passed], minlength=G)
    w = np.where(member & (pass_mass[gid] <= 0), 1.0, w)    # the unit-weight fallback
    return gid, member, passed, fail, uncapped, w


@given(batches())
def test_length_aware_inv1w_inv2w_weighted_credit_kept(b):
    """INV-1W: sum_valid W A' = sum_valid W A in every group (capped too); INV-2W: the weighted
    positive credit is preserved in uncapped groups."""
    out = run(b, "length_aware")
    gid, member, passed, fail, uncapped, w = _unit_masks(b, out)
    A, A1 = out.outcome_advantages, out.redistributed_advantages
    tol = 1e-5 * np.maximum(np.bincount(gid[member], w[member], minlength=G), 1e-9)
    got = np.bincount(gid[member], (w * A1)[member], minlength=G)
    np.testing.assert_allclose(got, np.bincount(gid[member], (w * A)[member], minlength=G),
                               atol=tol.max())
    unc = passed & uncapped
    np.testing.assert_allclose(np.bincount(gid[unc], (w * A1)[unc], minlength=G),
                               np.bincount(gid[unc], (w * A)[unc], minlength=G), atol=tol.max())


@given(batches())
def test_length_aware_inv3_inv4_inv5w_inv6(b):
    out = run(b, "length_aware")
    gid, member, passed, fail, uncapped, w = _unit_masks(b, out)
    A, A1, f = out.outcome_advantages, out.redistributed_advantages, out.factors_used
    np.testing.assert_array_equal(A1[fail & uncapped], A[fail & uncapped])      # INV-3
    unc = passed & uncapped
    for g in np.unique(gid[unc]):
        m = unc & (gid == g)
        ratio = A1[m] / f[m]                                                     # INV-4
        np.testing.assert_allclose(ratio, ratio[0], rtol=2e-6)
        fbar = np.sum(w[m] * f[m]) / np.sum(w[m])                                # INV-5W
        np.testing.assert_allclose(A1[m] - A[m], A[m] * (f[m] - fbar) / fbar, atol=2e-6)
        if np.all(f[m] == f[m][0]):                                              # INV-6
            np.testing.assert_allclose(A1[m], A[m], atol=2e-6)
    assert np.all(out.lam <= CAP)                                                # INV-7


@given(batches(), st.sampled_from([0.5, 3.0, 1e-3]))
def test_length_aware_reduces_to_sum_preserving_with_equal_weights_and_is_scale_free(b, c):
    """Equal weights within every group give sum_preserving's output; scaling a group's
    weights by a positive constant (another aggregation's denominator) changes nothing."""
    la, sp = run(b, "length_aware"), run(b)
    gid, member, *_ = masks(b, sp)
    eq = dict(b, weights=np.where(member, c * (1.0 + gid % 3), np.nan).astype(np.float32))
    got = run(eq, "length_aware")
    for name in ("advantages", "redistributed_advantages", "lam"):
        np.testing.assert_allclose(getattr(got, name), getattr(sp, name), atol=2e-6, err_msg=name)
    np.testing.assert_array_equal(got.capped, sp.capped)
    scaled = dict(b, weights=(b["weights"] * c * (1.0 + gid % 3)).astype(np.float32))
    got = run(scaled, "length_aware")
    np.testing.assert_allclose(got.redistributed_advantages, la.redistributed_advantages,
                               atol=2e-6)
    np.testing.assert_array_equal(got.capped, la.capped)


@pytest.mark.parametrize("broken,match", [
    # A failure moved (its token credit kept consistent): weighted credit was made.
    (lambda o: _perturb(o, 3, 0.01).replace(
        token_credit=o.token_credit + 0.01 * 5 / 130 * (np.arange(G) == 0)), "INV-1W"),
    # Credit moved between passes 0 and 1 with every weighted sum kept: the ratios break.
    (lambda o: _perturb(_perturb(o, 0, 0.02 / 40), 1, -0.02 / 20), "INV-4"),
    (lambda o: o.replace(lam=o.lam * 1.3), "INV-7"),     # 1.19 * 1.3 > 1.5
    (lambda o: o.replace(capped=o.capped | (np.arange(G) == 0)), "weighted mean pass factor"),
    (lambda o: o.replace(token_credit=o.token_credit + 0.1), "token credits"),
])
def test_length_aware_checks_trip_on_broken_advantages(broken, match):
    b = hand_example()
    b["weights"] = np.concatenate([np.array([40, 20, 10, 5, 5, 50]) / 130,
                                   np.full(T - 6, np.nan)]).astype(np.float32)
    good = run(b, "length_aware")
    checker("length_aware")(good, *args(b), weights=b["weights"])
    with pytest.raises(Exception, match=match):
        checker("length_aware")(broken(good), *args(b), weights=b["weights"])


def test_length_aware_input_errors_name_the_weights():
    b = hand_example()
    with pytest.raises(ValueError, match="weights: mode 'length_aware' needs"):
        adv.gagar_advantages(*args(b), num_groups=G, mode="length_aware")
    with pytest.raises(TypeError, match="weights"):
        adv.gagar_advantages(*args(b), num_groups=G, mode="length_aware",
                             weights=np.ones(T, np.int32))
    with pytest.raises(ValueError, match="weights"):
        adv.gagar_advantages(*args(b), num_groups=G, mode="length_aware",
                             weights=np.ones(T - 1, np.float32))
    bad = b["weights"].copy()
    bad[3] = -1.0           # a valid failure with a negative weight: the contract check trips
    out = run(dict(b, weights=bad), "length_aware")
    with pytest.raises(Exception, match="weights of valid members are finite and >= 0"):
        checker("length_aware")(out, *args(b), weights=bad)

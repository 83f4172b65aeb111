"""The in-jit conservation checks of `advantage.py`: the input contract and INV-1..INV-7 (and the
length-aware mode's INV-1W..INV-5W) as chex value assertions (docs/advantage.md sections 4, 5, 9).

    check_invariants(out, rewards, group_ids, factors, valid, hacked, grading_ok,
                     num_groups=G, lam_cap=1.5, mode="sum_preserving")     # eager: AssertionError
    chex.chexify(jax.jit(fn_that_calls_it))                                 # inside jit
"""
from __future__ import annotations

from typing import Optional

import chex
import jax
import jax.numpy as jnp

from gagar_jax.algo.advantage import (
    AdvantageOutput,
    GroupOutcomes,
    GroupStats,
    group_stats,
    segment_sum,
    unit_weight_fallback,
    validate_inputs,
    validated,
)


def check_invariants(out: AdvantageOutput, rewards: jax.typing.ArrayLike,
                     group_ids: jax.typing.ArrayLike, factors: jax.typing.ArrayLike,
                     valid: jax.typing.ArrayLike, hacked: jax.typing.ArrayLike,
                     grading_ok: jax.typing.ArrayLike, *, num_groups: int, lam_cap: float = 1.5,
                     mode: str = "sum_preserving", atol: float = 1e-5,
                     std_norm: bool = False, weights: Optional[jax.Array] = None) -> None:
    """Asserts the input contract and the identities that hold for `mode` (chex value asserts).

    Runs eagerly, or inside jit when the jitted function is wrapped in `chex.chexify` (the loss
    calls it under `debug_checks`). sum_preserving: INV-1..INV-7 (INV-8 follows from INV-1);
    downweight_only: INV-3, INV-4, INV-7; binary: A' = A; length_aware: INV-1W..INV-5W, INV-3,
    INV-4, INV-6, INV-7. INV-9 is a property of the whole function and is tested, not asserted.
    Element tolerances are `atol`, group sums `atol * n_g` (weighted sums: `atol` times the
    group's weight).

    Args:
      out: the AdvantageOutput to check.
      rewards, group_ids, factors, valid, hacked, grading_ok: the inputs it was computed from.
      num_groups, lam_cap, mode, std_norm, weights: as passed to `gagar_advantages`.
      atol: absolute tolerance.
    """
    x, _ = validate_inputs(rewards, group_ids, factors, valid, hacked, grading_ok,
                           num_groups=num_groups, lam_cap=lam_cap, mode=mode, weights=weights)
    check_invariants_of(out, x, lam_cap=lam_cap, mode=mode, atol=atol, std_norm=std_norm,
                        weights=weights)


def check_invariants_of(out: AdvantageOutput, outcomes: GroupOutcomes, *, lam_cap: float = 1.5,
                        mode: str = "sum_preserving", atol: float = 1e-5,
                        std_norm: bool = False, weights: Optional[jax.Array] = None) -> None:
    """`check_invariants` on a `GroupOutcomes` struct (the invariants are stated on A, the
    std-normalised outcome advantage under `std_norm`)."""
    x, w = validated(outcomes, lam_cap, mode, weights)
    G = x.num_groups
    st = group_stats(x, use_factors=mode != "binary", std_norm=std_norm)
    gid, member, passed, A, f = st.gid_T, st.member_T, st.pass_T, st.A_T, st.f_T
    seg = lambda v: segment_sum(v, gid, G)
    close = lambda a, b, tol: jnp.abs(a - b) <= tol
    fail, in_mixed = member & ~passed, member & st.mixed_G[gid]
    A1, tol_G = out.redistributed_advantages, atol * jnp.maximum(st.n_G, 1.0)
    r, g, adj = x.rewards_T, x.group_ids_T, jnp.where(member, out.advantages - A1, 0.0)
    checks = {
        "input contract: rewards of valid members are 0 or 1": ~x.valid_T | (r == 0) | (r == 1),
        "input contract: valid members' group ids lie in [0, num_groups)":
            ~x.valid_T | ((g >= 0) & (g < G)),
        "advantages are finite": jnp.isfinite(out.advantages) & jnp.isfinite(A1),
        "mixed flags follow 0 < k < n": out.mixed == st.mixed_G,
        "outcome advantages are r - p (/ std + eps)": close(out.outcome_advantages, A, atol),
        "zero advantage outside mixed groups": in_mixed | ((out.advantages == 0) & (A1 == 0)),
        "INV-7 lambda <= lambda_max": out.lam <= lam_cap,
        "lambda = 1, not capped, no fallback outside mixed groups":
            st.mixed_G | ((out.lam == 1) & ~out.capped & ~out.fallback),
        "fallback flags follow rule 5": out.fallback == st.fallback_G,
    }
    if w is not None:
        W = jnp.where(member, w.astype(jnp.float32), 0.0)
        checks["input contract: weights of valid members are finite and >= 0"] = (
            ~x.valid_T | (jnp.isfinite(w) & (w >= 0)))
        scale = atol * jnp.maximum(seg(jnp.abs(W)), 1e-30)
        if out.token_credit is not None:
            checks["token credits are the weighted sums of A' and A"] = (
                close(out.token_credit, seg(W * A1), scale)
                & close(out.token_outcome_credit, seg(W * A), scale))
    if mode == "binary":
        checks["binary: A' = A"] = close(A1, A, atol)
    if mode not in ("sum_preserving", "length_aware"):
        checks["lambda = 1 and no cap outside sum_preserving"] = (out.lam == 1) & ~out.capped
    if mode == "downweight_only":
        checks["INV-3 failures untouched"] = ~fail | close(A1, A, atol)
        checks["INV-4 passes get f * A"] = ~passed | close(A1, f * A, atol)
    if mode == "sum_preserving":
        k, F = st.k_G, seg(jnp.where(passed, f, 0.0))
        capped_T = out.capped[gid]
        unc_G, unc_T = st.mixed_G & ~out.capped, in_mixed & ~capped_T
        pos_A1, pos_A = seg(jnp.where(passed, A1, 0.0)), seg(jnp.where(passed, A, 0.0))
        c_G = pos_A1 / jnp.where(F > 0, F, 1.0)
        fbar = F / jnp.maximum(k, 1.0)
        fbar_T = jnp.where(passed, fbar[gid], 1.0)
        fmax = jax.ops.segment_max(jnp.where(passed, f, -jnp.inf), gid, num_segments=G)
        fmin = jax.ops.segment_min(jnp.where(passed, f, jnp.inf), gid, num_segments=G)
        base = jnp.where(passed, lam_cap * f * A, A)   # capped groups before re-centring
        shift = jnp.where(member & capped_T, A1 - base, 0.0)
        in_capped = member & capped_T
        smax = jax.ops.segment_max(jnp.where(in_capped, shift, -jnp.inf), gid, num_segments=G)
        smin = jax.ops.segment_min(jnp.where(in_capped, shift, jnp.inf), gid, num_segments=G)
        checks.update({
            "the cap fires iff the mean pass factor < 1 / lambda_max": ~st.mixed_G | jnp.where(
                out.capped, F * lam_cap <= k * (1 + 1e-6), F * lam_cap >= k * (1 - 1e-6)),
            "capped groups apply lambda_max": ~out.capped | (out.lam == lam_cap),
            "uncapped lambda = k / sum of pass factors": ~unc_G | close(out.lam * F, k, atol * k),
            "capped groups: lambda_max f A re-centred by one shift":
                ~out.capped | close(smax, smin, atol),
            "INV-1 zero mean": close(seg(jnp.where(member, A1, 0.0)), 0.0, tol_G),
            "INV-2 positive credit preserved": ~unc_G | close(pos_A1, pos_A, tol_G),
            "INV-3 failures untouched": ~(unc_T & fail) | close(A1, A, atol),
            "INV-4 pass advantages proportional to factors":
                ~(unc_T & passed) | close(A1, f * c_G[gid], atol),
            "INV-5 zero-sum shift":
                ~(unc_T & passed) | close(A1 - A, A * (f - fbar_T) / fbar_T, atol),
            "INV-6 equal factors reduce to A": ~(unc_T & (fmax == fmin)[gid]) | close(A1, A, atol),
        })
    if mode == "length_aware":
        checks.update(_length_aware_checks(out, st, unit_weight_fallback(st, w, G), lam_cap,
                                           atol))
    checks["adjustments are centred per group"] = close(
        seg(adj), 0.0, tol_G * (1.0 + jnp.max(jnp.abs(adj))))
    for name, ok in checks.items():
        chex.assert_trees_all_equal(jnp.all(ok), jnp.array(True), custom_message=name)


def _length_aware_checks(out: AdvantageOutput, st: GroupStats, W: jax.Array, lam_cap: float,
                         atol: float) -> dict:
    """INV-1W..INV-5W, INV-3, INV-4, INV-6, INV-7 and the cap rule of the length-aware mode,
    on the weights W~ it uses (a group whose passes all weigh 0 falls back to unit weights)."""
    G, gid, passed, A, f = st.mixed_G.shape[0], st.gid_T, st.pass_T, st.A_T, st.f_T
    seg = lambda v: segment_sum(v, gid, G)
    close = lambda a, b, tol: jnp.abs(a - b) <= tol
    A1, member = out.redistributed_advantages, st.member_T
    fail, in_mixed = member & ~passed, member & st.mixed_G[gid]
    unc_G = st.mixed_G & ~out.capped
    unc_T = in_mixed & ~out.capped[gid]
    K_w, F_w = seg(jnp.where(passed, W, 0.0)), seg(jnp.where(passed, W * f, 0.0))
    tol_G = atol * jnp.maximum(seg(W), 1e-30)
    fbar_w = F_w / jnp.where(K_w > 0, K_w, 1.0)
    fbar_T = jnp.where(passed, fbar_w[gid], 1.0)
    c_G = seg(jnp.where(passed, A1, 0.0)) / jnp.where(seg(jnp.where(passed, f, 0.0)) > 0,
                                                      seg(jnp.where(passed, f, 0.0)), 1.0)
    fmax = jax.ops.segment_max(jnp.where(passed, f, -jnp.inf), gid, num_segments=G)
    fmin = jax.ops.segment_min(jnp.where(passed, f, jnp.inf), gid, num_segments=G)
    shift = jnp.where(member & out.capped[gid],
                      A1 - jnp.where(passed, lam_cap * f * A, A), 0.0)
    in_capped = member & out.capped[gid]
    smax = jax.ops.segment_max(jnp.where(in_capped, shift, -jnp.inf), gid, num_segments=G)
    smin = jax.ops.segment_min(jnp.where(in_capped, shift, jnp.inf), gid, num_segments=G)
    return {
        "length_aware: the cap fires iff the weighted mean pass factor < 1 / lambda_max":
            ~st.mixed_G | jnp.where(out.capped, F_w * lam_cap <= K_w * (1 + 1e-6),
                                    F_w * lam_cap >= K_w * (1 - 1e-6)),
        "length_aware: capped groups apply lambda_max": ~out.capped | (out.lam == lam_cap),
        "length_aware: uncapped lambda = weighted pass mass / weighted factor mass":
            ~unc_G | close(out.lam * F_w, K_w, atol * K_w),
        "length_aware: capped groups: lambda_max f A shifted by one constant":
            ~out.capped | close(smax, smin, atol),
        "INV-1W the redistribution moves no weighted credit":
            close(seg(jnp.where(member, W * A1, 0.0)), seg(jnp.where(member, W * A, 0.0)), tol_G),
        "INV-2W weighted positive credit preserved":
            ~unc_G | close(seg(jnp.where(passed, W * A1, 0.0)), seg(jnp.where(passed, W * A, 0.0)),
                           tol_G),
        "INV-3 failures untouched": ~(unc_T & fail) | close(A1, A, atol),
        "INV-4 pass advantages proportional to factors":
            ~(unc_T & passed) | close(A1, f * c_G[gid], atol),
        "INV-5W weighted zero-sum shift":
            ~(unc_T & passed) | close(A1 - A, A * (f - fbar_T) / fbar_T, atol),
        "INV-6 equal factors reduce to A": ~(unc_T & (fmax == fmin)[gid]) | close(A1, A, atol),
    }

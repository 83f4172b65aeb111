"""An independent plain-NumPy, per-group-loop reference of SPEC section 2 (float64).

Written straight from the rules, one group at a time, sharing no code with gagar_jax.algo.advantage.
"""
import math

import numpy as np


def reference_advantages(rewards, group_ids, factors, valid, hacked, grading_ok, *,
                         num_groups, lam_cap=1.5, mode="sum_preserving", adjustments=None,
                         weights=None):
    """Returns a dict of float64 / bool numpy arrays with the AdvantageOutput field names.

    `weights` (per trajectory) are read by mode "length_aware" only: lambda preserves the
    weighted positive credit, a capped group is shifted to keep its weighted credit; a group
    whose passes all weigh 0 uses unit weights."""
    T = len(rewards)
    adv = np.zeros(T)
    outcome = np.zeros(T)
    shaped = np.zeros(T)
    eff = np.zeros(T)
    f_used = np.ones(T)
    equiv = np.zeros(T)
    lam = np.ones(num_groups)
    capped = np.zeros(num_groups, bool)
    mixed = np.zeros(num_groups, bool)
    fallback = np.zeros(num_groups, bool)
    for g in range(num_groups):
        members = [i for i in range(T) if valid[i] and group_ids[i] == g]
        if not members:
            continue
        r = {i: (0.0 if hacked[i] else float(rewards[i] > 0.5)) for i in members}
        for i in members:
            eff[i] = r[i]
            equiv[i] = r[i]
        passes = [i for i in members if r[i] == 1.0]
        n, k = len(members), len(passes)
        if not 0 < k < n:
            continue
        mixed[g] = True
        p = k / n
        A = {i: r[i] - p for i in members}
        for i in members:
            outcome[i] = A[i]
        f = {}
        if mode != "binary":
            bad = any(not (math.isfinite(factors[i]) and 0 < factors[i] <= 1) for i in passes)
            fallback[g] = (not grading_ok[g]) or bad
            f = {i: (1.0 if fallback[g] else float(factors[i])) for i in passes}
            for i in passes:
                f_used[i] = f[i]
        new = dict(A)
        if mode == "downweight_only":
            for i in passes:
                new[i] = f[i] * A[i]
        elif mode == "sum_preserving":
            s_plus = sum(A[i] for i in passes)
            lam_g = s_plus / sum(f[i] * A[i] for i in passes)
            if lam_g > lam_cap:
                lam_g = lam_cap
                capped[g] = True
            lam[g] = lam_g
            for i in passes:
                new[i] = lam_g * f[i] * A[i]
            if capped[g]:
                mean = sum(new.values()) / n
                new = {i: v - mean for i, v in new.items()}
        elif mode == "length_aware":
            w = {i: float(weights[i]) for i in members}
            if sum(w[i] for i in passes) <= 0:
                w = {i: 1.0 for i in members}
            lam_g = sum(w[i] * A[i] for i in passes) / sum(w[i] * f[i] * A[i] for i in passes)
            if lam_g > lam_cap:
                lam_g = lam_cap
                capped[g] = True
            lam[g] = lam_g
            for i in passes:
                new[i] = lam_g * f[i] * A[i]
            if capped[g]:
                shift = sum(w[i] * (new[i] - A[i]) for i in members) / sum(w.values())
                new = {i: v - shift for i, v in new.items()}
        for i in members:
            shaped[i] = new[i]
            adv[i] = new[i]
            equiv[i] = p + new[i]
        if adjustments is not None:
            c_mean = sum(float(adjustments[i]) for i in members) / n
            for i in members:
                adv[i] += float(adjustments[i]) - c_mean
    return dict(advantages=adv, outcome_advantages=outcome, redistributed_advantages=shaped,
                effective_rewards=eff, equivalent_rewards=equiv, factors_used=f_used,
                lam=lam, capped=capped, mixed=mixed, fallback=fallback)

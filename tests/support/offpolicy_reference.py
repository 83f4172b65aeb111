"""An independent NumPy reference for verl's policy losses and rollout correction (loops only).

Adapted from /work/notes/verl_numpy_reference.py (written from volcengine/verl@b178a3cd, not
copied from it): one sequence per row, as verl lays them out. `unpack` turns gagar's packed
rows (several trajectories a row) into that layout, so packed results can be checked too.
"""
from __future__ import annotations

import math

import numpy as np

SAFETY_BOUND = 20.0  # |log ratio| clamp used by verl before exp (PPO/CISPO/IS)
GSPO_LOG_RATIO_MAX = 10.0  # GSPO clamps the (combined) log-ratio from above only
MEAN_EPS = 1e-8  # verl's masked_mean: sum(x*m) / (sum(m) + 1e-8)


# --------------------------------------------------------------------------
# small masked helpers (explicit loops)
# --------------------------------------------------------------------------
def _clip(x, lo, hi):
    if lo is not None and x < lo:
        return lo
    if hi is not None and x > hi:
        return hi
    return x


def _clip_grad(x, lo, hi):
    """torch.clamp backward: 1 inside the closed interval [lo, hi], else 0."""
    if lo is not None and x < lo:
        return 0.0
    if hi is not None and x > hi:
        return 0.0
    return 1.0


def masked_sum_all(x, mask):
    B, S = x.shape
    s = 0.0
    for b in range(B):
        for t in range(S):
            if mask[b, t] != 0:
                s += x[b, t] * mask[b, t]
    return s


def masked_mean_all(x, mask):
    """verl masked_mean over all elements: sum(x*m) / (sum(m) + 1e-8)."""
    B, S = x.shape
    n = 0.0
    for b in range(B):
        for t in range(S):
            n += mask[b, t]
    return masked_sum_all(x, mask) / (n + MEAN_EPS)


def masked_sum_row(x, mask, b):
    s = 0.0
    for t in range(x.shape[1]):
        if mask[b, t] != 0:
            s += x[b, t] * mask[b, t]
    return s


def masked_mean_row(x, mask, b):
    n = 0.0
    for t in range(x.shape[1]):
        n += mask[b, t]
    return masked_sum_row(x, mask, b) / (n + MEAN_EPS)


def row_count(mask, b):
    n = 0.0
    for t in range(mask.shape[1]):
        n += mask[b, t]
    return n


def _std_ddof1(values):
    n = len(values)
    if n <= 1:
        return 0.0
    m = sum(values) / n
    return math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))


# --------------------------------------------------------------------------
# 4. loss aggregation (agg_loss)
# --------------------------------------------------------------------------
def agg_loss_coeffs(
    mask, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None
):
    """agg_loss is linear in the loss matrix: loss = sum_{b,t} c[b,t] * L[b,t].

    Returns the coefficient matrix c for one micro-batch on one rank.

    token-mean:              c = m / N_tok * dp
        N_tok = batch_num_tokens (global over dp, all micro-batches of the mini-batch) or sum(m)
    seq-mean-token-sum:      c = m / N_seq * dp
        N_seq = global_batch_size or #local rows with sum(m)>0
    seq-mean-token-mean:     c = m / (n_b + 1e-8) / N_seq * dp   n_b = sum_t m[b,t]
    seq-mean-token-sum-norm: c = m / K
        K = loss_scale_factor or S (padded length); NOTE: no division by #sequences, no dp factor.
    """
    B, S = mask.shape
    c = np.zeros((B, S), dtype=np.float64)
    if mode == "token-mean":
        n_tok = batch_num_tokens
        if n_tok is None:
            n_tok = 0.0
            for b in range(B):
                n_tok += row_count(mask, b)
        for b in range(B):
            for t in range(S):
                c[b, t] = mask[b, t] / n_tok * dp_size
    elif mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        n_seq = global_batch_size
        if n_seq is None:
            n_seq = 0.0
            for b in range(B):
                if row_count(mask, b) > 0:
                    n_seq += 1.0
        for b in range(B):
            n_b = row_count(mask, b)
            if n_b <= 0:
                continue  # fully-masked rows excluded
            for t in range(S):
                if mode == "seq-mean-token-sum":
                    c[b, t] = mask[b, t] / n_seq * dp_size
                else:
                    c[b, t] = mask[b, t] / (n_b + MEAN_EPS) / n_seq * dp_size
    elif mode == "seq-mean-token-sum-norm":
        k = loss_scale_factor if loss_scale_factor is not None else S
        for b in range(B):
            for t in range(S):
                c[b, t] = mask[b, t] / k
    else:
        raise ValueError(f"Invalid loss_agg_mode: {mode}")
    return c


def agg_loss(loss_mat, mask, mode, **kw):
    c = agg_loss_coeffs(mask, mode, **kw)
    B, S = loss_mat.shape
    total = 0.0
    for b in range(B):
        for t in range(S):
            if c[b, t] != 0.0:
                total += c[b, t] * loss_mat[b, t]
    return total


# --------------------------------------------------------------------------
# 1/2. vanilla PPO (clip-higher + dual clip), token level
# --------------------------------------------------------------------------
def _max_with_grad(a, da, b_, db):
    if a > b_:
        return a, da
    if b_ > a:
        return b_, db
    return a, 0.5 * (da + db)


def _min_with_grad(a, da, b_, db):
    if a < b_:
        return a, da
    if b_ < a:
        return b_, db
    return a, 0.5 * (da + db)


def ppo_loss(old_logp, logp, adv, mask, clip_low=0.2, clip_high=0.2, clip_c=3.0,
             loss_agg_mode="token-mean", is_weights=None, agg_kwargs=None):
    """verl loss_mode='vanilla'.

    d      = clamp(logp - old_logp, -20, 20)
    r      = exp(d)
    l1     = -A r ;  l2 = -A clip(r, 1-eps_lo, 1+eps_hi) ;  lc = max(l1, l2)
    l3     = -A c                       (dual clip, c = clip_ratio_c > 1)
    loss_t = min(lc, l3) if A < 0 else lc
    loss_t *= w_t (rollout IS weight, detached) if given
    metrics: pg_clipfrac      = masked_mean[l2 > l1]
             pg_clipfrac_lower = masked_mean[(lc > l3) & (A < 0)]
             ppo_kl           = masked_mean[-d]   (clamped d)
    """
    assert clip_c > 1.0
    agg_kwargs = agg_kwargs or {}
    B, S = logp.shape
    L = np.zeros((B, S))
    dL = np.zeros((B, S))  # d loss_mat[b,t] / d logp[b,t]
    clipped = np.zeros((B, S))
    clipped_lower = np.zeros((B, S))
    neg_kl = np.zeros((B, S))
    for b in range(B):
        for t in range(S):
            raw = logp[b, t] - old_logp[b, t]
            d = _clip(raw, -SAFETY_BOUND, SAFETY_BOUND)
            dd = _clip_grad(raw, -SAFETY_BOUND, SAFETY_BOUND)
            r = math.exp(d)
            dr = r * dd
            A = adv[b, t]
            l1, dl1 = -A * r, -A * dr
            rc = _clip(r, 1.0 - clip_low, 1.0 + clip_high)
            l2, dl2 = -A * rc, -A * dr * _clip_grad(r, 1.0 - clip_low, 1.0 + clip_high)
            lc, dlc = _max_with_grad(l1, dl1, l2, dl2)
            l3 = -A * clip_c
            clipped[b, t] = 1.0 if l2 > l1 else 0.0
            clipped_lower[b, t] = 1.0 if (lc > l3 and A < 0) else 0.0
            if A < 0:
                lo, dlo = _min_with_grad(l3, 0.0, lc, dlc)
            else:
                lo, dlo = lc, dlc
            w = 1.0 if is_weights is None else is_weights[b, t]
            L[b, t] = lo * w
            dL[b, t] = dlo * w
            neg_kl[b, t] = -d
    c = agg_loss_coeffs(mask, loss_agg_mode, **agg_kwargs)
    loss = agg_loss(L, mask, loss_agg_mode, **agg_kwargs)
    metrics = {
        "actor/pg_clipfrac": masked_mean_all(clipped, mask),
        "actor/ppo_kl": masked_mean_all(neg_kl, mask),
        "actor/pg_clipfrac_lower": masked_mean_all(clipped_lower, mask),
    }
    return loss, c * dL, metrics


# --------------------------------------------------------------------------
# 1. GSPO (GSPO-token form), aggregation forced to seq-mean-token-mean
# --------------------------------------------------------------------------
def gspo_loss(
    old_logp, logp, adv, mask, clip_low=3e-4, clip_high=4e-4, is_weights=None, agg_kwargs=None
):
    """verl loss_mode='gspo'.

    seq log ratio  : lbar_b = sum_t m (logp - old_logp) / max(n_b, 1)     (NO +-20 clamp here)
    token log ratio: lam_bt = logp_bt - sg(logp_bt) + sg(lbar_b)           (value == lbar_b)
                     lam_bt = min(lam_bt, 10)                              (upper clamp only)
    s_bt = exp(lam_bt)   (value = s_b = geometric-mean ratio; grad wrt logp_bt = s_b)
    l1 = -A s ; l2 = -A clip(s, 1-eps_lo, 1+eps_hi) ; loss = max(l1, l2)   (NO dual clip)
    loss *= w (rollout IS weight) if given
    aggregation: ALWAYS seq-mean-token-mean (the loss_agg_mode arg is ignored)
    metrics: pg_clipfrac = token masked_mean[l2 > l1]; ppo_kl = token masked_mean[old - logp]
             (unclamped); pg_clipfrac_lower = 0.
    """
    agg_kwargs = agg_kwargs or {}
    B, S = logp.shape
    L = np.zeros((B, S))
    dL = np.zeros((B, S))
    clipped = np.zeros((B, S))
    neg_kl = np.zeros((B, S))
    for b in range(B):
        n_b = max(row_count(mask, b), 1.0)
        lbar = 0.0
        for t in range(S):
            lbar += (logp[b, t] - old_logp[b, t]) * mask[b, t]
        lbar /= n_b
        for t in range(S):
            lam = _clip(lbar, None, GSPO_LOG_RATIO_MAX)
            dlam = _clip_grad(
                lbar, None, GSPO_LOG_RATIO_MAX
            )  # d lam / d logp_bt (stop-grad elsewhere)
            s = math.exp(lam)
            ds = s * dlam
            A = adv[b, t]
            l1, dl1 = -A * s, -A * ds
            sc = _clip(s, 1.0 - clip_low, 1.0 + clip_high)
            l2, dl2 = -A * sc, -A * ds * _clip_grad(s, 1.0 - clip_low, 1.0 + clip_high)
            lo, dlo = _max_with_grad(l1, dl1, l2, dl2)
            clipped[b, t] = 1.0 if l2 > l1 else 0.0
            w = 1.0 if is_weights is None else is_weights[b, t]
            L[b, t] = lo * w
            dL[b, t] = dlo * w
            neg_kl[b, t] = -(logp[b, t] - old_logp[b, t])
    mode = "seq-mean-token-mean"
    c = agg_loss_coeffs(mask, mode, **agg_kwargs)
    loss = agg_loss(L, mask, mode, **agg_kwargs)
    metrics = {
        "actor/pg_clipfrac": masked_mean_all(clipped, mask),
        "actor/ppo_kl": masked_mean_all(neg_kl, mask),
        "actor/pg_clipfrac_lower": 0.0,
    }
    return loss, c * dL, metrics


# --------------------------------------------------------------------------
# 3. CISPO
# --------------------------------------------------------------------------
def cispo_loss(old_logp, logp, adv, mask, clip_low=10.0, clip_high=0.2, loss_agg_mode="token-mean",
               is_weights=None, agg_kwargs=None):
    """verl loss_mode='cispo'.

    d  = clamp(logp - old_logp, -20, 20); r = exp(d)
    rc = clip(r, 1-eps_lo, 1+eps_hi)
        (both sides; verl example uses eps_lo=10 => no lower clip)
    loss_t = -sg(rc) * A * logp              (gradient -rc*A for EVERY token, clipped or not)
    loss_t *= w if given; aggregated with loss_agg_mode (default token-mean).
    metrics: pg_clipfrac = masked_mean[r != rc]; ppo_kl = masked_mean[-d]; pg_clipfrac_lower = 0.
    """
    agg_kwargs = agg_kwargs or {}
    B, S = logp.shape
    L = np.zeros((B, S))
    dL = np.zeros((B, S))
    clipped = np.zeros((B, S))
    neg_kl = np.zeros((B, S))
    for b in range(B):
        for t in range(S):
            d = _clip(logp[b, t] - old_logp[b, t], -SAFETY_BOUND, SAFETY_BOUND)
            r = math.exp(d)
            rc = _clip(r, 1.0 - clip_low, 1.0 + clip_high)
            A = adv[b, t]
            w = 1.0 if is_weights is None else is_weights[b, t]
            L[b, t] = -rc * A * logp[b, t] * w
            dL[b, t] = -rc * A * w
            clipped[b, t] = 1.0 if r != rc else 0.0
            neg_kl[b, t] = -d
    c = agg_loss_coeffs(mask, loss_agg_mode, **agg_kwargs)
    loss = agg_loss(L, mask, loss_agg_mode, **agg_kwargs)
    metrics = {
        "actor/pg_clipfrac": masked_mean_all(clipped, mask),
        "actor/ppo_kl": masked_mean_all(neg_kl, mask),
        "actor/pg_clipfrac_lower": 0.0,
    }
    return loss, c * dL, metrics


def reinforce_is_loss(
    rollout_logp, logp, adv, mask, is_weights=None, loss_agg_mode="token-mean", agg_kwargs=None
):
    """bypass_mode + loss_type='reinforce': loss_t = -A * logp * w (w detached)."""
    agg_kwargs = agg_kwargs or {}
    B, S = logp.shape
    L = np.zeros((B, S))
    dL = np.zeros((B, S))
    kl = np.zeros((B, S))
    for b in range(B):
        for t in range(S):
            w = 1.0 if is_weights is None else is_weights[b, t]
            L[b, t] = -adv[b, t] * logp[b, t] * w
            dL[b, t] = -adv[b, t] * w
            kl[b, t] = rollout_logp[b, t] - logp[b, t]
    c = agg_loss_coeffs(mask, loss_agg_mode, **agg_kwargs)
    return (
        agg_loss(L, mask, loss_agg_mode, **agg_kwargs),
        c * dL,
        {"actor/ppo_kl": masked_mean_all(kl, mask)},
    )


# --------------------------------------------------------------------------
# 6. entropy bonus / KL loss terms (as combined in the actor)
# --------------------------------------------------------------------------
def entropy_from_logits(logits):
    """[B, S, V] -> [B, S]; H = logsumexp(z) - sum softmax(z) * z."""
    B, S, V = logits.shape
    H = np.zeros((B, S))
    for b in range(B):
        for t in range(S):
            z = logits[b, t]
            mx = max(z)
            lse = mx + math.log(sum(math.exp(v - mx) for v in z))
            H[b, t] = lse - sum(math.exp(v - lse) * v for v in z)
    return H


def kl_low_var(logp, ref_logp):
    """kl_loss_type='low_var_kl' (k3): x = clamp(ref-logp,+-20); k = exp(x)-x-1; clamp(k,-10,10)."""
    B, S = logp.shape
    out = np.zeros((B, S))
    for b in range(B):
        for t in range(S):
            x = _clip(ref_logp[b, t] - logp[b, t], -20.0, 20.0)
            out[b, t] = _clip(math.exp(x) - x - 1.0, -10.0, 10.0)
    return out


def actor_total_loss(
    pg_loss, entropy, kld, mask, loss_agg_mode, entropy_coeff=0.0, kl_loss_coef=0.0
):
    """policy_loss = pg_loss - entropy_coeff * agg(H) + kl_loss_coef * agg(kl), same agg mode
    (config.loss_agg_mode, even for GSPO whose pg part is forced to seq-mean-token-mean)."""
    total = pg_loss
    if entropy is not None:
        total -= entropy_coeff * agg_loss(entropy, mask, loss_agg_mode)
    if kld is not None:
        total += kl_loss_coef * agg_loss(kld, mask, loss_agg_mode)
    return total


# --------------------------------------------------------------------------
# advantages (for completeness): GRPO / Dr.GRPO and DAPO overlong shaping
# --------------------------------------------------------------------------
def grpo_advantages(scores, group_ids, mask, norm_by_std=True, eps=1e-6):
    """A_b = (R_b - mean_g) / (std_g(ddof=1) + eps)  [Dr.GRPO: A_b = R_b - mean_g];
    singleton groups use mean 0, std 1. Broadcast over tokens and multiplied by mask."""
    B, S = mask.shape
    groups = {}
    for b in range(B):
        groups.setdefault(group_ids[b], []).append(scores[b])
    stats = {}
    for g, vals in groups.items():
        if len(vals) == 1:
            stats[g] = (0.0, 1.0)
        else:
            stats[g] = (sum(vals) / len(vals), _std_ddof1(vals))
    adv = np.zeros((B, S))
    for b in range(B):
        mu, sd = stats[group_ids[b]]
        a = (scores[b] - mu) / (sd + eps) if norm_by_std else scores[b] - mu
        for t in range(S):
            adv[b, t] = a * mask[b, t]
    return adv


def dapo_overlong_penalty(resp_len, max_resp_len, buffer_len, penalty_factor=1.0):
    expected = max_resp_len - buffer_len
    exceed = resp_len - expected
    return min(-exceed / buffer_len * penalty_factor, 0.0)


# --------------------------------------------------------------------------
# 5. rollout correction: IS weights
# --------------------------------------------------------------------------
def rollout_is_weights(
    old_logp,
    rollout_logp,
    mask,
    level="token",
    threshold=2.0,
    batch_normalize=False,
    mode="truncate",
    threshold_lower=None,
    veto_threshold=None,
):
    """IS weight w = pi_old / pi_rollout (decoupled) [pass logp of pi_theta as old_logp for bypass].

    level (HEAD supports token|sequence; 'geometric' only in the Oct-2025 API):
      token:     w_bt = exp(clamp(lr_bt, +-20))
      sequence:  w_bt = exp(clamp(sum_t m lr_bt, +-20))          (broadcast; the SUM is clamped)
      geometric: w_bt = exp(clamp(sum_t m lr_bt / n_b, +-20))    (legacy)
    then w *= m, metrics (computed on these un-truncated weights),
    mode truncate (HEAD, only mode): w = min(w, threshold)   (no lower truncation)
    mode clip (legacy "CIS"):        w = w * [lower <= w <= upper], lower defaults to 1/upper
    legacy veto: any valid token with lr < log(veto) zeroes the whole sequence's weights
    batch_normalize: w /= mean(w) -- token: over valid tokens; sequence: over valid sequences of
    their per-sequence mean weight; skipped if mean <= 1e-8. Weights are treated as constants.
    Returns (w [B,S], metrics dict without the 'rollout_corr/' prefix).
    """
    B, S = old_logp.shape
    lr = old_logp - rollout_logp
    w = np.zeros((B, S))
    lr_for_metrics = None  # per token for token level, per sequence otherwise
    if level == "token":
        lr_for_metrics = lr
        for b in range(B):
            for t in range(S):
                w[b, t] = math.exp(_clip(lr[b, t], -SAFETY_BOUND, SAFETY_BOUND))
    elif level in ("sequence", "geometric"):
        lr_for_metrics = np.zeros(B)
        for b in range(B):
            s = masked_sum_row(lr, mask, b)
            if level == "geometric":
                s = s / (row_count(mask, b) + MEAN_EPS)
            lr_for_metrics[b] = s
            v = math.exp(_clip(s, -SAFETY_BOUND, SAFETY_BOUND))
            for t in range(S):
                w[b, t] = v
    else:
        raise ValueError(level)
    for b in range(B):
        for t in range(S):
            w[b, t] *= mask[b, t]

    metrics = is_metrics(w, lr_for_metrics, mask, level, threshold)

    if mode == "truncate":
        for b in range(B):
            for t in range(S):
                w[b, t] = min(w[b, t], threshold)
    elif mode == "clip":
        lower = threshold_lower if threshold_lower is not None else 1.0 / threshold
        for b in range(B):
            for t in range(S):
                keep = lower <= w[b, t] <= threshold
                w[b, t] = w[b, t] if keep else 0.0
    else:
        raise ValueError(mode)

    if veto_threshold is not None:
        log_veto = math.log(veto_threshold)
        n_veto = 0
        for b in range(B):
            bad = any(mask[b, t] != 0 and lr[b, t] < log_veto for t in range(S))
            if bad:
                n_veto += 1
                for t in range(S):
                    w[b, t] = 0.0
        metrics["rollout_is_veto_fraction"] = n_veto / B

    if batch_normalize:
        if level == "token":
            mean_w = masked_mean_all(w, mask)
        else:
            tot, cnt = 0.0, 0
            for b in range(B):
                if row_count(mask, b) > 0:
                    tot += masked_mean_row(w, mask, b)
                    cnt += 1
            mean_w = tot / max(cnt, 1e-8)
        if mean_w > 1e-8:
            for b in range(B):
                for t in range(S):
                    w[b, t] /= mean_w
            metrics["rollout_is_batch_norm_factor"] = mean_w
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return w, metrics


def is_metrics(w, lr_for_metrics, mask, level, threshold):
    """Metrics on safety-bounded, masked, NOT-yet-truncated weights (HEAD semantics)."""
    B, S = w.shape
    lower = 1.0 / threshold
    m = {}
    if level == "token":
        m["rollout_is_mean"] = masked_mean_all(w, mask)
        hi = np.zeros((B, S))
        lo = np.zeros((B, S))
        mx, mn = -math.inf, math.inf
        for b in range(B):
            for t in range(S):
                hi[b, t] = 1.0 if w[b, t] > threshold else 0.0
                lo[b, t] = 1.0 if w[b, t] < lower else 0.0
                if mask[b, t] != 0:
                    mx = max(mx, w[b, t])
                    mn = min(mn, w[b, t])
        m["rollout_is_ratio_fraction_high"] = masked_mean_all(hi, mask)
        m["rollout_is_ratio_fraction_low"] = masked_mean_all(lo, mask)
        m["rollout_is_max"] = mx
        m["rollout_is_min"] = mn
    else:  # per-sequence log ratios, over ALL rows (incl. fully masked ones)
        m["rollout_is_max"] = math.exp(min(max(lr_for_metrics), SAFETY_BOUND))
        m["rollout_is_min"] = math.exp(min(lr_for_metrics))
        m["rollout_is_mean"] = masked_mean_all(w, mask)
        m["rollout_is_ratio_fraction_high"] = (
            sum(1.0 for v in lr_for_metrics if v > math.log(threshold)) / B
        )
        m["rollout_is_ratio_fraction_low"] = (
            sum(1.0 for v in lr_for_metrics if v < math.log(lower)) / B
        )
    wc = np.zeros((B, S))
    for b in range(B):
        for t in range(S):
            wc[b, t] = _clip(w[b, t], lower, threshold)
    n_valid = masked_sum_all(np.ones((B, S)), mask)
    if n_valid > 1:
        mu = masked_mean_all(wc, mask)
        var = masked_mean_all(wc * wc, mask) - mu * mu
        m["rollout_is_std"] = math.sqrt(max(var, 0.0))
    else:
        m["rollout_is_std"] = 0.0
    mu = masked_mean_all(wc, mask)
    wn = wc / (mu + 1e-8)
    m["rollout_is_eff_sample_size"] = 1.0 / masked_mean_all(wn * wn, mask)  # a FRACTION in (0, 1]
    seq_means = [masked_mean_row(w, mask, b) for b in range(B)]  # over all rows
    m["rollout_is_seq_mean"] = sum(seq_means) / B
    m["rollout_is_seq_std"] = _std_ddof1(seq_means)
    m["rollout_is_seq_max"] = max(seq_means)
    m["rollout_is_seq_min"] = min(seq_means)
    m["rollout_is_seq_max_deviation"] = max(abs(v - 1.0) for v in seq_means)
    m["rollout_is_seq_fraction_high"] = sum(1.0 for v in seq_means if v > threshold) / B
    m["rollout_is_seq_fraction_low"] = sum(1.0 for v in seq_means if v < lower) / B
    return m


# --------------------------------------------------------------------------
# 5. rollout correction: rejection masks
# --------------------------------------------------------------------------
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def parse_rs_thresholds(options, spec):
    """k1 options: 'lo_hi' or a single x (=> hi=x, lo=1/x). k2/k3: single positive upper bound.
    One spec is broadcast to all options; otherwise one per option (comma separated)."""
    if isinstance(spec, (int, float)):
        parts = [str(spec)]
    else:
        parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(parts) == 1:
        parts = parts * len(options)
    assert len(parts) == len(options)
    out = {}
    for opt, p in zip(options, parts, strict=True):
        if opt.endswith("k1"):
            if "_" in p:
                lo, hi = p.split("_", 1)
                lo, hi = float(lo), float(hi)
            else:
                hi = float(p)
                lo = 1.0 / hi
            out[opt] = (lo, hi)
        else:
            assert "_" not in p
            out[opt] = (None, float(p))
    return out


def rollout_rejection_mask(
    old_logp, rollout_logp, mask, rollout_rs="token_k1", threshold="0.5_2.0"
):
    """HEAD (post Dec-2025) divergence-based rejection.

    lr = clamp(old_logp - rollout_logp, +-20) per token;
    k1 = -lr ; k2 = lr^2/2 ; k3 = exp(lr)-1-lr.
    token_kX   : per-token statistic
    seq_sum_kX : sum_t m kX ;  seq_mean_kX : sum_t m kX / (n_b+1e-8) ;
    seq_max_kX : max_t over valid (0 if none)
    keep rule  : k1: log(lo) <= stat <= log(hi)    (NB: stat = -lr, so ratio-space keep is
                 1/hi <= r <= 1/lo; identical to [lo,hi] only if lo=1/hi)
                 k2/k3: stat <= hi
    sequence options keep/reject whole rows. Multiple comma-separated options are AND-ed.
    new_mask = mask * keep. Returns (new_mask, metrics without prefix).
    """
    B, S = old_logp.shape
    opts = []
    for o in rollout_rs.split(","):
        o = o.strip()
        if o and o not in opts:
            assert o in RS_OPTIONS, o
            opts.append(o)
    thr = parse_rs_thresholds(opts, threshold)
    lr = np.zeros((B, S))
    for b in range(B):
        for t in range(S):
            lr[b, t] = _clip(old_logp[b, t] - rollout_logp[b, t], -SAFETY_BOUND, SAFETY_BOUND)
    k = {
        "k1": -lr,
        "k2": 0.5 * lr * lr,
        "k3": np.exp(lr) - 1.0 - lr,
    }
    combined = np.ones((B, S))
    seq_valid = [row_count(mask, b) > 0 for b in range(B)]
    metrics = {}
    for opt in opts:
        lo, hi = thr[opt]
        kind = opt[-2:]
        is_k1 = kind == "k1"
        base = k[kind]
        lo_log = math.log(lo) if is_k1 else None
        hi_cmp = math.log(hi) if is_k1 else hi
        keep = np.zeros((B, S))
        per_tok = np.zeros((B, S))
        per_seq = None
        if opt.startswith("token"):
            for b in range(B):
                for t in range(S):
                    v = base[b, t]
                    per_tok[b, t] = v
                    ok = (v <= hi_cmp) and (not is_k1 or v >= lo_log)
                    keep[b, t] = 1.0 if ok else 0.0
            level = "token"
        else:
            per_seq = np.zeros(B)
            for b in range(B):
                if opt.startswith("seq_sum"):
                    v = masked_sum_row(base, mask, b)
                elif opt.startswith("seq_mean"):
                    v = masked_mean_row(base, mask, b)
                else:  # seq_max
                    vals = [base[b, t] for t in range(S) if mask[b, t] != 0]
                    v = max(vals) if vals else 0.0
                per_seq[b] = v
                ok = (v <= hi_cmp) and (not is_k1 or v >= lo_log)
                for t in range(S):
                    per_tok[b, t] = v
                    keep[b, t] = 1.0 if ok else 0.0
            level = "sequence"
        combined *= keep
        metrics.update(_rs_option_metrics(opt, per_tok, per_seq, mask, seq_valid, level, hi_cmp,
                                          lo_log if is_k1 else 0.0, is_k1))
        metrics[f"rollout_rs_{opt}_masked_fraction"] = masked_mean_all(1.0 - keep, mask)
        n_valid = sum(seq_valid)
        rej = 0
        for b in range(B):
            if seq_valid[b] and any(mask[b, t] != 0 and keep[b, t] == 0 for t in range(S)):
                rej += 1
        metrics[f"rollout_rs_{opt}_seq_masked_fraction"] = rej / n_valid if n_valid > 0 else 0.0
    metrics["rollout_rs_masked_fraction"] = masked_mean_all(1.0 - combined, mask)
    any_masked = 0
    for b in range(B):
        if any(mask[b, t] != 0 and combined[b, t] <= 0.5 for t in range(S)):
            any_masked += 1
    metrics["rollout_rs_seq_masked_fraction"] = any_masked / B  # over ALL rows
    return mask * combined, metrics


def _rs_option_metrics(opt, per_tok, per_seq, mask, seq_valid, level, hi, lo, use_lo):
    B, S = per_tok.shape
    p = f"rollout_rs_{opt}"
    m = {}
    seq_vals = (
        list(per_seq)
        if per_seq is not None
        else [masked_mean_row(per_tok, mask, b) for b in range(B)]
    )
    seq_vals = [v for v, ok in zip(seq_vals, seq_valid, strict=True) if ok]
    m[f"{p}_mean"] = masked_mean_all(per_tok, mask)
    valid_tok = [per_tok[b, t] for b in range(B) for t in range(S) if mask[b, t] != 0]
    if level == "sequence" and seq_vals:
        m[f"{p}_max"], m[f"{p}_min"] = max(seq_vals), min(seq_vals)
        m[f"{p}_fraction_high"] = sum(1.0 for v in seq_vals if v > hi) / len(seq_vals)
        m[f"{p}_fraction_low"] = (
            sum(1.0 for v in seq_vals if v < lo) / len(seq_vals) if use_lo else 0.0
        )
    else:
        m[f"{p}_max"], m[f"{p}_min"] = max(valid_tok), min(valid_tok)
        hi_ind = np.array(
            [[1.0 if per_tok[b, t] > hi else 0.0 for t in range(S)] for b in range(B)]
        )
        lo_ind = np.array(
            [[1.0 if per_tok[b, t] < lo else 0.0 for t in range(S)] for b in range(B)]
        )
        m[f"{p}_fraction_high"] = masked_mean_all(hi_ind, mask)
        m[f"{p}_fraction_low"] = masked_mean_all(lo_ind, mask) if use_lo else 0.0
    if len(valid_tok) > 1:
        c = np.array(
            [[_clip(per_tok[b, t], lo if use_lo else 0.0, hi) for t in range(S)] for b in range(B)]
        )
        mu = masked_mean_all(c, mask)
        m[f"{p}_std"] = math.sqrt(max(masked_mean_all(c * c, mask) - mu * mu, 0.0))
    else:
        m[f"{p}_std"] = 0.0
    if seq_vals:
        m[f"{p}_seq_mean"] = sum(seq_vals) / len(seq_vals)
        m[f"{p}_seq_std"] = _std_ddof1(seq_vals)
        m[f"{p}_seq_max"], m[f"{p}_seq_min"] = max(seq_vals), min(seq_vals)
        m[f"{p}_seq_max_deviation"] = max(abs(v) for v in seq_vals)
        m[f"{p}_seq_fraction_high"] = sum(1.0 for v in seq_vals if v > hi) / len(seq_vals)
        if use_lo:
            m[f"{p}_seq_fraction_low"] = sum(1.0 for v in seq_vals if v < lo) / len(seq_vals)
    return m


def legacy_ratio_rejection_mask(old_logp, rollout_logp, mask, level="token", upper=2.0, lower=None,
                                veto_threshold=None):
    """Nov/Dec-2025 API (rollout_rs in {token, sequence, geometric}, rollout_rs_threshold[_lower],
    rollout_token_veto_threshold). rho = exp(clamp(stat, +-20)) with stat = lr (token),
    sum_t m lr (sequence) or mean_t m lr (geometric); keep iff lower <= rho <= upper (lower default
    1/upper). Veto: drop a row if any valid token has lr < log(veto)."""
    B, S = old_logp.shape
    lo = lower if lower is not None else 1.0 / upper
    lr = old_logp - rollout_logp
    keep = np.zeros((B, S))
    for b in range(B):
        if level == "sequence":
            st = masked_sum_row(lr, mask, b)
        elif level == "geometric":
            st = masked_mean_row(lr, mask, b)
        for t in range(S):
            v = lr[b, t] if level == "token" else st
            rho = math.exp(_clip(v, -SAFETY_BOUND, SAFETY_BOUND))
            keep[b, t] = 1.0 if lo <= rho <= upper else 0.0
    new_mask = mask * keep
    metrics = {"rollout_rs_masked_fraction": masked_mean_all(1.0 - keep, mask)}
    if veto_threshold is not None:
        lv = math.log(veto_threshold)
        n = 0
        for b in range(B):
            if any(mask[b, t] != 0 and lr[b, t] < lv for t in range(S)):
                n += 1
                new_mask[b, :] = 0.0
        metrics["rollout_is_veto_fraction"] = n / B
    return new_mask, metrics


def icepop(old_logp, rollout_logp, mask, alpha=0.5, beta=2.0):
    """IcePop (Ring-1T, arXiv:2510.18855) -- NOT implemented in verl.
    k_bt = pi_old/pi_rollout = exp(lr);  M(k) = k if alpha <= k <= beta else 0.
    Returns (weights M(k)*m, kept mask, metrics). verl equivalent: rollout_is='token' with
    rollout_is_threshold >= beta plus rollout_rs='token_k1',
    rollout_rs_threshold=f'{1/beta}_{1/alpha}'
    (sign convention of k1, see rollout_rejection_mask)."""
    B, S = old_logp.shape
    w = np.zeros((B, S))
    kept = np.zeros((B, S))
    for b in range(B):
        for t in range(S):
            kk = math.exp(_clip(old_logp[b, t] - rollout_logp[b, t], -SAFETY_BOUND, SAFETY_BOUND))
            if alpha <= kk <= beta and mask[b, t] != 0:
                w[b, t] = kk
                kept[b, t] = mask[b, t]
    return w, kept, {"icepop_fraction_masked": masked_mean_all(mask - kept, mask)}


# --------------------------------------------------------------------------
# 5. rollout correction: off-policy (mismatch) diagnostics
# --------------------------------------------------------------------------
def offpolicy_metrics(old_logp, rollout_logp, mask):
    B, S = old_logp.shape
    m = {}
    mean_tr = [masked_mean_row(old_logp, mask, b) for b in range(B)]
    mean_ro = [masked_mean_row(rollout_logp, mask, b) for b in range(B)]
    m["training_ppl"] = sum(math.exp(-v) for v in mean_tr) / B
    m["training_log_ppl"] = sum(-v for v in mean_tr) / B
    m["kl"] = masked_mean_all(rollout_logp - old_logp, mask)  # k1 of KL(rollout || old)
    lr = old_logp - rollout_logp
    m["k3_kl"] = masked_mean_all(np.exp(lr) - lr - 1.0, mask)  # unclamped
    m["rollout_ppl"] = sum(math.exp(-v) for v in mean_ro) / B
    m["rollout_log_ppl"] = sum(-v for v in mean_ro) / B
    diff = [r - t for r, t in zip(mean_ro, mean_tr, strict=True)]
    m["log_ppl_diff"] = sum(diff) / B
    m["log_ppl_abs_diff"] = sum(abs(v) for v in diff) / B
    m["log_ppl_diff_max"] = max(diff)
    m["log_ppl_diff_min"] = min(diff)
    m["ppl_ratio"] = sum(math.exp(v) for v in diff) / B
    sq = np.zeros((B, S))
    for b in range(B):
        for t in range(S):
            sq[b, t] = math.exp(2.0 * _clip(lr[b, t], -SAFETY_BOUND, SAFETY_BOUND))
    m["chi2_token"] = masked_mean_all(sq, mask) - 1.0
    m["chi2_seq"] = (
        sum(
            math.exp(2.0 * _clip(masked_sum_row(lr, mask, b), -SAFETY_BOUND, SAFETY_BOUND))
            for b in range(B)
        )
        / B
        - 1.0
    )
    return m


def rollout_correction(
    old_logp,
    rollout_logp,
    mask,
    rollout_is=None,
    rollout_is_threshold=2.0,
    rollout_is_batch_normalize=False,
    rollout_rs=None,
    rollout_rs_threshold=None,
):
    """HEAD pipeline: IS weights (on the ORIGINAL mask) + RS mask + diagnostics; all metric keys
    get the 'rollout_corr/' prefix. The RS mask replaces response_mask (used for advantages,
    pg/entropy/KL aggregation); IS weights multiply only the per-token policy loss."""
    metrics = {}
    w = None
    if rollout_is is not None and rollout_is_threshold is not None:
        w, mi = rollout_is_weights(old_logp, rollout_logp, mask, rollout_is, rollout_is_threshold,
                                   rollout_is_batch_normalize)
        metrics.update(mi)
    new_mask = mask.copy()
    if rollout_rs is not None:
        new_mask, mr = rollout_rejection_mask(
            old_logp, rollout_logp, mask, rollout_rs, rollout_rs_threshold
        )
        metrics.update(mr)
    metrics.update(offpolicy_metrics(old_logp, rollout_logp, mask))
    return w, new_mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}


# --------------------------------------------------------------------------
def unpack(traj, *arrays):
    """Packed [B, S] arrays -> one row per trajectory id 0..T-1 (tokens in order, zero-padded)."""
    T = int(traj.max()) + 1
    rows = {t: [] for t in range(T)}
    B, S = traj.shape
    for b in range(B):
        for s in range(S):
            rows[traj[b, s]].append((b, s))
    L = max(len(v) for v in rows.values())
    out = []
    for a in arrays:
        o = np.zeros((T, L), np.float64)
        for t in range(T):
            for j, (b, s) in enumerate(rows[t]):
                o[t, j] = a[b, s]
        out.append(o)
    return out

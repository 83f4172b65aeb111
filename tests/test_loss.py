"""Loss math against values worked out by hand and plain NumPy loops."""
import dataclasses
import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

from gagar_jax.algo import loss as L
from gagar_jax.batch import Batch

AGGS = L.AGGREGATIONS


# ---------------------------------------------------------------- NumPy references
def np_surrogate(logp, old, adv, cfg, tis=None):
    """Per-token clipped surrogate written out element by element."""
    out = np.zeros_like(logp)
    for idx in np.ndindex(logp.shape):
        r = np.exp(logp[idx] - old[idx])
        a = adv[idx]
        v = max(-a * r, -a * min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high))
        if cfg.dual_clip is not None and a < 0:
            v = min(v, -a * cfg.dual_clip)
        out[idx] = v * (1.0 if tis is None else tis[idx])
    return out


def np_aggregate(per_tok, mask, traj, cfg, K):
    """Per-mini-batch loss by its definition (row b in mini-batch b % K)."""
    B = mask.shape[0]
    losses = []
    for k in range(K):
        rows = [b for b in range(B) if b % K == k]
        toks = {}
        for b in rows:
            for s in range(mask.shape[1]):
                if mask[b, s]:
                    toks.setdefault(traj[b, s], []).append(per_tok[b, s])
        if not toks:
            losses.append(0.0)
            continue
        n_tok = sum(len(v) for v in toks.values())
        if cfg.aggregation == "token-mean":
            losses.append(sum(sum(v) for v in toks.values()) / n_tok)
        elif cfg.aggregation == "seq-mean-token-mean":
            losses.append(np.mean([np.mean(v) for v in toks.values()]))
        elif cfg.aggregation == "seq-mean-token-sum":
            losses.append(np.mean([np.sum(v) for v in toks.values()]))
        else:
            losses.append(np.mean([np.sum(v) for v in toks.values()]) / cfg.max_response_len)
    return np.array(losses)


def packed_example(rng, B=4, S=8, T=8):
    """Rows of two trajectories each: 1 prompt token then generated tokens, some padding."""
    traj = np.zeros((B, S), np.int32)
    mask = np.zeros((B, S), np.float32)
    t = 0
    for b in range(B):
        cut = rng.integers(3, S - 2)
        end = rng.integers(cut + 2, S + 1)
        for lo, hi in ((0, cut), (cut, end)):
            traj[b, lo:hi] = t
            mask[b, lo + 1:hi] = 1.0
            t += 1
    assert t <= T
    return traj, mask


def inputs_from(adv, mask, weight, old, tis=None, ref=None):
    z = np.zeros_like(mask)
    return L.LossInputs(adv_BxS=jnp.asarray(adv * mask), mask_BxS=jnp.asarray(mask),
                        weight_BxS=jnp.asarray(weight), old_logprobs_BxS=jnp.asarray(old * mask),
                        tis_weight_BxS=jnp.asarray(np.ones_like(mask) if tis is None else tis),
                        ref_logprobs_BxS=jnp.asarray(z if ref is None else ref * mask))


@functools.partial(jax.jit, static_argnames=("cfg",))
def jit_pg_loss(logp, ent, inputs, cfg):
    return L.pg_loss(logp, ent, inputs, cfg)


# ---------------------------------------------------------------- hand-worked values
def test_surrogate_hand_values():
    """Four tokens, one trajectory each, seq-mean-token-sum with N = 4 (weights 1/4)."""
    cfg = L.LossConfig(
        clip_low=0.2, clip_high=0.28, dual_clip=3.0, aggregation="seq-mean-token-sum"
    )
    ratio = np.array([[1.5, 0.5, 5.0, 1.1]], np.float32)
    adv = np.array([[1.0, -1.0, -1.0, 0.5]], np.float32)
    mask = np.ones((1, 4), np.float32)
    #  A=+1, r=1.5: max(-1.5, -1.28) = -1.28  (clipped high, no gradient)
    #  A=-1, r=0.5: max(0.5, 0.8)    =  0.8   (clipped low, no gradient)
    #  A=-1, r=5.0: max(5, 1.2) = 5 -> dual clip min(5, 3) = 3
    #  A=.5, r=1.1: max(-0.55, -0.55) = -0.55
    expected = (-1.28 + 0.8 + 3.0 - 0.55) / 4
    inp = inputs_from(adv, mask, mask / 4, np.zeros_like(mask))
    logp = jnp.log(jnp.asarray(ratio))
    loss, aux = jit_pg_loss(logp, jnp.zeros_like(logp), inp, cfg)
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    assert (aux.clip_high_count, aux.clip_low_count, aux.dual_clip_count, aux.tokens) == (
        1,
        1,
        1,
        4,
    )
    grad = jax.grad(lambda lp: L.pg_loss(lp, jnp.zeros_like(lp), inp, cfg)[0])(logp)
    # Only the unclipped token moves: d/dlogp (-A r / 4) = -0.5 * 1.1 / 4.
    np.testing.assert_allclose(grad, [[0.0, 0.0, 0.0, -0.5 * 1.1 / 4]], rtol=1e-6, atol=1e-7)
    # Without dual clip the third token is 5 and carries gradient -A r / 4 = 5 / 4.
    cfg2 = dataclasses.replace(cfg, dual_clip=None)
    loss2, aux2 = jit_pg_loss(logp, jnp.zeros_like(logp), inp, cfg2)
    np.testing.assert_allclose(loss2, (-1.28 + 0.8 + 5.0 - 0.55) / 4, rtol=1e-6)
    assert aux2.dual_clip_count == 0


@pytest.mark.parametrize("agg", AGGS)
def test_aggregation_weights_hand_example(agg):
    """Two rows, K=1: traj 0 has 3 tokens, traj 1 has 1, traj 2 has 2 (6 tokens, 3 trajectories)."""
    traj = np.array([[0, 0, 0, 0, 1, 1], [2, 2, 2, 0, 0, 0]], np.int32)
    mask = np.array([[0, 1, 1, 1, 0, 1], [0, 1, 1, 0, 0, 0]], np.float32)
    cfg = L.LossConfig(aggregation=agg, max_response_len=10)
    w = np.asarray(L.aggregation_weights(jnp.asarray(mask), jnp.asarray(traj), 3, cfg))
    row0 = {"token-mean": 1 / 6, "seq-mean-token-mean": (1 / 9, 1 / 3),
            "seq-mean-token-sum": 1 / 3, "seq-mean-token-sum-norm": 1 / 30}[agg]
    row1 = {"token-mean": 1 / 6, "seq-mean-token-mean": 1 / 6,
            "seq-mean-token-sum": 1 / 3, "seq-mean-token-sum-norm": 1 / 30}[agg]
    if isinstance(row0, tuple):
        exp0 = [0, row0[0], row0[0], row0[0], 0, row0[1]]
    else:
        exp0 = [0, row0, row0, row0, 0, row0]
    exp1 = [0, row1, row1, 0, 0, 0]
    np.testing.assert_allclose(w, np.array([exp0, exp1]), rtol=1e-6)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("K", [1, 2])
def test_loss_matches_numpy_in_each_mode(agg, K):
    rng = np.random.default_rng(7)
    traj, mask = packed_example(rng)
    T = 8
    cfg = L.LossConfig(aggregation=agg, dual_clip=2.5, max_response_len=16)
    old = rng.normal(-1.5, 0.3, mask.shape).astype(np.float32)
    logp = (old + rng.normal(0, 0.4, mask.shape)).astype(np.float32)
    adv_T = rng.normal(0, 1, T).astype(np.float32)
    adv = adv_T[traj] * mask
    w = L.aggregation_weights(jnp.asarray(mask), jnp.asarray(traj), T, cfg, K)
    inp = inputs_from(adv, mask, np.asarray(w), old)
    per_tok = np_surrogate(logp, old, adv, cfg)
    want_K = np_aggregate(per_tok, mask, traj, cfg, K)
    # The mini-batch loss is the sum over its rows (the micro-batch split must not matter).
    split = jax.tree.map(lambda x: L.split_rows(x, K, 2), inp)
    lp = L.split_rows(jnp.asarray(logp), K, 2)
    for k in range(K):
        got = 0.0
        for j in range(2):
            sub = jax.tree.map(lambda x, k=k, j=j: x[k, j], split)
            got += float(jit_pg_loss(lp[k, j], jnp.zeros_like(lp[k, j]), sub, cfg)[0])
        np.testing.assert_allclose(got, want_K[k], rtol=2e-5, atol=1e-7)


def test_split_rows_roundtrip_and_layout():
    x = jnp.arange(12)
    y = L.split_rows(x, 2, 3)
    assert y.shape == (2, 3, 2)
    for k in range(2):
        for j in range(3):
            for r in y[k, j]:
                assert int(r) % 2 == k and (int(r) // 2) % 3 == j
    np.testing.assert_array_equal(L.merge_rows(y), x)
    with pytest.raises(ValueError, match="divisible"):
        L.split_rows(jnp.arange(10), 2, 3)


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators_vs_numpy(est):
    rng = np.random.default_rng(1)
    logp = rng.normal(-2, 0.5, (3, 5))
    ref = logp + rng.normal(0, 0.3, (3, 5))
    lr = ref - logp
    want = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": np.exp(lr) - 1 - lr}[est]
    got = L.kl_penalty(jnp.asarray(logp, jnp.float32), jnp.asarray(ref, jnp.float32), est)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The estimators agree in expectation: sample from pi, check E[k] ~ KL(pi || ref) for 2 symbols.
    p, q = np.array([0.7, 0.3]), np.array([0.4, 0.6])
    exact = np.sum(p * np.log(p / q))
    lp_, lq = np.log(p), np.log(q)
    k = np.asarray(L.kl_penalty(jnp.asarray(lp_, jnp.float32), jnp.asarray(lq, jnp.float32), est))
    if est != "k2":  # k1 and k3 are unbiased
        np.testing.assert_allclose(np.sum(p * k), exact, rtol=1e-5)


def test_kl_term_enters_loss():
    rng = np.random.default_rng(3)
    mask = np.ones((2, 4), np.float32)
    logp = rng.normal(-1, 0.2, (2, 4)).astype(np.float32)
    ref = logp + rng.normal(0, 0.2, (2, 4)).astype(np.float32)
    cfg = L.LossConfig(kl_coef=0.1, kl_estimator="k3", aggregation="token-mean")
    inp = inputs_from(np.zeros_like(mask), mask, mask / 8, logp, ref=ref)
    loss, aux = jit_pg_loss(jnp.asarray(logp), jnp.zeros_like(mask), inp, cfg)
    lr = ref - logp
    np.testing.assert_allclose(loss, 0.1 * np.mean(np.exp(lr) - 1 - lr), rtol=1e-5)
    np.testing.assert_allclose(aux.pg_loss, 0.0, atol=1e-8)


def test_uniform_advantages_give_zero_gradient():
    rng = np.random.default_rng(4)
    mask = np.ones((2, 6), np.float32)
    old = rng.normal(-1, 0.2, mask.shape).astype(np.float32)
    logp = jnp.asarray(old + rng.normal(0, 0.5, mask.shape).astype(np.float32))
    inp = inputs_from(np.zeros_like(mask), mask, mask / 12, old)
    for agg in AGGS:
        cfg = L.LossConfig(aggregation=agg, dual_clip=3.0)
        g = jax.grad(lambda lp, cfg=cfg: L.pg_loss(lp, jnp.zeros_like(lp), inp, cfg)[0])(logp)
        np.testing.assert_array_equal(g, 0.0)


def test_garbage_off_mask_cannot_leak():
    mask = np.array([[0, 1, 1, 0]], np.float32)
    logp = jnp.asarray([[1e4, -1.0, -1.0, jnp.nan]], jnp.float32)
    inp = inputs_from(np.ones_like(mask), mask, mask / 2, np.full_like(mask, -1.0))
    logp = jnp.where(jnp.isnan(logp), 0.0, logp)  # the model writes 0 off-segment
    loss, aux = jit_pg_loss(logp, jnp.zeros_like(logp), inp, L.LossConfig())
    np.testing.assert_allclose(loss, -1.0, rtol=1e-6)
    assert np.isfinite(aux.approx_kl_sum)


@given(st.integers(0, 2 ** 31 - 1), st.sampled_from([1, 2, 4]))
def test_weight_sums_property(seed, K):
    """token-mean / seq-mean-token-mean weights sum to 1 per non-empty mini-batch."""
    rng = np.random.default_rng(seed)
    traj, mask = packed_example(rng)
    mask[rng.random(mask.shape) < 0.2] = 0.0
    for agg in ("token-mean", "seq-mean-token-mean"):
        cfg = L.LossConfig(aggregation=agg)
        w = np.asarray(L.aggregation_weights(jnp.asarray(mask), jnp.asarray(traj), 8, cfg, K))
        for k in range(K):
            rows = np.arange(mask.shape[0]) % K == k
            tot = w[rows].sum()
            assert abs(tot - (1.0 if mask[rows].sum() else 0.0)) < 1e-5
        assert np.all(w[mask == 0] == 0)


def test_config_validation():
    with pytest.raises(ValueError, match="dual_clip"):
        L.LossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="recompute_old_logprobs"):
        L.LossConfig(tis_cap=2.0)
    with pytest.raises(ValueError, match="aggregation"):
        L.LossConfig(aggregation="mean")
    with pytest.raises(ValueError, match="lam_cap"):
        L.LossConfig(lam_cap=0.9)
    with pytest.raises(ValueError, match="unknown keys"):
        L.LossConfig.from_config({"clip_lo": 0.1})
    model = type("M", (), {"router_aux_loss_coef": 1e-3, "router_z_loss_coef": 1e-4})
    c = L.LossConfig.from_config({"clip_low": 0.1}, model=model)
    assert (c.clip_low, c.router_aux_coef, c.router_z_coef) == (0.1, 1e-3, 1e-4)


# ---------------------------------------------------------- prepare_batch (with advantages)
def tiny_batch(factors=(1.0, 0.5), recompute_shift=0.0):
    """One row, group 0: passes t0 (f0), t1 (f1), failures t2, t3; group 1: invalid t4 only."""
    S = 12
    traj = np.array([[0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 4, 4]], np.int32)
    seg = np.array([[1, 1, 1, 2, 2, 2, 3, 3, 4, 4, 5, 5]], np.int32)
    mask = np.array([[0, 1, 1, 0, 1, 1, 0, 1, 0, 1, 0, 1]], np.float32)
    pos = np.zeros((1, S), np.int32)
    return Batch(
        tokens_BxS=jnp.zeros((1, S), jnp.int32), segment_ids_BxS=jnp.asarray(seg),
        positions_BxS=jnp.asarray(pos), traj_index_BxS=jnp.asarray(traj),
        loss_mask_BxS=jnp.asarray(mask), old_logprobs_BxS=jnp.full((1, S), -1.0) * mask,
        group_ids_T=jnp.asarray([0, 0, 0, 0, 1], jnp.int32),
        rewards_T=jnp.asarray([1, 1, 0, 0, 0], jnp.float32),
        valid_T=jnp.asarray([True, True, True, True, False]),
        hacked_T=jnp.zeros(5, bool), factors_T=jnp.asarray([*factors, 1, 1, 1], jnp.float32),
        adjustments_T=jnp.zeros(5, jnp.float32), grading_ok_G=jnp.ones(2, bool))


def test_prepare_hand_worked_group():
    # p = 2/4, A = +-0.5; lam = 2 / (1 + 0.5) = 4/3 -> A' = 2/3, 1/3 for passes, -0.5 for failures.
    p = jax.jit(L.prepare_batch, static_argnames=("cfg", "mini_batches"))(
        tiny_batch(), L.LossConfig(aggregation="token-mean"))
    inputs, adv = p.inputs, p.adv
    np.testing.assert_allclose(adv.advantages, [2 / 3, 1 / 3, -0.5, -0.5, 0.0], rtol=1e-6)
    np.testing.assert_allclose(adv.lam[0], 4 / 3, rtol=1e-6)
    want = np.array([[0, 2 / 3, 2 / 3, 0, 1 / 3, 1 / 3, 0, -.5, 0, -.5, 0, 0]])
    np.testing.assert_allclose(inputs.adv_BxS, want, rtol=1e-6, atol=1e-7)
    # The invalid trajectory's generated token is not trained (6 trained tokens, not 7).
    np.testing.assert_allclose(inputs.weight_BxS.sum(), 1.0, rtol=1e-6)
    assert float(inputs.mask_BxS.sum()) == 6.0
    np.testing.assert_array_equal(inputs.tis_weight_BxS, 1.0)


def test_prepare_capped_group():
    # Lone low-quality pass: passes t0 (f=0.2) and t1 (f=0.2): lam = 2/0.4 = 5 > 1.5 -> capped,
    # A' = 1.5*0.2*0.5 = 0.15 each, failures -0.5, re-center by mean (0.3 - 1) / 4 = -0.175.
    adv = L.prepare_batch(tiny_batch(factors=(0.2, 0.2)), L.LossConfig()).adv
    assert bool(adv.capped[0]) and float(adv.lam[0]) == pytest.approx(1.5)
    np.testing.assert_allclose(adv.advantages[:4], [0.325, 0.325, -0.325, -0.325], rtol=1e-5)
    np.testing.assert_allclose(adv.advantages[:4].sum(), 0.0, atol=1e-6)


def test_prepare_tis_weight_and_ratio_denominator():
    b = tiny_batch()
    learner_old = b.old_logprobs_BxS + 1.5 * b.loss_mask_BxS  # exp(1.5) = 4.48 > cap
    learner_old = learner_old.at[0, 4].set(-1.2)                  # exp(-0.2) below cap
    cfg = L.LossConfig(recompute_old_logprobs=True, tis_cap=2.0)
    inputs = L.prepare_batch(b, cfg, learner_old_logprobs_BxS=learner_old).inputs
    m = np.asarray(inputs.mask_BxS)
    np.testing.assert_allclose(inputs.old_logprobs_BxS, np.asarray(learner_old) * m, rtol=1e-6)
    want = np.where(m > 0, 2.0, 1.0)
    want[0, 4] = np.exp(-0.2)
    np.testing.assert_allclose(inputs.tis_weight_BxS, want, rtol=1e-6)
    with pytest.raises(ValueError, match="learner_old_logprobs"):
        L.prepare_batch(b, cfg)
    # The TIS weight multiplies the surrogate (NumPy reference with the same weight).
    rng = np.random.default_rng(0)
    logp = np.asarray(learner_old) + rng.normal(0, 0.1, m.shape).astype(np.float32) * m
    loss, _ = L.pg_loss(jnp.asarray(logp), jnp.zeros_like(logp), inputs, cfg)
    per_tok = np_surrogate(logp, np.asarray(inputs.old_logprobs_BxS), np.asarray(inputs.adv_BxS),
                           cfg, tis=np.asarray(inputs.tis_weight_BxS))
    np.testing.assert_allclose(loss, (per_tok * np.asarray(inputs.weight_BxS)).sum(), rtol=1e-5)


def test_prepare_length_aware_weighs_trajectories_by_their_trained_tokens():
    # tiny_batch with t1 cut to 1 trained token: trained tokens t0 2, t1 1, t2 1, t3 1.
    b = tiny_batch()
    b = b.replace(loss_mask_BxS=b.loss_mask_BxS.at[0, 5].set(0.0))
    prep = jax.jit(L.prepare_batch, static_argnames=("cfg", "mini_batches"))
    # token-mean: W = (2, 1, 1, 1) / 5; lambda = (2 + 1) / (2 x 1 + 1 x 0.5) = 1.2 (not 4/3):
    # A' = 0.6, 0.3, -0.5, -0.5, and sum W A' = sum W A = 0.1.
    p = prep(b, L.LossConfig(aggregation="token-mean", mode="length_aware"))
    np.testing.assert_allclose(p.traj_weights_T, [0.4, 0.2, 0.2, 0.2, 0.0], rtol=1e-6)
    np.testing.assert_allclose(p.adv.advantages, [0.6, 0.3, -0.5, -0.5, 0.0], rtol=1e-6)
    np.testing.assert_allclose(p.adv.token_credit[0], 0.1, rtol=1e-5)
    # The broadcast carries the same advantages; the weights are the loss's own.
    np.testing.assert_allclose(p.inputs.adv_BxS[0, [1, 2, 4, 7, 9]], [0.6, 0.6, 0.3, -0.5, -0.5],
                               rtol=1e-6)
    # seq-mean-token-mean weighs every trajectory alike: sum_preserving's lambda 4/3.
    p = prep(b, L.LossConfig(aggregation="seq-mean-token-mean", mode="length_aware"))
    np.testing.assert_allclose(p.adv.advantages[:4], [2 / 3, 1 / 3, -0.5, -0.5], rtol=1e-6)
    # Other modes compute no weights (their path is unchanged).
    assert prep(b, L.LossConfig(aggregation="token-mean")).traj_weights_T is None

"""Rollout-mismatch correction (rollout_correction.py) against an independent NumPy loop of
verl's rollout_corr_helper, on verl's layout (a sequence a row) and on packed rows."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from support import offpolicy_reference as R

import gagar_jax
from gagar_jax.algo import loss as L


def example(seed=0, B=6, S=9):
    rng = np.random.default_rng(seed)
    lengths = [9, 5, 7, 1, 3, 8]
    mask = np.zeros((B, S))
    for b in range(B):
        mask[b, :lengths[b]] = 1.0
    ro = -np.abs(rng.normal(1.0, 0.7, (B, S)))
    old = ro + rng.normal(0.0, 0.3, (B, S))
    return old, ro, mask


def cfg(**kw):
    return L.LossConfig(recompute_old_logprobs=True, **kw)


def run(old, ro, mask, c, **kw):
    f = jax.jit(functools.partial(gagar_jax.rollout_correction, cfg=c, **kw))
    return jax.device_get(f(*(jnp.asarray(x, jnp.float32) for x in (old, ro, mask))))


@pytest.mark.parametrize("level,cap", [("token", 1.5), ("sequence", 1.5), ("geometric", 1.1)])
def test_is_weights_match_verl_loop(level, cap):
    old, ro, mask = example()
    w, m, met = run(old, ro, mask, cfg(rollout_is=level, rollout_is_threshold=cap))
    want, wm = R.rollout_is_weights(old, ro, mask, level=level, threshold=cap)
    np.testing.assert_allclose(np.where(mask > 0, w, 0), want, rtol=1e-5)
    np.testing.assert_array_equal(m, mask)                 # IS weights never drop tokens
    assert np.all(w[mask == 0] == 1) and want.max() == pytest.approx(cap)
    np.testing.assert_allclose(met.is_weight_mean, wm["rollout_is_mean"], rtol=1e-5)
    if level == "token":   # verl's sequence-level max is over all rows, ours over trained tokens
        np.testing.assert_allclose(met.is_weight_max, wm["rollout_is_max"], rtol=1e-5)


@pytest.mark.parametrize("rs,th", [("token_k1", "0.8_1.25"), ("seq_mean_k1", "0.95_1.05"),
                                   ("seq_sum_k3", 0.05), ("seq_max_k2", 0.02),
                                   ("token_k1,seq_max_k3", "0.7_1.4,0.05"), ("seq_mean_k3", "0.01"),
                                   ("seq_sum_k1", "0.5_1.5")])
def test_rejection_matches_verl_loop(rs, th):
    """verl's rollout_rs options (seq_mean_k1 is the geo-mask), asymmetric k1 band included."""
    old, ro, mask = example(1)
    w, m, met = run(old, ro, mask, cfg(rollout_rs=rs, rollout_rs_threshold=th))
    want, wm = R.rollout_rejection_mask(old, ro, mask, rs, th)
    np.testing.assert_array_equal(m, want)
    assert 0 < want.sum() < mask.sum()
    np.testing.assert_allclose(met.masked_token_frac, wm["rollout_rs_masked_fraction"], rtol=1e-5)
    # every row has trained tokens here, so verl's all-rows fraction is ours
    np.testing.assert_allclose(
        met.masked_traj_frac, wm["rollout_rs_seq_masked_fraction"], rtol=1e-6
    )
    np.testing.assert_array_equal(w, 1.0)


def test_icepop_and_mismatch_metrics():
    old, ro, mask = example(2)
    w, m, met = run(old, ro, mask, cfg(icepop_low=0.8, icepop_high=1.25))
    want_w, kept, wm = R.icepop(old, ro, mask, 0.8, 1.25)
    np.testing.assert_allclose(np.where(mask > 0, w, 0), want_w, rtol=1e-5)
    np.testing.assert_array_equal(m, mask)     # IcePop keeps the denominators: weight 0 only
    np.testing.assert_allclose(met.masked_token_frac, wm["icepop_fraction_masked"], rtol=1e-5)
    off = R.offpolicy_metrics(old, ro, mask)
    np.testing.assert_allclose(met.kl, off["kl"], rtol=1e-5)
    np.testing.assert_allclose(met.k3_kl, off["k3_kl"], rtol=1e-5)
    d = [abs(old[b, t] - ro[b, t]) for b in range(6) for t in range(9) if mask[b, t]]
    np.testing.assert_allclose(met.logp_abs_diff_mean, np.mean(d), rtol=1e-5)
    np.testing.assert_allclose(met.logp_abs_diff_max, np.max(d), rtol=1e-5)


def packed(seed=3, B=4, S=16):
    rng = np.random.default_rng(seed)
    traj = np.zeros((B, S), np.int32)
    mask = np.zeros((B, S))
    for b in range(B):
        cut = int(rng.integers(5, S - 5))
        traj[b, :cut], traj[b, cut:] = 2 * b, 2 * b + 1
        mask[b, 1:cut], mask[b, cut + 1:] = 1.0, 1.0
    ro = -np.abs(rng.normal(1.0, 0.7, (B, S)))
    old = ro + rng.normal(0.0, 0.1, (B, S))
    return traj, old, ro, mask


SEQ_CASES = [dict(rollout_is="sequence", rollout_is_threshold=1.3),
             dict(rollout_is="geometric", rollout_is_threshold=1.02),
             dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.97_1.03")]


@pytest.mark.parametrize("kw", SEQ_CASES, ids=["seq_is", "geo_is", "geo_mask"])
def test_packed_trajectories_and_context_sharding(kw, devices):
    """Sequence-level weights / masks reduce over a whole trajectory of a packed row: equal to
    verl's loop on the unpacked trajectories, and with S split over 2 or 4 chips (context)."""
    traj, old, ro, mask = packed()
    c = cfg(**kw)
    w, m, _ = run(old, ro, mask, c, traj_index_BxS=jnp.asarray(traj), num_trajectories=8)
    u_old, u_ro, u_mask, u_w, u_m = R.unpack(traj, old, ro, mask, w, m)
    if "rollout_is" in kw:
        want, _ = R.rollout_is_weights(u_old, u_ro, u_mask, level=kw["rollout_is"],
                                       threshold=kw["rollout_is_threshold"])
        np.testing.assert_allclose(u_w * u_mask, want, rtol=1e-5)
    else:
        want, _ = R.rollout_rejection_mask(u_old, u_ro, u_mask, kw["rollout_rs"],
                                           kw["rollout_rs_threshold"])
        np.testing.assert_array_equal(u_m, want)
        assert 0 < want.sum() < u_mask.sum()
    f = jax.jit(functools.partial(gagar_jax.rollout_correction, cfg=c, num_trajectories=8))
    for context in (2, 4):
        sh = NamedSharding(Mesh(np.asarray(devices[:context]), ("context",)), P(None, "context"))
        args = [jax.device_put(jnp.asarray(x, jnp.float32), sh) for x in (old, ro, mask)]
        w2, m2, _ = f(*args, traj_index_BxS=jax.device_put(jnp.asarray(traj), sh))
        np.testing.assert_allclose(w2, w, rtol=1e-6)
        np.testing.assert_array_equal(m2, m)


def test_prepare_applies_the_rejection_before_the_denominators():
    """Rejected tokens leave the mask, the advantages and every denominator (as verl's
    response_mask); IS weights multiply the policy term."""
    from test_loss import tiny_batch
    b = tiny_batch()
    learner = b.old_logprobs_BxS + 0.5 * b.loss_mask_BxS
    learner = learner.at[0, 2].set(b.old_logprobs_BxS[0, 2])   # one token with ratio 1
    c = cfg(rollout_rs="token_k1", rollout_rs_threshold="0.9_1.1", aggregation="token-mean")
    p = L.prepare_batch(b, c, learner_old_logprobs_BxS=learner)
    m = np.asarray(p.inputs.mask_BxS)
    assert m.sum() == 1 and m[0, 2] == 1
    np.testing.assert_allclose(p.inputs.weight_BxS.sum(), 1.0, rtol=1e-6)
    assert float(p.rollout.masked_token_frac) == pytest.approx(5 / 6)
    np.testing.assert_array_equal(np.asarray(p.inputs.adv_BxS) * (1 - m), 0.0)

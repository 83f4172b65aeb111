"""The objectives (policy_loss.py) against an independent NumPy loop of verl's definitions."""
import dataclasses
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
from gagar_jax.algo import policy_loss as PL


def example(seed=0, B=6, S=9, spread=0.2):
    rng = np.random.default_rng(seed)
    lengths = [9, 5, 7, 1, 3, 8]
    mask = np.zeros((B, S))
    for b in range(B):
        mask[b, S - lengths[b]:] = 1.0          # masked prompt positions first
    old = -np.abs(rng.normal(1.0, 0.7, (B, S)))
    logp = old + rng.normal(0.0, spread, (B, S))
    adv = np.repeat(rng.normal(0.0, 1.0, (B, 1)), S, axis=1) * mask
    return logp, old, adv, mask


def cfg_for(objective, agg, **kw):
    base = dict(ppo=dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0),
                gspo=dict(clip_low=3e-3, clip_high=4e-3), cispo=dict(clip_low=10.0, clip_high=0.2))
    return L.LossConfig(policy_loss=objective, aggregation=agg, max_response_len=9,
                        **{**base[objective], **kw})


def reference(objective, logp, old, adv, mask, cfg, is_weights=None):
    if objective == "ppo":
        return R.ppo_loss(old, logp, adv, mask, cfg.clip_low, cfg.clip_high, cfg.dual_clip,
                          cfg.aggregation, is_weights=is_weights)
    if objective == "gspo":
        return R.gspo_loss(old, logp, adv, mask, cfg.clip_low, cfg.clip_high, is_weights=is_weights)
    return R.cispo_loss(old, logp, adv, mask, cfg.clip_low, cfg.clip_high, cfg.aggregation,
                        is_weights=is_weights)


CASES = [("ppo", a) for a in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")] + [
    ("gspo", "token-mean"), ("cispo", "token-mean"), ("cispo", "seq-mean-token-mean")]


@pytest.mark.parametrize("objective,agg", CASES)
def test_objective_matches_verl_loop(objective, agg):
    """Value, gradient and clip fraction on rows with masked tokens (GSPO ignores `agg`:
    verl forces seq-mean-token-mean on its policy term)."""
    logp, old, adv, mask = example(spread=0.3)
    cfg = cfg_for(objective, agg)
    rng = np.random.default_rng(1)
    w_is = np.exp(rng.normal(0, 0.1, mask.shape)) * mask
    want, dwant, m = reference(objective, logp, old, adv, mask, cfg, is_weights=w_is)
    f = jax.jit(functools.partial(gagar_jax.policy_loss, cfg=cfg))
    args = [jnp.asarray(x, jnp.float32) for x in (logp, old, adv, mask)]
    (loss, met), grad = jax.value_and_grad(
        lambda lp: f(lp, *args[1:], is_weights=jnp.asarray(w_is, jnp.float32)), has_aux=True
    )(args[0])
    np.testing.assert_allclose(loss, want, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(grad, dwant, rtol=2e-4, atol=1e-6)
    clipfrac = float(met["clip_frac_low"] + met["clip_frac_high"])
    assert float(met["pg_clipfrac"]) == pytest.approx(clipfrac, abs=1e-7)   # verl's name
    # ppo_kl is k1, mean(old - current) over trained tokens, beside our k3 approx_kl
    want_k1 = float(np.sum((old - logp) * mask) / np.sum(mask))
    assert float(met["ppo_kl"]) == pytest.approx(want_k1, rel=1e-5, abs=1e-7)
    assert float(met["ppo_kl"]) == pytest.approx(m["actor/ppo_kl"], rel=1e-5, abs=1e-7)
    if objective != "cispo":
        assert clipfrac == pytest.approx(m["actor/pg_clipfrac"], abs=1e-6)
        assert 0 < clipfrac < 1
    if objective == "ppo":
        assert float(met["dual_clip_frac"]) == pytest.approx(m["actor/pg_clipfrac_lower"], abs=1e-6)


def test_cispo_clipped_tokens_keep_gradient_and_dr_grpo_norm():
    """CISPO: a clipped token still gets -clip(r) A / n; PPO's seq-mean-token-sum-norm is verl's
    m / K divided by the number of sequences (gagar's Dr. GRPO normaliser, see docs/loss.md)."""
    cfg = L.LossConfig(policy_loss="cispo", clip_low=10.0, clip_high=0.2, aggregation="token-mean")
    logp = jnp.log(jnp.array([[2.0, 1.1]]))     # old = 0: ratios 2 (clipped to 1.2) and 1.1
    adv, mask = jnp.ones((1, 2)), jnp.ones((1, 2))
    g = jax.grad(lambda lp: gagar_jax.policy_loss(lp, jnp.zeros((1, 2)), adv, mask, cfg)[0])(logp)
    np.testing.assert_allclose(g, [[-1.2 / 2, -1.1 / 2]], rtol=1e-6)
    logp, old, adv, mask = example()
    cfg = cfg_for("ppo", "seq-mean-token-sum-norm")
    want = R.ppo_loss(old, logp, adv, mask, 0.2, 0.28, 3.0, "seq-mean-token-sum-norm",
                      agg_kwargs=dict(loss_scale_factor=9))[0] / (mask.sum(1) > 0).sum()
    got = gagar_jax.policy_loss(
        *(jnp.asarray(x, jnp.float32) for x in (logp, old, adv, mask)), cfg
    )[0]
    np.testing.assert_allclose(got, want, rtol=2e-5)


def packed(seed=0, B=4, S=12):
    """Two trajectories a row (one prompt token each), some padding; T = 2B."""
    rng = np.random.default_rng(seed)
    traj = np.zeros((B, S), np.int32)
    mask = np.zeros((B, S))
    for b in range(B):
        cut = int(rng.integers(4, S - 4))
        end = int(rng.integers(cut + 3, S + 1))
        traj[b, :cut], traj[b, cut:] = 2 * b, 2 * b + 1
        mask[b, 1:cut] = 1.0
        mask[b, cut + 1:end] = 1.0
    old = -np.abs(rng.normal(1.0, 0.5, (B, S)))
    logp = old + rng.normal(0, 0.01, (B, S))
    adv_T = rng.normal(0, 1, 2 * B)
    return traj, mask, logp, old, adv_T[traj] * mask


@pytest.mark.parametrize("objective,agg", [("gspo", "seq-mean-token-sum-norm"),
                                           ("cispo", "seq-mean-token-mean"),
                                           ("ppo", "token-mean")])
def test_packed_micro_batches_equal_single_shot_and_loop(objective, agg):
    """Packed rows, K = 2 mini-batches of J = 2 micro-batches: summing `pg_loss` over the
    micro-batches equals the single-shot mini-batch loss and gradient, and the per-trajectory
    NumPy loop (verl's layout: one trajectory a row)."""
    traj, mask, logp, old, adv = packed()
    cfg = cfg_for(objective, agg)
    K, J, T = 2, 2, 8
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    w = L.aggregation_weights(f32(mask), jnp.asarray(traj), T, cfg, K)
    pw = L.aggregation_weights(f32(mask), jnp.asarray(traj), T, cfg, K,
                               aggregation=PL.policy_aggregation(cfg))
    inp = L.LossInputs(adv_BxS=f32(adv), mask_BxS=f32(mask), weight_BxS=w,
                       old_logprobs_BxS=f32(old * mask), tis_weight_BxS=jnp.ones_like(w),
                       ref_logprobs_BxS=jnp.zeros_like(w), pg_weight_BxS=pw,
                       traj_index_BxS=jnp.asarray(traj), num_trajectories=T)
    split = lambda x, k=K, j=J: jax.tree.map(lambda a: L.split_rows(a, k, j), x)
    lp = f32(logp)

    def micro_sum(lp_, k):
        lps, ins = split(lp_), split(inp)
        return sum(
            L.pg_loss(
                lps[k, j], jnp.zeros_like(lps[k, j]), jax.tree.map(lambda a, j=j: a[k, j], ins), cfg
            )[0]
            for j in range(J)
        )

    def single(lp_, k):
        lps, ins = split(lp_, K, 1), split(inp, K, 1)
        return L.pg_loss(lps[k, 0], jnp.zeros_like(lps[k, 0]), jax.tree.map(lambda a: a[k, 0], ins),
                         cfg)[0]

    for k in range(K):
        rows = [b for b in range(traj.shape[0]) if b % K == k]
        ut = traj[rows]
        u_lp, u_old, u_adv, u_mask = R.unpack(ut - ut.min(), logp[rows], old[rows], adv[rows],
                                              mask[rows])
        keep = u_mask.sum(1) > 0
        want = reference(objective, u_lp[keep], u_old[keep], u_adv[keep], u_mask[keep], cfg)[0]
        if agg == "seq-mean-token-sum-norm" and objective != "gspo":
            want = want / keep.sum()
        got, g_micro = jax.value_and_grad(micro_sum)(lp, k)
        g_single = jax.grad(single)(lp, k)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
        np.testing.assert_allclose(g_micro, g_single, rtol=1e-5, atol=1e-8)


def test_entropy_bonus_aggregated_like_the_loss():
    traj, mask, logp, old, adv = packed(1)
    cfg = L.LossConfig(aggregation="seq-mean-token-mean", entropy_coef=0.01)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    w = L.aggregation_weights(f32(mask), jnp.asarray(traj), 8, cfg)
    inp = L.LossInputs(adv_BxS=f32(adv), mask_BxS=f32(mask), weight_BxS=w,
                       old_logprobs_BxS=f32(old * mask), tis_weight_BxS=jnp.ones_like(w),
                       ref_logprobs_BxS=jnp.zeros_like(w))
    ent = f32(np.random.default_rng(0).uniform(0.5, 2.0, mask.shape))
    base = L.pg_loss(f32(logp), ent, inp, dataclasses.replace(cfg, entropy_coef=0.0))[0]
    (loss, aux), g = jax.value_and_grad(lambda e: L.pg_loss(f32(logp), e, inp, cfg), has_aux=True)(
        ent
    )
    # Loop: mean over trajectories of each one's mean entropy.
    per = [
        np.mean([ent[b, s] for b in range(4) for s in range(12) if traj[b, s] == t and mask[b, s]])
        for t in range(8)
    ]
    np.testing.assert_allclose(aux.entropy_loss, np.mean(per), rtol=1e-5)
    np.testing.assert_allclose(loss, base - 0.01 * np.mean(per), rtol=1e-5)
    np.testing.assert_allclose(g, -0.01 * np.asarray(w), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("context", [2, 4])
def test_gspo_context_sharded_equals_one_device(context, devices):
    """GSPO's per-trajectory mean reduces over S, which context parallelism splits."""
    traj, mask, logp, old, adv = packed(2, B=4, S=16)
    cfg = cfg_for("gspo", "token-mean")
    args = [jnp.asarray(x, jnp.float32) for x in (logp, old, adv, mask)]
    fn = lambda lp, o, a, m, t: gagar_jax.policy_loss(lp, o, a, m, cfg, traj_index_BxS=t,
                                                      num_trajectories=8)[0]
    want, gwant = jax.jit(jax.value_and_grad(fn))(*args, jnp.asarray(traj))
    mesh = Mesh(np.asarray(devices[:context]), ("context",))
    sh = NamedSharding(mesh, P(None, "context"))
    put = [jax.device_put(x, sh) for x in args + [jnp.asarray(traj)]]
    got, g = jax.jit(jax.value_and_grad(fn))(*put)
    assert g.sharding.spec == P(None, "context") or not g.sharding.is_fully_replicated
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(g, gwant, rtol=1e-6, atol=1e-9)


def test_config_validation():
    L.LossConfig(policy_loss="cispo", clip_low=10.0)            # no lower clip: allowed
    for bad in (dict(policy_loss="grpo"), dict(clip_low=10.0), dict(rollout_is="token"),
                dict(recompute_old_logprobs=True, rollout_is="token", tis_cap=2.0),
                dict(recompute_old_logprobs=True, rollout_rs="seq_mean_k1"),
                dict(recompute_old_logprobs=True, rollout_rs="seq_mean_k3",
                     rollout_rs_threshold="0.1_0.2"),
                dict(recompute_old_logprobs=True, icepop_low=0.5),
                dict(routing_replay="r2"), dict(entropy_coef=-1.0)):
        with pytest.raises(ValueError):
            L.LossConfig(**bad)
    # a rejection threshold without its option would reject nothing, silently
    with pytest.raises(ValueError, match="rollout_rs_threshold='2.0' is set but loss.rollout_rs"):
        L.LossConfig(recompute_old_logprobs=True, rollout_rs_threshold="2.0")


@pytest.mark.parametrize("objective", ["gspo", "cispo"])
def test_cli_trains_with_the_objective(tmp_path, objective):
    """`make train` with `--config.loss.policy_loss=gspo` / `cispo` (two steps, CPU), through the
    CLI's entry point in this process; the end-of-run save only (no checkpoint is checked)."""
    from support import trainer_runs
    clip_low = "10.0" if objective == "cispo" else "0.2"
    summary = trainer_runs.run_in_process(
        tmp_path, f"--config.loss.policy_loss={objective}", f"--config.loss.clip_low={clip_low}",
        "--config.train.steps=2", "--config.train.checkpoint_every=0")
    assert summary["steps"] == 2

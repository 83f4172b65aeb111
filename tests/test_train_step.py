"""The jitted train step: accumulation, sharding, skipping, debug checks, learning direction.

One shape everywhere (B=8, S=32, T=16, G=4) and module-scoped compiled steps keep the compile
count low on 2 shared cores.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.close import assert_rel_close
from support.paths import load_tiny_config

from gagar_jax import sharding as shd
from gagar_jax.algo import loss as L
from gagar_jax.algo.advantage import gagar_advantages
from gagar_jax.batch import Batch
from gagar_jax.model.logprobs import token_logprobs
from gagar_jax.run import step as TS
from gagar_jax.run.optim import OptimConfig, decay_mask, make_schedule
from gagar_jax.sharding import make_mesh

B, S, T, G = 8, 32, 16, 4
# Group layout: 4 trajectories per group, 2 per row, so every group spans two rows and thus
# straddles the two mini-batches (rows b % 2) and the micro-batches.
REWARDS = [1, 1, 0, 0,   1, 0, 0, 0,   1, 1, 1, 0,   1, 1, 0, 0]
FACTORS = [1.0, 0.4, 1, 1,   0.9, 1, 1, 1,   1.0, 0.85, 0.4, 1,   0.2, 0.2, 1, 1]  # group 3 capped


def tiny_cfg(**over):
    c = load_tiny_config()
    base = TS.StepConfig.from_config(c)
    loss = dataclasses.replace(base.loss, router_aux_coef=0.0, router_z_coef=0.0,
                               aggregation="seq-mean-token-sum-norm", max_response_len=S)
    # eps=1e-5 keeps the first Adam update continuous in tiny gradients (sharded vs single).
    optim = OptimConfig(learning_rate=1e-2, eps=1e-5, weight_decay=0.0, grad_clip_norm=1.0)
    cfg = dataclasses.replace(base, loss=loss, optim=optim, epochs=1, mini_batches=2,
                              micro_batches=2, debug_checks=False)
    for k, v in over.items():
        cfg = dataclasses.replace(cfg, **{k: v})
    return cfg


def make_batch(rewards=REWARDS, factors=FACTORS, seed=0, old_logprobs=None) -> Batch:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 256, (B, S)).astype(np.int32)
    seg = np.zeros((B, S), np.int32)
    pos = np.zeros((B, S), np.int32)
    traj = np.zeros((B, S), np.int32)
    mask = np.zeros((B, S), np.float32)
    for t in range(T):
        b, half = divmod(t, 2)
        n = int(rng.integers(10, 17))       # segment length, prompt of 4 tokens
        lo = half * 16
        seg[b, lo:lo + n] = half + 1
        pos[b, lo:lo + n] = np.arange(n)
        traj[b, lo:lo + n] = t
        mask[b, lo + 4:lo + n] = 1.0
    old = np.zeros((B, S), np.float32) if old_logprobs is None else np.asarray(old_logprobs)
    return Batch(
        tokens_BxS=jnp.asarray(tokens), segment_ids_BxS=jnp.asarray(seg),
        positions_BxS=jnp.asarray(pos), traj_index_BxS=jnp.asarray(traj),
        loss_mask_BxS=jnp.asarray(mask), old_logprobs_BxS=jnp.asarray(old * mask),
        group_ids_T=jnp.asarray(np.arange(T) // 4, jnp.int32),
        rewards_T=jnp.asarray(rewards, jnp.float32), valid_T=jnp.ones(T, bool),
        hacked_T=jnp.zeros(T, bool), factors_T=jnp.asarray(factors, jnp.float32),
        adjustments_T=jnp.zeros(T, jnp.float32), grading_ok_G=jnp.ones(G, bool))


# ---------------------------------------------------------------- module-scoped set-up
@pytest.fixture(scope="module")
def cfg():
    return tiny_cfg()


@pytest.fixture(scope="module")
def mesh1(devices):
    return make_mesh(type("M", (), dict(data=1, fsdp=1, expert=1, tensor=1)), devices[:1])


@pytest.fixture(scope="module")
def init(cfg, mesh1):
    state, graphdef, shardings = TS.init_train_state(cfg, mesh1, jax.random.key(0))
    host = jax.device_get(state)
    # Keep the key as plain data: a device key could alias into (and die with) a donated state.
    return host.replace(rng=np.asarray(jax.random.key_data(host.rng))), graphdef, shardings


@pytest.fixture(scope="module")
def forward(init):
    """Jitted per-token log-probs of the whole batch (for on-policy old_logprobs and probes)."""
    _, graphdef, _ = init
    def logprobs(params, bias, batch):
        model = nnx.merge(graphdef, params, bias)
        return token_logprobs(model, batch.tokens_BxS, batch.segment_ids_BxS, batch.positions_BxS,
                              batch.routed_experts_BxSxLxK)[0]
    return jax.jit(logprobs)


@pytest.fixture(scope="module")
def batch(init, forward):
    host, _, _ = init
    lp = forward(host.params, host.router_bias, make_batch())
    return make_batch(old_logprobs=lp)


@pytest.fixture(scope="module")
def step1(cfg, mesh1, init, batch):
    _, graphdef, shardings = init
    return TS.make_train_step(cfg, mesh1, shardings, shd.batch_shardings(batch, mesh1), graphdef)


def fresh(host_state, shardings):
    """A new device copy of the host state (the step donates its state)."""
    state = host_state.replace(rng=jax.random.wrap_key_data(host_state.rng))
    return jax.device_put(state, shardings, may_alias=False)


@pytest.fixture(scope="module")
def ref_out(step1, init, batch):
    host, _, shardings = init
    new, metrics = step1(fresh(host, shardings), batch)
    return jax.device_get(new), jax.device_get(metrics)


# ---------------------------------------------------------------- optimizer
def test_schedule_and_decay_mask(init):
    cfg = OptimConfig(learning_rate=1.0, warmup_steps=4, schedule="cosine", decay_steps=14,
                      min_lr_ratio=0.1)
    sched = make_schedule(cfg)
    # The warm-up starts at step 1's value, (c + 1) / W: the first update is never at lr 0.
    np.testing.assert_allclose([sched(i) for i in (0, 1, 3, 4)], [0.25, 0.5, 1.0, 1.0],
                               atol=1e-6)
    # halfway through the cosine: 0.1 + 0.9 * (1 + cos(pi / 2)) / 2 = 0.55; the end: 0.1
    np.testing.assert_allclose([sched(9), sched(14), sched(100)], [0.55, 0.1, 0.1], atol=1e-6)
    const = make_schedule(OptimConfig(learning_rate=2.0, warmup_steps=2, schedule="constant"))
    np.testing.assert_allclose([const(0), const(1), const(2), const(50)], [1.0, 2.0, 2.0, 2.0],
                               atol=1e-6)
    one = make_schedule(OptimConfig(learning_rate=2.0, warmup_steps=1, schedule="constant"))
    assert float(one(0)) == 2.0
    with pytest.raises(ValueError, match="decay_steps"):
        OptimConfig(schedule="cosine", warmup_steps=10, decay_steps=5)
    host, _, _ = init
    flat = {"/".join(str(getattr(k, "key", k)) for k in p): m
            for p, m in jax.tree_util.tree_leaves_with_path(decay_mask(host.params))}
    assert any(m for n, m in flat.items() if "expert" in n or "wq" in n)
    norms = [m for n, m in flat.items() if "norm" in n or "scale" in n]
    assert norms and not any(norms)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(host.params))


# ---------------------------------------------------------------- the single-device step
def test_step_metrics_and_state(cfg, ref_out, batch, init):
    host, _, _ = init
    new, m = ref_out
    assert int(new.step) == 1 and int(new.updates) == 2 and int(new.skipped) == 0
    assert float(m.updates) == 2 and float(m.skipped) == 0
    adv = gagar_advantages(batch.rewards_T, batch.group_ids_T, batch.factors_T, batch.valid_T,
                           batch.hacked_T, batch.grading_ok_G, num_groups=G)
    np.testing.assert_allclose(m.audit.advantages_T, adv.advantages, rtol=1e-6)
    np.testing.assert_array_equal(m.audit.capped_G, [False, False, False, True])
    assert float(m.capped_groups) == 1 and float(m.mixed_groups) == 4 and float(m.groups) == 4
    assert float(m.lam_max) == pytest.approx(1.5)
    np.testing.assert_allclose(m.lam_mean, np.mean(np.asarray(adv.lam)), rtol=1e-6)
    assert float(m.tokens) == float(np.asarray(batch.loss_mask_BxS).sum())
    assert float(m.trajectories) == T
    np.testing.assert_allclose(m.mean_response_len, float(m.tokens) / T, rtol=1e-6)
    # On-policy old log-probs: the first update starts at ratio 1, so nothing is clipped there.
    assert 0.0 <= float(m.clip_frac_high) < 0.5 and float(m.entropy) > 0.0
    assert np.isfinite(m.loss) and float(m.grad_norm) > 0
    np.testing.assert_allclose(m.learning_rate, 1e-2)
    np.testing.assert_allclose(
        m.pos_credit_before, np.asarray(adv.pos_credit_before).sum(), rtol=1e-6
    )
    np.testing.assert_allclose(m.expert_load_LxE.sum(-1), 1.0, rtol=1e-5)
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), new.params, host.params)
    assert all(jax.tree.leaves(changed)[:3])


def test_no_recompile_across_steps(step1, init, batch, ref_out):
    host, _, shardings = init
    state = fresh(host, shardings)
    for seed in (1, 2):
        b = make_batch(seed=seed, old_logprobs=batch.old_logprobs_BxS)
        state, _ = step1(state, b)
    assert int(state.step) == 2
    assert step1.jitted._cache_size() == 1


def test_nonfinite_skips_update(step1, init, batch):
    host, _, shardings = init
    # A NaN in row 1 poisons mini-batch 1 only (rows b % 2): that update is skipped.
    bad1 = batch.replace(old_logprobs_BxS=batch.old_logprobs_BxS.at[1, 5].set(jnp.nan))
    new, m = jax.device_get(step1(fresh(host, shardings), bad1))
    assert (int(new.step), int(new.updates), int(new.skipped)) == (1, 1, 1)
    assert float(m.skipped) == 1 and float(m.updates) == 1
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(new.params))
    # NaNs in both mini-batches: nothing is applied, state unchanged but the counters.
    bad2 = bad1.replace(old_logprobs_BxS=bad1.old_logprobs_BxS.at[0, 5].set(jnp.nan))
    new, m = jax.device_get(step1(fresh(host, shardings), bad2))
    assert (int(new.step), int(new.updates), int(new.skipped)) == (1, 0, 2)
    assert float(m.skipped) == 2 and not np.isfinite(m.loss)
    jax.tree.map(np.testing.assert_array_equal, new.params, host.params)
    jax.tree.map(np.testing.assert_array_equal, new.opt_state, host.opt_state)


def test_uniform_batch_gives_zero_policy_gradient(step1, init, batch):
    host, _, shardings = init
    uniform = batch.replace(
        rewards_T=jnp.asarray([1] * 4 + [0] * 4 + [1] * 4 + [0] * 4, jnp.float32)
    )
    new, m = step1(fresh(host, shardings), uniform)
    assert float(m.mixed_groups) == 0 and float(m.grad_norm) == 0.0 and float(m.pg_loss) == 0.0
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(new).params, host.params)


def test_bad_batch_split_is_a_clear_error(cfg, init):
    _, graphdef, _ = init
    small = jax.tree.map(lambda x: x[:6] if x.ndim == 2 and x.shape[0] == B else x, make_batch())
    with pytest.raises(ValueError, match="mini_batches \\* train.micro_batches"):
        jax.eval_shape(functools.partial(TS.train_step, graphdef=graphdef,
                                         cfg=dataclasses.replace(cfg, micro_batches=4)),
                       init[0], small)


# ---------------------------------------------------------------- sharding and accumulation
# Each mesh also uses a different number of micro-batches than the single-device reference
# (J=2): the accumulated gradient must equal it whatever J is (J=1 is the single-shot gradient).
# A 5-entry shape adds the context axis: rows split along S (context parallelism, 8 tokens a chip).
@pytest.mark.parametrize("shape,micro", [((8, 1, 1, 1), 1), ((2, 1, 4, 1), 4), ((1, 2, 2, 2), 2),
                                         ((1, 2, 1, 4, 1), 2)])
def test_sharded_accumulated_step_matches_single_device(shape, micro, cfg, init, batch, ref_out,
                                                        devices):
    host, graphdef, _ = init
    c = dataclasses.replace(cfg, micro_batches=micro)
    names = ("data", "fsdp", "expert", "tensor") if len(shape) == 4 else shd.MESH_AXES
    mesh = make_mesh(type("M", (), dict(zip(names, shape, strict=False))), devices)
    if len(shape) == 5:  # sequence-split rows, with every layer rematerialized
        c = dataclasses.replace(c, model=dataclasses.replace(c.model, remat="full"))
        graphdef = TS.abstract_train_state(c, mesh)[1]
    if shape == (1, 2, 2, 2):  # born sharded: eval_shape -> shardings -> jit(init)
        state, _, shardings = TS.init_train_state(c, mesh, jax.random.key(0))
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), host.params)
    else:
        shardings = TS.state_shardings(fresh(host, None), mesh, c)
        state = fresh(host, shardings)
    bsh = shd.batch_shardings(batch, mesh)
    step = TS.make_train_step(c, mesh, shardings, bsh, graphdef)
    new, m = step(state, jax.device_put(batch, bsh))
    gate = [
        x for p, x in jax.tree_util.tree_leaves_with_path(new.params) if "expert_gate" in str(p)
    ][0]
    if len(shape) == 5:  # the rows really are split along S, the parameters over fsdp x context
        assert bsh.tokens_BxS.spec[1] == "context"
        assert "context" in str(gate.sharding.spec)
    if shape[2] > 1:  # experts really are split over the expert axis
        assert "expert" in str(gate.sharding.spec) and not gate.sharding.is_fully_replicated
    ref_state, ref_m = ref_out
    new, m = jax.device_get((new, m))
    for name in ("loss", "pg_loss", "grad_norm", "entropy", "approx_kl", "clip_frac_high"):
        np.testing.assert_allclose(getattr(m, name), getattr(ref_m, name), rtol=2e-4, atol=1e-6,
                                   err_msg=name)
    # Adam normalises each element, so an entry's own rounding (not the gradient's norm-relative
    # error) reaches its update; at lr 1e-2 the updates are a large part of these tiny params.
    # 1e-4 covers any codegen (measured: 1.03e-5 at -O1); a wrong accumulation is off by 1e-2.
    assert_rel_close(new.params, ref_state.params, rtol=1e-4)


# ---------------------------------------------------------------- debug checks
def test_debug_checks_and_optional_paths(cfg, init, batch, mesh1, monkeypatch):
    """One compiled step with debug checks on, and the optional paths: recomputed old log-probs
    with a truncated IS weight, a KL reference, routing replay, and the sigmoid_bias router's
    bias update."""
    host, graphdef, shardings = init
    real = L.advantages_of

    def broken(outcomes, **kwargs):
        # Trajectory 2 fails, so its factor is never read by the real function: use it to
        # perturb trajectory 0's advantage at run time (0 while the factor is 1; one compile).
        out = real(outcomes, **kwargs)
        eps = outcomes.factors_T[2] - 1.0
        return out.replace(advantages=out.advantages.at[0].add(eps),
                           redistributed_advantages=out.redistributed_advantages.at[0].add(eps))

    monkeypatch.setattr(L, "advantages_of", broken)
    loss = dataclasses.replace(cfg.loss, recompute_old_logprobs=True, tis_cap=2.0, kl_coef=0.1)
    dcfg = dataclasses.replace(cfg, debug_checks=True, loss=loss, mini_batches=1,
                               model=dataclasses.replace(cfg.model, router="sigmoid_bias"))
    host = host.replace(ref_params=host.params, ref_router_bias=host.router_bias)
    shardings = shardings.replace(ref_params=shardings.params,
                                  ref_router_bias=shardings.router_bias)
    # Behavior log-probs 0.5 above the learner's: the TIS weight is exp(-0.5) on every token.
    # Routing replay: every token was routed to experts (0, 1) on every MoE layer.
    L_moe, K = dcfg.model.num_moe_layers, dcfg.model.top_k
    routed = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, S, L_moe, K))
    off = batch.replace(old_logprobs_BxS=batch.old_logprobs_BxS + 0.5 * batch.loss_mask_BxS,
                        routed_experts_BxSxLxK=routed)
    step = TS.make_train_step(dcfg, mesh1, shardings, shd.batch_shardings(off, mesh1), graphdef)
    new, m = jax.device_get(step(fresh(host, shardings), off))   # intact advantages pass
    assert int(new.step) == 1 and float(m.skipped) == 0 and np.isfinite(m.loss)
    # One update: its ratio is exactly 1 against the learner's own log-probs (against the shifted
    # behavior ones it would be exp(-0.5) < 1 - clip_low and clip), and the reference is the
    # current policy, so the KL term and the approx KL are 0 (up to float reassociation).
    assert float(m.clip_frac_low) == 0.0 and float(m.clip_frac_high) == 0.0
    assert abs(float(m.kl_loss)) < 1e-6 and abs(float(m.approx_kl)) < 1e-6 and float(m.updates) == 1
    # Aux-loss-free balancing from the step's load: bias = rate * sign(mean load - load).
    (bias_LxE,) = jax.tree.leaves(new.router_bias)
    load = np.asarray(m.expert_load_LxE)
    rate = dcfg.model.router_bias_update_rate
    np.testing.assert_allclose(bias_LxE, rate * np.sign(load.mean(-1, keepdims=True) - load))
    # The replayed routing reached the model: experts 0 and 1 took all the load.
    E = dcfg.model.num_experts
    np.testing.assert_allclose(load, np.tile([0.5, 0.5] + [0.0] * (E - 2), (L_moe, 1)), atol=1e-6)
    np.testing.assert_allclose(bias_LxE[:, :2], -rate)
    np.testing.assert_allclose(bias_LxE[:, 2:], rate)
    with pytest.raises(Exception, match="INV-1"):       # +0.1 on one pass breaks the zero mean
        step(fresh(host, shardings), off.replace(factors_T=off.factors_T.at[2].set(1.1)))
    with pytest.raises(Exception, match="input contract"):
        step(fresh(host, shardings), off.replace(rewards_T=off.rewards_T.at[0].set(0.5)))


# ---------------------------------------------------------------- learning direction
def _train_gaps(step, init, forward, steps=4):
    host, graphdef, shardings = init
    b0 = make_batch()
    traj = np.asarray(b0.traj_index_BxS)
    mask = np.asarray(b0.loss_mask_BxS)

    def mean_lp(state):
        lp = np.asarray(forward(state.params, state.router_bias, b0))
        return np.array([lp[(traj == t) & (mask > 0)].mean() for t in range(T)])

    state = fresh(host, shardings)
    before = mean_lp(state)
    for _ in range(steps):  # on-policy: the behavior log-probs are the current policy's
        b = make_batch(old_logprobs=forward(state.params, state.router_bias, b0))
        state, m = step(state, b)
        adv = np.asarray(m.audit.advantages_T)
    return mean_lp(state) - before, adv


def test_training_moves_logprobs_by_advantage(cfg, init, forward, mesh1, step1, batch):
    host, graphdef, shardings = init
    assert cfg.loss.mode == "sum_preserving"
    binary = dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, mode="binary"))
    step_bin = TS.make_train_step(
        binary, mesh1, shardings, shd.batch_shardings(batch, mesh1), graphdef
    )
    d_sp, adv_sp = _train_gaps(step1, init, forward)
    d_bin, adv_bin = _train_gaps(step_bin, init, forward)
    for d, adv in ((d_sp, adv_sp), (d_bin, adv_bin)):
        assert d[adv > 0].mean() > d[adv < 0].mean() + 0.05
    # Group 0: passes t0 (f=1.0) and t1 (f=0.4). Binary gives both 0.5; sum-preserving gives
    # 0.71 and 0.29, so t0 gains clearly more than t1 only under sum_preserving.
    assert adv_bin[0] == adv_bin[1] and adv_sp[0] > 2 * adv_sp[1]
    assert (d_sp[0] - d_sp[1]) > (d_bin[0] - d_bin[1]) + 0.02


# ---------------------------------------------------------------- KL reference
def test_kl_reference_routes_with_its_own_frozen_bias(cfg, init, batch, mesh1):
    """The reference's log-probs use `ref_router_bias`, never the live bias: with reference
    params equal to the live ones, the KL term is ~0 when both biases agree and clearly > 0 when
    only the live bias moved (balancing re-routed the live policy, not the frozen reference)."""
    host, _, _ = init
    loss = dataclasses.replace(cfg.loss, kl_coef=0.1)
    kcfg = dataclasses.replace(cfg, loss=loss, mini_batches=1,   # one update: KL at its params
                               model=dataclasses.replace(cfg.model, router="sigmoid_bias"))
    abstract, graphdef = TS.abstract_train_state(kcfg, mesh1)    # no compile: shapes only
    assert abstract.ref_router_bias is not None
    shardings = TS.state_shardings(abstract, mesh1, kcfg)
    step = TS.make_train_step(kcfg, mesh1, shardings, shd.batch_shardings(batch, mesh1), graphdef)
    frozen = jax.tree.map(np.zeros_like, host.router_bias)
    # The live bias moved far: experts 4..7 now win every token's selection.
    E = kcfg.model.num_experts
    moved = jax.tree.map(lambda b: np.broadcast_to(np.where(np.arange(E) >= E // 2, 2.0, -2.0),
                                                   b.shape).astype(b.dtype), frozen)
    base = host.replace(ref_params=host.params, ref_router_bias=frozen, router_bias=moved)

    def kl(state):
        new, m = jax.device_get(step(fresh(state, shardings), batch))
        # The reference is frozen: the step never writes it.
        jax.tree.map(np.testing.assert_array_equal, new.ref_router_bias, state.ref_router_bias)
        return float(m.kl_loss)

    same = kl(base.replace(ref_router_bias=moved))
    differ = kl(base)
    assert abs(same) < 1e-6
    assert differ > 1e-3, differ


# ---------------------------------------------------------------- objectives, correction, R2
def offpolicy_case(cfg, batch, objective, mini_batches):
    """A debug-checked config with sequence IS, the geo-mask, an entropy bonus and R2, and a
    batch whose behavior log-probs are off the learner's, routed to experts (0, 1) by the feed."""
    clips = dict(gspo=(3e-4, 4e-4), cispo=(10.0, 0.2))[objective]
    loss = dataclasses.replace(
        cfg.loss, policy_loss=objective, clip_low=clips[0], clip_high=clips[1],
        recompute_old_logprobs=True, rollout_is="sequence", rollout_rs="seq_mean_k1",
        rollout_rs_threshold="0.985_1.015", entropy_coef=0.01, routing_replay="r2")
    dcfg = dataclasses.replace(cfg, debug_checks=True, loss=loss, mini_batches=mini_batches)
    L_moe, K = dcfg.model.num_moe_layers, dcfg.model.top_k
    shift = np.random.default_rng(0).normal(0, 0.05, (B, S)).astype(np.float32)
    off = batch.replace(old_logprobs_BxS=batch.old_logprobs_BxS + shift * batch.loss_mask_BxS,
                        routed_experts_BxSxLxK=jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32),
                                                                (B, S, L_moe, K)))
    return dcfg, off, shift


@pytest.fixture(scope="module")
def gspo_step(cfg, init, batch, mesh1):
    """GSPO, two mini-batches, one device: (config, batch, step, host result)."""
    host, graphdef, shardings = init
    dcfg, off, shift = offpolicy_case(cfg, batch, "gspo", mini_batches=2)
    step = TS.make_train_step(dcfg, mesh1, shardings, shd.batch_shardings(off, mesh1), graphdef)
    return dcfg, off, shift, step, jax.device_get(step(fresh(host, shardings), off))


def _check_offpolicy_step(m, shift, batch, updates):
    assert float(m.updates) == updates and float(m.skipped) == 0 and np.isfinite(m.loss)
    trained = np.asarray(batch.loss_mask_BxS) > 0
    np.testing.assert_allclose(m.rollout.logp_abs_diff_max, np.abs(shift[trained]).max(), rtol=1e-4)
    assert 0 < float(m.rollout.masked_token_frac) < 1 and float(m.rollout.is_weight_max) > 0
    assert float(m.entropy_loss) > 0
    assert not np.all(np.asarray(m.expert_load_LxE)[:, 2:] == 0)    # the feed's (0, 1) ignored


def test_gspo_with_correction_and_r2_keeps_the_checks(gspo_step, init, batch):
    """The debug-checked GSPO step (conservation identities hold), R2 winning over the feed's
    routed_experts, and the rollout metrics; a broken input contract still raises."""
    host, _, shardings = init
    dcfg, off, shift, step, (new, m) = gspo_step
    _check_offpolicy_step(m, shift, batch, updates=2)
    assert float(m.clip_frac_low + m.clip_frac_high) > 0       # the second update clips
    with pytest.raises(Exception, match="input contract"):     # the checks really run
        step(fresh(host, shardings), off.replace(rewards_T=off.rewards_T.at[0].set(0.5)))


def test_cispo_first_update_ratio_is_one_under_r2(cfg, init, batch, mesh1):
    """CISPO in one update: under R2 its ratio is 1 (no clipping, approx KL 0)."""
    host, graphdef, shardings = init
    dcfg, off, shift = offpolicy_case(cfg, batch, "cispo", mini_batches=1)
    step = TS.make_train_step(dcfg, mesh1, shardings, shd.batch_shardings(off, mesh1), graphdef)
    new, m = jax.device_get(step(fresh(host, shardings), off))
    _check_offpolicy_step(m, shift, batch, updates=1)
    assert float(m.clip_frac_low) == 0 and float(m.clip_frac_high) == 0
    assert abs(float(m.approx_kl)) < 1e-9


@pytest.mark.parametrize("expert", [1, 4])
def test_r2_replays_recorded_routing(expert, cfg, init, batch, devices):
    """R2: the updates replay the ids the pre-update pass chose. With unchanged parameters the
    ratio is 1 (|r - 1| <= 1e-5) and the ids identical, with and without an expert mesh; with
    perturbed router weights free routing flips experts, the replayed routing does not."""
    host, _, _ = init
    c = dataclasses.replace(cfg, mini_batches=1, micro_batches=1, loss=dataclasses.replace(
        cfg.loss, recompute_old_logprobs=True, routing_replay="r2"))
    mesh = make_mesh(type("M", (), dict(data=1, fsdp=1, expert=expert, tensor=1)), devices[:expert])
    abstract, graphdef = TS.abstract_train_state(c, mesh)
    shardings = TS.state_shardings(abstract, mesh, c)
    tok = jax.tree.map(lambda x: L.split_rows(x, 1, 1), TS.TokenInputs.from_batch(batch))

    @jax.jit
    def probe(params, rec_params, bias):
        old, tok_r = TS.replay_inputs(graphdef, rec_params, bias, tok, c)
        t0 = jax.tree.map(lambda x: x[0, 0], tok_r)
        run = lambda routed: token_logprobs(nnx.merge(graphdef, params, bias), t0.tokens_BxS,
                                            t0.segment_ids_BxS, t0.positions_BxS, routed)
        lp, _, aux = run(t0.routed_experts_BxSxLxK)
        free = run(None)[2].routed_experts_BxSxLxK
        return old, lp, t0.routed_experts_BxSxLxK, aux.routed_experts_BxSxLxK, free

    state = fresh(host, shardings)
    noisy = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.3 * jax.random.normal(jax.random.key(1), x.shape, x.dtype)
        if "router" in str(p) else x, state.params)
    trained = np.asarray(batch.loss_mask_BxS) > 0
    with jax.set_mesh(mesh):
        old, lp, rec, used, free = jax.device_get(
            probe(state.params, state.params, state.router_bias)
        )
        np.testing.assert_array_equal(used, rec)
        assert np.abs(np.exp(lp - old) - 1)[trained].max() <= 1e-5
        _, lp2, rec2, used2, free2 = jax.device_get(probe(noisy, state.params, state.router_bias))
    np.testing.assert_array_equal(rec2, rec)
    np.testing.assert_array_equal(used2, rec)                 # replay holds the routing
    assert np.mean(free2 != rec) > 0.05                       # without replay it flips


def test_sequence_level_options_under_context_parallelism(gspo_step, init, devices):
    """GSPO's sequence ratio, sequence IS and the geo-mask reduce over whole trajectories, which
    context parallelism splits across chips: context 4 (8 tokens a chip, every trajectory split)
    gives the one-device step (the pure functions are checked at context 2 and 4 too, in
    test_policy_loss.py and test_rollout_correction.py)."""
    host, _, _ = init
    dcfg, off, _, _, (ref_state, ref_m) = gspo_step
    # chexify's checks do not trace inside the context attention's shard_map: checks off here.
    dcfg = dataclasses.replace(dcfg, debug_checks=False)
    mesh = make_mesh(
        type("M", (), dict(zip(shd.MESH_AXES, (1, 1, 1, 4, 1), strict=True))), devices[:4]
    )
    graphdef = TS.abstract_train_state(dcfg, mesh)[1]
    shardings = TS.state_shardings(fresh(host, None), mesh, dcfg)
    bsh = shd.batch_shardings(off, mesh)
    assert bsh.tokens_BxS.spec[1] == "context"
    step = TS.make_train_step(dcfg, mesh, shardings, bsh, graphdef)
    new, m = jax.device_get(step(fresh(host, shardings), jax.device_put(off, bsh)))
    for name in ("loss", "pg_loss", "grad_norm", "clip_frac_low", "clip_frac_high", "entropy_loss"):
        np.testing.assert_allclose(getattr(m, name), getattr(ref_m, name), rtol=2e-4,
                                   atol=1e-6, err_msg=name)
    for name in ("masked_token_frac", "masked_traj_frac", "is_weight_mean", "k3_kl"):
        np.testing.assert_allclose(getattr(m.rollout, name), getattr(ref_m.rollout, name),
                                   rtol=1e-5, err_msg=name)
    assert_rel_close(new.params, ref_state.params, rtol=1e-4)

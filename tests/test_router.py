"""Router: selection, gate weights, replay, balancing statistics and the bias update."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gagar_jax import sharding
from gagar_jax.model import router

T, E, K = 64, 8, 2


@pytest.fixture(scope="module")
def logits():
    return jnp.asarray(np.random.default_rng(1).normal(size=(T, E)) * 2, jnp.float32)


@pytest.fixture(scope="module")
def mask():
    m = np.ones(T, np.float32)
    m[-10:] = 0.0  # padding tail
    m[3] = 0.0
    return jnp.asarray(m)


def _np_softmax(z):
    z = np.asarray(z, np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


_ROUTE = jax.jit(router.route, static_argnames=("top_k", "router", "norm_topk_prob"))


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_topk_matches_numpy(logits, norm):
    out = _ROUTE(logits, top_k=K, norm_topk_prob=norm)
    p = _np_softmax(logits)
    idx = np.argsort(-p, axis=1, kind="stable")[:, :K]
    w = np.take_along_axis(p, idx, 1)
    if norm:
        w = w / w.sum(1, keepdims=True)
    np.testing.assert_array_equal(out.idx_TxK, idx)
    np.testing.assert_allclose(out.weights_TxK, w, rtol=1e-6, atol=1e-7)
    assert out.idx_TxK.dtype == jnp.int32 and out.weights_TxK.dtype == jnp.float32
    eager = router.route(logits, top_k=K, norm_topk_prob=norm)  # jit and no-jit agree
    np.testing.assert_array_equal(eager.idx_TxK, out.idx_TxK)
    np.testing.assert_allclose(eager.weights_TxK, out.weights_TxK, rtol=1e-6)


def test_sigmoid_bias_changes_selection_not_weights(logits):
    bias = jnp.zeros(E).at[5].set(10.0)  # forces expert 5 into every token's top-k
    out = _ROUTE(logits, top_k=K, router="sigmoid_bias", bias_E=bias)
    s = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
    idx = np.argsort(-(s + np.asarray(bias)), axis=1, kind="stable")[:, :K]
    np.testing.assert_array_equal(out.idx_TxK, idx)
    assert np.all(np.any(np.asarray(out.idx_TxK) == 5, axis=1))
    w = np.take_along_axis(s, idx, 1)  # unbiased scores, normalized
    np.testing.assert_allclose(out.weights_TxK, w / w.sum(1, keepdims=True), rtol=1e-6)
    # The bias is not trainable: no gradient reaches it.
    gb = jax.grad(lambda b: jnp.sum(router.route(logits, top_k=K, router="sigmoid_bias",
                                                 bias_E=b).weights_TxK ** 2))(bias)
    assert float(jnp.max(jnp.abs(gb))) == 0.0


def test_aux_z_loss_and_load_match_numpy_excluding_padding(logits, mask):
    out = _ROUTE(logits, top_k=K, token_mask_T=mask)
    p, m = _np_softmax(logits), np.asarray(mask, bool)
    idx = np.argsort(-p, axis=1, kind="stable")[:, :K]
    counts = np.zeros(E)
    for t in np.nonzero(m)[0]:
        for k in range(K):
            counts[idx[t, k]] += 1
    n = m.sum()
    aux = E * np.sum(counts / n * p[m].mean(0))
    z = np.mean(np.log(np.exp(np.asarray(logits, np.float64)).sum(1))[m] ** 2)
    np.testing.assert_allclose(out.counts_E, counts)
    np.testing.assert_allclose(out.load_E, counts / counts.sum(), rtol=1e-6)
    np.testing.assert_allclose(out.aux_loss, aux, rtol=1e-5)
    np.testing.assert_allclose(out.z_loss, z, rtol=1e-5)
    # Padding rows are inert: changing their logits changes nothing.
    wild = jnp.where(mask[:, None] > 0, logits, 50.0 * jnp.arange(E, dtype=jnp.float32))
    out2 = _ROUTE(wild, top_k=K, token_mask_T=mask)
    for f in ("counts_E", "aux_loss", "z_loss"):
        np.testing.assert_allclose(getattr(out2, f), getattr(out, f), rtol=1e-6)


def test_aux_loss_is_top_k_for_a_balanced_router():
    # Uniform probabilities and perfectly even assignments give exactly K (HF convention).
    idx = jnp.asarray(np.arange(T * K).reshape(T, K) % E, jnp.int32)
    aux = router.load_balancing_loss(jnp.full((T, E), 1.0 / E), idx, jnp.ones(T))
    np.testing.assert_allclose(aux, K, rtol=1e-6)


def test_statistics_are_global_under_sharding(logits, mask):
    mesh = sharding.make_mesh(types.SimpleNamespace(data=8, fsdp=1, expert=1, tensor=1))
    tok = NamedSharding(mesh, P(("data", "fsdp", "expert")))
    want = _ROUTE(logits, top_k=K, token_mask_T=mask)
    with jax.set_mesh(mesh):
        got = _ROUTE(jax.device_put(logits, tok), top_k=K, token_mask_T=jax.device_put(mask, tok))
    for f in ("counts_E", "aux_loss", "z_loss"):
        np.testing.assert_allclose(getattr(got, f), getattr(want, f), rtol=1e-6)


def test_replay_uses_recorded_experts_and_keeps_router_gradients(logits):
    rng = np.random.default_rng(2)
    replay = np.full((T, K), -1, np.int32)
    rows = np.arange(0, T, 2)
    # Record the router's LEAST likely experts, so replay visibly differs from top-k.
    replay[rows] = np.argsort(np.asarray(logits), axis=1)[rows, :K]
    replay[1] = [0, -1]                     # partial record: the router selects
    replay = jnp.asarray(replay)
    out = _ROUTE(logits, top_k=K, replay_idx_TxK=replay)
    plain = _ROUTE(logits, top_k=K)
    np.testing.assert_array_equal(out.idx_TxK[rows], replay[rows])
    others = np.setdiff1d(np.arange(T), rows)
    np.testing.assert_array_equal(out.idx_TxK[others], plain.idx_TxK[others])
    np.testing.assert_array_equal(out.replayed_T, np.isin(np.arange(T), rows))
    p = _np_softmax(logits)
    w = np.take_along_axis(p, np.asarray(out.idx_TxK), 1)
    np.testing.assert_allclose(out.weights_TxK, w / w.sum(1, keepdims=True), rtol=1e-5)

    # Gradient w.r.t. the logits of sum_k c_k w_k (c fixed) vs a NumPy finite difference.
    c = jnp.asarray(rng.normal(size=(T, K)), jnp.float32)
    f = jax.jit(lambda z: jnp.sum(c * router.route(z, top_k=K, replay_idx_TxK=replay).weights_TxK))
    g = jax.jit(jax.grad(f))(logits)
    t = int(rows[3])
    assert float(jnp.max(jnp.abs(g[t]))) > 1e-3
    for e in range(E):
        dz = jnp.zeros((T, E)).at[t, e].set(1e-2)
        fd = (f(logits + dz) - f(logits - dz)) / 2e-2
        np.testing.assert_allclose(g[t, e], fd, rtol=2e-2, atol=1e-4)


def test_bias_update_moves_load_toward_balance():
    skew = jnp.asarray(np.random.default_rng(3).normal(size=(256, E)), jnp.float32)
    skew = skew + jnp.linspace(2.0, -2.0, E)[None, :]  # expert 0 hot, expert E-1 cold

    @jax.jit
    def step(bias):
        out = router.route(skew, top_k=K, router="sigmoid_bias", bias_E=bias)
        return router.update_bias(bias, out.load_E, 0.05), out.load_E

    bias = jnp.zeros(E)
    _, load0 = step(bias)
    for _ in range(60):
        bias, load = step(bias)
    ratio = lambda load: float(jnp.max(load) / jnp.mean(load))
    assert ratio(load0) > 2.0
    assert ratio(load) < 0.6 * ratio(load0)
    assert float(bias[0]) < 0 < float(bias[-1])


def test_update_bias_exact_step():
    got = router.update_bias(jnp.zeros(4), jnp.array([4.0, 1.0, 2.0, 1.0]), 0.5)
    np.testing.assert_allclose(got, [-0.5, 0.5, 0.0, 0.5])


@given(st.integers(0, 2**31 - 1), st.booleans())
def test_router_invariants(seed, norm):
    z = jnp.asarray(np.random.default_rng(seed).normal(size=(T, E)) * 4, jnp.float32)
    out = _ROUTE(z, top_k=K, norm_topk_prob=norm)
    idx = np.asarray(out.idx_TxK)
    assert np.all((idx >= 0) & (idx < E))
    assert np.all(idx[:, 0] != idx[:, 1])
    if norm:
        np.testing.assert_allclose(np.asarray(out.weights_TxK).sum(1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(float(out.counts_E.sum()), T * K)
    assert np.isfinite(float(out.z_loss))


def test_no_recompiles_for_same_shapes(logits, mask):
    traces = []

    @jax.jit
    def f(z, m):
        traces.append(1)
        return router.route(z, top_k=K, token_mask_T=m).aux_loss

    for s in range(3):
        f(logits * (s + 1), mask).block_until_ready()
    assert len(traces) == 1


def test_bad_arguments_raise_clear_errors(logits):
    with pytest.raises(ValueError, match="router='nope'"):
        router.route(logits, top_k=K, router="nope")
    with pytest.raises(ValueError, match=r"logits_TxE must be \[T, E\]"):
        router.route(logits[None], top_k=K)
    with pytest.raises(ValueError, match="top_k=9"):
        router.route(logits, top_k=9)
    with pytest.raises(ValueError, match="bias_E is only used"):
        router.route(logits, top_k=K, bias_E=jnp.zeros(E))
    with pytest.raises(ValueError, match="replay_idx_TxK shape"):
        router.route(logits, top_k=K, replay_idx_TxK=jnp.zeros((T, 3), jnp.int32))


def test_group_limited_top_k_and_routed_scaling_by_hand():
    """8 experts in 4 groups of 2; a group scores the sum of its two best biased scores."""
    s = np.array([[0.9, 0.0, 0.5, 0.5, 0.6, 0.6, 0.1, 0.1]], np.float32)   # sigmoid scores
    logits = jnp.asarray(np.log(s + 1e-12) - np.log1p(-s))  # sigmoid^-1
    bias = jnp.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0])
    # biased group scores: g0 0.9, g1 1.0, g2 1.2, g3 2.2 -> best 2 groups: g3, g2.
    out = router.route(logits, top_k=2, router="sigmoid_bias", bias_E=bias, n_group=4, topk_group=2,
                routed_scaling_factor=2.5)
    assert sorted(np.asarray(out.idx_TxK)[0].tolist()) in ([4, 7], [5, 7])  # 0.6 tie in g2
    # expert 0 (score 0.9, the best) is outside the chosen groups; weights from unbiased scores.
    w = np.sort(np.asarray(out.weights_TxK)[0])
    np.testing.assert_allclose(w, np.sort(np.array([0.6, 0.1]) / 0.7 * 2.5), rtol=1e-5)
    plain = router.route(logits, top_k=2, router="sigmoid_bias", bias_E=bias)
    assert 0 in np.asarray(plain.idx_TxK)[0]  # without groups the best expert wins

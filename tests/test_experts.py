"""Expert backends: every backend against a NumPy loop and `dense`, forward and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from support.close import assert_rel_close
from support.experts import expert_mesh, loss_and_grads

from gagar_jax.kernels.experts import dispatch
from gagar_jax.kernels.experts import ep as experts_ep
from gagar_jax.kernels.experts import local as experts
from gagar_jax.kernels.experts import registry as experts_registry

T, D, F, E, K = 64, 16, 8, 8, 2


def numpy_moe(x, g, u, d, idx, w):
    """Plain loop over tokens and their K assignments; ids outside [0, E) contribute 0."""
    x, g, u, d, w = (np.asarray(a, np.float64) for a in (x, g, u, d, w))
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if 0 <= e < g.shape[0]:
                hg = x[t] @ g[e]
                y[t] += w[t, k] * ((hg / (1 + np.exp(-hg)) * (x[t] @ u[e])) @ d[e])
    return y


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    g, u = (jnp.asarray(rng.normal(size=(E, D, F)) / np.sqrt(D), jnp.float32) for _ in range(2))
    d = jnp.asarray(rng.normal(size=(E, F, D)) / np.sqrt(F), jnp.float32)
    logits = rng.normal(size=(T, E))
    logits[:, 2] += 1.5  # skewed routing: expert 2 is popular, some groups > block sizes
    idx = np.argsort(-logits, axis=1)[:, :K].astype(np.int32)
    idx[5, 1] = -1       # "no expert" ids (e.g. another device's expert) contribute 0
    idx[9, :] = E
    w = jnp.asarray(rng.uniform(0.1, 1.0, size=(T, K)), jnp.float32)
    return x, g, u, d, jnp.asarray(idx), w




@pytest.fixture(scope="module")
def reference(problem):
    return loss_and_grads("dense")(*problem)


def _assert_close(got, want):
    assert_rel_close(got, want)


def test_dense_matches_numpy_loop(problem, reference):
    (_, y), _ = reference
    np.testing.assert_allclose(y, numpy_moe(*problem), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend,opts", [
    ("ragged", {}),
    ("grouped", {}),
    ("grouped", {"block": 4, "big_block": 16}),   # both chunk sizes in use
    ("grouped", {"block": 1, "big_block": 1}),
    ("capacity", {"capacity_factor": float(E)}),   # capacity T*K: nothing can drop
])
def test_backend_matches_dense_forward_and_grads(problem, reference, backend, opts):
    got = loss_and_grads(backend, **opts)(*problem)
    _assert_close(got, reference)
    # Rows whose every id is out of range get exactly zero output.
    assert float(jnp.max(jnp.abs(got[0][1][9]))) == 0.0


def test_grouped_bf16_close_to_fp32_dense(problem, reference):
    bf = [a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in problem]
    (_, y), grads = loss_and_grads("grouped", block=4, big_block=16)(*bf)
    (_, y_ref), grads_ref = reference
    assert y.dtype == jnp.bfloat16 and grads[1].dtype == jnp.bfloat16
    for a, b in zip((y,) + tuple(grads), (y_ref,) + tuple(grads_ref), strict=False):
        a, b = np.asarray(a, np.float32), np.asarray(b)
        assert np.max(np.abs(a - b)) <= 0.03 * np.max(np.abs(b))




@pytest.mark.parametrize("shape", [(8, 1, 1, 1), (2, 1, 4, 1), (1, 2, 2, 2)])
def test_ep_on_meshes_matches_single_device_dense(problem, reference, shape):
    mesh = expert_mesh(shape)
    with jax.set_mesh(mesh):
        got = loss_and_grads("ep")(*problem)
    _assert_close(got, reference)


@pytest.mark.parametrize("shape,chunks", [((2, 1, 4, 1), None), ((1, 2, 2, 2), None),
                                          ((2, 1, 4, 1), 1)])   # chunks=1: the unchunked path
def test_ep_a2a_bookkeeping_matches_dense_with_emulated_collective(problem, reference, shape,
                                                                   chunks):
    with jax.set_mesh(expert_mesh(shape)):
        got = loss_and_grads("ep_a2a", exchange=experts_ep.emulated_ragged_all_to_all,
                              chunks=chunks)(*problem)
    _assert_close(got, reference)


def test_emulated_ragged_all_to_all_matches_the_documented_example():
    # The two-device example of jax.lax.ragged_all_to_all's docstring.
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    args = [jnp.array(a, jnp.int32).reshape(2, -1) for a in (
        [[1, 2, 2], [3, 4, 0]], [[0] * 4] * 2, [[0, 1], [0, 1]], [[1, 2], [1, 1]],
        [[0, 0], [1, 2]], [[1, 1], [2, 1]])]
    # Jitted: one compile, not one per eagerly dispatched op of the unrolled loop.
    fn = jax.jit(jax.shard_map(
        lambda *a: experts_ep.emulated_ragged_all_to_all(*(v[0] for v in a), axis_name="x")[None],
        mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))
    np.testing.assert_array_equal(fn(*args), [[1, 3, 0, 0], [2, 2, 4, 0]])


# The real ragged_all_to_all compiled for TPU: tests/test_ep_a2a.py.


def test_ep_with_explicit_mesh_argument_and_no_ambient_mesh(problem, reference):
    got = loss_and_grads("ep", mesh=expert_mesh((1, 1, 8, 1)))(*problem)
    _assert_close(got, reference)


def test_ep_runs_any_token_count_by_padding(problem):
    """T = 58 tokens on a mesh whose token axes split 8 ways (data 2 x expert 4): the layout
    both EP backends share pads to 64 with rows routed to no expert and matches dense on the 58
    (forward and grads)."""
    short = tuple(a[:58] if a.ndim == 2 and a.shape[0] == T else a for a in problem)
    want = loss_and_grads("dense")(*short)
    with jax.set_mesh(expert_mesh((2, 1, 4, 1))):
        got = loss_and_grads("ep")(*short)
    assert got[0][1].shape == (58, D)
    _assert_close(got, want)


def test_ep_errors_name_the_problem(problem):
    with pytest.raises(ValueError, match="needs a mesh"):
        experts_registry.expert_ffn(*problem, backend="ep")
    with pytest.raises(ValueError, match="num_experts=6 is not divisible"):
        x, g, u, d, idx, w = problem
        experts_registry.expert_ffn(x, g[:6], u[:6], d[:6], idx, w, backend="ep",
                           mesh=expert_mesh((2, 1, 4, 1)))


def test_dropless_when_every_token_picks_one_expert(problem):
    x, g, u, d, _, w = problem
    idx = jnp.full((T, K), 3, jnp.int32)
    want = numpy_moe(x, g, u, d, np.asarray(idx), w)
    for backend in ("dense", "ragged", "grouped"):
        y = jax.jit(lambda *a, b=backend: experts_registry.expert_ffn(*a, backend=b))(
            x, g, u, d, idx, w
        )
        np.testing.assert_allclose(y, want, atol=1e-5, rtol=1e-5, err_msg=backend)
    with jax.set_mesh(expert_mesh((2, 1, 4, 1))):
        y = jax.jit(lambda *a: experts_registry.expert_ffn(*a, backend="ep"))(x, g, u, d, idx, w)
        np.testing.assert_allclose(y, want, atol=1e-5, rtol=1e-5, err_msg="ep")
        y = jax.jit(lambda *a: experts_registry.expert_ffn(
            *a, backend="ep_a2a", exchange=experts_ep.emulated_ragged_all_to_all))(
                x, g, u, d, idx, w)
        np.testing.assert_allclose(y, want, atol=1e-5, rtol=1e-5, err_msg="ep_a2a")


def test_capacity_counts_its_drops(problem):
    x, g, u, d, _, w = problem
    idx = jnp.full((T, K), 3, jnp.int32).at[:, 1].set(jnp.arange(T) % E)
    out = jax.jit(experts.capacity_ffn)(x, g, u, d, idx, w)
    cap = experts.expert_capacity(T, K, E, 1.25)
    assert cap == 20
    # Expert 3 gets T (k=0) + T/E (k=1) assignments; the first `cap` in token order survive.
    n3 = T + T // E
    assert int(out.dropped) == n3 - cap
    keep = np.zeros((T, K), bool)
    flat = np.asarray(idx).reshape(-1)
    seen = {}
    for n, e in enumerate(flat):
        seen[e] = seen.get(e, 0) + 1
        keep.reshape(-1)[n] = seen[e] <= cap
    want = numpy_moe(x, g, u, d, np.where(keep, np.asarray(idx), -1), w)
    np.testing.assert_allclose(out.y_TxD, want, atol=1e-5, rtol=1e-5)


@given(st.lists(st.integers(-1, E), min_size=T * K, max_size=T * K))
def test_grouped_and_ragged_match_numpy_on_any_routing(problem, ids):
    x, g, u, d, _, w = problem
    idx = np.asarray(ids, np.int32).reshape(T, K)
    want = numpy_moe(x, g, u, d, idx, w)
    np.testing.assert_allclose(_GROUPED(x, g, u, d, idx, w), want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(_RAGGED(x, g, u, d, idx, w), want, atol=1e-5, rtol=1e-5)


_GROUPED = jax.jit(
    lambda *a: experts_registry.expert_ffn(*a, backend="grouped", block=4, big_block=16)
)
_RAGGED = jax.jit(lambda *a: experts_registry.expert_ffn(*a, backend="ragged"))


def test_no_recompiles_for_same_shapes(problem):
    x, g, u, d, idx, w = problem
    traces = []

    @jax.jit
    def step(x, g, u, d, idx, w):
        traces.append(1)
        return jax.grad(lambda x: jnp.sum(experts.grouped_ffn(x, g, u, d, idx, w)))(x)

    for shift in range(3):
        step(x + shift, g, u, d, (idx + shift) % E, w).block_until_ready()
    assert len(traces) == 1


@given(st.lists(st.integers(0, 300), min_size=1, max_size=40), st.integers(1, 64))
def test_padded_block_bound_covers_any_split(sizes, block):
    # The static buffer must hold sum_e ceil(n_e / block) blocks for every split of N rows.
    used = sum(-(-n // block) for n in sizes)
    assert used <= dispatch.num_padded_blocks(sum(sizes), len(sizes), block)


def test_bad_arguments_raise_clear_errors(problem):
    x, g, u, d, idx, w = problem
    with pytest.raises(ValueError, match="backend='nope'"):
        experts_registry.expert_ffn(x, g, u, d, idx, w, backend="nope")
    with pytest.raises(ValueError, match="gate/up/down shapes"):
        experts_registry.expert_ffn(x, g, u, g, idx, w, backend="grouped")
    with pytest.raises(ValueError, match="idx_TxK"):
        experts_registry.expert_ffn(x, g, u, d, idx[:, :1], w, backend="grouped")
    with pytest.raises(ValueError, match="integer expert ids"):
        experts_registry.expert_ffn(x, g, u, d, w, w, backend="grouped")

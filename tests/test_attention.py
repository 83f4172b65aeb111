"""Packed causal attention: plain vs blockwise (values, gradients), segment isolation, memory."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.close import assert_rel_close

from gagar_jax.kernels.attention.blockwise import blockwise_attention, plain_attention
from gagar_jax.kernels.attention.registry import attention

B, S, H, KV, DH = 2, 40, 4, 2, 8


def _inputs(seed=0, s=S):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, s, H, DH))
    k = jax.random.normal(ks[1], (B, s, KV, DH))
    v = jax.random.normal(ks[2], (B, s, KV, DH))
    w = jax.random.normal(ks[3], (B, s, H, DH))
    return q, k, v, w


SEG = jnp.array([[1] * 12 + [2] * 20 + [0] * 8, [1] * 40], jnp.int32)


def _numpy_attention(q, k, v, seg):
    """Per-query loop in float64: the independent oracle."""
    q, k, v, seg = (np.asarray(a, np.float64) for a in (q, k, v, seg))
    out = np.zeros_like(q)
    g = H // KV
    for b in range(B):
        for t in range(q.shape[1]):
            keys = [u for u in range(t + 1) if seg[b, u] == seg[b, t]]
            for h in range(H):
                s = np.array([q[b, t, h] @ k[b, u, h // g] for u in keys]) / np.sqrt(DH)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[b, t, h] = sum(pi * v[b, u, h // g] for pi, u in zip(p, keys, strict=False))
    return out


def test_plain_matches_numpy_loop():
    q, k, v, _ = _inputs()
    np.testing.assert_allclose(plain_attention(q, k, v, SEG), _numpy_attention(q, k, v, SEG),
                               atol=1e-5)


@pytest.mark.parametrize("block", [16, 64])  # 16 does not divide 40 (padding); 64 > S (one block)
def test_blockwise_matches_plain_values_and_grads(block):
    q, k, v, w = _inputs(1)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, SEG) * w)

    blk = lambda q, k, v, s: blockwise_attention(q, k, v, s, block=block)
    assert_rel_close(jax.jit(blk)(q, k, v, SEG), plain_attention(q, k, v, SEG))
    g_plain = jax.grad(loss(plain_attention), (0, 1, 2))(q, k, v)
    g_blk = jax.jit(jax.grad(loss(blk), (0, 1, 2)))(q, k, v)
    assert_rel_close(g_blk, g_plain)


def test_packed_row_equals_each_segment_alone():
    q, k, v, _ = _inputs(2)
    packed = blockwise_attention(q, k, v, SEG, block=8)
    for lo, hi in ((0, 12), (12, 32)):
        one = jnp.ones((1, hi - lo), jnp.int32)
        alone = blockwise_attention(q[:1, lo:hi], k[:1, lo:hi], v[:1, lo:hi], one, block=8)
        assert_rel_close(packed[:1, lo:hi], alone)


def test_causal_no_gradient_from_later_tokens():
    q, k, v, _ = _inputs(3)
    t = 20
    f = lambda k, v: blockwise_attention(q, k, v, SEG, block=8)[:, t].sum()
    dk, dv = jax.grad(f, (0, 1))(k, v)
    assert float(jnp.abs(dk[:, t + 1:]).max()) == 0.0 and float(jnp.abs(dv[:, t + 1:]).max()) == 0.0
    assert float(jnp.abs(dv[:, t]).max()) > 0.0


def test_bf16_runs_close_to_fp32():
    q, k, v, _ = _inputs(4)
    lo = blockwise_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), SEG, block=8)
    assert lo.dtype == jnp.bfloat16
    np.testing.assert_allclose(lo.astype(jnp.float32), plain_attention(q, k, v, SEG), atol=5e-2)


def test_bad_impl_and_shapes_rejected():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="impl"):
        attention(q, k, v, SEG, impl="flash3")
    with pytest.raises(ValueError, match="segment_ids"):
        plain_attention(q, k, v, SEG[:, :10])


def _temp_bytes(fn, s):
    shape = lambda h: jax.ShapeDtypeStruct((1, s, h, 16), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, s), jnp.int32)
    loss = lambda q, k, v, sg: jnp.sum(fn(q, k, v, sg) ** 2)
    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(shape(2), shape(1), shape(1), seg).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_memory_linear_plain_quadratic():
    blk = lambda q, k, v, s: blockwise_attention(q, k, v, s, block=256)
    ratio_blk = _temp_bytes(blk, 4096) / _temp_bytes(blk, 1024)
    ratio_plain = _temp_bytes(plain_attention, 4096) / _temp_bytes(plain_attention, 1024)
    assert ratio_blk < 6, ratio_blk      # ~4x for 4x the tokens
    assert ratio_plain > 10, ratio_plain  # ~16x: [S, S] scores


_blk_jit = jax.jit(lambda q, k, v, s: blockwise_attention(q, k, v, s, block=8))


@settings(max_examples=15)
@given(st.lists(st.integers(1, 15), min_size=1, max_size=6), st.integers(0, 8))
def test_any_segment_layout_blockwise_equals_numpy(lengths, pad):
    """Random packings (fixed shapes, so one compile): blockwise == the NumPy loop oracle."""
    ids = [i + 1 for i, n in enumerate(lengths) for _ in range(n)][: S - pad]
    row = ids + [0] * (S - len(ids))
    seg = jnp.array([row, row[::-1]], jnp.int32)  # reversed: ids decrease, padding first
    q, k, v, _ = _inputs(5)
    np.testing.assert_allclose(_blk_jit(q, k, v, seg), _numpy_attention(q, k, v, seg), atol=1e-5)


# -------------------------------------------------------------------------- sliding window, sinks
DV = 6  # a value head width of its own (MiMo: q/k 192, v 128)


def _numpy_window_sink(q, k, v, seg, window, sink):
    """Per-query float64 loop: keys u with t - window < u <= t in t's segment; a sink logit
    joins the denominator only (transformers' MiMo-V2-Flash eager attention)."""
    q, k, v, seg, sink = (np.asarray(a, np.float64) for a in (q, k, v, seg, sink))
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    g = H // KV
    for b in range(q.shape[0]):
        for t in range(q.shape[1]):
            keys = [u for u in range(max(0, t - window + 1), t + 1) if seg[b, u] == seg[b, t]]
            for h in range(H):
                s = np.array([q[b, t, h] @ k[b, u, h // g] for u in keys]) / np.sqrt(DH)
                m = max(s.max(), sink[h])
                p = np.exp(s - m) / (np.exp(s - m).sum() + np.exp(sink[h] - m))
                out[b, t, h] = sum(pi * v[b, u, h // g] for pi, u in zip(p, keys, strict=False))
    return out


def test_window_sinks_and_value_width_match_numpy_and_plain_grads():
    q, k, _, w = _inputs(6)
    v = jax.random.normal(jax.random.key(7), (B, S, KV, DV))
    w = w[..., :DV]
    sink = jnp.array([0.5, -1.0, 2.0, 0.0])
    want = _numpy_window_sink(q, k, v, SEG, 5, sink)
    plain = lambda q, k, v, s: plain_attention(q, k, v, SEG, window=5, sinks_H=s)
    blk = lambda q, k, v, s: blockwise_attention(q, k, v, SEG, block=8, window=5, sinks_H=s)
    loss = lambda fn: lambda *a: jnp.sum(fn(*a) * w)

    @jax.jit
    def run(q, k, v, sink):
        # boundary (transformers: kv_idx > q_idx - window): query 30 sees key 26, not key 25.
        dk = jax.grad(lambda k: plain(q, k, v, sink)[:, 30].sum())(k)
        o_blk, vjp = jax.vjp(blk, q, k, v, sink)
        return (plain(q, k, v, sink), o_blk, jax.grad(loss(plain), (0, 1, 2, 3))(q, k, v, sink),
                vjp(w), dk)

    o_plain, o_blk, g_plain, g_blk, dk = run(q, k, v, sink)
    np.testing.assert_allclose(o_plain, want, atol=1e-5)
    np.testing.assert_allclose(o_blk, want, atol=1e-5)
    for a, b in zip(g_blk, g_plain, strict=False):
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) <= 1e-5
    assert float(jnp.abs(dk[0, 26]).max()) > 0 and float(jnp.abs(dk[0, 25]).max()) == 0.0


@settings(max_examples=40)
@given(st.integers(1, 12), st.integers(1, 12), st.integers(1, 9), st.integers(0, 40),
       st.integers(0, 30))
def test_window_block_ranges_are_exactly_the_blocks_with_visible_keys(nq, nk, blk, window, d):
    """The loops visit exactly the (query block, key block) pairs holding a visible pair: a
    sliding layer does O(S * W) work. Also with queries starting d keys in (context shards)."""
    from gagar_jax.kernels.attention.blockwise import _key_block_range, _query_block_range
    visible = lambda i, j: any(0 <= qi - kj and (not window or qi - kj < window)
                               for qi in range(d + i * blk, d + (i + 1) * blk)
                               for kj in range(j * blk, (j + 1) * blk))
    for i in range(nq):
        lo, hi = (int(x) for x in _key_block_range(i, nk, d, blk, window))
        assert [j for j in range(nk) if visible(i, j)] == list(range(lo, max(lo, hi)))
    for j in range(nk):
        lo, hi = (int(x) for x in _query_block_range(j, nq, d, blk, window))
        assert [i for i in range(nq) if visible(i, j)] == list(range(lo, max(lo, hi)))

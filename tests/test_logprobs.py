"""Chunked log-probs / entropy against the plain log_softmax path; the model-level contract."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.close import assert_rel_close
from support.paths import load_tiny_config

from gagar_jax.model.logprobs import (
    chunked_logprobs_entropy,
    logits_bytes,
    next_token_mask,
    token_logprobs,
)
from gagar_jax.model.transformer import ModelConfig, Transformer


def _plain(h, w, tgt):
    logp = jax.nn.log_softmax(jnp.einsum("nd,dv->nv", h, w), axis=-1)
    lp = jnp.take_along_axis(logp, tgt[:, None], axis=-1)[:, 0]
    return lp, -jnp.sum(jnp.exp(logp) * logp, axis=-1)


# 7, 32 do not divide V=50 (padded last chunk); 100 > V; keep_logits: saved tiles vs recompute
@pytest.mark.parametrize("chunk,keep", [(7, False), (32, True), (100, False), (7, True)])
def test_chunked_matches_plain_values_and_grads(chunk, keep):
    """Values, and the custom VJP against jax.grad of the plain log_softmax path, for cotangents
    on both outputs, on the log-probs only and on the entropy only (symbolic zeros)."""
    kh, kw, kt = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(kh, (12, 16))
    w = jax.random.normal(kw, (16, 50)) * 0.5
    tgt = jax.random.randint(kt, (12,), 0, 50)
    lp, ent = jax.jit(chunked_logprobs_entropy, static_argnums=(3, 4))(h, w, tgt, chunk, keep)
    lp0, ent0 = _plain(h, w, tgt)
    assert_rel_close((lp, ent), (lp0, ent0))

    def scalar(fn, a, b):
        def f(h, w):
            lp, ent = fn(h, w)
            return a * jnp.sum(lp * jnp.arange(12.0)) + b * jnp.sum(ent * jnp.cos(jnp.arange(12.0)))
        return f

    chunked = lambda h, w: chunked_logprobs_entropy(h, w, tgt, chunk, keep)
    plain = lambda h, w: _plain(h, w, tgt)
    for a, b in ((1.0, 1.0), (1.0, 0), (0, 1.0)):   # python 0: that output gets no cotangent
        g = jax.jit(jax.grad(scalar(chunked, a, b), (0, 1)))(h, w)
        g0 = jax.grad(scalar(plain, a, b), (0, 1))(h, w)
        assert_rel_close(g, g0)


def test_bf16_inputs_give_bf16_grads_close_to_float32():
    """Pod configs compute in bfloat16: the custom VJP keeps dtypes (h, w in -> grads in the
    same dtype, dh summed over chunks in float32) and agrees with the float32 path run on the
    same bf16-rounded inputs to bf16 precision."""
    kh, kw, kt = jax.random.split(jax.random.key(1), 3)
    h = jax.random.normal(kh, (12, 16)).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (16, 50)) * 0.5).astype(jnp.bfloat16)
    tgt = jax.random.randint(kt, (12,), 0, 50)
    f = lambda h, w: jnp.sum(chunked_logprobs_entropy(h, w, tgt, 7)[0] * jnp.arange(12.0))
    gh, gw = jax.jit(jax.grad(f, (0, 1)))(h, w)
    assert gh.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16
    gh0, gw0 = jax.grad(f, (0, 1))(h.astype(jnp.float32), w.astype(jnp.float32))
    assert_rel_close((gh.astype(jnp.float32), gw.astype(jnp.float32)), (gh0, gw0), rtol=2e-2)


def test_unused_outputs_give_zero_grads():
    h, w, tgt = jnp.ones((3, 4)), jnp.ones((4, 10)), jnp.array([0, 3, 9])
    g = jax.grad(lambda h, w: jnp.sum(jax.lax.stop_gradient(
        chunked_logprobs_entropy(h, w, tgt, 4)[0])), (0, 1))(h, w)
    assert float(jnp.abs(g[0]).max()) == 0.0 and float(jnp.abs(g[1]).max()) == 0.0


def test_bad_shapes_rejected():
    with pytest.raises(ValueError, match="shapes do not fit"):
        chunked_logprobs_entropy(jnp.ones((3, 4)), jnp.ones((5, 10)), jnp.zeros((3,), jnp.int32), 4)
    with pytest.raises(ValueError, match="chunk must be > 0"):
        chunked_logprobs_entropy(jnp.ones((3, 4)), jnp.ones((4, 10)), jnp.zeros((3,), jnp.int32), 0)


def test_logits_bytes_by_hand():
    assert logits_bytes(4092, 32_000, 1_000) == 4 * 4092 * 32_000
    assert logits_bytes(10, 50, 7) == 4 * 10 * 56        # padded to 8 chunks of 7
    assert logits_bytes(10, 50, 100) == 4 * 10 * 50      # chunk clipped to V


def test_entropy_of_uniform_is_log_v():
    lp, ent = chunked_logprobs_entropy(
        jnp.zeros((3, 4)), jnp.ones((4, 10)), jnp.array([0, 3, 9]), 4
    )
    np.testing.assert_allclose(ent, np.log(10.0) * np.ones(3), rtol=1e-6)
    np.testing.assert_allclose(lp, -np.log(10.0) * np.ones(3), rtol=1e-6)


def test_next_token_mask_by_hand():
    seg = jnp.array([[1, 1, 1, 2, 2, 0, 0], [3, 3, 3, 3, 3, 3, 3]])
    expect = [[0, 1, 1, 0, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1]]
    np.testing.assert_array_equal(next_token_mask(seg), expect)


@pytest.fixture(scope="module")
def model():
    return Transformer(ModelConfig.from_config(load_tiny_config().model), rngs=nnx.Rngs(0))


def test_token_logprobs_match_full_logits(model):
    B, S = 2, 24
    tokens = jax.random.randint(jax.random.key(1), (B, S), 0, 256)
    seg = jnp.array([[1] * 10 + [2] * 10 + [0] * 4, [1] * 24], jnp.int32)
    pos = jnp.array([list(range(10)) * 2 + [0] * 4, list(range(24))], jnp.int32)

    @nnx.jit
    def both(m, tokens):
        lp, ent, _ = token_logprobs(m, tokens, seg, pos)
        logits, _ = m(tokens, segment_ids_BxS=seg, positions_BxS=pos)
        return lp, ent, logits

    lp, ent, logits = both(model, tokens)
    logp = np.asarray(jax.nn.log_softmax(logits, -1))
    mask = np.asarray(next_token_mask(seg))
    want_lp = np.zeros((B, S), np.float32)
    want_ent = np.zeros((B, S), np.float32)
    for b in range(B):
        for t in range(1, S):
            if mask[b, t]:
                want_lp[b, t] = logp[b, t - 1, int(tokens[b, t])]
                want_ent[b, t] = -np.sum(np.exp(logp[b, t - 1]) * logp[b, t - 1])
    assert_rel_close((lp, ent), (want_lp, want_ent))
    assert float(jnp.abs(lp[0, 10])) == 0.0 and float(jnp.abs(lp[0, 20:]).max()) == 0.0


def test_chunked_never_holds_full_logits():
    """fwd+bwd temporaries: flat in V for the chunked path (one chunk tile at a time), at least
    one full [N, V] float32 array for the plain path."""
    N, D = 2048, 32

    def temp(fn, V):
        args = (
            jax.ShapeDtypeStruct((N, D), jnp.float32),
            jax.ShapeDtypeStruct((D, V), jnp.float32),
            jax.ShapeDtypeStruct((N,), jnp.int32),
        )

        def loss(h, w, t):
            lp, ent = fn(h, w, t)
            return jnp.sum(lp) + jnp.sum(ent)

        return (
            jax.jit(jax.grad(loss, (0, 1)))
            .lower(*args)
            .compile()
            .memory_analysis()
            .temp_size_in_bytes
        )

    chunked = lambda h, w, t: chunked_logprobs_entropy(h, w, t, 512)
    small, large = temp(chunked, 8192), temp(chunked, 32768)
    assert large < 1.5 * small, (small, large)   # 4x the vocabulary, ~ the same memory
    assert large < N * 32768 * 4 / 8              # far below the full logits
    assert temp(_plain, 8192) >= N * 8192 * 4     # the plain path does hold them
    kept = lambda h, w, t: chunked_logprobs_entropy(h, w, t, 512, True)
    assert temp(kept, 8192) >= N * 8192 * 4       # keep_logits holds the tiles for the backward

"""Context parallelism: rows split along S over the 'context' mesh axis give what one chip gives.

One tiny MiMo-family model (a dense layer, full and sliding-window layers with sinks, MoE layers
with routing replay; expert parallelism where the mesh has an expert axis) on packed rows whose
segments cross every chip boundary; each mesh is one compile of logits, log-probs, entropy and
their gradients, compared with the unsharded program (norm-relative, tests/support/close.py). The
sliding window (6) spans more than one chip's chunk at context = 8 (4 tokens per chip), so the
halo exchange takes two hops there.
"""
import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.close import assert_rel_close
from support.paths import load_config

from gagar_jax import sharding
from gagar_jax.kernels.attention import blockwise as attention
from gagar_jax.kernels.attention import context as attention_context
from gagar_jax.kernels.attention import registry as attention_registry
from gagar_jax.kernels.experts import registry as experts_registry
from gagar_jax.model.logprobs import token_logprobs
from gagar_jax.model.transformer import ModelConfig, Transformer

B, S = 2, 32
# Segment lengths per row (0 = padding): boundaries fall inside every chip's chunk at context 8.
ROWS = [[3, 17, 10, 0, 0], [14, 18]]


def _mimo_cfg() -> ModelConfig:
    mod_config = load_config("tiny_mimo")
    cfg = ModelConfig.from_config(mod_config.model)
    return dataclasses.replace(cfg, num_layers=3, layer_types=("full", "sliding", "full"),
                               sliding_window=6, attn_block=4, attention="blockwise",
                               expert_backend=experts_registry.resolve("auto"))


CFG = _mimo_cfg()


def _packed():
    rng = np.random.default_rng(0)
    seg = np.zeros((B, S), np.int32)
    pos = np.zeros((B, S), np.int32)
    for b, lengths in enumerate(ROWS):
        start = 0
        for i, n in enumerate(lengths):
            seg[b, start:start + n] = i + 1
            pos[b, start:start + n] = np.arange(n)
            start += n
    tokens = rng.integers(1, CFG.vocab_size, (B, S)).astype(np.int32)
    # Routing replay on about half the tokens (-1 = the router selects).
    routed = rng.integers(0, CFG.num_experts, (B, S, CFG.num_moe_layers, CFG.top_k)).astype(
        np.int32
    )
    routed[:, :, :, 1] = (routed[:, :, :, 0] + 1) % CFG.num_experts  # distinct ids per token
    routed = np.where(rng.random((B, S, 1, 1)) < 0.5, routed, -1)
    w = rng.standard_normal((3, B, S)).astype(np.float32)
    return tokens, seg, pos, routed, w


def _mesh(**axes):
    sizes = {**dict(data=-1, fsdp=1, expert=1, context=1, tensor=1), **axes}
    return sharding.make_mesh(types.SimpleNamespace(**sizes))


@functools.cache
def _model():
    """(graphdef, params), built once for the reference and every mesh (an eager init
    dispatches each of its ops: about a second on 2 shared cores)."""
    return nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))


def _run(mesh=None):
    """(logits, log-probs, entropy, routed experts) and the parameter gradients of a weighted
    sum of log-probs and entropies (the loss's shape), as host arrays."""
    graphdef, params = _model()
    tokens, seg, pos, routed, w = _packed()

    def fn(params, tokens, seg, pos, routed):
        def loss(params):
            model = nnx.merge(graphdef, params)
            lp, ent, aux = token_logprobs(model, tokens, seg, pos, routed)
            return jnp.sum(w[0] * lp + w[1] * ent), (lp, ent, aux.routed_experts_BxSxLxK)
        grads, (lp, ent, used) = jax.grad(loss, has_aux=True)(params)
        logits, _ = nnx.merge(graphdef, params)(tokens, segment_ids_BxS=seg, positions_BxS=pos,
                                                 routed_experts_BxSxLxK=routed)
        return (logits, lp, ent, used), grads

    args = (params, tokens, seg, pos, routed)
    if mesh is None:
        return jax.device_get(jax.jit(fn)(*args))
    with jax.set_mesh(mesh):
        placed = [jax.device_put(params, sharding.state_shardings(params, mesh))]
        for x, axes in ((tokens, ("batch", "seq")), (seg, ("batch", "seq")),
                        (pos, ("batch", "seq")), (routed, ("batch", "seq", None, None))):
            placed.append(jax.device_put(x, sharding.named_sharding(mesh, axes, x.shape)))
        out = jax.jit(fn)(*placed)
        assert out[0][1].sharding.spec[1] == "context"  # log-probs stay split along S
        return jax.device_get(out)


@pytest.fixture(scope="module")
def reference():
    return _run()


# Context alone (the rest of the 8 devices on data) at 2 and 8, and combined with fsdp and
# expert; context = 4 (with fsdp) runs in tests/test_train_step.py's whole-step comparison.
@pytest.mark.parametrize("axes", [dict(context=2), dict(context=8),
                                  dict(fsdp=2, expert=2, context=2)],
                         ids=lambda a: "-".join(f"{k}{v}" for k, v in a.items()))
def test_context_parallel_model_equals_one_chip(reference, axes):
    (logits, lp, ent, used), grads = _run(_mesh(**axes))
    (logits_r, lp_r, ent_r, used_r), grads_r = reference
    assert_rel_close(logits, logits_r, name="logits")
    assert_rel_close(lp, lp_r, name="logprobs")
    assert_rel_close(ent, ent_r, name="entropy")
    np.testing.assert_array_equal(used, used_r)  # routing (replayed and selected) identical
    assert_rel_close(grads, grads_r, name="grads")


def test_sliding_halo_and_full_gather_match_plain_attention():
    """The exchange alone, on a mesh of context 8 x nothing else, for full and sliding layers:
    queries against the keys they gathered equal the one-chip reference (values and all
    gradients, sinks included); the window-6 halo crosses two chips of 4 tokens, and the
    balanced full layers move query halves of 2 tokens between chips."""
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (B, S, 4, 8))
    k = jax.random.normal(ks[1], (B, S, 2, 8))
    v = jax.random.normal(ks[2], (B, S, 2, 4))
    sinks = jax.random.normal(ks[3], (4,))
    _, seg, _, _, _ = _packed()
    probe = jnp.sin(jnp.arange(B * S * 4 * 4, dtype=jnp.float32)).reshape(B, S, 4, 4)

    def both(fn):
        def loss(q, k, v, sinks):
            full = fn(q, k, v, seg, window=0, sinks_H=None)
            slide = fn(q, k, v, seg, window=6, sinks_H=sinks)
            return jnp.sum((full + slide) * probe), (full, slide)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)

    want = both(attention.plain_attention)
    with jax.set_mesh(_mesh(context=8)):
        for balance in (True, False):  # zig-zag query halves on full layers, or own queries
            got = both(lambda *a, balance=balance, **kw: attention_context.attention(
                *a, impl="blockwise", block=2, balance=balance, **kw))
            assert_rel_close(jax.device_get(got), jax.device_get(want), name=f"balance={balance}")


def test_context_errors():
    batch = {"tokens_BxS": np.zeros((2, 30), np.int32)}
    with pytest.raises(ValueError, match="not divisible by the context axis"):
        sharding.batch_shardings(batch, _mesh(context=4))
    with jax.set_mesh(_mesh(context=2)):
        x = jnp.zeros((1, 8, 2, 4))
        with pytest.raises(ValueError, match="attention impl must be one of"):
            jax.jit(lambda x: attention_context.attention(x, x, x, jnp.ones((1, 8), jnp.int32),
                                                          impl="flash3"))(x)
        assert attention_registry.resolve("auto") == "blockwise"


def test_process_row_block_with_rows_spanning_hosts():
    """Four fake hosts of two devices on fsdp 2 x context 4: a host holds half the rows and
    half of S; the two hosts of one row group hold the same rows, different S halves."""
    mesh = _mesh(data=1, fsdp=2, context=4)
    host = lambda d: d.id // 2
    got = [sharding.process_row_block(mesh, 8, 64, p, process_of=host) for p in range(4)]
    assert got == [(slice(0, 4), slice(0, 32)), (slice(0, 4), slice(32, 64)),
                   (slice(4, 8), slice(0, 32)), (slice(4, 8), slice(32, 64))]
    one = sharding.process_row_block(_mesh(data=8), 8, 64, 0)  # one host: everything
    assert one == (slice(0, 8), slice(0, 64))
    with pytest.raises(ValueError, match="non-contiguous"):  # hosts striped across the rows
        sharding.process_row_block(_mesh(data=8), 8, 64, 0, process_of=lambda d: d.id % 2)

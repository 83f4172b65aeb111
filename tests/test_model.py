"""The Transformer: config validation, causality, packing, scan == unrolled, remat, bf16,
routing replay, router-bias balancing, no recompiles."""
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
from support.close import assert_rel_close
from support.paths import load_tiny_config

from gagar_jax.model.moe import RouterBias, update_router_bias
from gagar_jax.model.transformer import ModelConfig, Transformer

TINY = ModelConfig.from_config(load_tiny_config().model)
# Most tests use the cheapest-to-compile paths (plain attention, dense experts); the configured
# blockwise + grouped paths are checked against them once (test_default_paths_match_reference).
CFG = dataclasses.replace(TINY, attention="plain", expert_backend="dense")
B, S = 2, 24
SEG = jnp.array([[1] * 10 + [2] * 10 + [0] * 4, [1] * 24], jnp.int32)
POS = jnp.array([list(range(10)) * 2 + [0] * 4, list(range(24))], jnp.int32)
TOKENS = jax.random.randint(jax.random.key(1), (B, S), 0, 256)


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


@nnx.jit
def forward(m, tokens, seg, pos, routed=None):
    return m(tokens, segment_ids_BxS=seg, positions_BxS=pos, routed_experts_BxSxLxK=routed)


def test_config_from_tiny_and_validation():
    assert TINY.num_moe_layers == 2 and TINY.expert_backend == "grouped"
    with pytest.raises(ValueError, match="unknown keys"):
        ModelConfig.from_config({**load_tiny_config().model.to_dict(), "num_expert": 3})
    with pytest.raises(ValueError, match="num_kv_heads"):
        dataclasses.replace(CFG, num_kv_heads=3)
    with pytest.raises(ValueError, match="remat"):
        dataclasses.replace(CFG, remat="some")
    with pytest.raises(ValueError, match="top_k"):
        dataclasses.replace(CFG, top_k=9)


def test_shapes_aux_and_router_bias_is_not_a_param(model):
    logits, aux = forward(model, TOKENS, SEG, POS)
    assert logits.shape == (B, S, 256) and logits.dtype == jnp.float32
    np.testing.assert_allclose(aux.expert_load_LxE.sum(-1), np.ones(2), rtol=1e-6)
    assert aux.routed_experts_BxSxLxK.shape == (B, S, 2, 2)
    assert np.isfinite(float(aux.aux_loss)) and float(aux.z_loss) > 0
    params = nnx.state(model, nnx.Param)
    assert not any("router_bias" in str(p) for p, _ in nnx.to_flat_state(params))
    assert nnx.state(model, RouterBias)["moe_layers"]["mlp"]["router_bias"].shape == (2, 8)


def test_causal_no_gradient_from_later_tokens(model):
    t = 11
    tokens = jnp.concatenate([jnp.arange(12), 100 + jnp.arange(12)])[None]  # later ids unseen
                                                                            # before
    seg, pos = jnp.ones((1, 24), jnp.int32), jnp.arange(24)[None]

    def f(m):
        return m(tokens, segment_ids_BxS=seg, positions_BxS=pos)[0][0, t].sum()

    g = nnx.jit(nnx.grad(f))(model)["embedding"][...]
    assert float(jnp.abs(g[100:112]).max()) == 0.0   # tokens after t
    assert float(jnp.abs(g[:12]).max()) > 0.0          # tokens up to t


def test_packed_row_equals_each_sequence_alone(model):
    packed, _ = forward(model, TOKENS, SEG, POS)
    for lo, hi in ((0, 10), (10, 20)):
        alone, _ = forward(
            model, TOKENS[:1, lo:hi], jnp.ones((1, 10), jnp.int32), jnp.arange(10)[None]
        )
        assert_rel_close(packed[0, lo:hi], alone[0])


def _unrolled_logits(m, tokens, seg, pos):
    """Layer by layer in a Python loop: the reference for the scanned stack."""
    x = m.embedding[...][tokens]
    graphdef, state = nnx.split(m.moe_layers)
    for i in range(CFG.num_moe_layers):
        layer = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
        x, _ = layer(x, seg, pos, None)
    return m.final_norm(x) @ m.output_kernel_DxV()


def test_scan_equals_unrolled(model):
    logits, _ = forward(model, TOKENS, SEG, POS)
    unrolled = nnx.jit(_unrolled_logits)(model, TOKENS, SEG, POS)
    assert_rel_close(logits, unrolled)


def test_default_paths_match_reference(model):
    """tiny_cpu's blockwise attention + grouped experts == plain attention + dense experts."""
    m = Transformer(TINY, rngs=nnx.Rngs(0))
    logits, aux = forward(m, TOKENS, SEG, POS)
    ref, ref_aux = forward(model, TOKENS, SEG, POS)
    assert_rel_close(logits, ref)
    np.testing.assert_array_equal(aux.routed_experts_BxSxLxK, ref_aux.routed_experts_BxSxLxK)


def _loss_and_grad(cfg):
    m = Transformer(cfg, rngs=nnx.Rngs(0))

    @nnx.jit
    def run(m):
        def loss(m):
            logits, aux = m(TOKENS, segment_ids_BxS=SEG, positions_BxS=POS)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 0]) + 1e-2 * aux.aux_loss
        return nnx.value_and_grad(loss)(m)

    return run(m)


def test_remat_modes_identical():
    ref_loss, ref_grad = _loss_and_grad(CFG)
    for mode in ("full", "save_matmuls"):
        loss, grad = _loss_and_grad(dataclasses.replace(CFG, remat=mode))
        assert_rel_close(loss, ref_loss, name=mode)
        assert_rel_close(grad, ref_grad, name=mode)


def test_bf16_runs_and_tracks_fp32(model):
    cfg = dataclasses.replace(CFG, param_dtype="bfloat16", compute_dtype="bfloat16",
                              num_dense_layers=1, tie_embeddings=True)
    m = Transformer(cfg, rngs=nnx.Rngs(0))
    assert m.moe_layers.mlp.expert_gate[...].dtype == jnp.bfloat16
    logits, aux = forward(m, TOKENS, SEG, POS)
    assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))
    # The same weights in fp32 give nearly the same logits.
    m32 = Transformer(dataclasses.replace(cfg, param_dtype="float32", compute_dtype="float32"),
                      rngs=nnx.Rngs(0))
    nnx.update(m32, jax.tree.map(lambda a: a.astype(jnp.float32), nnx.state(m)))
    ref, _ = forward(m32, TOKENS, SEG, POS)
    assert float(jnp.mean(jnp.abs(logits - ref))) < 0.05 * float(jnp.mean(jnp.abs(ref)))


def test_routing_replay_uses_given_experts(model):
    _, aux = forward(model, TOKENS, SEG, POS)
    chosen = aux.routed_experts_BxSxLxK
    # Replaying the model's own choice changes nothing.
    l0, _ = forward(model, TOKENS, SEG, POS)
    l1, aux1 = forward(model, TOKENS, SEG, POS, chosen)
    assert_rel_close(l1, l0)   # another program (replay inputs), the same routing
    # Replaying other experts: exactly those are used, and the output moves.
    other = (chosen + 3) % CFG.num_experts
    other = other.at[0, :5].set(-1)  # no record for the first tokens: the router selects
    l2, aux2 = forward(model, TOKENS, SEG, POS, other)
    np.testing.assert_array_equal(aux2.routed_experts_BxSxLxK[:, 5:], other[:, 5:])
    np.testing.assert_array_equal(aux2.routed_experts_BxSxLxK[0, :5], chosen[0, :5])
    assert float(jnp.abs(l2 - l0).max()) > 1e-3


def test_router_bias_update_moves_load_toward_balance():
    cfg = dataclasses.replace(CFG, router="sigmoid_bias")
    m = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(5), (4, 32), 0, 256)
    seg, pos = jnp.ones((4, 32), jnp.int32), jnp.broadcast_to(jnp.arange(32), (4, 32))
    # Start strongly unbalanced: a large bias on expert 0 in every layer.
    m.moe_layers.mlp.router_bias[...] = jnp.zeros((2, 8)).at[:, 0].set(1.0)
    spread = []
    for _ in range(12):
        _, aux = forward(m, tokens, seg, pos)
        spread.append(float(jnp.max(aux.expert_load_LxE) - jnp.min(aux.expert_load_LxE)))
        update_router_bias(m, aux.expert_load_LxE, rate=0.1)
    assert spread[-1] < 0.5 * spread[0], spread


def test_no_recompiles_across_calls(model):
    @jax.jit
    @chex.assert_max_traces(n=1)
    def fwd(state, tokens):
        return nnx.merge(graphdef, state)(tokens, segment_ids_BxS=SEG, positions_BxS=POS)[0]

    graphdef, state = nnx.split(model)
    for seed in range(3):
        fwd(state, jax.random.randint(jax.random.key(seed), (B, S), 0, 256))


def test_program_size_does_not_grow_with_depth():
    """Layers run under a scan: the lowered program of 6 layers is no bigger than of 2."""
    def hlo_size(n):
        cfg = dataclasses.replace(CFG, num_layers=n, num_dense_layers=1)
        graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
        fn = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t)[0])
        return len(fn.lower(state, TOKENS).as_text())

    assert hlo_size(6) < 1.05 * hlo_size(2)


def test_layer_pattern_scanned_and_program_size_flat_with_depth():
    """MiMo's interleave (full at layer 0 and every 6th) scans over its period: 48 layers lower to
    no bigger a program than 24, and the stacks are the period, a tail and the dense layer."""
    from gagar_jax.model.transformer import layer_stacks

    def cfg_of(n):
        types = tuple("full" if i == 0 or (i + 1) % 6 == 0 else "sliding" for i in range(n))
        return dataclasses.replace(CFG, num_layers=n, num_dense_layers=1, layer_types=types,
                                   sliding_window=4, sliding_num_kv_heads=4, attention_sinks=True)

    assert [(s.name, len(s.pattern), s.repeats) for s in layer_stacks(cfg_of(48))] == [
        ("dense_layers", 1, 1),
        ("moe_layers", 6, 7),
        ("moe_layers_1", 1, 4),
        ("moe_layers_2", 1, 1),
    ]

    def hlo_size(n):
        graphdef, state = nnx.split(
            nnx.eval_shape(lambda: Transformer(cfg_of(n), rngs=nnx.Rngs(0)))
        )
        fn = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t)[0])
        return len(fn.lower(state, TOKENS).as_text())

    assert hlo_size(48) < 1.05 * hlo_size(24)


@given(st.lists(st.booleans(), min_size=1, max_size=40), st.integers(0, 3))
def test_layer_stacks_cover_every_layer_once_in_order(sliding, dense):
    import types

    from gagar_jax.model.layer_pattern import layer_stacks
    n = len(sliding)
    dense = min(dense, n)
    cfg = types.SimpleNamespace(num_layers=n, num_dense_layers=dense,
                                is_sliding=lambda i: sliding[i])
    order = []
    for spec in layer_stacks(cfg):
        for r in range(spec.repeats):
            for k, sl in enumerate(spec.pattern):
                layer = spec.first + r * len(spec.pattern) + k
                assert sl == sliding[layer] and spec.moe == (layer >= dense)
                order.append(layer)
    assert order == list(range(n))

"""The kernel registries choose by declared capability: a new kernel needs one record, and every
dispatcher below the resolution point rejects an unresolved "auto"."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from support.close import assert_rel_close
from support.paths import load_tiny_config

from gagar_jax.kernels.attention import blockwise
from gagar_jax.kernels.attention import context as attention_context
from gagar_jax.kernels.attention import registry as attention_registry
from gagar_jax.kernels.experts import ep
from gagar_jax.kernels.experts import registry as experts_registry
from gagar_jax.model.transformer import ModelConfig, resolve_kernels


def _context_mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("context",))


def test_registered_static_offset_kernel_serves_the_context_path():
    """A kernel that declares static_offset gets the values its offset can take, with no edit
    to the context-parallel code, and gives blockwise's result."""
    seen = []

    def probe_local(q, k, v, seg, *, kv_segment_ids_BxK=None, q_offset=0, q_offsets=None,
                    window=0, sinks_H=None):
        seen.append(q_offsets)
        assert q_offsets is None or all(isinstance(o, int) for o in q_offsets)
        return blockwise.plain_attention(q, k, v, seg, kv_segment_ids_BxK=kv_segment_ids_BxK,
                                         q_offset=q_offset, window=window, sinks_H=sinks_H)

    attention_registry.register(attention_registry.AttentionKernel(
        "probe", blockwise.plain_attention, probe_local, platforms=("cpu",), static_offset=True))
    try:
        ks = jax.random.split(jax.random.PRNGKey(0), 3)
        q, k, v = (jax.random.normal(kk, (1, 16, 2, 8)) for kk in ks)
        seg = jnp.asarray(np.repeat([[1, 2]], 8, axis=1).reshape(1, 16), jnp.int32)
        want = blockwise.plain_attention(q, k, v, seg)
        with jax.set_mesh(_context_mesh(2)):
            for balance in (True, False):
                got = jax.jit(lambda q, k, v, b=balance: attention_context.attention(
                    q, k, v, seg, impl="probe", balance=b))(q, k, v)
                assert_rel_close(jax.device_get(got), want, name=f"balance={balance}")
        assert seen and all(offsets is not None for offsets in seen), seen
        # The model accepts the registered name.
        ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
                    head_dim=4, moe_intermediate_size=8, intermediate_size=8, num_experts=2,
                    top_k=1, attention="probe")
    finally:
        attention_registry.KERNELS.pop("probe")


def test_every_dispatcher_rejects_unresolved_auto():
    x = jnp.zeros((1, 8, 2, 4))
    seg = jnp.ones((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="unresolved"):
        attention_registry.attention(x, x, x, seg, impl="auto")
    with pytest.raises(ValueError, match="unresolved"):
        attention_context.attention(x, x, x, seg, impl="auto")
    with jax.set_mesh(_context_mesh(2)):
        with pytest.raises(ValueError, match="unresolved"):
            jax.jit(lambda x: attention_context.attention(x, x, x, seg, impl="auto"))(x)
    t, d, f, e = 4, 8, 8, 2
    args = (jnp.zeros((t, d)), jnp.zeros((e, d, f)), jnp.zeros((e, d, f)), jnp.zeros((e, f, d)),
            jnp.zeros((t, 1), jnp.int32), jnp.ones((t, 1)))
    with pytest.raises(ValueError, match="unresolved"):
        experts_registry.expert_ffn(*args, backend="auto")
    with pytest.raises(ValueError, match="resolve_local"):
        ep.ep_a2a_ffn(*args, mesh=Mesh(np.array(jax.devices()[:2]), ("expert",)), local="auto",
                      exchange=ep.emulated_ragged_all_to_all)


def test_auto_is_resolved_once_for_the_mesh():
    cfg = ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
                      head_dim=4, moe_intermediate_size=8, intermediate_size=8, num_experts=2,
                      top_k=1)
    r = resolve_kernels(cfg, None)
    assert (r.attention, r.expert_backend, r.ep_local_ffn) == ("blockwise", "grouped", "grouped")
    ep_mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    assert resolve_kernels(cfg, ep_mesh).expert_backend == "ep"
    assert resolve_kernels(r, ep_mesh) == r   # resolved choices stay


def test_ep_a2a_local_ffn_and_chunks_are_config_keys():
    m = load_tiny_config().model
    assert (m.ep_local_ffn, m.ep_chunks) == ("auto", 0)
    base = dict(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
                head_dim=4, moe_intermediate_size=8, intermediate_size=8, num_experts=2, top_k=1)
    for bad, match in ((dict(ep_local_ffn="fast"), "ep_local_ffn"), (dict(ep_chunks=-1),
                                                                      "ep_chunks")):
        with pytest.raises(ValueError, match=match):
            ModelConfig(**base, **bad)

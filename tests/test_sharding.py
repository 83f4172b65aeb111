"""Mesh, logical-axis rules, sharded init, and the same numbers on 8 devices as on one."""
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.close import assert_rel_close
from support.paths import load_tiny_config

from gagar_jax import sharding
from gagar_jax.model.transformer import ModelConfig, Transformer
from gagar_jax.run.step import StepConfig, init_train_state

CFG = dataclasses.replace(ModelConfig.from_config(load_tiny_config().model), attention="plain",
                          expert_backend="dense")
B, S = 8, 16
TOKENS = jax.random.randint(jax.random.key(1), (B, S), 0, 256)
SEG = jnp.concatenate([jnp.ones((B, 10), jnp.int32), 2 * jnp.ones((B, 6), jnp.int32)], 1)
POS = jnp.concatenate([jnp.arange(10), jnp.arange(6)])[None].repeat(B, 0)
W = jax.random.normal(jax.random.key(2), (B, S, 256))


def mesh_of(data, fsdp, expert, tensor, devices=None):
    return sharding.make_mesh(types.SimpleNamespace(data=data, fsdp=fsdp, expert=expert,
                                                    tensor=tensor), devices)


def test_make_mesh_fill_and_errors(devices):
    m = mesh_of(-1, 2, 1, 1)
    assert dict(m.shape) == {"data": 4, "fsdp": 2, "expert": 1, "context": 1, "tensor": 1}
    with pytest.raises(ValueError, match="at most one"):
        mesh_of(-1, -1, 1, 1)
    with pytest.raises(ValueError, match="needs 6 devices"):
        mesh_of(3, 2, 1, 1)
    assert mesh_of(1, 1, 1, 1, devices[:1]).devices.size == 1


def test_logical_to_spec_rules_and_divisibility():
    mesh = mesh_of(2, 1, 4, 1)
    assert sharding.logical_to_spec(("batch", None), (8, 16), mesh) == P(
        ("data", "fsdp", "expert"), None
    )
    # 6 rows: data (2) divides, data*expert (8) does not -> expert dropped.
    assert sharding.logical_to_spec(("batch",), (6,), mesh) == P(("data", "fsdp"))
    wide = mesh_of(1, 1, 1, 8)
    assert sharding.logical_to_spec(("embed", "kv_heads", None), (64, 2, 16), wide) == P(
        ("fsdp", "expert"), None, None
    )
    assert sharding.logical_to_spec(("expert_embed",), (64,), wide) == P("fsdp")
    with pytest.raises(KeyError, match="unknown logical axis"):
        sharding.logical_to_spec(("nope",))


EXPECTED = {  # mesh (1, 2, 2, 2): fsdp=2, expert=2, tensor=2
    "embedding": P("tensor", ("fsdp", "expert")),   # dense weights: width over fsdp x expert
    "lm_head": P(("fsdp", "expert"), "tensor"),
    "final_norm/scale": P(None),
    "moe_layers/attn/wq": P(None, ("fsdp", "expert"), "tensor", None),
    "moe_layers/attn/wk": P(None, ("fsdp", "expert"), "tensor", None),
    "moe_layers/attn/wo": P(None, "tensor", None, ("fsdp", "expert")),
    "moe_layers/attn/q_norm/scale": P(None, None),
    "moe_layers/mlp/router": P(None, ("fsdp", "expert"), None),
    "moe_layers/mlp/router_bias": P(None, None),
    "moe_layers/mlp/expert_gate": P(None, "expert", "fsdp", "tensor"),   # width over fsdp only
    "moe_layers/mlp/expert_up": P(None, "expert", "fsdp", "tensor"),
    "moe_layers/mlp/expert_down": P(None, "expert", "tensor", "fsdp"),
}


def _flat(state):
    return {sharding.leaf_path(path): x
            for path, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def test_init_train_state_born_sharded_specs_and_values():
    mesh = mesh_of(1, 2, 2, 2)
    step_cfg = dataclasses.replace(StepConfig.from_config(load_tiny_config()), model=CFG)
    key = jax.random.key(0)
    state, _, _ = init_train_state(step_cfg, mesh, key)
    flat = {**_flat(state.params), **_flat(state.router_bias)}
    for name, spec in EXPECTED.items():
        assert flat[name].sharding == NamedSharding(mesh, spec), name
    # init_train_state draws the model from the first half of its key.
    ref = _flat(nnx.state(Transformer(CFG, rngs=nnx.Rngs(jax.random.split(key)[0]))))
    assert set(flat) == set(ref)
    for name, x in flat.items():
        # Same random streams; jit may fuse the init scaling differently (1 ulp).
        np.testing.assert_allclose(np.asarray(x), np.asarray(ref[name]), rtol=1e-6, err_msg=name)
    with pytest.raises(KeyError, match="PARAM_AXES"):
        sharding.param_logical_axes(["moe_layers", "mlp", "new_weight"], 2)


def _loss_and_grads(cfg, state_sharding=None, mesh=None):
    m = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(m)

    def loss(state, tokens):
        logits, aux = nnx.merge(graphdef, state)(tokens, segment_ids_BxS=SEG, positions_BxS=POS)
        return jnp.sum(logits * W) / B + aux.aux_loss + aux.z_loss

    fn = jax.jit(jax.value_and_grad(loss))
    if mesh is None:
        return fn(state, TOKENS)
    with jax.set_mesh(mesh):
        state = jax.device_put(state, sharding.state_shardings(state, mesh))
        tokens = jax.device_put(
            TOKENS, sharding.named_sharding(mesh, ("batch", None), TOKENS.shape)
        )
        return fn(state, tokens)


@pytest.fixture(scope="module")
def reference():
    return _loss_and_grads(CFG)


@pytest.mark.parametrize("mesh_shape,backend", [
    ((8, 1, 1, 1), "dense"), ((2, 1, 4, 1), "dense"), ((1, 2, 2, 2), "dense"),
    ((2, 1, 4, 1), "ep"), ((1, 2, 2, 2), "ep"),
])
def test_sharded_matches_single_device(reference, mesh_shape, backend):
    mesh = mesh_of(*mesh_shape)
    loss, grads = _loss_and_grads(dataclasses.replace(CFG, expert_backend=backend), mesh=mesh)
    ref_loss, ref_grads = reference
    assert_rel_close(loss, ref_loss)
    flat, ref_flat = _flat(grads), _flat(ref_grads)
    assert set(flat) == set(ref_flat)
    for name, g in flat.items():   # float32 sums in another order: norm-relative
        assert_rel_close(g, ref_flat[name], name=name)
    # The expert weights' gradient keeps the expert-axis layout.
    spec = flat["moe_layers/mlp/expert_gate"].sharding.spec
    assert mesh.shape["expert"] == 1 or spec[1] == "expert"

"""A tiny MiMo-family model and a deterministic sequence of weight states for delta-publishing
tests: per step, most leaves move by a little (a few bf16 elements change: sparse deltas), the
embedding moves a lot (dense), the norms not at all (unchanged), the fp32-kept router tensors
every element (dense, float32)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gagar_jax.model.transformer import ModelConfig, Transformer
from gagar_jax.rollout import delta

CFG = ModelConfig(
    vocab_size=128, hidden_size=64, num_heads=2, head_dim=32, moe_intermediate_size=32,
    intermediate_size=96, num_experts=4, top_k=2, expert_backend="dense", attention="plain",
    num_layers=3, num_kv_heads=1, num_dense_layers=1, router="sigmoid_bias", qk_norm=False,
    layer_types=("sliding", "full", "sliding"), sliding_window=5, sliding_num_kv_heads=2,
    attention_sinks=True, v_head_dim=32, n_group=2, topk_group=1, hf_family="mimo_v2_flash")


def model_and_states(steps: int) -> tuple:
    """(model, [state of step 0, ..., state of step `steps`]) (numpy pytrees for nnx.update)."""
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    state = jax.tree.map(np.asarray, nnx.state(model))
    states = [state]
    for _ in range(steps):
        def move(path, x):
            name = "/".join(str(getattr(k, "key", k)) for k in path)
            if "norm" in name:
                return x
            scale = 0.05 if "embed" in name else 1e-5
            return (x + scale * rng.standard_normal(x.shape)).astype(x.dtype)
        state = jax.tree_util.tree_map_with_path(move, state)
        states.append(state)
    return model, states


def set_state(model: Transformer, state: object) -> Transformer:
    nnx.update(model, jax.tree.map(jnp.asarray, state))
    return model


def raw(weights: dict) -> dict:
    """name -> (dtype, shape, bytes) of materialized tensors, for exact comparison."""
    return {n: (t.dtype, t.array.shape, t.array.tobytes()) for n, t in weights.items()}


def applicable(path: str) -> str:
    """'' if version `path` can be applied (every version of its chain has its manifest and its
    files, each as long as its header says), else what is wrong."""
    try:
        delta.materialize(path)
    except (OSError, ValueError, KeyError) as e:
        return repr(e)
    return ""

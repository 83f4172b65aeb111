"""Hugging Face Qwen3-MoE checkpoints in and out.

`from_pretrained(path)` reads a `transformers` Qwen3-MoE directory: config.json (both the layout
current `transformers` writes -- `num_local_experts`, `rope_parameters` -- and the one published
with Hub checkpoints such as Qwen3-30B-A3B -- `num_experts`, `rope_theta`) and safetensors
weights (one file or sharded with `model.safetensors.index.json`; experts stored per expert,
`experts.{e}.gate_proj.weight`, or fused, `experts.gate_up_proj`). `save_pretrained(model, path)`
writes the per-expert layout `transformers` saves and loads (and vLLM / SGLang read).

Weight layouts (HF Linear weights are [out, in]; ours are [in, out] with heads split out):
  q_proj [H*Dh, D] -> wq [D, H, Dh]      o_proj [D, H*Dh] -> wo [H, Dh, D]
  mlp.gate [E, D]  -> router [D, E]      experts.e.gate_proj [F, D] -> expert_gate[e] [D, F]
"""
from __future__ import annotations

import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from gagar_jax import sharding
from gagar_jax.model import ModelConfig, Transformer

INDEX_FILE = "model.safetensors.index.json"


# ----------------------------------------------------------------------------- config
def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """ModelConfig from a Qwen3-MoE config.json dict; `overrides` set our runtime-only fields."""
    if hf.get("model_type", "qwen3_moe") != "qwen3_moe":
        raise ValueError(f"config.json model_type is {hf.get('model_type')!r}, expected 'qwen3_moe'")
    for key in ("attention_bias", "use_sliding_window"):
        if hf.get(key, False):
            raise ValueError(f"config.json {key}=true is not supported by this Qwen3-MoE port")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={hf['hidden_act']!r}; only 'silu' is supported")
    rope = hf.get("rope_parameters") or {}
    if (rope.get("rope_type") or "default") != "default" or hf.get("rope_scaling"):
        raise ValueError(f"only default RoPE is supported, got rope_parameters={rope}, "
                         f"rope_scaling={hf.get('rope_scaling')}")
    n_layers = hf["num_hidden_layers"]
    num_experts = hf.get("num_local_experts", hf.get("num_experts"))
    if not num_experts:
        raise ValueError("config.json has neither num_local_experts nor num_experts")
    mlp_only, step = set(hf.get("mlp_only_layers") or []), hf.get("decoder_sparse_step", 1)
    is_moe = [i not in mlp_only and (i + 1) % step == 0 for i in range(n_layers)]
    num_dense = is_moe.index(True) if any(is_moe) else n_layers
    if any(is_moe[:num_dense]) or not all(is_moe[num_dense:]):
        raise ValueError(f"dense layers must come first; mlp_only_layers={sorted(mlp_only)}, "
                         f"decoder_sparse_step={step} gives MoE layers {is_moe}")
    heads = hf["num_attention_heads"]
    kw = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=n_layers,
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        moe_intermediate_size=hf["moe_intermediate_size"], intermediate_size=hf["intermediate_size"],
        num_dense_layers=num_dense, num_experts=num_experts, top_k=hf["num_experts_per_tok"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 1e-3)),
    )
    kw.update(overrides)
    return ModelConfig(**kw)


def config_to_hf(cfg: ModelConfig) -> dict:
    """config.json dict in the layout transformers 5 writes, plus the Hub's legacy key names."""
    if cfg.router != "softmax":
        raise ValueError("Qwen3-MoE checkpoints only express the softmax router; "
                         f"model.router={cfg.router!r} cannot be exported")
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "num_local_experts": cfg.num_experts, "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k, "norm_topk_prob": cfg.norm_topk_prob,
        "mlp_only_layers": list(range(cfg.num_dense_layers)), "decoder_sparse_step": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "use_sliding_window": False, "max_position_embeddings": 32768,
        "router_aux_loss_coef": cfg.router_aux_loss_coef, "dtype": cfg.param_dtype,
    }


# ----------------------------------------------------------------------------- weights
def _reader(path: str) -> Callable[[str], np.ndarray]:
    """name -> numpy array over one or many safetensors files."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        single = os.path.join(path, "model.safetensors")
        if not os.path.exists(single):
            raise FileNotFoundError(f"{path} has neither model.safetensors nor {INDEX_FILE}")
        with safe_open(single, "np") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    handles = {}

    def get(name: str) -> np.ndarray:
        if name not in weight_map:
            raise KeyError(f"checkpoint {path} has no tensor {name!r}")
        fname = weight_map[name]
        if fname not in handles:
            handles[fname] = safe_open(os.path.join(path, fname), "np")
        return handles[fname].get_tensor(name)

    get.names = set(weight_map)
    return get


def _layer_from_hf(get, i: int, cfg: ModelConfig, moe: bool) -> dict:
    D, H, Kv, Dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    p = f"model.layers.{i}."
    out = {
        "attn_norm/scale": get(p + "input_layernorm.weight"),
        "mlp_norm/scale": get(p + "post_attention_layernorm.weight"),
        "attn/wq": get(p + "self_attn.q_proj.weight").T.reshape(D, H, Dh),
        "attn/wk": get(p + "self_attn.k_proj.weight").T.reshape(D, Kv, Dh),
        "attn/wv": get(p + "self_attn.v_proj.weight").T.reshape(D, Kv, Dh),
        "attn/wo": get(p + "self_attn.o_proj.weight").T.reshape(H, Dh, D),
        "attn/q_norm/scale": get(p + "self_attn.q_norm.weight"),
        "attn/k_norm/scale": get(p + "self_attn.k_norm.weight"),
    }
    if not moe:
        for name in ("gate", "up", "down"):
            out[f"mlp/mlp_{name}"] = get(p + f"mlp.{name}_proj.weight").T
        return out
    out["mlp/router"] = get(p + "mlp.gate.weight").T
    out["mlp/router_bias"] = np.zeros((cfg.num_experts,), np.float32)
    if p + "mlp.experts.gate_up_proj" in get.names:  # fused layout: [E, 2F, D] and [E, D, F]
        gate_up = get(p + "mlp.experts.gate_up_proj")
        F = cfg.moe_intermediate_size
        out["mlp/expert_gate"] = gate_up[:, :F].transpose(0, 2, 1)
        out["mlp/expert_up"] = gate_up[:, F:].transpose(0, 2, 1)
        out["mlp/expert_down"] = get(p + "mlp.experts.down_proj").transpose(0, 2, 1)
    else:
        for name in ("gate", "up", "down"):
            out[f"mlp/expert_{name}"] = np.stack(
                [get(p + f"mlp.experts.{e}.{name}_proj.weight").T for e in range(cfg.num_experts)])
    return out


def _state_from_hf(get, cfg: ModelConfig) -> dict:
    flat = {"embedding": get("model.embed_tokens.weight"), "final_norm/scale": get("model.norm.weight")}
    if not cfg.tie_embeddings:
        flat["lm_head"] = get("lm_head.weight").T
    stacks = (("dense_layers", range(cfg.num_dense_layers), False),
              ("moe_layers", range(cfg.num_dense_layers, cfg.num_layers), True))
    for container, layers, moe in stacks:
        per_layer = [_layer_from_hf(get, i, cfg, moe) for i in layers]
        for key in (per_layer[0] if per_layer else {}):
            flat[f"{container}/{key}"] = np.stack([layer[key] for layer in per_layer])
    return flat


def from_pretrained(path: str, dtype: str = "float32", *, mesh=None, **overrides):
    """Loads a Hugging Face Qwen3-MoE directory.

    Args:
      path: directory with config.json and model.safetensors (or a sharded index).
      dtype: parameter and compute dtype, "float32" or "bfloat16".
      mesh: optional `Mesh`: each parameter is placed straight into its shards (the logical-axis
        rules of `sharding.py`) instead of onto one device.
      **overrides: further ModelConfig fields (e.g. expert_backend, attention, remat).
    Returns:
      (Transformer, ModelConfig).
    """
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    overrides = {"param_dtype": dtype, "compute_dtype": dtype, **overrides}
    cfg = config_from_hf(hf, **overrides)
    flat = _state_from_hf(_reader(path), cfg)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    shardings = None if mesh is None else sharding.state_shardings(abstract, mesh)

    def fill(key_path, leaf, where=None):
        name = sharding.leaf_path(key_path)
        if name not in flat:
            raise KeyError(f"no checkpoint tensor for parameter {name}")
        arr = np.asarray(flat.pop(name))
        if arr.shape != leaf.shape:
            raise ValueError(f"parameter {name}: checkpoint shape {arr.shape}, model {leaf.shape}")
        arr = arr.astype(np.float32).astype(leaf.dtype)
        return jnp.asarray(arr) if where is None else jax.device_put(arr, where)

    if shardings is None:
        state = jax.tree_util.tree_map_with_path(fill, abstract)
    else:
        state = jax.tree_util.tree_map_with_path(fill, abstract, shardings)
    if flat:
        raise ValueError(f"checkpoint tensors not used by the model: {sorted(flat)}")
    return nnx.merge(graphdef, state), cfg


def _to_host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:  # multi-host: all join the gather
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def _hf_tensors(model: Transformer) -> dict:
    cfg = model.cfg
    ours = {}
    jax.tree_util.tree_map_with_path(lambda kp, x: ours.__setitem__(sharding.leaf_path(kp), _to_host(x)),
                                     nnx.state(model))
    out = {"model.embed_tokens.weight": ours["embedding"], "model.norm.weight": ours["final_norm/scale"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = ours["lm_head"].T
    D = cfg.hidden_size
    for i in range(cfg.num_layers):
        moe = i >= cfg.num_dense_layers
        c, j = ("moe_layers", i - cfg.num_dense_layers) if moe else ("dense_layers", i)
        g = lambda key: ours[f"{c}/{key}"][j]  # noqa: E731
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = g("attn_norm/scale")
        out[p + "post_attention_layernorm.weight"] = g("mlp_norm/scale")
        out[p + "self_attn.q_proj.weight"] = g("attn/wq").reshape(D, -1).T
        out[p + "self_attn.k_proj.weight"] = g("attn/wk").reshape(D, -1).T
        out[p + "self_attn.v_proj.weight"] = g("attn/wv").reshape(D, -1).T
        out[p + "self_attn.o_proj.weight"] = g("attn/wo").reshape(-1, D).T
        out[p + "self_attn.q_norm.weight"] = g("attn/q_norm/scale")
        out[p + "self_attn.k_norm.weight"] = g("attn/k_norm/scale")
        if not moe:
            for name in ("gate", "up", "down"):
                out[p + f"mlp.{name}_proj.weight"] = g(f"mlp/mlp_{name}").T
            continue
        out[p + "mlp.gate.weight"] = g("mlp/router").T
        for name in ("gate", "up", "down"):
            w = g(f"mlp/expert_{name}")
            for e in range(cfg.num_experts):
                out[p + f"mlp.experts.{e}.{name}_proj.weight"] = w[e].T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_pretrained(model: Transformer, path: str, max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes config.json and safetensors (sharded with an index above `max_shard_bytes`).

    Every process must call it (sharded parameters are gathered); only process 0 writes.
    """
    config = config_to_hf(model.cfg)
    tensors = _hf_tensors(model)
    if jax.process_index() != 0:
        return
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += nbytes
    shards.append(current)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata=meta)
        return
    weight_map = {}
    for n, shard in enumerate(shards):
        fname = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata=meta)
        weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)

"""Hugging Face checkpoints in and out, for every family of `hf_families` (Qwen3-MoE, MiMo-V2-Flash).

`from_pretrained(path)` reads config.json (`model_type` picks the family; see `hf_config.py`) and
safetensors weights (one file or sharded with `model.safetensors.index.json`), in the Hub's
per-expert layout or transformers' fused-expert layout. Block-FP8 checkpoints
(`quantization_config.quant_method = "fp8"`: e4m3 weights with a `weight_scale_inv` per
128 x 128 block, as MiMo publishes them) are dequantized on load:
W[i, j] = q[i, j] * scale_inv[i // 128, j // 128], edge blocks included. Tensors under the
family's `carried_prefixes` (MiMo's multi-token-prediction `model.mtp.*`) are skipped on load
and copied into published directories by `save_pretrained(..., carry_from=...)`.

`save_pretrained(model, path, dtype=...)` writes the model in its export family
(`ModelConfig.export_family`), per-expert layout, with the family's fp32-kept tensors (MiMo's
router weight and correction bias) in float32.

safetensors is read and written here directly (a JSON header + raw little-endian bytes): the
installed numpy reader cannot read F8_E4M3 or BF16, which ml_dtypes provides.
"""
from __future__ import annotations

import json
import os
from typing import Callable

import jax
import ml_dtypes
import numpy as np
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from gagar_jax import hf_families, hf_load, sharding
from gagar_jax.hf_config import config_from_hf, config_to_hf  # noqa: F401  (public API)
from gagar_jax.model import Transformer
from gagar_jax.safetensors_io import (INDEX_FILE, ST_DTYPES, dequantize_block_fp8,  # noqa: F401
                                      read_header, write_safetensors)

SAVE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _reader(path, block: tuple | None = None) -> Callable[[str], np.ndarray]:
    """name -> whole float32 numpy array (FP8 weights dequantized); `.names` the tensor names."""
    src = hf_load.Source(path, block)
    get = lambda name: src.read(name)  # noqa: E731
    get.names = src.names
    return get


# ----------------------------------------------------------------------------- transforms
def _save_transform(t: str, name: str, w: np.ndarray) -> dict:
    if t == "copy":
        return {name: w}
    if t == "linear":
        return {name: w.T}
    if t == "heads_out":  # [D, H, Dh] -> [H*Dh, D]
        return {name: w.reshape(w.shape[0], -1).T}
    if t == "heads_in":   # [H, Dv, D] -> [D, H*Dv]
        return {name: w.reshape(-1, w.shape[-1]).T}
    if t == "per_expert":
        return {name.format(e=e): w[e].T for e in range(w.shape[0])}
    raise ValueError(f"transform {t!r} is load-only")


# ----------------------------------------------------------------------------- load
def read_config(path) -> dict:
    """config.json of a checkpoint directory (local or object-store path)."""
    return json.loads((epath.Path(path) / "config.json").read_text())


def from_pretrained(path, dtype: str = "float32", *, mesh=None, shardings=None, **overrides):
    """Loads a Hugging Face Qwen3-MoE or MiMo-V2-Flash directory, each process reading only the
    bytes of its own shards (`hf_load`).

    Args:
      path: directory (local, gs://, s3://) with config.json and model.safetensors (or a sharded
        index).
      dtype: parameter and compute dtype, "float32" or "bfloat16" (the sigmoid router and its
        bias stay float32, as in transformers).
      mesh: optional `Mesh`: each parameter is placed straight into its shards (the logical-axis
        rules of `sharding.py`) instead of onto one device.
      shardings: optional shardings of the model state (an nnx.State tree), instead of `mesh`.
      **overrides: further ModelConfig fields (e.g. expert_backend, attention, remat).
    Returns:
      (Transformer, ModelConfig).
    """
    hf = read_config(path)
    overrides = {"param_dtype": dtype, "compute_dtype": dtype, **overrides}
    cfg = config_from_hf(hf, **overrides)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    if shardings is None and mesh is not None:
        shardings = sharding.state_shardings(abstract, mesh)
    state = hf_load.load_state(path, hf, cfg, abstract, shardings)
    return nnx.merge(graphdef, state), cfg


def carried_tensors(path) -> dict:
    """The tensors of checkpoint `path` its family skips on load (e.g. MiMo MTP), float32."""
    hf = read_config(path)
    family = hf_families.FAMILIES.get(hf.get("model_type", "qwen3_moe"))
    if family is None or not family.carried_prefixes:
        return {}
    get = _reader(path, hf_load.fp8_block(hf))
    return {n: get(n).astype(np.float32) for n in sorted(get.names)
            if any(n.startswith(p) for p in family.carried_prefixes)}


# ----------------------------------------------------------------------------- save
def _to_host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:  # multi-host: all join the gather
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def hf_tensors(model: Transformer, dtype: str = "float32") -> dict:
    """The model's tensors under its export family's names (fp32-kept ones in float32)."""
    cfg = model.cfg
    fam_name = cfg.export_family
    if fam_name is None:
        raise ValueError(hf_families.export_error(cfg))
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(SAVE_DTYPES)}, got {dtype!r}")
    family = hf_families.FAMILIES[fam_name]
    ours = {}
    jax.tree_util.tree_map_with_path(lambda kp, x: ours.__setitem__(sharding.leaf_path(kp), _to_host(x)),
                                     nnx.state(model))
    top = {s.ours: s for s in family.top}
    layer = {s.ours: s for s in family.layer}
    prefixes = hf_load.stack_paths(cfg)
    out = {}

    def put(spec, named):
        for name, w in named.items():
            w = np.asarray(w, np.float32)
            out[name] = np.ascontiguousarray(w if spec.fp32 else w.astype(SAVE_DTYPES[dtype]))

    for name, w in ours.items():
        prefix, layers, key = hf_load.split_leaf(name, prefixes)
        if prefix is None:
            put(top[key], _save_transform(top[key].transform, top[key].hf, w))
            continue
        if key not in layer:
            if key in family.zero_if_absent:
                continue
            raise KeyError(f"{fam_name} has no tensor for parameter {name}")
        spec = layer[key]
        for r, i in enumerate(layers):
            put(spec, _save_transform(spec.transform, spec.hf.replace("{i}", str(i)), w[r]))
    return out


def save_pretrained(model: Transformer, path: str, max_shard_bytes: int = 5 * 2**30, *,
                    dtype: str = "float32", carry_from: str = "") -> None:
    """Writes config.json and safetensors (sharded with an index above `max_shard_bytes`).

    Every process must call it (sharded parameters are gathered); only process 0 writes.

    Args:
      model: the Transformer; its config must have an export family.
      path: output directory (created).
      max_shard_bytes: safetensors shard size bound.
      dtype: "float32" | "bfloat16" | "float16" for every tensor but the family's fp32-kept ones.
      carry_from: a checkpoint directory whose carried tensors (MiMo `model.mtp.*`) are
        written too, in `dtype`.
    """
    config = config_to_hf(model.cfg, dtype)
    tensors = hf_tensors(model, dtype)
    if carry_from:
        tensors.update({k: v.astype(SAVE_DTYPES[dtype]) for k, v in carried_tensors(carry_from).items()})
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
        write_safetensors(os.path.join(path, "model.safetensors"), shards[0], meta)
        return
    weight_map = {}
    for n, shard in enumerate(shards):
        fname = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(path, fname), shard, meta)
        weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)

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
import struct
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from gagar_jax import hf_families, sharding
from gagar_jax.hf_config import config_from_hf, config_to_hf  # noqa: F401  (public API)
from gagar_jax.model import ModelConfig, Transformer, layer_stacks

INDEX_FILE = "model.safetensors.index.json"
ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
             "F8_E4M3": ml_dtypes.float8_e4m3fn, "I64": np.int64, "I32": np.int32,
             "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
SAVE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
SCALE_SUFFIX = "_scale_inv"


# ----------------------------------------------------------------------------- safetensors
def read_header(fname: str) -> tuple:
    """(header dict without __metadata__, byte offset of the data section) of a safetensors file."""
    with open(fname, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def read_tensor(fname: str, entry: dict, data_start: int) -> np.ndarray:
    """One tensor of a safetensors file as a numpy array (ml_dtypes for BF16 / F8_E4M3)."""
    if entry["dtype"] not in ST_DTYPES:
        raise ValueError(f"{fname}: unsupported safetensors dtype {entry['dtype']}")
    dt = np.dtype(ST_DTYPES[entry["dtype"]])
    begin, end = entry["data_offsets"]
    count = (end - begin) // dt.itemsize
    arr = np.fromfile(fname, dtype=dt.newbyteorder("<"), count=count, offset=data_start + begin)
    return arr.reshape(entry["shape"])


def write_safetensors(fname: str, tensors: dict, metadata: dict | None = None) -> None:
    """Writes numpy arrays (float32 / bfloat16 / float16 / ints) as one safetensors file."""
    names = {np.dtype(v): k for k, v in ST_DTYPES.items()}
    header, offset = {}, 0
    for name in sorted(tensors):
        a = tensors[name]
        header[name] = {"dtype": names[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(fname, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name]).tobytes())


def dequantize_block_fp8(q: np.ndarray, scale_inv: np.ndarray, block: tuple = (128, 128)) -> np.ndarray:
    """W[i, j] = q[i, j] * scale_inv[i // bi, j // bj] in float32 (partial edge blocks included)."""
    bi, bj = block
    rows, cols = q.shape
    want = (-(-rows // bi), -(-cols // bj))
    if scale_inv.shape != want:
        raise ValueError(f"weight_scale_inv shape {scale_inv.shape} != {want} for a {q.shape} "
                         f"weight in {bi}x{bj} blocks")
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), bi, axis=0), bj, axis=1)[:rows, :cols]
    return q.astype(np.float32) * s


def _reader(path: str, block: tuple | None = None) -> Callable[[str], np.ndarray]:
    """name -> numpy array over one or many safetensors files; FP8 weights come dequantized."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        single = os.path.join(path, "model.safetensors")
        if not os.path.exists(single):
            raise FileNotFoundError(f"{path} has neither model.safetensors nor {INDEX_FILE}")
        weight_map = {k: "model.safetensors" for k in read_header(single)[0]}
    headers = {}

    def raw(name: str) -> np.ndarray:
        fname = os.path.join(path, weight_map[name])
        if fname not in headers:
            headers[fname] = read_header(fname)
        header, start = headers[fname]
        return read_tensor(fname, header[name], start)

    def get(name: str) -> np.ndarray:
        if name not in weight_map:
            raise KeyError(f"checkpoint {path} has no tensor {name!r}")
        arr = raw(name)
        if block is not None and name + SCALE_SUFFIX in weight_map:
            return dequantize_block_fp8(arr, raw(name + SCALE_SUFFIX), block)
        if arr.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
            raise ValueError(f"{name} is float8 but the checkpoint has no fp8 quantization_config")
        return arr

    get.names = {n for n in weight_map if not (block is not None and n.endswith(SCALE_SUFFIX))}
    return get


def _fp8_block(hf_cfg: dict):
    q = hf_cfg.get("quantization_config") or {}
    if not q:
        return None
    if q.get("quant_method") != "fp8":
        raise ValueError(f"quantization_config.quant_method={q.get('quant_method')!r}; only 'fp8' "
                         "(block-scaled e4m3) is supported")
    block = tuple(q.get("weight_block_size") or (128, 128))
    if len(block) != 2:
        raise ValueError(f"quantization_config.weight_block_size must be [rows, cols], got {block}")
    return block


# ----------------------------------------------------------------------------- transforms
def _load_transform(t: str, get, name: str, shape: tuple, cfg: ModelConfig) -> np.ndarray:
    F = cfg.moe_intermediate_size
    if t == "copy":
        return get(name)
    if t in ("linear", "heads_out", "heads_in"):
        return get(name).T.reshape(shape)
    if t == "per_expert":
        return np.stack([get(name.format(e=e)).T for e in range(cfg.num_experts)])
    if t == "fused_gate":
        return get(name)[:, :F].transpose(0, 2, 1)
    if t == "fused_up":
        return get(name)[:, F:].transpose(0, 2, 1)
    if t == "fused_down":
        return get(name).transpose(0, 2, 1)
    raise ValueError(f"unknown transform {t!r}")


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


def _stack_paths(cfg: ModelConfig) -> list:
    """(parameter path prefix, layer indices) of every block stack of the model."""
    return [(prefix, layers) for spec in layer_stacks(cfg) for prefix, _, layers in spec.paths()]


def _split_leaf(name: str, prefixes: list) -> tuple:
    """'moe_layers_1/p0/attn/wq' -> (stack prefix, its layer indices, 'attn/wq'); top-level
    parameters give (None, None, name)."""
    for prefix, layers in sorted(prefixes, key=lambda p: -len(p[0])):
        if name.startswith(prefix + "/"):
            return prefix, layers, name[len(prefix) + 1:]
    return None, None, name


# ----------------------------------------------------------------------------- load
def _load_leaf(get, family, cfg, name: str, shape: tuple, used: set) -> np.ndarray:
    prefixes = _stack_paths(cfg)
    prefix, layers, key = _split_leaf(name, prefixes)
    if prefix is None:
        spec = {s.ours: s for s in family.top}.get(key)
        if spec is None:
            raise KeyError(f"{family.model_type} has no tensor for parameter {name}")
        used.add(spec.hf)
        return _load_transform(spec.transform, get, spec.hf, shape, cfg)
    spec = {s.ours: s for s in family.layer}.get(key)
    if spec is None:
        if key in family.zero_if_absent:
            return np.zeros(shape, np.float32)
        raise KeyError(f"{family.model_type} has no tensor for parameter {name}")
    out = []
    for i in layers:
        out.append(_load_layer_tensor(get, spec, cfg, i, shape[1:], used))
    return np.stack(out)


def _load_layer_tensor(get, spec, cfg, i: int, shape: tuple, used: set) -> np.ndarray:
    candidates = [(spec.hf, spec.transform)] + [(a, spec.transform) for a in spec.load_aliases]
    if spec.fused:
        candidates.append(spec.fused)
    for template, transform in candidates:
        name = template.replace("{i}", str(i))
        probe = name.format(e=0) if transform == "per_expert" else name
        if probe in get.names:
            names = ([name.format(e=e) for e in range(cfg.num_experts)]
                     if transform == "per_expert" else [name])
            used.update(names)
            return _load_transform(transform, get, name, shape, cfg)
    raise KeyError(f"checkpoint has no tensor {spec.hf.replace('{i}', str(i))!r} "
                   f"(nor {[c[0].replace('{i}', str(i)) for c in candidates[1:]]})")


def from_pretrained(path: str, dtype: str = "float32", *, mesh=None, **overrides):
    """Loads a Hugging Face Qwen3-MoE or MiMo-V2-Flash directory.

    Args:
      path: directory with config.json and model.safetensors (or a sharded index).
      dtype: parameter and compute dtype, "float32" or "bfloat16" (the sigmoid router and its
        bias stay float32, as in transformers).
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
    family = hf_families.FAMILIES[hf.get("model_type", "qwen3_moe")]
    get = _reader(path, _fp8_block(hf))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    shardings = None if mesh is None else sharding.state_shardings(abstract, mesh)
    used: set = set()

    def fill(key_path, leaf, where=None):
        name = sharding.leaf_path(key_path)
        arr = np.asarray(_load_leaf(get, family, cfg, name, leaf.shape, used))
        if arr.shape != leaf.shape:
            raise ValueError(f"parameter {name}: checkpoint shape {arr.shape}, model {leaf.shape}")
        arr = arr.astype(np.float32).astype(leaf.dtype)
        return jnp.asarray(arr) if where is None else jax.device_put(arr, where)

    if shardings is None:
        state = jax.tree_util.tree_map_with_path(fill, abstract)
    else:
        state = jax.tree_util.tree_map_with_path(fill, abstract, shardings)
    unused = sorted(n for n in get.names - used
                    if not any(n.startswith(p) for p in family.carried_prefixes))
    if unused:
        raise ValueError(f"checkpoint tensors not used by the model: {unused[:8]}"
                         + (f" and {len(unused) - 8} more" if len(unused) > 8 else ""))
    return nnx.merge(graphdef, state), cfg


def carried_tensors(path: str) -> dict:
    """The tensors of checkpoint `path` its family skips on load (e.g. MiMo MTP), float32."""
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    family = hf_families.FAMILIES.get(hf.get("model_type", "qwen3_moe"))
    if family is None or not family.carried_prefixes:
        return {}
    get = _reader(path, _fp8_block(hf))
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
    prefixes = _stack_paths(cfg)
    out = {}

    def put(spec, named):
        for name, w in named.items():
            w = np.asarray(w, np.float32)
            out[name] = np.ascontiguousarray(w if spec.fp32 else w.astype(SAVE_DTYPES[dtype]))

    for name, w in ours.items():
        prefix, layers, key = _split_leaf(name, prefixes)
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

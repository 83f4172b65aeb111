"""Hugging Face checkpoints in and out, for every family of `hf_families` \
(Qwen3-MoE, MiMo-V2-Flash).

`from_pretrained(path)` reads config.json (`model_type` picks the family; see `config_json.py`) and
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

Pod scale: `hf_load` reads only each process's shards (byte ranges); `hf_save` reshards on device
so every process writes a disjoint share. Paths may be local or object-store (`etils.epath`).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable

import jax
import numpy as np
from etils import epath
from flax import nnx
from jax.sharding import Mesh

from gagar_jax import sharding
from gagar_jax.distributed import barrier, is_primary
from gagar_jax.hf import families as hf_families
from gagar_jax.hf import load as hf_load
from gagar_jax.hf import save as hf_save
from gagar_jax.hf.config_json import config_from_hf, config_to_hf, engine_warnings  # noqa: F401
from gagar_jax.hf.config_json import published_config as _published_config
from gagar_jax.hf.safetensors import (  # noqa: F401
    INDEX_FILE,
    dequantize_block_fp8,
    read_header,
    write_safetensors,
)
from gagar_jax.model.transformer import ModelConfig, Transformer

log = logging.getLogger(__name__)


def _reader(path: epath.PathLike, block: tuple | None = None) -> Callable[[str], np.ndarray]:
    """name -> whole float32 numpy array (FP8 weights dequantized); `.names` the tensor names."""
    src = hf_load.Source(path, block)
    get = lambda name: src.read(name)
    get.names = src.names
    return get


# ----------------------------------------------------------------------------- load
def read_config(path: epath.PathLike) -> dict:
    """config.json of a checkpoint directory (local or object-store path)."""
    return json.loads((epath.Path(path) / "config.json").read_text())


def from_pretrained(path: epath.PathLike, dtype: str = "float32", *, mesh: Mesh | None = None,
                    shardings: nnx.State | None = None,
                    **overrides) -> tuple[Transformer, ModelConfig]:
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


# ----------------------------------------------------------------------------- save
def model_leaves(model: Transformer) -> dict:
    """Our parameter path name -> array, for every leaf of the model state."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
    return {sharding.leaf_path(kp): x for kp, x in flat}


def carried_shapes(path: epath.PathLike) -> dict:
    """Name -> shape of the tensors of checkpoint `path` its family skips on load (MiMo MTP)."""
    family = hf_families.FAMILIES.get(read_config(path).get("model_type", "qwen3_moe"))
    if family is None or not family.carried_prefixes:
        return {}
    src = hf_load.Source(path, hf_load.fp8_block(read_config(path)))
    return {n: src.shape(n) for n in sorted(src.names)
            if any(n.startswith(p) for p in family.carried_prefixes)}


def published_config(cfg: ModelConfig, dtype: str = "", source: str = "",
                     min_positions: int = 0) -> dict:
    """config.json of a published directory: the model's keys over those of checkpoint
    `source` (its config.json; "" or unreadable: none), `config_json.published_config`."""
    hf = None
    if source:
        try:
            hf = read_config(source)
        except (OSError, ValueError) as e:
            log.warning("config.json of %s unreadable (%s): its keys are not carried over",
                        source, e)
    return _published_config(cfg, dtype, hf, min_positions)


def save_pretrained(model: Transformer, path: epath.PathLike, max_shard_bytes: int = 5 * 2**30, *,
                    dtype: str = "float32", carry_from: str = "", min_positions: int = 0) -> None:
    """Writes config.json and safetensors (sharded with an index above `max_shard_bytes` or on
    several processes), every process writing a disjoint share (`hf_save`).

    Every process must call it (the reshard to the writing hosts is a collective).

    Args:
      model: the Transformer; its config must have an export family.
      path: output directory (local or object store; created).
      max_shard_bytes: safetensors file size bound.
      dtype: "float32" | "bfloat16" | "float16" for every tensor but the family's fp32-kept ones.
      carry_from: a checkpoint directory whose carried tensors (MiMo `model.mtp.*`) are
        written too, in `dtype`, and whose config.json keys the model does not set are kept.
      min_positions: `max_position_embeddings` is at least this when `carry_from` has none.
    """
    config = published_config(model.cfg, dtype, carry_from, min_positions)
    if is_primary():
        for line in engine_warnings(model.cfg):
            log.warning("published %s differs in an engine: %s", path, line)
    leaves = model_leaves(model)
    plan = hf_save.plan_save(leaves, model.cfg, jax.process_count(), dtype,
                             carried_shapes(carry_from) if carry_from else None, max_shard_bytes)
    share = hf_save.gather_share(leaves, plan)
    if carry_from:
        share.update(hf_save.read_carried(plan, carry_from))
    out = epath.Path(path)
    if is_primary():
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=2))
    barrier("gagar_save_pretrained_dir")
    hf_save.write_share(share, plan, out, jax.process_index())
    barrier("gagar_save_pretrained_files")
    if is_primary():
        hf_save.write_index(plan, out)

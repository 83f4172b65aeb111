"""Parallel, bounded save of a sharded model as a Hugging Face checkpoint.

safetensors files hold whole tensors, so the model is first resharded on device
(`units.to_owners`: an all-to-all, cast to the save dtype on device) until every HF tensor
(one layer of a leaf, or one expert of a stacked expert leaf) lives on exactly one process. Each
process then copies only its own tensors to host memory (`gather_share`) and writes them into its
own files (`write_share`): no process holds or writes more than its share, and the shares are
disjoint. Which process writes which tensor, and the file names, follow from the shapes alone
(`plan_save`), so process 0 writes the index without asking anyone; it must do so last, after
every process has written its files.

Files: `model-00001-of-0000N.safetensors` ..., numbered in (process, part) order; a process's
tensors are split into parts of at most `max_shard_bytes`. A 1-process save that fits one part is
the single `model.safetensors` (no index).
"""
from __future__ import annotations

import dataclasses
import json

import jax
import ml_dtypes
import numpy as np
from etils import epath

from gagar_jax.hf import families as hf_families
from gagar_jax.hf import load as hf_load
from gagar_jax.hf import units as param_units
from gagar_jax.hf.safetensors import write_safetensors
from gagar_jax.model.config import ModelConfig
from gagar_jax.publish_format import INDEX_FILE, SINGLE_FILE

SAVE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def save_shape(t: str, shape: tuple) -> tuple:
    """Shape of the stored tensor that transform `t` writes for one of our units."""
    if t == "copy":
        return tuple(shape)
    if t in ("linear", "per_expert"):
        return tuple(shape[::-1])
    if t == "heads_out":   # [D, H, Dh] -> [H*Dh, D]
        return (int(np.prod(shape[1:])), shape[0])
    if t == "heads_in":    # [H, Dv, D] -> [D, H*Dv]
        return (shape[-1], int(np.prod(shape[:-1])))
    raise ValueError(f"transform {t!r} is load-only")


def save_transform(t: str, w: np.ndarray) -> np.ndarray:
    """One unit in our layout -> the stored tensor (a view; copied when written)."""
    if t == "copy":
        return w
    if t in ("linear", "per_expert"):   # per_expert units are single experts
        return w.T
    if t == "heads_out":
        return w.reshape(w.shape[0], -1).T
    if t == "heads_in":
        return w.reshape(-1, w.shape[-1]).T
    raise ValueError(f"transform {t!r} is load-only")


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str          # stored name
    leaf: str          # our leaf ("" for a carried tensor)
    unit: int
    transform: str
    shape: tuple       # stored shape
    dtype: str


@dataclasses.dataclass
class SavePlan:
    units: dict        # leaf name -> param_units.LeafUnits
    tensors: dict      # stored name -> Tensor
    owner: dict        # stored name -> process
    files: list        # [(file name, process, [stored names])]

    def weight_map(self) -> dict:
        return {n: f for f, _, names in self.files for n in names}

    def bytes_of(self, process: int) -> int:
        return sum(_nbytes(self.tensors[n]) for _, p, names in self.files if p == process
                   for n in names)


def _nbytes(t: Tensor) -> int:
    return int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize


def plan_save(leaves: dict, cfg: ModelConfig, procs: int, dtype: str, carried: dict | None = None,
              max_shard_bytes: int = 5 * 2**30) -> SavePlan:
    """Who writes which tensor into which file.

    Args:
      leaves: our leaf name -> array or ShapeDtypeStruct (the model state).
      cfg: the ModelConfig (its export family names the tensors).
      procs: number of processes.
      dtype: "float32" | "bfloat16" | "float16" (the family's fp32-kept tensors stay float32).
      carried: stored name -> shape of tensors copied from another checkpoint (MiMo MTP).
      max_shard_bytes: bound on one file's tensor bytes.
    """
    family_name = hf_families.resolve_family(cfg)
    if family_name is None:
        raise ValueError(hf_families.export_error(cfg))
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(SAVE_DTYPES)}, got {dtype!r}")
    family = hf_families.FAMILIES[family_name]
    top = {s.ours: s for s in family.top}
    layer = {s.ours: s for s in family.layer}
    prefixes = hf_load.stack_paths(cfg)
    specs = {}
    for name in leaves:
        prefix, layers, key = hf_load.split_leaf(name, prefixes)
        spec = top.get(key) if prefix is None else layer.get(key)
        if spec is None:
            if prefix is not None and key in family.zero_if_absent:
                continue
            raise KeyError(f"{family_name} has no tensor for parameter {name}")
        specs[name] = (spec, layers)
    pub = np.dtype(SAVE_DTYPES[dtype]).name
    units = param_units.plan({n: leaves[n] for n in specs}, procs,
                             lambda n, _: "float32" if specs[n][0].fp32 else pub)
    tensors, owner = {}, {}
    for name, (spec, layers) in specs.items():
        lu = units[name]
        for u in range(lu.units):
            idx = lu.unit_index(u)
            stored = spec.hf if not idx else spec.hf.replace("{i}", str(layers[idx[0]]))
            if spec.transform == "per_expert":
                stored = stored.format(e=idx[1])
            t = Tensor(stored, name, u, spec.transform, save_shape(spec.transform, lu.unit_shape),
                       lu.dtype)
            tensors[stored], owner[stored] = t, lu.owner(u)
    load = np.zeros(procs, np.int64)
    for n, t in tensors.items():
        load[owner[n]] += _nbytes(t)
    for n in sorted(carried or {}):   # carried tensors: to the least loaded process
        t = Tensor(n, "", 0, "copy", tuple(carried[n]), pub)
        tensors[n], owner[n] = t, int(np.argmin(load))
        load[owner[n]] += _nbytes(t)
    parts = []
    for p in range(procs):
        current, size = [], 0
        for n in sorted(k for k in tensors if owner[k] == p):
            if current and size + _nbytes(tensors[n]) > max_shard_bytes:
                parts.append((p, current))
                current, size = [], 0
            current.append(n)
            size += _nbytes(tensors[n])
        if current:
            parts.append((p, current))
    if procs == 1 and len(parts) == 1:
        files = [(SINGLE_FILE, 0, parts[0][1])]
    else:
        files = [(f"model-{j + 1:05d}-of-{len(parts):05d}.safetensors", p, names)
                 for j, (p, names) in enumerate(parts)]
    return SavePlan(units, tensors, owner, files)


def gather_share(leaves: dict, plan: SavePlan) -> dict:
    """stored name -> numpy tensor (stored layout and dtype) of the tensors this process writes.

    Every process must call it (the reshard is a collective). Device-to-host copies only of this
    process's units; leaves are resharded one at a time, so device memory grows by one leaf."""
    mesh = param_units.process_mesh() if jax.process_count() > 1 else None
    by_leaf: dict = {}
    for t in plan.tensors.values():
        if t.leaf:
            by_leaf.setdefault(t.leaf, {})[t.unit] = t
    share = {}
    for name, lu in plan.units.items():
        x = leaves[name]
        if mesh is None:   # one process: every unit is ours
            a = np.asarray(jax.device_get(jax.numpy.asarray(x).astype(lu.dtype)))
            mine = dict(enumerate(a.reshape((lu.units,) + lu.unit_shape)))
        else:
            mine = param_units.host_units(param_units.to_owners(x, lu, mesh), lu)
        for u, w in mine.items():
            t = by_leaf[name][u]
            share[t.name] = save_transform(t.transform, w)
    return share


def read_carried(plan: SavePlan, source: epath.PathLike) -> dict:
    """The carried tensors this process writes, read from checkpoint `source` (its bytes only)."""
    p = jax.process_index()
    names = [n for n, t in plan.tensors.items() if not t.leaf and plan.owner[n] == p]
    if not names:
        return {}
    src = hf_load.Source(source, hf_load.fp8_block(json.loads(
        (epath.Path(source) / "config.json").read_text())))
    return {n: src.read(n).astype(plan.tensors[n].dtype) for n in names}


def write_share(share: dict, plan: SavePlan, directory: epath.PathLike, process: int,
                digests: dict | None = None) -> int:
    """Writes this process's files into `directory`; returns the bytes written. `digests`, if
    given, gets {file name: sha256 hex} of each file written."""
    total = 0
    for fname, p, names in plan.files:
        if p == process:
            total += write_safetensors(epath.Path(directory) / fname, {n: share[n] for n in names},
                                       {"format": "pt"}, digests)
    return total


def write_index(plan: SavePlan, directory: epath.PathLike) -> None:
    """The index of a multi-file save (write it after every process's files)."""
    if len(plan.files) == 1 and plan.files[0][0] == SINGLE_FILE:
        return
    total = sum(_nbytes(t) for t in plan.tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": plan.weight_map()}
    (epath.Path(directory) / INDEX_FILE).write_text(json.dumps(index, indent=2))

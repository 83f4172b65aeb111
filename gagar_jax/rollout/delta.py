"""Published versions as tensors, delta chains included: numpy only (no JAX, no torch, no etils).

A version under `<workdir>/published/` is full (HF safetensors) or a delta on its manifest's
`base` (docs/checkpoints.md, "Delta publishing"); `chain(path)` follows `base` down to a full
version, and `materialize(path)` loads that one and applies every delta on it in order:

    weights = materialize(read_latest(workdir)["path"])     # {stored name: Tensor}
    w = weights["model.embed_tokens.weight"].array          # BF16 is raw uint16 bits

An engine that holds version A and sees `latest` at B applies only `pending(A, B)`: the deltas
after A on B's chain (None when A is not on it: start again from the base). Applying a delta is
a bit copy (no arithmetic), so base + deltas equals a full publish of the same step byte for
byte (tests/test_weight_delta.py).

Delta files (written by `gagar_jax/hf/delta.py`, whose docstring is the format): every
`delta-*.safetensors` of the directory; per changed tensor either `NAME` (the whole tensor) or
`NAME:idx` + `NAME:val` (flat C-order indices into the stored tensor, and the new values).
"""
from __future__ import annotations

import dataclasses
import json
import os
import struct

import numpy as np

from gagar_jax.publish_format import DELTA_PREFIX, IDX, INDEX_FILE, SINGLE_FILE, VAL
from gagar_jax.rollout.pointer import read_manifest

# safetensors dtype -> the numpy dtype the bits are held in (BF16 as raw uint16: never computed)
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
          "F8_E4M3": np.uint8, "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
          "U8": np.uint8, "BOOL": np.bool_}


class ChainError(ValueError):
    """A version that cannot be applied: a manifest or a base is missing (collected, or a
    publish still being written), or the chain loops."""


@dataclasses.dataclass
class Tensor:
    """One stored tensor: its safetensors dtype and its elements (BF16: uint16 bits)."""
    dtype: str
    array: np.ndarray


def read_safetensors(fname: str) -> dict:
    """name -> Tensor of every tensor of a safetensors file, read in one pass (writable arrays
    over one buffer). A file shorter than its header says is an error naming it."""
    with open(fname, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        end = max((e["data_offsets"][1] for e in header.values()), default=0)
        buf = bytearray(end)
        got = f.readinto(buf)
    if got != end:
        raise ValueError(f"{fname}: {8 + n + got} bytes, its header needs {8 + n + end}")
    out = {}
    for name, e in header.items():
        if e["dtype"] not in DTYPES:
            raise ValueError(f"{fname}: tensor {name}: unsupported dtype {e['dtype']}")
        lo, hi = e["data_offsets"]
        dt = np.dtype(DTYPES[e["dtype"]])
        a = np.frombuffer(buf, dt, (hi - lo) // dt.itemsize, lo).reshape(e["shape"])
        out[name] = Tensor(e["dtype"], a)
    return out


def weight_files(path: str) -> list:
    """The safetensors files of a full version (sharded with an index, or one file)."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            return [os.path.join(path, n) for n in sorted(set(json.load(f)["weight_map"].values()))]
    return [os.path.join(path, SINGLE_FILE)]


def delta_files(path: str, manifest: dict) -> list:
    """The delta files of a delta version, as its manifest lists them."""
    return [os.path.join(path, n) for n in manifest.get("files", [])
            if n.startswith(DELTA_PREFIX) and n.endswith(".safetensors")]


def chain(path: str) -> list:
    """[full version, delta, ..., `path`]: the directories to apply, base first (siblings under
    one `published/`). Raises ChainError when one is missing or unfinished."""
    out, seen = [], set()
    while True:
        m = read_manifest(path)
        if m is None:
            raise ChainError(f"{path}: no manifest (unfinished, or collected)")
        out.append(path)
        seen.add(os.path.basename(path))
        if m.get("kind", "full") == "full":
            return out[::-1]
        base = m.get("base")
        if not base or base in seen:
            raise ChainError(f"{path}: a {m.get('kind')!r} version with base {base!r}")
        path = os.path.join(os.path.dirname(path), base)


def load_full(path: str) -> dict:
    """name -> Tensor of a full version's weights."""
    out = {}
    for f in weight_files(path):
        out.update(read_safetensors(f))
    return out


def apply_delta(weights: dict, path: str, touched: dict | None = None,
                defer: set | frozenset = frozenset()) -> list:
    """Applies the delta version `path` to `weights` (name -> Tensor, the version it is on) in
    place; returns the names changed. Every entry is a bit copy into the existing array (which
    may be a view into a larger one: an engine's loader layout) when that array is writable and
    of the entry's dtype and shape; a dense entry replaces the tensor otherwise. `touched`
    (name -> [(flat indices, values)] in the order written, or None for a whole tensor)
    gathers what was written, for an engine that patches its own copy element by element;
    the sparse entries of the names in `defer` go to `touched` only (that engine keeps those
    elements elsewhere and brings `weights` up to date itself)."""
    changed = []
    for f in delta_files(path, read_manifest(path) or {}):
        entries = read_safetensors(f)
        for name, t in entries.items():
            if name.endswith(IDX) or name.endswith(VAL):
                continue
            dst = weights.get(name)
            if dst is not None and dst.dtype == t.dtype and dst.array.shape == t.array.shape \
                    and dst.array.flags.writeable:
                dst.array[...] = t.array
            else:
                weights[name] = t
            changed.append(name)
            if touched is not None:
                touched[name] = None
        for key in [k for k in entries if k.endswith(IDX)]:
            name = key[: -len(IDX)]
            if name not in weights:
                raise ChainError(f"{path}: a sparse delta for {name}, absent from its base")
            dst, val = weights[name], entries[name + VAL]
            if val.dtype != dst.dtype:
                raise ChainError(f"{path}: {name} is {val.dtype} in the delta, {dst.dtype} before")
            changed.append(name)
            log = None if touched is None else touched.setdefault(name, [])
            if log is not None:       # None: a dense entry came first (the whole tensor)
                log.append((entries[key].array, val))
                if name in defer:
                    continue
            if not dst.array.flags.writeable:
                dst.array = dst.array.copy()
            dst.array.reshape(-1)[entries[key].array] = val.array
    return changed


def materialize(path: str) -> dict:
    """name -> Tensor of version `path`: its chain's full version with every delta applied."""
    versions = chain(path)
    weights = load_full(versions[0])
    for d in versions[1:]:
        apply_delta(weights, d)
    return weights


def pending(loaded: str, path: str) -> list | None:
    """The deltas that take an engine holding version `loaded` to version `path` ([] when they
    are the same), or None when `loaded` is not on `path`'s chain (load `materialize(path)`)."""
    versions = chain(path)
    names = [os.path.normpath(v) for v in versions]
    if not loaded or os.path.normpath(loaded) not in names:
        return None
    return versions[names.index(os.path.normpath(loaded)) + 1:]

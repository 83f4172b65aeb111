"""Delta publishes: what changed in the publish dtype since the previous published version.

A delta version directory (docs/checkpoints.md, "Delta publishing") holds config.json and one or
more `delta-<process>-<part>.safetensors` files per process, nothing else. For every stored
tensor whose bits differ from the previous version's:
  - `NAME:idx` (int32, or int64 past 2**31 elements) and `NAME:val` (the publish dtype): the
    flat C-order indices of the changed elements of the stored tensor and their new values,
    when that is smaller than the tensor;
  - otherwise `NAME`: the whole new tensor.
Tensors absent from every file are unchanged. Values are compared bit for bit (an unsigned view
of each element), so applying a delta is an exact bit copy: base + deltas equals a full publish
of the same step byte for byte. The reader is `gagar_jax/rollout/delta.py` (numpy only, no JAX);
both take the file names and entry suffixes from `gagar_jax/publish_format.py`, and
tests/test_weight_delta.py holds the two together.

Each process encodes its own share against its own previous share (the shares are disjoint and
follow from the shapes, `save.plan_save`), so no process sees another's tensors.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from etils import epath

from gagar_jax.hf.safetensors import write_safetensors
from gagar_jax.publish_format import IDX, VAL, delta_file_name


def bits(a: np.ndarray) -> np.ndarray:
    """The elements of `a` as unsigned integers of the same width, C-order, flat (a view when
    `a` is contiguous)."""
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(f"u{a.dtype.itemsize}")


@dataclasses.dataclass
class DeltaStats:
    """One process's delta: elements changed out of all, tensors by encoding, bytes."""
    changed: int = 0
    elements: int = 0
    sparse: int = 0
    dense: int = 0
    unchanged: int = 0
    full_bytes: int = 0      # what a full publish of this share would write (tensor bytes)
    bytes: int = 0           # what the delta files hold (tensor bytes, headers included)


def encode(name: str, prev: np.ndarray, cur: np.ndarray) -> dict:
    """The delta entries of one stored tensor: {} (unchanged), {NAME:idx, NAME:val} or {NAME}."""
    if prev.shape != cur.shape or prev.dtype != cur.dtype:
        return {name: np.ascontiguousarray(cur)}
    flat = np.flatnonzero(bits(prev) != bits(cur))
    if flat.size == 0:
        return {}
    idx = flat.astype(np.int32 if cur.size < 2**31 else np.int64)
    if flat.size * (idx.itemsize + cur.itemsize) >= cur.nbytes:
        return {name: np.ascontiguousarray(cur)}
    return {name + IDX: idx, name + VAL: np.ascontiguousarray(cur).reshape(-1)[flat]}


def encode_share(prev: dict, cur: dict) -> tuple:
    """Entries for this process's share `cur` (stored name -> array) against `prev` (the same
    names, the previous version's values); a name missing from `prev` is sent whole.

    Returns:
      ({base name: {entry name: array}}, DeltaStats without `bytes`).
    """
    out, stats = {}, DeltaStats()
    for name in sorted(cur):
        c = cur[name]
        stats.elements += c.size
        stats.full_bytes += c.nbytes
        p = prev.get(name)
        e = encode(name, p, c) if p is not None else {name: np.ascontiguousarray(c)}
        if not e:
            stats.unchanged += 1
            continue
        if name in e:
            stats.dense += 1
            stats.changed += c.size if p is None else int(np.count_nonzero(bits(p) != bits(c)))
        else:
            stats.sparse += 1
            stats.changed += e[name + IDX].size
        out[name] = e
    return out, stats


def write_delta_share(entries: dict, directory: epath.PathLike, process: int,
                      max_shard_bytes: int, digests: dict | None = None) -> tuple:
    """Writes this process's delta files (a tensor's entries stay in one file; files of at most
    `max_shard_bytes` tensor bytes, one at least). Returns (bytes written, file names);
    `digests`, if given, gets {file name: sha256 hex} of each file written."""
    parts, current, size = [], {}, 0
    for name in sorted(entries):
        e = entries[name]
        n = sum(a.nbytes for a in e.values())
        if current and size + n > max_shard_bytes:
            parts.append(current)
            current, size = {}, 0
        current.update(e)
        size += n
    parts.append(current)   # an empty file when nothing changed: the process reports its share
    total, names = 0, []
    for j, tensors in enumerate(parts):
        names.append(delta_file_name(process, j))
        total += write_safetensors(epath.Path(directory) / names[-1], tensors,
                                   {"format": "gagar-delta"}, digests)
    return total, names

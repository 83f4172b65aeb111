"""Writing shards and converting between the two encodings (JSONL <-> ArrayRecord of msgpack).

Conversion is record-for-record and schema-agnostic (records are re-encoded from their parsed
form, so even records the learner would reject survive it); lines that do not parse at all are
counted and skipped. Output files appear atomically (temp name + rename; on an object store, one
upload of the whole object), which is also how a producer publishes a spool shard.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np
from etils import epath

from gagar_jax.distributed import is_remote
from gagar_jax.feed import packed, schema
from gagar_jax.feed.sources import ShardReader, shard_encoding


@dataclasses.dataclass(frozen=True)
class ConvertStats:
    records: int
    skipped_unparseable: int


def _write_local(path: epath.Path, encoding: str, payloads: Iterable[bytes]) -> int:
    """Writes encoded records to a local temp file; returns the count. Caller renames it."""
    n = 0
    if encoding == "json":
        with open(path, "wb") as f:
            for p in payloads:
                f.write(p + b"\n")
                n += 1
        return n
    from array_record.python.array_record_module import ArrayRecordWriter
    writer = ArrayRecordWriter(os.fspath(path), "group_size:1")
    for p in payloads:
        writer.write(p)
        n += 1
    writer.close()
    return n


def write_shard(path: epath.PathLike, payloads: Iterable[bytes]) -> int:
    """Atomically writes already-encoded records to `path` (encoding from its suffix).

    Args:
      path: destination (*.jsonl: JSON payloads; *.arrayrecord: msgpack payloads).
      payloads: encoded records, one group each.
    Returns:
      The number of records written.
    """
    path = epath.Path(path)
    encoding = shard_encoding(path)
    # ArrayRecord writes local files; remote destinations are staged locally then copied.
    with tempfile.TemporaryDirectory() as tmp:
        local = epath.Path(tmp) / ("part" + path.suffix)
        n = _write_local(local, encoding, payloads)
        if is_remote(path):     # one upload: an object appears whole, and there is no rename
            path.write_bytes(local.read_bytes())
            return n
        staged = path.parent / ("." + path.name + ".tmp")
        local.copy(staged, overwrite=True)
        staged.replace(path)
    return n


def write_groups(path: epath.PathLike, groups: Iterable[schema.Group]) -> int:
    """Atomically writes `Group` records to a *.jsonl or *.arrayrecord shard."""
    encoding = shard_encoding(path)
    return write_shard(path, (schema.encode(g, encoding) for g in groups))


def pack_routed(obj: Any) -> Any:
    """A parsed record with every nested-list `routed_experts` turned into the compact form
    (docs/feed.md, "Compact arrays"); lists that are not a rectangular `[n, L, K]` of ids
    >= -1 are left as they are (the learner names what is wrong with them)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("trajectories"), list):
        return obj
    for traj in obj["trajectories"]:
        routed = traj.get("routed_experts") if isinstance(traj, dict) else None
        if not isinstance(routed, list):
            continue
        try:
            ids = np.asarray(routed)
            if ids.ndim == 3:
                traj["routed_experts"] = schema.to_builtins(packed.pack(ids))
        except (ValueError, TypeError, OverflowError):
            continue
    return obj


def convert(src: epath.PathLike, dst: epath.PathLike, *, max_record_bytes: int = 2**31 - 1,
            compact_routing: bool = False) -> ConvertStats:
    """Converts a shard between JSONL and ArrayRecord (by suffix), record for record.

    Args:
      src, dst: the shards.
      max_record_bytes: longer JSONL lines are skipped as unparseable (default 2 GiB: long
        trajectories with packed routing run to hundreds of MB per group).
      compact_routing: rewrite nested-list `routed_experts` in the compact form (`pack_routed`).
    Returns:
      Counts of records written and unparseable records skipped.
    """
    src_enc, dst_enc = shard_encoding(src), shard_encoding(dst)
    skipped = 0

    def payloads():
        nonlocal skipped
        reader = ShardReader(src, max_record_bytes=max_record_bytes)
        while (rec := reader.next()) is not None:
            try:
                if not isinstance(rec.payload, bytes):      # an `Oversized` line
                    raise msgspec.DecodeError("over max_record_bytes")
                obj = schema.decode_untyped(rec.payload, src_enc)
            except msgspec.DecodeError:
                skipped += 1
                continue
            if compact_routing:
                obj = pack_routed(obj)
            if src_enc == dst_enc and not compact_routing:
                yield rec.payload
            elif dst_enc == "json":
                yield msgspec.json.encode(obj)
            else:
                yield msgspec.msgpack.encode(obj)

    n = write_shard(dst, payloads())
    return ConvertStats(records=n, skipped_unparseable=skipped)

"""dead_letter.jsonl: one line per rejected record, with its reason and the original record.

The file's length is part of the feed's checkpointed state: on resume it is truncated back to
the checkpointed length, so records re-read after a crash are dead-lettered exactly once.

Entries are bounded: a record over `max_record_bytes` (an `Oversized` payload, or any raw
payload that large) is stored as its first `PREFIX_BYTES` bytes plus its size and sha256, never
whole. Writing an entry never raises because of the record's content (deep nesting, non-finite
numbers, odd types): the fallback entry keeps the reason, the origin and the raw bytes.
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import logging
import os
from typing import Any, Optional

import msgspec
from etils import epath

from gagar_jax.feed import schema

log = logging.getLogger(__name__)
_ENC = msgspec.json.Encoder()
PREFIX_BYTES = 4096         # how much of an oversized record a dead-letter entry keeps


@dataclasses.dataclass(frozen=True)
class Oversized:
    """A record too large to read whole: its first bytes, its full size and its sha256."""

    prefix: bytes
    size: int
    sha256: str


def summarize(raw: bytes) -> Oversized:
    """The `Oversized` form of a whole record held in memory."""
    return Oversized(bytes(raw[:PREFIX_BYTES]), len(raw), hashlib.sha256(raw).hexdigest())


def _oversized(o: Oversized) -> dict:
    return {"prefix_base64": base64.b64encode(o.prefix[:PREFIX_BYTES]).decode("ascii"),
            "size": o.size, "sha256": o.sha256}


def _original(raw: Any, encoding: str, limit: int) -> dict:
    """The record as it arrived: parsed JSON when it parses, its raw bytes (base64) when it
    does not parse or was msgpack; a prefix + size + sha256 when it is over `limit` bytes."""
    if isinstance(raw, Oversized):
        return {"oversized": _oversized(raw)}
    if isinstance(raw, schema.Group):
        return {"record": schema.to_builtins(raw)}
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        try:
            return {"record": msgspec.to_builtins(raw)}
        except Exception:  # noqa: BLE001 -- any object: keep a bounded repr instead
            return {"record_repr": repr(raw)[:PREFIX_BYTES]}
    raw = bytes(raw)
    if len(raw) > limit:
        return {"oversized": _oversized(summarize(raw))}
    b64 = {"raw_base64": base64.b64encode(raw).decode("ascii")}
    try:
        record = {"record": msgspec.to_builtins(schema.decode_untyped(raw, encoding))}
        _ENC.encode(record)   # deep nesting or odd values fail here, not in write()
    except Exception:  # noqa: BLE001 -- unparseable, too deep: the bytes are the record
        return b64
    # JSON cannot carry everything msgpack can (non-finite floats, binary): keep the bytes too.
    return record if encoding == "json" else {**record, **b64}


class DeadLetter:
    """Appends rejected records to `path`; `enabled=False` (non-zero processes) writes nothing.

    Args:
      path: the dead-letter file.
      enabled: whether this process writes.
      max_record_bytes: records larger than this are stored as prefix + size + sha256.
    """

    def __init__(self, path: epath.PathLike, enabled: bool = True,
                 max_record_bytes: int = 4_000_000):
        self.path = epath.Path(path)
        self.enabled = enabled
        self.limit = max_record_bytes
        self.count = 0
        self.length = self.path.stat().length if enabled and self.path.exists() else 0

    def entry(self, reason: str, detail: str, raw: Any, encoding: str, origin: str,
              group_id: Optional[str] = None) -> bytes:
        """The encoded line for one rejected record (never raises on record content)."""
        entry = {"reason": reason, "detail": str(detail)[:PREFIX_BYTES], "origin": origin,
                 "group_id": group_id if group_id is None else str(group_id)[:schema.MAX_ID_CHARS]}
        try:
            entry.update(_original(raw, encoding, self.limit))
            return _ENC.encode(entry) + b"\n"
        except Exception as e:  # noqa: BLE001 -- the entry must exist whatever the record is
            entry.pop("record", None)
            entry["record_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            return _ENC.encode(entry) + b"\n"

    def write(self, reason: str, detail: str, raw: Any, encoding: str, origin: str,
              group_id: Optional[str] = None) -> None:
        """Appends one entry: reason, detail, origin (file/shard and record index), original.

        I/O errors (a full disk, a read-only workdir) propagate: they are fatal to the run.
        """
        self.count += 1
        if not self.enabled:
            return
        line = self.entry(reason, detail, raw, encoding, origin, group_id)
        with self.path.open("ab") as f:
            f.write(line)
        self.length += len(line)

    def sync(self) -> None:
        """Forces the file to stable storage (before a checkpoint records `length`)."""
        # Object-store writes are durable once the call returns: nothing to force there.
        if self.enabled and "://" not in str(self.path) and self.path.exists():
            fd = os.open(os.fspath(self.path), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def restore(self, length: int, count: int) -> None:
        """Truncates the file back to a checkpointed `length` (bytes); never extends it."""
        self.count = count
        if not self.enabled:
            return
        size = self.path.stat().length if self.path.exists() else 0
        if size > length:
            # Truncation needs a local file; remote workdirs are rewritten.
            try:
                os.truncate(os.fspath(self.path), length)
            except (OSError, TypeError):
                self.path.write_bytes(self.path.read_bytes()[:length])
        elif size < length:
            log.warning("%s is %d bytes, shorter than the checkpointed %d; not extending it",
                        self.path, size, length)
            length = size
        self.length = length

"""dead_letter.jsonl: one line per rejected record, with its reason and the original record.

The file's position is part of the feed's checkpointed state: on resume it is cut back to the
checkpointed position, so records re-read after a crash are dead-lettered exactly once. On an
object-store workdir the file is a series of segments (`audit_file.py`).

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
from typing import Any, Optional

import msgspec
from etils import epath

from gagar_jax.audit_file import AuditFile, AuditPosition
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
        except Exception:  # any object: keep a bounded repr instead
            return {"record_repr": repr(raw)[:PREFIX_BYTES]}
    raw = bytes(raw)
    if len(raw) > limit:
        return {"oversized": _oversized(summarize(raw))}
    b64 = {"raw_base64": base64.b64encode(raw).decode("ascii")}
    try:
        record = {"record": msgspec.to_builtins(schema.decode_untyped(raw, encoding))}
        _ENC.encode(record)   # deep nesting or odd values fail here, not in write()
    except Exception:  # unparseable, too deep: the bytes are the record
        return b64
    # JSON cannot carry everything msgpack can (non-finite floats, binary): keep the bytes too.
    return record if encoding == "json" else {**record, **b64}


class DeadLetter:
    """Appends rejected records to `path`; `enabled=False` (non-zero processes) writes nothing.

    The file is an `AuditFile`: one file on local disk, rolling segments on an object store.
    Each entry is flushed at once (an object store uploads the open segment again).

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
        self._file = AuditFile(path) if enabled else None

    def position(self) -> AuditPosition:
        """Where the file ends (every entry is flushed when written): for the checkpoint."""
        return self._file.position() if self.enabled else AuditPosition("", 0)

    @property
    def length(self) -> int:
        """Bytes of the file (local) or of its open segment (object stores)."""
        return self.position().length

    def entry(self, reason: str, detail: str, raw: Any, encoding: str, origin: str,
              group_id: Optional[str] = None) -> bytes:
        """The encoded line for one rejected record (never raises on record content)."""
        entry = {"reason": reason, "detail": str(detail)[:PREFIX_BYTES], "origin": origin,
                 "group_id": group_id if group_id is None else str(group_id)[:schema.MAX_ID_CHARS]}
        try:
            entry.update(_original(raw, encoding, self.limit))
            return _ENC.encode(entry) + b"\n"
        except Exception as e:  # the entry must exist whatever the record is
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
        self._file.write(self.entry(reason, detail, raw, encoding, origin, group_id))
        self._file.flush()

    def sync(self) -> None:
        """Forces the file to stable storage (before a checkpoint records its position)."""
        if self.enabled:
            self._file.sync()

    def restore(self, length: int, count: int, segment: str = "") -> None:
        """Cuts the file back to a checkpointed position (bytes of the file, or of `segment`
        on an object store); never extends it."""
        self.count = count
        if self.enabled:
            self._file.restore(AuditPosition(segment, length))

    def close(self) -> None:
        if self.enabled:
            self._file.close()

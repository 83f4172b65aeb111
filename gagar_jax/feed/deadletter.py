"""dead_letter.jsonl: one line per rejected record, with its reason and the original record.

The file's length is part of the feed's checkpointed state: on resume it is truncated back to
the checkpointed length, so records re-read after a crash are dead-lettered exactly once.
"""
from __future__ import annotations

import base64
import os
from typing import Any, Optional

import msgspec
from etils import epath

from gagar_jax.feed import schema

_ENC = msgspec.json.Encoder()


def _original(raw: Any, encoding: str) -> dict:
    """The record as it arrived: parsed JSON when it parses, its raw bytes (base64) when it
    does not parse or was msgpack."""
    if isinstance(raw, schema.Group):
        return {"record": schema.to_builtins(raw)}
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        try:
            return {"record": msgspec.to_builtins(raw)}
        except (TypeError, ValueError):
            return {"record_repr": repr(raw)[:100_000]}
    raw = bytes(raw)
    b64 = {"raw_base64": base64.b64encode(raw).decode("ascii")}
    try:
        record = {"record": msgspec.to_builtins(schema.decode_untyped(raw, encoding))}
    except (msgspec.DecodeError, TypeError, ValueError):
        return b64
    # JSON cannot carry everything msgpack can (non-finite floats, binary): keep the bytes too.
    return record if encoding == "json" else {**record, **b64}


class DeadLetter:
    """Appends rejected records to `path`; `enabled=False` (non-zero processes) writes nothing."""

    def __init__(self, path: epath.PathLike, enabled: bool = True):
        self.path = epath.Path(path)
        self.enabled = enabled
        self.count = 0
        self.length = self.path.stat().length if enabled and self.path.exists() else 0

    def write(self, reason: str, detail: str, raw: Any, encoding: str, origin: str,
              group_id: Optional[str] = None) -> None:
        """Appends one entry: reason, detail, origin (file/shard and record index), original."""
        self.count += 1
        if not self.enabled:
            return
        entry = {"reason": reason, "detail": detail, "origin": origin, "group_id": group_id}
        entry.update(_original(raw, encoding))
        line = _ENC.encode(entry) + b"\n"
        with self.path.open("ab") as f:
            f.write(line)
        self.length += len(line)

    def restore(self, length: int, count: int) -> None:
        """Truncates the file back to a checkpointed `length` (bytes)."""
        self.count = count
        if not self.enabled:
            return
        if self.path.exists() and self.path.stat().length > length:
            # Truncation needs a local file; remote workdirs are rewritten.
            try:
                os.truncate(os.fspath(self.path), length)
            except (OSError, TypeError):
                self.path.write_bytes(self.path.read_bytes()[:length])
        self.length = length

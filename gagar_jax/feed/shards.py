"""Reading one feed shard (a JSONL or ArrayRecord file) with bounded memory.

A JSONL line over `max_record_bytes` is handed out as an `Oversized` summary (prefix, size,
sha256) without being read whole: memory per line is at most max_record_bytes + 1 MiB. A shard
that is not a regular file (a directory, a symlink to /dev/zero, a FIFO) or cannot be read is
skipped and reported through `SourceEvents`, never raised.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import stat as stat_lib
from typing import Any, Callable, Optional

from etils import epath

from gagar_jax.feed.deadletter import PREFIX_BYTES, Oversized

JSONL_SUFFIXES = (".jsonl", ".json")
ARRAYRECORD_SUFFIXES = (".arrayrecord", ".array_record")
DONE_MARKER = "_DONE"   # a spool containing this file ends once every shard is consumed
_CHUNK = 1 << 20        # bytes read at a time while skipping past an oversized line


@dataclasses.dataclass(frozen=True)
class RawRecord:
    payload: Any        # bytes (json / msgpack), an `Oversized`, or an object (Group or dict)
    encoding: str       # "json" | "msgpack" | "object"
    origin: str         # "<file>:<record index>", for dead-letter entries


class SourceEvents:
    """What a source reports besides records. The `Feed` replaces this with one that also
    counts shards in its ledger; this default only logs."""

    def __init__(self, log: Callable[[str], None] = print):
        self.log = log

    def skipped(self, path: str, kind: str, detail: str) -> None:
        """A shard was skipped (`kind`: "not_a_regular_file" | "unreadable")."""
        self.log(f"feed: skipping shard {path}: {detail}")

    def changed(self, path: str) -> None:
        """A consumed shard's size or mtime changed after it was read."""
        self.log(f"feed: WARNING consumed shard {path} changed after it was read; the change "
                 "is not read (publish a new shard instead)")

    def idle(self) -> None:
        """The source has nothing to hand out right now (called before each idle wait)."""


def is_remote(path: Any) -> bool:
    """True for object-store paths (gs://, s3://): no POSIX stat, locks or truncation there."""
    return "://" in str(path)


def shard_encoding(path: epath.PathLike) -> str:
    """"json" for *.jsonl, "msgpack" for *.arrayrecord; raises for anything else."""
    name = epath.Path(path).name
    if name.endswith(JSONL_SUFFIXES):
        return "json"
    if name.endswith(ARRAYRECORD_SUFFIXES):
        return "msgpack"
    raise ValueError(f"feed shard {name!r}: expected a name ending in "
                     f"{JSONL_SUFFIXES + ARRAYRECORD_SUFFIXES}")


def _not_regular(path: epath.Path) -> Optional[str]:
    """Why a local shard path is not a readable regular file (None if it is, or is remote)."""
    if is_remote(path):
        return None
    try:
        mode = os.stat(os.fspath(path)).st_mode     # follows symlinks (e.g. to /dev/zero)
    except OSError as e:
        return f"cannot stat: {e.strerror or e}"
    if not stat_lib.S_ISREG(mode):
        kind = "a directory" if stat_lib.S_ISDIR(mode) else "not a regular file"
        return f"{kind} (mode {stat_lib.filemode(mode)})"
    return None


class ShardReader:
    """Sequential records of one shard starting at record `start` (blank JSONL lines skipped).

    Raises OSError (or, for ArrayRecord, any error of the reader) when the shard cannot be
    opened; `next()` returns None at the end and re-raises read errors as OSError.
    """

    def __init__(self, path: epath.PathLike, start: int = 0, max_record_bytes: int = 4_000_000):
        self.path = epath.Path(path)
        self.encoding = shard_encoding(self.path)
        self.limit = max_record_bytes
        self.index = 0
        why = _not_regular(self.path)
        if why:
            raise IsADirectoryError(f"{self.path}: {why}")
        if self.encoding == "json":
            self._file = self.path.open("rb")           # streamed line by line, never slurped
        else:
            import grain.python as grain  # deferred: grain is heavy to import
            self._source = grain.ArrayRecordDataSource([str(self.path)])
        while self.index < start and self.next() is not None:
            pass

    def _line(self) -> Any:
        """The next non-blank line (bytes), an `Oversized` summary, or None at the end."""
        while True:
            line = self._file.readline(self.limit + 1)
            if not line:
                return None
            if len(line) <= self.limit or line.endswith(b"\n"):
                if not line.isspace():      # stops at the first byte (no copy of the line)
                    return line
                continue
            digest, size, chunk = hashlib.sha256(), 0, line
            while True:     # hash the rest of the line in bounded chunks (no newline hashed)
                body = chunk[:-1] if chunk.endswith(b"\n") else chunk
                digest.update(body)
                size += len(body)
                if chunk.endswith(b"\n"):
                    break
                chunk = self._file.readline(_CHUNK)
                if not chunk:
                    break
            return Oversized(line[:PREFIX_BYTES], size, digest.hexdigest())

    def next(self) -> Optional[RawRecord]:
        if self.encoding == "json":
            payload = self._line()
            if payload is None:
                self.close()
                return None
        else:
            if self.index >= len(self._source):
                return None
            payload = self._source[self.index]
        rec = RawRecord(payload, self.encoding, f"{self.path}:{self.index}")
        self.index += 1
        return rec

    def close(self) -> None:
        if self.encoding == "json" and not self._file.closed:
            self._file.close()


def open_shard(path: epath.PathLike, start: int, max_record_bytes: int,
               events: SourceEvents) -> Optional[ShardReader]:
    """A `ShardReader`, or None after reporting why the shard is skipped."""
    try:
        return ShardReader(path, start, max_record_bytes)
    except IsADirectoryError as e:
        events.skipped(str(path), "not_a_regular_file", str(e))
    except Exception as e:  # noqa: BLE001 -- unreadable: permissions, I/O, a bad ArrayRecord
        events.skipped(str(path), "unreadable", f"{type(e).__name__}: {e}")
    return None


def read_next(reader: ShardReader, events: SourceEvents) -> Optional[RawRecord]:
    """`reader.next()`, turning a read error into a reported skip of the shard's rest."""
    try:
        return reader.next()
    except Exception as e:  # noqa: BLE001 -- an I/O error mid-shard ends that shard only
        events.skipped(str(reader.path), "unreadable",
                       f"read error after record {reader.index}: {type(e).__name__}: {e}")
        return None

"""Reading one feed shard (a JSONL or ArrayRecord file) with bounded memory.

A JSONL line over `max_record_bytes` is handed out as an `Oversized` summary (prefix, size,
sha256) without being read whole: memory per line is at most about twice max_record_bytes (its
pieces and the joined line) plus a read buffer of at most 16 MiB. \
A shard that is not a regular file (a
directory, a symlink to /dev/zero, a FIFO) or cannot be read is skipped and reported through
`SourceEvents`, never raised.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import stat as stat_lib
from collections.abc import Callable
from typing import Any, BinaryIO, Optional

from etils import epath

from gagar_jax.distributed import is_remote
from gagar_jax.feed.deadletter import PREFIX_BYTES, Oversized

LOG = logging.getLogger(__name__)   # only the CLI configures logging

JSONL_SUFFIXES = (".jsonl", ".json")
ARRAYRECORD_SUFFIXES = (".arrayrecord", ".array_record")
DONE_MARKER = "_DONE"   # a spool containing this file ends once every shard is consumed
_CHUNK = 1 << 20        # bytes read at a time while skipping past an oversized line


@dataclasses.dataclass(frozen=True)
class RawRecord:
    payload: Any        # bytes (json / msgpack), an `Oversized`, or an object (Group or dict)
    encoding: str       # "json" | "msgpack" | "object"
    origin: str         # "<file>:<record index>", for dead-letter entries


VANISHED = "vanished_after_partial_read"   # skipped_shards_by_reason keys
REPLACED = "replaced_after_partial_read"
MARK_BYTES = 256        # bytes before a saved read position that identify the file read


def warner(log: Callable[[str], None]) -> Callable[[str], None]:
    """`log`'s logger at WARNING level when `log` is a logger's `info`, else `log` itself."""
    owner = getattr(log, "__self__", None)
    if isinstance(owner, logging.Logger) and getattr(log, "__func__", None) is logging.Logger.info:
        return owner.warning
    return log


class SourceEvents:
    """What a source reports besides records. The `Feed` replaces this with one that also
    counts shards in its ledger; this default only logs."""

    def __init__(self, log: Callable[[str], None] = LOG.info):
        self.log = log
        self.warn = warner(log)

    def skipped(self, path: str, kind: str, detail: str) -> None:
        """A shard was skipped (`kind`: "not_a_regular_file" | "unreadable")."""
        self.log(f"feed: skipping shard {path}: {detail}")

    def changed(self, path: str) -> None:
        """A consumed shard's size or mtime changed after it was read (other than growth)."""
        self.warn(f"feed: WARNING consumed shard {path} changed after it was read; the change "
                  "is not read (publish a new shard instead)")

    def grew(self, path: str) -> None:
        """A spool shard written in place grew after it was read (once per shard): the new
        records are read."""
        self.warn(f"feed: WARNING shard {path} grew after it was read: it is being written in "
                  "place; its new records are read (publish by rename: docs/feed.md)")

    def vanished(self, path: str, records_read: int) -> None:
        """The shard being read disappeared (deleted while the learner was down): its unread
        records are lost."""
        self.warn(f"feed: WARNING shard {path} vanished after {records_read} of its records were "
                  f"read (deleted before the run ended?); its unread records are lost, counted "
                  f"in the ledger as {VANISHED}")

    def replaced(self, path: str, records_read: int, detail: str) -> None:
        """The shard being read was replaced by another file (a different inode, or other
        bytes before the read position): the original's unread records are lost, and the new
        file is not read from the old position."""
        self.warn(f"feed: WARNING shard {path} was replaced by another file after {records_read} "
                  f"of its records were read ({detail}); the original's unread records are lost "
                  f"and the new file is not read, counted in the ledger as {REPLACED}")

    def unreadable(self, path: str, detail: str) -> None:
        """A spool shard cannot be read yet (permission denied): it is retried at every poll
        (logged once per shard)."""
        self.warn(f"feed: WARNING shard {path} cannot be read ({detail}); retrying at every "
                  "poll, counted in the ledger's unreadable_shards until it is read")

    def readable(self, path: str) -> None:
        """A shard reported by `unreadable` was opened."""
        self.log(f"feed: shard {path} is readable now; reading it")

    def file_set_changed(self, path: str, kind: str) -> None:
        """On resume, a file feed's glob matches differently (`kind`: "vanished_after_read": a
        file already read is gone, nothing lost; "inserted_before_position": a new file sorts
        before the resume position, it is read)."""
        self.warn(f"feed: WARNING feed file {path}: {kind.replace('_', ' ')} (the position is "
                  "kept by file name)")

    def idle(self) -> None:
        """The source has nothing to hand out right now (called before each idle wait)."""


def shard_encoding(path: epath.PathLike) -> str:
    """"json" for *.jsonl, "msgpack" for *.arrayrecord; raises for anything else."""
    name = epath.Path(path).name
    if name.endswith(JSONL_SUFFIXES):
        return "json"
    if name.endswith(ARRAYRECORD_SUFFIXES):
        return "msgpack"
    raise ValueError(f"feed shard {name!r}: expected a name ending in "
                     f"{JSONL_SUFFIXES + ARRAYRECORD_SUFFIXES}")


def mark(path: epath.PathLike, offset: int) -> Optional[list]:
    """What identifies the local file at `path` read up to byte `offset`: [inode, a digest of
    the `MARK_BYTES` bytes before `offset`] (None: remote, or it cannot be read)."""
    path = epath.Path(path)
    if is_remote(path):
        return None
    try:
        with open(os.fspath(path), "rb") as f:
            ino = os.fstat(f.fileno()).st_ino
            start = max(0, offset - MARK_BYTES)
            f.seek(start)
            data = f.read(offset - start)
    except OSError:
        return None
    return [ino, hashlib.sha256(data).hexdigest()[:16]]


def replaced(path: epath.PathLike, saved: Optional[list], offset: int) -> Optional[str]:
    """Why the file at `path` is not the one `saved` (a `mark(path, offset)`) was taken from;
    None when it is, or when there is nothing to compare (no mark, remote, gone)."""
    path = epath.Path(path)
    if not saved or is_remote(path):
        return None
    try:
        size = os.stat(os.fspath(path)).st_size
    except OSError:
        return None
    if size < offset:
        return f"{size} bytes, fewer than the {offset} already read"
    now = mark(path, offset)
    if now is None:
        return None
    if now[0] != saved[0]:
        return f"inode {saved[0]} is now {now[0]}"
    if now[1] != saved[1]:
        return f"the {MARK_BYTES} bytes before byte {offset} differ"
    return None


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


class LineReader:
    """`readline(limit)` over a binary file, reading up to 16 MiB at a time.

    Same contract as `io.BufferedReader.readline(limit)` (at most `limit` bytes, ending after
    the first newline), at memcpy speed: the buffered reader's readline scans 8 KiB chunks
    and runs at ~0.4 GB/s on lines of hundreds of MB (long trajectories with packed routing).
    """

    CHUNK = 1 << 24

    def __init__(self, file: BinaryIO):
        self.file = file
        self.buf = b""
        self.pos = 0
        self.consumed = 0       # bytes handed out (readline) or skipped (skip_line) so far
        self.eol = False        # whether the last line skipped by `skip_line` ended in b"\n"

    def readline(self, limit: int) -> bytes:
        pieces, size = [], 0
        while True:
            end = min(len(self.buf), self.pos + (limit - size))
            i = self.buf.find(b"\n", self.pos, end)
            stop = end if i < 0 else i + 1
            if stop > self.pos:
                whole = self.pos == 0 and stop == len(self.buf)    # no copy of the buffer
                pieces.append(self.buf if whole else memoryview(self.buf)[self.pos:stop])
                size += stop - self.pos
                self.pos = stop
            if i >= 0 or size >= limit:
                break
            # Never read much past `limit`: memory stays bounded by the caller's limit.
            self.buf, self.pos = self.file.read(min(self.CHUNK, max(1 << 16, limit - size))), 0
            if not self.buf:
                break
        self.consumed += size
        if len(pieces) == 1:
            return pieces[0] if isinstance(pieces[0], bytes) else pieces[0].tobytes()
        return b"".join(pieces)

    def skip_line(self, consume: Callable[[memoryview], None]) -> int:
        """Passes the rest of the current line (without its newline) to `consume` in pieces
        of at most `_CHUNK` bytes, never holding it whole; returns its length."""
        size = 0
        while True:
            i = self.buf.find(b"\n", self.pos)
            stop = len(self.buf) if i < 0 else i
            if stop > self.pos:
                consume(memoryview(self.buf)[self.pos:stop])
                size += stop - self.pos
            self.pos = stop if i < 0 else i + 1
            if i >= 0:
                self.consumed += size + 1
                self.eol = True
                return size
            self.buf, self.pos = self.file.read(_CHUNK), 0
            if not self.buf:
                self.consumed += size
                self.eol = False
                return size

    @property
    def closed(self) -> bool:
        return self.file.closed

    def close(self) -> None:
        self.file.close()


class ShardReader:
    """Sequential records of one shard starting at record `start` (blank JSONL lines skipped).

    JSONL only: `offset` (the byte offset of record `start`, as `self.offset` said) seeks there
    instead of reading the records before it; with `hold_partial`, a last line without a
    newline is not a record yet (a writer may still be writing it): the reader ends before it,
    `offset` stays at its start and `held` counts its bytes, so a later reader opened at
    `offset` reads it once it is whole (or, without `hold_partial`, as it is).

    Raises OSError (or, for ArrayRecord, any error of the reader) when the shard cannot be
    opened; `next()` returns None at the end and re-raises read errors as OSError.
    """

    def __init__(self, path: epath.PathLike, start: int = 0, max_record_bytes: int = 4_000_000,
                 *, offset: Optional[int] = None, hold_partial: bool = False):
        self.path = epath.Path(path)
        self.encoding = shard_encoding(self.path)
        self.limit = max_record_bytes
        self.index = 0
        self.offset = 0             # JSONL: bytes up to the end of the last line consumed
        self.held = 0               # JSONL: bytes of a last line held back (no newline yet)
        self.hold_partial = hold_partial and self.encoding == "json"
        self.failed = False         # a read error ended the reader (the rest was skipped)
        why = _not_regular(self.path)
        if why:
            raise IsADirectoryError(f"{self.path}: {why}")
        if self.encoding == "json":
            f = self.path.open("rb")
            if offset:
                f.seek(offset)
                self.index, self.offset = start, offset
            self._base = self.offset
            self._file = LineReader(f)   # streamed line by line, never slurped
        else:
            import grain.python as grain  # deferred: grain is heavy to import
            if not is_remote(self.path):   # a refused open raises PermissionError, not grain's
                open(os.fspath(self.path), "rb").close()
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
                if self.hold_partial and not line.endswith(b"\n"):
                    return self._hold()
                self.offset = self._base + self._file.consumed
                if not line.isspace():      # stops at the first byte (no copy of the line)
                    return line
                continue
            digest = hashlib.sha256(line)
            # The rest of the line is hashed straight from the read buffer (no newline hashed).
            size = len(line) + self._file.skip_line(digest.update)
            if self.hold_partial and not self._file.eol:
                return self._hold()
            self.offset = self._base + self._file.consumed
            return Oversized(line[:PREFIX_BYTES], size, digest.hexdigest())

    def _hold(self) -> None:
        """Ends the reader before the unterminated last line (its bytes: `held`)."""
        self.held = self._base + self._file.consumed - self.offset
        return None

    def mark(self) -> Optional[list]:
        """`mark(path, offset)` of the file this reader reads (its open descriptor while it
        is open, so a file replaced under it is not mistaken for it)."""
        f = getattr(getattr(self, "_file", None), "file", None)
        if f is None or f.closed or is_remote(self.path) or not hasattr(f, "fileno"):
            return mark(self.path, self.offset)
        try:
            start = max(0, self.offset - MARK_BYTES)
            data = os.pread(f.fileno(), self.offset - start, start)
            return [os.fstat(f.fileno()).st_ino, hashlib.sha256(data).hexdigest()[:16]]
        except OSError:
            return None

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
               events: SourceEvents, *, raise_denied: bool = False,
               **kw: Any) -> Optional[ShardReader]:
    """A `ShardReader` (`kw`: its `offset`, `hold_partial`), or None after reporting why the
    shard is skipped; with `raise_denied`, a PermissionError is raised instead (the spool
    retries such a shard)."""
    try:
        return ShardReader(path, start, max_record_bytes, **kw)
    except PermissionError as e:
        if raise_denied:
            raise
        events.skipped(str(path), "unreadable", f"{type(e).__name__}: {e}")
    except IsADirectoryError as e:
        events.skipped(str(path), "not_a_regular_file", str(e))
    except Exception as e:  # unreadable: permissions, I/O, a bad ArrayRecord
        events.skipped(str(path), "unreadable", f"{type(e).__name__}: {e}")
    return None


def read_next(reader: ShardReader, events: SourceEvents) -> Optional[RawRecord]:
    """`reader.next()`, turning a read error into a reported skip of the shard's rest."""
    try:
        return reader.next()
    except Exception as e:  # an I/O error mid-shard ends that shard only
        reader.failed = True
        events.skipped(str(reader.path), "unreadable",
                       f"read error after record {reader.index}: {type(e).__name__}: {e}")
        return None

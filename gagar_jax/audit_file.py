"""Append-only audit files (metrics.jsonl, groups.jsonl, dead_letter.jsonl) on any storage.

    f = AuditFile(workdir / "metrics.jsonl")
    f.restore(position)          # on resume, before any write: cut back to the checkpoint
    f.write(line); f.flush()     # every step
    position = f.sync()          # before a checkpoint: durable, and where the file ends

Local and network file systems: one file, opened for append, fsync'ed by `sync`, truncated back
to the checkpointed length by `restore` (`AuditPosition(segment="", length)`).

Object stores (a path with a scheme, e.g. gs://, through `etils.epath`) have no append, no
truncate and no rename. There the file is a series of segments `<stem>-<NNNNNN><suffix>`
(metrics-000000.jsonl, metrics-000001.jsonl, ...; concatenated in name order they are the
file, `read_lines`). The open segment is held in memory and uploaded whole on every flush (one
object write; at most `segment_bytes`); it is closed when it reaches `segment_bytes` and at every
`sync`, so a segment a checkpoint points at is never written again. `sync` returns
`AuditPosition(segment=<the open segment's name>, length=<its bytes>)`; `restore` deletes the
segments after that one, rewrites that one to its first `length` bytes if it is longer, and
continues in the next segment. A crash between checkpoints thus loses no line a checkpoint
counts and repeats none, as on local disk (docs/reliability.md).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from etils import epath

from gagar_jax.distributed import is_remote

log = logging.getLogger(__name__)
SEGMENT_BYTES = 1 << 20     # object stores: largest open segment (bounds each flush's upload)


@dataclasses.dataclass(frozen=True)
class AuditPosition:
    """Where an append-only audit file ended when a checkpoint was taken.

    Local and network file systems: `segment` is "" (the file itself) and `length` its size in
    bytes. Object stores: `segment` names the last segment that belongs to the checkpoint and
    `length` its size; later segments are discarded on resume.
    """

    segment: str
    length: int

    def to_json(self) -> dict:
        return {"segment": self.segment, "length": self.length}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> AuditPosition:
        return cls(segment=str(d.get("segment", "")), length=int(d["length"]))


def truncate_to(path: str, position: AuditPosition) -> None:
    """Cuts a local audit file back to `position`; a shorter file is logged, never extended."""
    p = epath.Path(path)
    if not p.exists():
        if position.length:
            log.warning("%s is missing (checkpoint expects %d bytes); starting it empty",
                        path, position.length)
        return
    size = p.stat().length
    if size > position.length:
        os.truncate(os.fspath(path), position.length)
        log.info("%s: cut back from %d to %d bytes (lines after the checkpoint)", path, size,
                 position.length)
    elif size < position.length:
        log.warning("%s is %d bytes, shorter than the checkpointed %d; not extending it",
                    path, size, position.length)


def _oserror(e: OSError, path: Any) -> OSError:
    return OSError(e.errno, e.strerror or str(e), str(path))


class AuditFile:
    """One append-only audit file; see the module docstring for the two layouts.

    Args:
      path: the file (`workdir / "metrics.jsonl"`); local, or any `etils.epath` object store.
      segment_bytes: object stores: close the open segment once it holds this many bytes.
    Errors: every OSError is re-raised naming the file (`filename` = the path).
    """

    def __init__(self, path: epath.PathLike, *, segment_bytes: int = SEGMENT_BYTES):
        self.path = epath.Path(path)
        self.remote = is_remote(path)
        self.segment_bytes = segment_bytes
        self._f = None                      # local: the append handle, opened at first write
        self._buf = bytearray()             # remote: the open segment's bytes
        self._dirty = False
        self._index = self._next_index() if self.remote else 0

    # -- object-store segments ----------------------------------------------------------------
    def _pattern(self) -> re.Pattern:
        stem, suffix = os.path.splitext(self.path.name)
        return re.compile(re.escape(stem) + r"-(\d{6})" + re.escape(suffix) + "$")

    def _segment(self, index: int) -> epath.Path:
        stem, suffix = os.path.splitext(self.path.name)
        return self.path.parent / f"{stem}-{index:06d}{suffix}"

    def segments(self) -> list:
        """(index, path) of the existing segments, in order (object stores)."""
        pat = self._pattern()
        if not self.path.parent.exists():
            return []
        found = [(int(m.group(1)), p) for p in self.path.parent.iterdir()
                 if (m := pat.match(p.name))]
        return sorted(found, key=lambda t: t[0])

    def _next_index(self) -> int:
        segs = self.segments()
        return segs[-1][0] + 1 if segs else 0

    def _upload(self) -> None:
        if self._dirty:
            seg = self._segment(self._index)
            try:
                seg.write_bytes(bytes(self._buf))
            except OSError as e:
                raise _oserror(e, seg) from e
            self._dirty = False

    def _roll(self) -> None:
        self._index += 1
        self._buf = bytearray()

    # -- the interface ------------------------------------------------------------------------
    def write(self, data: bytes | str) -> None:
        """Appends `data` (handed to storage by the next `flush`)."""
        if isinstance(data, str):
            data = data.encode()
        if self.remote:
            self._buf += data
            self._dirty = True
            return
        try:
            if self._f is None:
                self._f = open(os.fspath(self.path), "ab")
            self._f.write(data)
        except OSError as e:
            raise _oserror(e, self.path) from e

    def flush(self) -> None:
        """Local: buffered bytes to the OS. Object stores: the open segment uploaded whole."""
        if self.remote:
            self._upload()
            if len(self._buf) >= self.segment_bytes:
                self._roll()
            return
        if self._f is not None:
            try:
                self._f.flush()
            except OSError as e:
                raise _oserror(e, self.path) from e

    def sync(self) -> AuditPosition:
        """Flushes to stable storage and returns where the file ends (for a checkpoint)."""
        if self.remote:     # an object write is durable once it returns
            self._upload()
            pos = AuditPosition(self._segment(self._index).name, len(self._buf))
            if self._buf:
                self._roll()    # a checkpointed segment is never written again
            return pos
        self.flush()
        if self._f is None:
            return AuditPosition("", self.path.stat().length if self.path.exists() else 0)
        try:
            os.fsync(self._f.fileno())
            return AuditPosition("", self._f.tell())
        except OSError as e:
            raise _oserror(e, self.path) from e

    def position(self) -> AuditPosition:
        """Where the file ends now, as far as storage has it after the last flush/sync."""
        if self.remote:
            return AuditPosition(self._segment(self._index).name, len(self._buf))
        return AuditPosition("", self.length)

    @property
    def length(self) -> int:
        """Bytes in the file (local) or the open segment (object stores) so far."""
        if self.remote:
            return len(self._buf)
        if self._f is not None:
            return self._f.tell()
        return self.path.stat().length if self.path.exists() else 0

    def restore(self, position: AuditPosition) -> None:
        """Cuts the file back to a checkpointed `position` (call before writing)."""
        if not self.remote:
            truncate_to(os.fspath(self.path), position)
            return
        if not position.segment:
            log.warning("%s: checkpoint position has no segment (written on a local workdir?); "
                        "keeping every segment", self.path)
            return
        keep = self._pattern().match(position.segment)
        if keep is None:
            raise ValueError(f"{self.path}: checkpointed segment {position.segment!r} is not "
                             "one of its segments")
        last = int(keep.group(1))
        for index, seg in self.segments():
            if index > last:
                seg.unlink()
                log.info("%s: removed (written after the checkpoint)", seg)
            elif index == last:
                data = seg.read_bytes()
                if len(data) > position.length:
                    seg.write_bytes(data[:position.length])
                    log.info("%s: cut back from %d to %d bytes", seg, len(data), position.length)
        self._index, self._buf, self._dirty = last + 1, bytearray(), False

    def close(self) -> None:
        self.flush()
        if self._f is not None:
            f, self._f = self._f, None
            try:
                f.close()
            except OSError as e:
                raise _oserror(e, self.path) from e


def read_lines(path: epath.PathLike) -> list:
    """The lines of an audit file in either layout (the file, or its segments in order)."""
    f = AuditFile(path)
    if not f.remote:
        p = epath.Path(path)
        return p.read_text().splitlines() if p.exists() else []
    return [line for _, seg in f.segments() for line in seg.read_text().splitlines()]


def unused_name(parent: epath.PathLike, stem: str) -> epath.Path:
    """`parent/stem`, or `parent/stem.1`, `.2`, ... : the first name nothing holds yet, so two
    moves in one second (or after the clock was set back) never share a directory."""
    parent = epath.Path(parent)
    path, n = parent / stem, 0
    while path.exists():
        n += 1
        path = parent / f"{stem}.{n}"
    return path

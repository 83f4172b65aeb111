"""Where feed records come from: files (JSONL or ArrayRecord, one path or a glob), a live spool
directory, or an in-process Python iterator.

A source hands out `RawRecord`s one at a time (`next_record()`, None = no more) and exposes a
JSON-able `state()` / `restore(state)` so a resumed run continues exactly where it stopped.
Paths go through `etils.epath` (local disk, GCS, S3). Sources never crash on what they read
(see `shards.py`); what they skip is reported through their `events` (`SourceEvents`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Optional

from etils import epath

from gagar_jax.distributed import broadcast_from_process0, is_remote
from gagar_jax.feed.config import FeedConfig
from gagar_jax.feed.shards import (  # noqa: F401  (re-exported: the sources' vocabulary)
    ARRAYRECORD_SUFFIXES,
    DONE_MARKER,
    JSONL_SUFFIXES,
    RawRecord,
    ShardReader,
    SourceEvents,
    open_shard,
    read_next,
    replaced,
    shard_encoding,
)
from gagar_jax.feed.spool import SpoolSource

LOG = logging.getLogger(__name__)   # only the CLI configures logging


def _glob(pattern: str) -> list:
    path = epath.Path(pattern)
    if any(c in path.name for c in "*?["):
        files = sorted(path.parent.glob(path.name), key=str)
    else:
        files = [path]
    for f in files:
        shard_encoding(f)
        if not f.exists():
            raise FileNotFoundError(f"feed path {f} does not exist")
    if not files:
        raise FileNotFoundError(f"feed path {pattern!r} matches no file")
    return files


class FileSource:
    """All records of one file or a glob's files, in sorted file order.

    The position is kept by file name: the names read to their end, the current file's name,
    record index, byte offset (JSONL) and `mark` (inode and the bytes before the offset). On
    resume against a glob that matches differently, a file already read that is gone and a
    new file sorting before the position are reported (`events.file_set_changed`; the new
    file is read), a current file that is gone counts as vanished and one replaced by another
    file as replaced (its new content is not read from the old position).
    """

    def __init__(self, pattern: str, *, max_record_bytes: int = 4_000_000):
        self.files = _glob(pattern)
        self.limit = max_record_bytes
        self.events = SourceEvents()
        self._queue = list(self.files)        # files still to open, in order
        self._done: list = []                 # names of the files read to their end
        self._current: Optional[epath.Path] = None
        self._reader: Optional[ShardReader] = None

    def next_record(self) -> Optional[RawRecord]:
        while True:
            if self._reader is None:
                if self._current is not None:
                    self._end_file()
                if not self._queue:
                    return None
                self._current = self._queue.pop(0)
                self._reader = open_shard(self._current, 0, self.limit, self.events)
                continue
            rec = read_next(self._reader, self.events)
            if rec is not None:
                return rec
            self._reader = None

    def _end_file(self) -> None:
        self._done.append(self._current.name)
        self._current, self._reader = None, None

    def state(self) -> dict:
        reader = self._reader
        return {"done": list(self._done),
                "current": self._current.name if self._current is not None else None,
                "record": reader.index if reader else 0,
                "offset": reader.offset if reader and reader.encoding == "json" else 0,
                "mark": reader.mark() if reader else None}

    def restore(self, state: dict) -> None:
        if "file" in state:      # before names were kept: {"file": index, "record": n}
            i = int(state["file"])
            state = {"done": [f.name for f in self.files[:i]], "record": state["record"],
                     "current": self.files[i].name if i < len(self.files) else None}
        done, current = list(state["done"]), state.get("current")
        parent = self.files[0].parent
        names = {f.name for f in self.files}
        for name in done:
            if name not in names:
                self.events.file_set_changed(str(parent / name), "vanished_after_read")
        position = max([*done, current or ""], key=str, default="")
        seen = set(done) | {current}
        for f in self.files:
            if f.name not in seen and f.name < position:
                self.events.file_set_changed(str(f), "inserted_before_position")
        self._done, self._reader, self._current = done, None, None
        self._queue = [f for f in self.files if f.name not in seen]
        if current is None:
            return
        path, record = parent / current, int(state["record"])
        offset = int(state.get("offset", 0))
        if current not in names:
            self.events.vanished(str(path), record)
            self._done.append(current)
            return
        why = replaced(path, state.get("mark"), offset)
        if why:
            self.events.replaced(str(path), record, why)
            self._done.append(current)
            return
        self._current = path
        # local JSONL: seek to the byte offset; elsewhere re-read up to the record index
        self._reader = open_shard(path, record, self.limit, self.events,
                                  offset=(offset or None) if not is_remote(path) else None)


class IteratorSource:
    """In-process groups: `Group` objects, dicts in the schema's shape, or JSON bytes/str.

    On restore, pass a fresh iterator over the same sequence: the consumed prefix is skipped.
    """

    def __init__(self, items: Iterable[Any]):
        self._it = iter(items)
        self.consumed = 0

    def next_record(self) -> Optional[RawRecord]:
        try:
            item = next(self._it)
        except StopIteration:
            return None
        origin = f"<iterator>:{self.consumed}"
        self.consumed += 1
        if isinstance(item, str):
            item = item.encode()
        if isinstance(item, (bytes, bytearray)):
            return RawRecord(bytes(item), "json", origin)
        return RawRecord(item, "object", origin)

    def state(self) -> dict:
        return {"consumed": self.consumed}

    def restore(self, state: dict) -> None:
        for _ in range(int(state["consumed"]) - self.consumed):
            if next(self._it, None) is None:
                break
        self.consumed = int(state["consumed"])


def make_source(cfg: FeedConfig, *, process_count: int = 1, log: Callable[[str], None] = LOG.info,
                stop: Optional[Callable[[], bool]] = None) -> SpoolSource | FileSource:
    """The source `cfg` names: the spool directory if set, else the file/glob `path`.

    `stop` (spool only, one process) ends an idle wait, e.g. on preemption.
    """
    if cfg.spool_dir:
        return SpoolSource(cfg.spool_dir, poll_s=cfg.spool_poll_s, timeout_s=cfg.spool_timeout_s,
                           log_every_s=cfg.spool_log_every_s, log=log,
                           agree=broadcast_from_process0 if process_count > 1 else None,
                           stop=stop if process_count == 1 else None,
                           settle_s=cfg.spool_settle_s, max_record_bytes=cfg.max_record_bytes)
    if cfg.path:
        return FileSource(cfg.path, max_record_bytes=cfg.max_record_bytes)
    raise ValueError("feed: set feed.path (file or glob) or feed.spool_dir, or pass a source")

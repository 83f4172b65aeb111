"""Where feed records come from: files (JSONL or ArrayRecord, one path or a glob), a live spool
directory, or an in-process Python iterator.

A source hands out `RawRecord`s one at a time (`next_record()`, None = no more) and exposes a
JSON-able `state()` / `restore(state)` so a resumed run continues exactly where it stopped.
Paths go through `etils.epath` (local disk, GCS, S3). Sources never crash on what they read
(see `shards.py`); what they skip is reported through their `events` (`SourceEvents`).
"""
from __future__ import annotations

import logging
import os
import stat as stat_lib
import time
from collections.abc import Callable, Iterable
from typing import Any, Optional

from etils import epath

from gagar_jax.distributed import broadcast_from_process0, is_remote, list_names
from gagar_jax.feed.config import FeedConfig
from gagar_jax.feed.shards import (
    ARRAYRECORD_SUFFIXES,
    DONE_MARKER,
    JSONL_SUFFIXES,
    RawRecord,
    ShardReader,
    SourceEvents,
    open_shard,
    read_next,
    shard_encoding,
)

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
    """All records of one file or a glob's files, in sorted file order."""

    def __init__(self, pattern: str, *, max_record_bytes: int = 4_000_000):
        self.files = _glob(pattern)
        self.limit = max_record_bytes
        self.events = SourceEvents()
        self._file = 0
        self._reader: Optional[ShardReader] = None

    def next_record(self) -> Optional[RawRecord]:
        while self._file < len(self.files):
            if self._reader is None:
                self._reader = open_shard(self.files[self._file], 0, self.limit, self.events)
            rec = read_next(self._reader, self.events) if self._reader is not None else None
            if rec is not None:
                return rec
            self._file, self._reader = self._file + 1, None
        return None

    def state(self) -> dict:
        return {"file": self._file, "record": self._reader.index if self._reader else 0}

    def restore(self, state: dict) -> None:
        self._file = int(state["file"])
        self._reader = None
        if self._file < len(self.files):
            self._reader = open_shard(self.files[self._file], int(state["record"]), self.limit,
                                      self.events)
            if self._reader is None:
                self._file += 1


def _exists(path: epath.Path) -> bool:
    """Whether `path` exists (a dangling symlink counts: it is skipped as not a regular file)."""
    if is_remote(path):
        return path.exists()
    return os.path.lexists(os.fspath(path))


def _ignored(name: str) -> bool:
    return (name.startswith((".", "_")) or name.endswith(".tmp")
            or not name.endswith(JSONL_SUFFIXES + ARRAYRECORD_SUFFIXES))


class SpoolSource:
    """Tails a directory where writers publish complete shards atomically.

    Writers write `name.jsonl.tmp` (or any name starting with "." or "_" or ending in ".tmp")
    and rename it to `name.jsonl` / `name.arrayrecord` when complete (on object stores: create
    the final object in one upload). Shards are read in name order, each exactly once; the
    consumed set (with each shard's size and mtime), the position inside the current shard and
    where each local JSONL shard's read ended are the checkpointed state.

    Protection against careless writers (local and network file systems): a shard is read only
    once its size and mtime have stayed unchanged for `settle_s` seconds of this process's
    clock (0 = at once). A JSONL shard is read in whole lines: a last line without a newline
    is held back (a writer may still be writing it) until the shard grows, `_DONE` appears or
    the feed times out; a JSONL shard that grows after it was read is read on from where its
    read ended (`events.grew`, once per shard); any other change of a consumed shard (a
    rewrite, a truncation; for ArrayRecord any change) is reported once (`events.changed`)
    and not read. Objects on object stores appear whole and are read at once.

    Args:
      directory: the spool.
      poll_s: seconds between listings while idle.
      timeout_s: end the feed after this long without a new shard (0 = wait forever).
      log_every_s: seconds between "waiting for the feed" lines.
      log: where those lines go.
      agree: maps this process's view {"names", "grown", "skipped", "changed", "settling",
        "done", "timed_out"} to the view all processes act on (multi-process:
        `broadcast_from_process0`, so process 0 decides which shards are settled or grew);
        identity by default.
      stop: optional callable; when it returns True while the spool is idle, the feed ends
        (the trainer passes its preemption flag, so SIGTERM is honored while waiting).
      settle_s: see above.
      max_record_bytes: longest JSONL line read whole.
    """

    def __init__(self, directory: str, *, poll_s: float = 1.0, timeout_s: float = 0.0,
                 log_every_s: float = 30.0, log: Callable[[str], None] = LOG.info,
                 agree: Optional[Callable[[dict], dict]] = None,
                 stop: Optional[Callable[[], bool]] = None, settle_s: float = 0.0,
                 max_record_bytes: int = 4_000_000):
        self.dir = epath.Path(directory)
        self.stop = stop or (lambda: False)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.poll_s, self.timeout_s, self.log_every_s = poll_s, timeout_s, log_every_s
        self.settle_s = 0.0 if is_remote(self.dir) else settle_s
        self.limit = max_record_bytes
        self.log = log
        self.events = SourceEvents(log)
        self.agree = agree or (lambda view: view)
        self.consumed: dict = {}      # name -> [size, mtime_ns] after its last read (None: unknown)
        # Local JSONL shards: name -> [offset, records, held, grew]: the byte offset and record
        # count where the last read ended, the bytes of a last line held back (no newline yet),
        # and whether the shard was reported as grown.
        self.tails: dict = {}
        self._settling: dict = {}     # name -> ([size, mtime_ns], first seen, monotonic)
        self._current: Optional[str] = None
        self._reader: Optional[ShardReader] = None

    def _tracked(self, name: str) -> bool:
        """Read in whole lines, with growth read as data: JSONL shards on a file system."""
        return not is_remote(self.dir) and shard_encoding(name) == "json"

    def _listing(self) -> dict:
        """name -> [size, mtime_ns] (None: remote, or not a regular file -> "skip" marker)."""
        out = {}
        if is_remote(self.dir):
            for name in list_names(self.dir):     # afresh: gcsfs caches listings forever
                if not _ignored(name):
                    out[name] = None
            return out
        with os.scandir(os.fspath(self.dir)) as entries:
            for e in entries:
                if _ignored(e.name):
                    continue
                try:
                    st = e.stat()                       # follows symlinks
                except OSError:
                    out[e.name] = "skip"
                    continue
                out[e.name] = ([st.st_size, st.st_mtime_ns] if stat_lib.S_ISREG(st.st_mode)
                               else "skip")
        return out

    def _view(self) -> dict:
        """This process's proposal: settled names, consumed names that grew (read on) or
        changed otherwise (reported), names to skip."""
        now = time.monotonic()
        names, grown, skipped, changed, settling, waiting = [], [], [], [], {}, False
        for name, st in sorted(self._listing().items()):
            if name in self.consumed:
                old = self.consumed[name]
                if old is None or not isinstance(st, list) or st == old:
                    continue
                tail = self.tails.get(name)
                if tail is not None and st[0] > tail[0]:
                    grown.append(name)          # bytes past where the read ended
                else:
                    changed.append([name, st])
                continue
            if st == "skip":
                skipped.append(name)
                continue
            prev = self._settling.get(name)
            since = prev[1] if prev is not None and prev[0] == st else now
            settling[name] = (st, since)
            if st is None or now - since >= self.settle_s:
                names.append(name)
            else:
                waiting = True
        self._settling = settling
        return {"names": names, "grown": grown, "skipped": skipped, "changed": changed,
                "settling": waiting}

    def _apply(self, view: dict) -> None:
        for name in view["skipped"]:
            self.events.skipped(str(self.dir / name), "not_a_regular_file",
                                f"{self.dir / name}: not a readable regular file")
            self.consumed[name] = None
        for name, st in view["changed"]:
            self.events.changed(str(self.dir / name))
            self.consumed[name] = st
            self.tails.pop(name, None)       # rewritten: never read again

    def _open(self, name: str, *, tail: bool = False, hold: bool = True) -> None:
        """Makes `name` the current shard: from its start, or (`tail`) from where its last
        read ended; `hold`: a last line without a newline is held back."""
        start, offset = 0, None
        if tail:
            offset, start = self.tails[name][:2]
        self._current = name
        self._reader = open_shard(self.dir / name, start, self.limit, self.events,
                                  offset=offset, hold_partial=hold and self._tracked(name))
        if self._reader is None:
            self._current = None
            self.tails.pop(name, None)

    def _end_shard(self) -> None:
        """The current shard's reader ended: remember where (local JSONL shards), and the
        shard's size and mtime now."""
        name, reader = self._current, self._reader
        self._current, self._reader = None, None
        if name is None or reader is None or reader.failed or not self._tracked(name):
            if name is not None:
                self.tails.pop(name, None)
            return
        grew = self.tails.get(name, [0, 0, 0, 0])[3]
        self.tails[name] = [reader.offset, reader.index, reader.held, grew]
        try:
            st = os.stat(os.fspath(self.dir / name))
        except OSError:
            return
        end = reader.offset + reader.held
        # Bytes written after the read reached the end: a size that differs from what was
        # read makes the next listing read on.
        self.consumed[name] = ([st.st_size, st.st_mtime_ns] if st.st_size == end
                               else [end, 0])

    def _flush_held(self) -> bool:
        """The feed is ending: reads the held-back last lines as they are. True if one was
        opened."""
        for name, tail in sorted(self.tails.items()):
            if tail[2] > 0:
                if not _exists(self.dir / name):      # its held line went with it
                    self.events.vanished(str(self.dir / name), tail[1])
                    self.tails.pop(name)
                    continue
                self._open(name, tail=True, hold=False)
                if self._reader is not None:
                    return True
        return False

    def next_record(self) -> Optional[RawRecord]:
        idle_since = last_log = time.monotonic()
        while True:
            if self._reader is not None:
                rec = read_next(self._reader, self.events)
                if rec is not None:
                    return rec
                self._end_shard()
            now = time.monotonic()
            view = self.agree({
                **self._view(), "done": (self.dir / DONE_MARKER).exists(),
                "timed_out": bool(self.timeout_s) and now - idle_since > self.timeout_s})
            self._apply(view)
            grown = [n for n in view.get("grown", []) if n in self.tails]
            if grown:                   # older data first
                name = grown[0]
                if not self.tails[name][3]:
                    self.tails[name][3] = 1
                    self.events.grew(str(self.dir / name))
                self._open(name, tail=True)
                continue
            if view["names"]:
                name = view["names"][0]
                st = self._settling.pop(name, (None, 0))[0]
                self.consumed[name] = st
                self._open(name)
                continue
            ending = (view["done"] and not view["settling"]) or view["timed_out"]
            if ending and self._flush_held():
                continue
            if view["done"] and not view["settling"]:
                return None
            if view["timed_out"]:
                self.log(f"feed: spool {self.dir} idle for {self.timeout_s:.0f} s; ending the feed")
                return None
            if self.stop():
                self.log(f"feed: stop requested while waiting on spool {self.dir}")
                return None
            if now - last_log >= self.log_every_s:
                settling = ", a shard settling (spool_settle_s)" if view["settling"] else ""
                held = sum(1 for t in self.tails.values() if t[2] > 0)
                held = (f", {held} shard(s) ending in a line without a newline (held back)"
                        if held else "")
                self.log(f"feed: waiting for the feed (spool {self.dir}, idle "
                         f"{now - idle_since:.0f} s, {len(self.consumed)} shards consumed"
                         f"{settling}{held})")
                last_log = now
            self.events.idle()
            time.sleep(self.poll_s)

    def state(self) -> dict:
        reader = self._reader
        return {"consumed": dict(sorted(self.consumed.items())),
                "tails": {k: list(v) for k, v in sorted(self.tails.items())},
                "current": self._current, "record": reader.index if reader else 0,
                "offset": reader.offset if reader else 0,
                "hold": reader.hold_partial if reader else True}

    def restore(self, state: dict) -> None:
        consumed = state["consumed"]
        # Old checkpoints hold a list of names (no size/mtime: changes are not checked), and
        # no tails (a consumed shard that changes is reported, not read on).
        self.consumed = (dict(consumed) if isinstance(consumed, dict)
                         else {name: None for name in consumed})
        self.tails = {k: list(v) for k, v in state.get("tails", {}).items()}
        self._current, self._reader = state.get("current"), None
        if self._current is not None:
            path, record = self.dir / self._current, int(state["record"])
            if not _exists(path):    # deleted while the learner was down: say what is lost
                self.events.vanished(str(path), record)
                self._current = None
                self.tails.pop(path.name, None)
                return
            offset = int(state.get("offset", 0)) or None
            self._reader = open_shard(path, record, self.limit, self.events, offset=offset,
                                      hold_partial=bool(state.get("hold", True))
                                      and self._tracked(self._current))
            if self._reader is None:
                self._current = None


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

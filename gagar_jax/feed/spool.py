"""The live spool: a directory where producers publish complete shards, tailed by the learner.

Listing is once per poll (`spool_listing.py`: its cost does not grow with the consumed shards
the protocol keeps): the settled shards of one listing are all read before the directory is
listed again.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Optional

from etils import epath

from gagar_jax.distributed import is_remote
from gagar_jax.feed.shards import (
    DONE_MARKER,
    RawRecord,
    ShardReader,
    SourceEvents,
    mark,
    open_shard,
    read_next,
    replaced,
    shard_encoding,
)
from gagar_jax.feed.spool_listing import LINK_OUTSIDE, NOT_REGULAR, SpoolLister  # noqa: F401

LOG = logging.getLogger(__name__)   # only the CLI configures logging



def _exists(path: epath.Path) -> bool:
    """Whether `path` exists (a dangling symlink counts: it is skipped as not a regular file)."""
    if is_remote(path):
        return path.exists()
    return os.path.lexists(os.fspath(path))


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

    Also: a shard whose saved read position no longer fits its file (another inode, other bytes
    before the position, fewer bytes) is counted as replaced (`events.replaced`), never read
    from that position; a symbolic link whose target is outside the spool is skipped
    (`link_outside_spool`); a shard that cannot be opened for lack of permission is retried at
    every poll and counted while it cannot be read (`events.unreadable`); a spool directory that
    disappears is waited for (warned once).

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
        # [kind, name] of the last agreed listing not yet read ("grown" | "new"): read before
        # the directory is listed again, so a burst of shards costs one listing.
        self._pending: list = []
        self._denied: dict = {}       # name -> monotonic time its open was last refused
        self.lister = SpoolLister(self.dir, log)
        self._current: Optional[str] = None
        self._reader: Optional[ShardReader] = None

    def _tracked(self, name: str) -> bool:
        """Read in whole lines, with growth read as data: JSONL shards on a file system."""
        return not is_remote(self.dir) and shard_encoding(name) == "json"

    def _view(self) -> dict:
        """This process's proposal: settled names, consumed names that grew (read on) or
        changed otherwise (reported), names to skip."""
        now = time.monotonic()
        names, grown, skipped, changed, settling, waiting = [], [], [], [], {}, False
        for name, st in sorted(self.lister.listing(self.consumed, self.tails).items()):
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
            if isinstance(st, str):
                skipped.append([name, st])
                continue
            if now - self._denied.get(name, -float("inf")) < self.poll_s:
                continue                        # refused at the last try: retried next poll
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
        for name, kind in view["skipped"]:
            path = self.dir / name
            detail = (f"{path}: a symbolic link to {os.path.realpath(os.fspath(path))}, outside "
                      "the spool" if kind == LINK_OUTSIDE else f"{path}: not a readable regular "
                      "file")
            self.events.skipped(str(path), kind, detail)
            self.consumed[name] = None
        for name, st in view["changed"]:
            self.events.changed(str(self.dir / name))
            self.consumed[name] = st
            self.tails.pop(name, None)       # rewritten: never read again

    def _open(self, name: str, *, tail: bool = False, hold: bool = True) -> None:
        """Makes `name` the current shard: from its start, or (`tail`) from where its last
        read ended (unless the file there was replaced); `hold`: a last line without a newline
        is held back. Raises PermissionError (the caller retries the shard)."""
        start, offset = 0, None
        if tail:
            offset, start = self.tails[name][:2]
            saved = self.tails[name][4] if len(self.tails[name]) > 4 else None
            why = replaced(self.dir / name, saved, offset)
            if why:
                self._replaced(name, start, why)
                return
        self._current = name
        try:
            self._reader = open_shard(self.dir / name, start, self.limit, self.events,
                                      offset=offset, hold_partial=hold and self._tracked(name),
                                      raise_denied=True)
        except PermissionError:
            self._current = None
            raise
        if self._reader is None:
            self._current = None
            self.tails.pop(name, None)

    def _replaced(self, name: str, records: int, why: str) -> None:
        """Counts shard `name` as replaced after `records` records; its new file is not read
        (its size and mtime now are remembered, so it is not reported again)."""
        self.events.replaced(str(self.dir / name), records, why)
        self.tails.pop(name, None)
        try:
            st = os.stat(os.fspath(self.dir / name))
            self.consumed[name] = [st.st_size, st.st_mtime_ns]
        except OSError:
            self.consumed[name] = None

    def _open_new(self, name: str) -> None:
        """Opens a settled shard from its start; one refused for permission is not consumed
        (retried next poll) and counted until it opens."""
        st = self._settling.pop(name, (None, 0))[0]
        self.consumed[name] = st
        try:
            self._open(name)
        except PermissionError as e:
            del self.consumed[name]
            if name not in self._denied:
                self.events.unreadable(str(self.dir / name), f"{type(e).__name__}: {e}")
            self._denied[name] = time.monotonic()
            return
        if self._denied.pop(name, None) is not None:
            self.events.readable(str(self.dir / name))

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
        self.tails[name] = [reader.offset, reader.index, reader.held, grew,
                            mark(self.dir / name, reader.offset)]
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
                try:
                    self._open(name, tail=True, hold=False)
                except PermissionError:
                    continue                # counted when it was first refused
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
            if self._pending:
                kind, name = self._pending.pop(0)
                if kind == "new":
                    self._open_new(name)
                elif name in self.tails:
                    try:
                        self._open(name, tail=True)     # a replaced file is not growth
                    except PermissionError:
                        pass                # its growth is read once it can be opened
                    if self._reader is not None and not self.tails[name][3]:
                        self.tails[name][3] = 1
                        self.events.grew(str(self.dir / name))
                continue
            now = time.monotonic()
            # `_DONE` before the listing: a producer writes it after its last shard, so a
            # listing after it has seen that shard (the other order could miss it).
            done = (self.dir / DONE_MARKER).exists()
            view = self.agree({
                **self._view(), "done": done,
                "timed_out": bool(self.timeout_s) and now - idle_since > self.timeout_s})
            self._apply(view)
            # Older data first: what grew, then the new shards in name order.
            self._pending = ([["grown", n] for n in view.get("grown", []) if n in self.tails]
                             + [["new", n] for n in view["names"]])
            if self._pending:
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
        # Shards listed but not yet read are not consumed: a resume lists them again.
        return {"consumed": dict(sorted(self.consumed.items())),
                "tails": {k: list(v) for k, v in sorted(self.tails.items())},
                "current": self._current, "record": reader.index if reader else 0,
                "offset": reader.offset if reader else 0,
                "hold": reader.hold_partial if reader else True,
                "mark": reader.mark() if reader else None}

    def restore(self, state: dict) -> None:
        consumed = state["consumed"]
        # Old checkpoints hold a list of names (no size/mtime: changes are not checked), and
        # no tails (a consumed shard that changes is reported, not read on).
        self.consumed = (dict(consumed) if isinstance(consumed, dict)
                         else {name: None for name in consumed})
        self.tails = {k: list(v) for k, v in state.get("tails", {}).items()}
        self._current, self._reader = state.get("current"), None
        self._pending, self._denied, self._settling = [], {}, {}
        if self._current is not None:
            path, record = self.dir / self._current, int(state["record"])
            if not _exists(path):    # deleted while the learner was down: say what is lost
                self.events.vanished(str(path), record)
                self._current = None
                self.tails.pop(path.name, None)
                return
            why = replaced(path, state.get("mark"), int(state.get("offset", 0)))
            if why:                  # replaced while the learner was down: say what is lost
                name, self._current = self._current, None
                self._replaced(name, record, why)
                return
            offset = int(state.get("offset", 0)) or None
            self._reader = open_shard(path, record, self.limit, self.events, offset=offset,
                                      hold_partial=bool(state.get("hold", True))
                                      and self._tracked(self._current))
            if self._reader is None:
                self._current = None

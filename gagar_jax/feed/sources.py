"""Where feed records come from: files (JSONL or ArrayRecord, one path or a glob), a live spool
directory, or an in-process Python iterator.

A source hands out `RawRecord`s one at a time (`next_record()`, None = no more) and exposes a
JSON-able `state()` / `restore(state)` so a resumed run continues exactly where it stopped.
Paths go through `etils.epath` (local disk, GCS, S3).
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np
from etils import epath

JSONL_SUFFIXES = (".jsonl", ".json")
ARRAYRECORD_SUFFIXES = (".arrayrecord", ".array_record")
DONE_MARKER = "_DONE"   # a spool containing this file ends once every shard is consumed


@dataclasses.dataclass(frozen=True)
class RawRecord:
    payload: Any        # bytes (json / msgpack) or an object (Group or dict) for in-process use
    encoding: str       # "json" | "msgpack" | "object"
    origin: str         # "<file>:<record index>", for dead-letter entries


def shard_encoding(path: epath.PathLike) -> str:
    """"json" for *.jsonl, "msgpack" for *.arrayrecord; raises for anything else."""
    name = epath.Path(path).name
    if name.endswith(JSONL_SUFFIXES):
        return "json"
    if name.endswith(ARRAYRECORD_SUFFIXES):
        return "msgpack"
    raise ValueError(f"feed shard {name!r}: expected a name ending in "
                     f"{JSONL_SUFFIXES + ARRAYRECORD_SUFFIXES}")


class ShardReader:
    """Sequential records of one shard starting at record `start` (blank JSONL lines skipped)."""

    def __init__(self, path: epath.PathLike, start: int = 0):
        self.path = epath.Path(path)
        self.encoding = shard_encoding(self.path)
        self.index = 0
        if self.encoding == "json":
            self._lines: Iterator[bytes] = iter(self.path.open("rb"))   # streamed, not slurped
        else:
            import grain.python as grain  # deferred: grain is heavy to import
            self._source = grain.ArrayRecordDataSource([str(self.path)])
        while self.index < start and self.next() is not None:
            pass

    def next(self) -> Optional[RawRecord]:
        if self.encoding == "json":
            for line in self._lines:
                if line.strip():
                    break
            else:
                return None
            payload = line
        else:
            if self.index >= len(self._source):
                return None
            payload = self._source[self.index]
        rec = RawRecord(payload, self.encoding, f"{self.path}:{self.index}")
        self.index += 1
        return rec


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

    def __init__(self, pattern: str):
        self.files = _glob(pattern)
        self._file = 0
        self._reader: Optional[ShardReader] = None

    def next_record(self) -> Optional[RawRecord]:
        while self._file < len(self.files):
            if self._reader is None:
                self._reader = ShardReader(self.files[self._file])
            rec = self._reader.next()
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
            self._reader = ShardReader(self.files[self._file], int(state["record"]))


def broadcast_from_process0(obj: Any) -> Any:
    """Every process gets process 0's JSON-able `obj` (so all processes see one spool listing)."""
    from jax.experimental import multihost_utils
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
    buf = np.zeros(n, np.uint8)
    buf[:min(n, data.size)] = data[:n]
    return json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))))


class SpoolSource:
    """Tails a directory where writers publish complete shards atomically.

    Writers write `name.jsonl.tmp` (or any name starting with "." or "_" or ending in ".tmp")
    and rename it to `name.jsonl` / `name.arrayrecord` when complete (on object stores: create
    the final object in one upload). Shards are read in name order, each exactly once; the
    consumed set and the position inside the current shard are the checkpointed state.

    Args:
      directory: the spool.
      poll_s: seconds between listings while idle.
      timeout_s: end the feed after this long without a new shard (0 = wait forever).
      log_every_s: seconds between "waiting for the feed" lines.
      log: where those lines go.
      agree: maps this process's view {"names", "done", "timed_out"} to the view all processes
        act on (multi-process: `broadcast_from_process0`); identity by default.
      stop: optional callable; when it returns True while the spool is idle, the feed ends
        (the trainer passes its preemption flag, so SIGTERM is honored while waiting).
    """

    def __init__(self, directory: str, *, poll_s: float = 1.0, timeout_s: float = 0.0,
                 log_every_s: float = 30.0, log: Callable[[str], None] = print,
                 agree: Optional[Callable[[dict], dict]] = None,
                 stop: Optional[Callable[[], bool]] = None):
        self.dir = epath.Path(directory)
        self.stop = stop or (lambda: False)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.poll_s, self.timeout_s, self.log_every_s = poll_s, timeout_s, log_every_s
        self.log = log
        self.agree = agree or (lambda view: view)
        self.consumed: set = set()
        self._current: Optional[str] = None
        self._reader: Optional[ShardReader] = None

    def _pending(self) -> list:
        names = []
        for p in self.dir.iterdir():
            n = p.name
            if n.startswith((".", "_")) or n.endswith(".tmp") or n in self.consumed:
                continue
            if n.endswith(JSONL_SUFFIXES + ARRAYRECORD_SUFFIXES):
                names.append(n)
        return sorted(names)

    def next_record(self) -> Optional[RawRecord]:
        idle_since = last_log = time.monotonic()
        while True:
            if self._reader is not None:
                rec = self._reader.next()
                if rec is not None:
                    return rec
                self.consumed.add(self._current)
                self._current, self._reader = None, None
            now = time.monotonic()
            view = self.agree({
                "names": self._pending(), "done": (self.dir / DONE_MARKER).exists(),
                "timed_out": bool(self.timeout_s) and now - idle_since > self.timeout_s})
            if view["names"]:
                self._current = view["names"][0]
                self._reader = ShardReader(self.dir / self._current)
                continue
            if view["done"]:
                return None
            if view["timed_out"]:
                self.log(f"feed: spool {self.dir} idle for {self.timeout_s:.0f} s; ending the feed")
                return None
            if self.stop():
                self.log(f"feed: stop requested while waiting on spool {self.dir}")
                return None
            if now - last_log >= self.log_every_s:
                self.log(f"feed: waiting for the feed (spool {self.dir}, idle "
                         f"{now - idle_since:.0f} s, {len(self.consumed)} shards consumed)")
                last_log = now
            time.sleep(self.poll_s)

    def state(self) -> dict:
        return {"consumed": sorted(self.consumed), "current": self._current,
                "record": self._reader.index if self._reader else 0}

    def restore(self, state: dict) -> None:
        self.consumed = set(state["consumed"])
        self._current, self._reader = state.get("current"), None
        if self._current is not None:
            self._reader = ShardReader(self.dir / self._current, int(state["record"]))


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

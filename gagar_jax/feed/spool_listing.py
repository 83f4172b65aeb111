"""Listing a spool directory at a cost that does not grow with the shards it consumed.

The protocol keeps consumed shards in the spool, so a listing is one `os.listdir` (names only)
and stats only new names, consumed shards ending in a held-back line and `recheck_per_poll`
other consumed shards, in turn (their growth or a change is seen within consumed/256 polls).
Symbolic links whose target is outside the spool are never followed (`LINK_OUTSIDE`), and a
spool directory that disappeared lists as empty (warned once), so the source waits for it.
"""
from __future__ import annotations

import os
import stat as stat_lib
from collections.abc import Callable

from etils import epath

from gagar_jax.distributed import is_remote, list_names
from gagar_jax.feed.shards import ARRAYRECORD_SUFFIXES, JSONL_SUFFIXES, warner

NOT_REGULAR = "not_a_regular_file"   # skipped_shards_by_reason keys
LINK_OUTSIDE = "link_outside_spool"
RECHECK_PER_POLL = 256    # consumed shards stat'ed per listing (growth, changes), in turn


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _ignored(name: str) -> bool:
    return (name.startswith((".", "_")) or name.endswith(".tmp")
            or not name.endswith(JSONL_SUFFIXES + ARRAYRECORD_SUFFIXES))


class SpoolLister:
    """The listings of one spool directory (see the module docstring).

    Args:
      directory: the spool.
      log: where "disappeared" / "is back" lines go (warnings at WARNING level).
    """

    def __init__(self, directory: epath.Path, log: Callable[[str], None]):
        self.dir = directory
        self.log, self.warn = log, warner(log)
        self.recheck_per_poll = RECHECK_PER_POLL
        self._recheck_at = 0          # where the next listing's re-check of consumed shards starts
        self._missing = False         # the spool directory is gone (warned once)

    def listing(self, consumed: dict, tails: dict) -> dict:
        """name -> [size, mtime_ns] (None: remote, or a consumed shard not re-checked this
        time), or the reason to skip it (`NOT_REGULAR`, `LINK_OUTSIDE`). A missing spool
        directory lists as empty (warned once).

        Args:
          consumed: the source's consumed shards (name -> [size, mtime_ns] or None).
          tails: the source's JSONL tails (name -> [offset, records, held, grew, mark]).

        Only new names, consumed shards ending in a held-back line, and `recheck_per_poll`
        other consumed shards (in turn) are stat'ed, so a listing's work in Python and its
        stats do not grow with the shards consumed (the names come from one `os.listdir`)."""
        out = {}
        if is_remote(self.dir):
            for name in list_names(self.dir):     # afresh: gcsfs caches listings forever
                if not _ignored(name):
                    out[name] = None
            return out
        try:
            names = set(os.listdir(os.fspath(self.dir)))
        except FileNotFoundError:
            if not self._missing:
                self.warn(f"feed: WARNING spool {self.dir} disappeared; waiting for it "
                                 "to come back (the run keeps its work and its ledger)")
            self._missing = True
            return out
        if self._missing:
            self.log(f"feed: spool {self.dir} is back")
            self._missing = False
        root = os.path.realpath(os.fspath(self.dir))
        for name in names.difference(consumed):
            if not _ignored(name):
                out[name] = self._stat(name, root)
        keys = list(consumed)
        k = min(self.recheck_per_poll, len(keys))
        first = self._recheck_at % len(keys) if keys else 0
        self._recheck_at = first + k
        turn = keys[first:first + k] + keys[:max(0, first + k - len(keys))]
        held = [n for n, t in tails.items() if t[2]]
        for name in turn + held:
            if name in names and consumed.get(name) is not None:
                st = self._stat(name, root)
                out[name] = st if isinstance(st, list) else None
        return out

    def _stat(self, name: str, root: str):
        """[size, mtime_ns] of a regular file, or why `name` is skipped; a symbolic link out of
        the spool is never followed."""
        path = os.path.join(os.fspath(self.dir), name)
        try:
            st = os.lstat(path)
            if stat_lib.S_ISLNK(st.st_mode):
                if not _inside(os.path.realpath(path), root):
                    return LINK_OUTSIDE
                st = os.stat(path)
        except OSError:
            return NOT_REGULAR
        return [st.st_size, st.st_mtime_ns] if stat_lib.S_ISREG(st.st_mode) else NOT_REGULAR

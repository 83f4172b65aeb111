"""The feed ledger: every group received is accounted for exactly once.

    received = trained + filtered_uniform + filtered_stale + quarantined + leftover

`leftover` is the number of groups still buffered (not yet in a batch); after `Feed.finish()`
it is final. `trained` is split further by the trainer's per-group outputs (`record_trained`).
Shards the sources skipped (not regular files, links out of the spool, unreadable, vanished or
replaced after a partial read), shards that cannot be read yet (retried), and
consumed spool shards that changed or grew after they were read are counted too; they are
outside the identity (no group was received from what they lost). `ahead_of_learner` counts
received groups whose policy_version was ahead of the learner (a breakdown of `received`: the
ones beyond `feed.max_future_versions` are also in `quarantined_by_reason["from_the_future"]`).
"""
from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Callable, Sequence

from etils import epath

from gagar_jax.distributed import is_remote
from gagar_jax.feed.shards import REPLACED, VANISHED, SourceEvents


@dataclasses.dataclass
class Ledger:
    received: int = 0
    trained: int = 0
    trained_fallback: int = 0
    trained_capped: int = 0
    trained_recorded: int = 0       # trained groups whose step's results were read back
    trained_partial: int = 0        # trained groups of partial rollouts (several policy versions)
                                    # (< trained only while a step is in flight)
    filtered_uniform: int = 0
    filtered_stale: int = 0
    quarantined_by_reason: dict = dataclasses.field(default_factory=collections.Counter)
    leftover: int = 0
    finished: bool = False
    skipped_shards_by_reason: dict = dataclasses.field(default_factory=collections.Counter)
    changed_shards: int = 0         # consumed spool shards changed later (not growth: not read)
    grown_shards: int = 0           # spool shards written in place that grew after a read (read)
    # shard -> records read before it vanished (deleted while the learner was down): its unread
    # records are lost; also counted in skipped_shards_by_reason["vanished_after_partial_read"]
    vanished_shards: dict = dataclasses.field(default_factory=dict)
    ahead_of_learner: int = 0       # received groups with policy_version ahead of the learner
    # shard -> records read before it was replaced by another file (inode, or the bytes before
    # the read position): the original's unread records are lost, the new file is not read;
    # also counted in skipped_shards_by_reason["replaced_after_partial_read"] and changed_shards
    replaced_shards: dict = dataclasses.field(default_factory=dict)
    # spool shards that cannot be read right now (permission denied) -> the error: retried at
    # every poll, removed once read
    unreadable_shards: dict = dataclasses.field(default_factory=dict)
    # a file feed's glob matching differently on resume: "vanished_after_read" (a file read to
    # its end is gone: nothing lost), "inserted_before_position" (a new file sorts before the
    # position: it is read)
    file_changes_by_reason: dict = dataclasses.field(default_factory=collections.Counter)

    @property
    def quarantined(self) -> int:
        return sum(self.quarantined_by_reason.values())

    def quarantine(self, reason: str) -> None:
        self.quarantined_by_reason[reason] = self.quarantined_by_reason.get(reason, 0) + 1

    def record_trained(self, group_ids: Sequence[str], fallback_flags: Sequence[bool],
                       capped_flags: Sequence[bool]) -> None:
        """Adds the trainer's per-group outcome for the groups of one trained batch.

        Args:
          group_ids: the batch's group ids (`BatchInfo.group_ids`), one per real group slot.
          fallback_flags: per group, whether the grading fallback applied (`out.fallback`).
          capped_flags: per group, whether the λ cap fired (`out.capped`).
        Extra entries (padding group slots) in the flag sequences are ignored.
        """
        n = len(group_ids)
        if len(fallback_flags) < n or len(capped_flags) < n:
            raise ValueError(f"record_trained: {n} group ids but {len(fallback_flags)} fallback "
                             f"and {len(capped_flags)} capped flags")
        if self.trained_recorded + n > self.trained:
            raise ValueError(f"record_trained: {n} more groups than were handed out for training")
        self.trained_recorded += n
        self.trained_fallback += int(sum(bool(f) for f in list(fallback_flags)[:n]))
        self.trained_capped += int(sum(bool(c) for c in list(capped_flags)[:n]))

    @property
    def balanced(self) -> bool:
        return self.received == (self.trained + self.filtered_uniform + self.filtered_stale
                                 + self.quarantined + self.leftover)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["quarantined_by_reason"] = dict(sorted(self.quarantined_by_reason.items()))
        d["skipped_shards_by_reason"] = dict(sorted(self.skipped_shards_by_reason.items()))
        for key in ("vanished_shards", "replaced_shards", "unreadable_shards",
                    "file_changes_by_reason"):
            d[key] = dict(sorted(getattr(self, key).items()))
        d["quarantined"] = self.quarantined
        d["balanced"] = self.balanced
        return d

    @classmethod
    def from_json(cls, d: dict) -> Ledger:
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["quarantined_by_reason"] = collections.Counter(kw.get("quarantined_by_reason", {}))
        kw["skipped_shards_by_reason"] = collections.Counter(
            kw.get("skipped_shards_by_reason", {}))
        for key in ("vanished_shards", "replaced_shards", "unreadable_shards"):
            kw[key] = dict(kw.get(key, {}))
        kw["file_changes_by_reason"] = collections.Counter(kw.get("file_changes_by_reason", {}))
        return cls(**kw)

    def write(self, path: epath.PathLike) -> None:
        """Writes ledger.json atomically: temp file + rename on a file system; on an object
        store one object upload, which is atomic by itself (and there is no rename)."""
        path = epath.Path(path)
        text = json.dumps(self.to_json(), indent=2) + "\n"
        if is_remote(path):
            path.write_text(text)
            return
        tmp = path.parent / (path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)


class LedgerEvents(SourceEvents):
    """Source events counted in a ledger (and logged), idle waits passed on.

    Args:
      ledger: returns the ledger to count in (the feed's, which a restore replaces).
      on_idle: called before each idle wait of the source.
      log: where the lines go.
    """

    def __init__(self, ledger: Callable[[], Ledger], on_idle: Callable[[], None],
                 log: Callable[[str], None]):
        super().__init__(log)
        self._ledger, self._on_idle = ledger, on_idle

    def skipped(self, path: str, kind: str, detail: str) -> None:
        super().skipped(path, kind, detail)
        counts = self._ledger().skipped_shards_by_reason
        counts[kind] = counts.get(kind, 0) + 1

    def changed(self, path: str) -> None:
        super().changed(path)
        self._ledger().changed_shards += 1

    def grew(self, path: str) -> None:
        super().grew(path)
        self._ledger().grown_shards += 1

    def vanished(self, path: str, records_read: int) -> None:
        super().vanished(path, records_read)
        ledger = self._ledger()
        ledger.skipped_shards_by_reason[VANISHED] = (
            ledger.skipped_shards_by_reason.get(VANISHED, 0) + 1)
        ledger.vanished_shards[path] = int(records_read)

    def replaced(self, path: str, records_read: int, detail: str) -> None:
        super().replaced(path, records_read, detail)
        ledger = self._ledger()
        ledger.skipped_shards_by_reason[REPLACED] = (
            ledger.skipped_shards_by_reason.get(REPLACED, 0) + 1)
        ledger.replaced_shards[path] = int(records_read)
        ledger.changed_shards += 1

    def unreadable(self, path: str, detail: str) -> None:
        super().unreadable(path, detail)
        self._ledger().unreadable_shards[path] = detail

    def readable(self, path: str) -> None:
        super().readable(path)
        self._ledger().unreadable_shards.pop(path, None)

    def file_set_changed(self, path: str, kind: str) -> None:
        super().file_set_changed(path, kind)
        counts = self._ledger().file_changes_by_reason
        counts[kind] = counts.get(kind, 0) + 1

    def idle(self) -> None:
        self._on_idle()

"""The feed's entry point: records in, packed `Batch`es out, every group accounted for.

    feed = Feed(FeedConfig.from_config(cfg.feed), workdir, vocab_size=..., num_moe_layers=...,
                top_k=...)
    while (item := feed.next_batch(step)) is not None:
        batch, info = item            # numpy Batch: this process's rows, all T/G arrays
        ...train...; feed.record_trained(info.group_ids, fallback_G, capped_G)
        save(checkpoint, feed_state=feed.state())
    feed.finish()

Per batch: pull records (buffered first, then the source), validate (rejects go to
dead_letter.jsonl), drop stale and uniform-outcome groups, and add whole groups while they fit
(T trajectory slots, G group slots, first-fit-decreasing packing into B rows of S tokens); the
batch itself is assembled in `assemble.py`.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import msgspec
from etils import epath

from gagar_jax import batch as batch_lib
from gagar_jax import grading
from gagar_jax.feed import buckets, packed, packing, schema
from gagar_jax.feed.assemble import BatchInfo, assemble  # BatchInfo re-exported
from gagar_jax.feed.config import FeedConfig
from gagar_jax.feed.deadletter import DeadLetter, Oversized
from gagar_jax.feed.ledger import Ledger, LedgerEvents
from gagar_jax.feed.multihost import agree_across_processes
from gagar_jax.feed.shards import RawRecord, warner
from gagar_jax.feed.sources import make_source
from gagar_jax.feed.validate import (
    ModelShape,
    ParsedGroup,
    Reason,
    Rejected,
    classify_decode_error,
    validate_group,
)

LOG = logging.getLogger(__name__)   # only the CLI configures logging

STATE_VERSION = 2            # 1: seen_group_ids was a list (still restored)
SEEN_IDS_MAX = 1_000_000     # hard cap on remembered group ids (oldest versions go first)
LEDGER_WRITE_EVERY_S = 5.0   # ledger.json rewrite interval (always on finish/restore)


class Feed:
    """Turns a stream of group records into fixed-shape batches; see the module docstring.

    Args:
      cfg: the `FeedConfig`.
      workdir: run directory (dead_letter.jsonl and ledger.json go here).
      vocab_size, num_moe_layers, top_k, num_experts: the model records are checked against.
      source: a source object (`FileSource`, `SpoolSource`, `IteratorSource`); default from cfg.
      factor_table: `grading.FactorTable` for tier/rank -> factor (default table if None).
      process_index, process_count: this process's rows (`packing.local_row_slice`); only
        process 0 writes files.
      rows: the rows this process builds, overriding the even split (the trainer passes
        `sharding.process_row_block`'s: with context parallelism hosts share rows); with length
        buckets one slice per bucket.
      cols: the columns of S this process builds (`process_row_block`'s S range: with the
        context axis spanning hosts, each host builds and decodes only its part of the rows);
        default all of S (with length buckets one slice per bucket).
      log: where progress lines go.
      agree: maps this process's row-build failures ({group_id: [reason, detail]}: packed
        payloads of its rows that did not decode) to the failures every process acts on;
        default: `merge_failures` of all processes' (one small all-gather per batch when
        process_count > 1), so a group is quarantined on every process or on none.
      on_idle: called while the source waits for records (the trainer reads back the finished
        step then, so its lines appear without waiting for the next batch).
      stopped: True once a stop (SIGTERM) was asked for: a source that ends then ends no feed,
        and a batch still filling keeps its groups buffered instead of being trained undersized.
      published_version: the newest policy version published in the workdir before this
        process started (-1: none). After a resume from an older checkpoint it can be ahead of
        the step, and groups generated with it are not from the future.
    """

    def __init__(self, cfg: FeedConfig, workdir: epath.PathLike, *, vocab_size: int,
                 num_moe_layers: int = 0, top_k: int = 0, num_experts: Optional[int] = None,
                 source: Any = None, factor_table: Any = None, process_index: int = 0,
                 process_count: int = 1, rows: Optional[slice] = None,
                 cols: Optional[slice] = None, log: Callable[[str], None] = LOG.info,
                 agree: Optional[Callable[[dict], dict]] = None,
                 on_idle: Callable[[], None] = lambda: None,
                 stopped: Callable[[], bool] = lambda: False, published_version: int = -1):
        self.cfg = cfg
        self.shape = ModelShape(vocab_size, num_moe_layers, top_k, num_experts)
        if cfg.routing_replay and not (num_moe_layers and top_k):
            raise ValueError("feed.routing_replay needs num_moe_layers > 0 and top_k > 0")
        self.workdir = epath.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.writer = process_index == 0
        if cfg.buckets:     # one block per length bucket
            self.rows = rows if rows is not None else [
                packing.local_row_slice(b, process_index, process_count)
                for b, _ in cfg.bucket_shapes]
            self.cols = cols if cols is not None else [slice(0, s) for _, s in cfg.bucket_shapes]
        else:
            self.rows = rows if rows is not None else packing.local_row_slice(
                cfg.rows_per_batch, process_index, process_count)
            self.cols = cols if cols is not None else slice(0, cfg.seq_len)
        self.source = source if source is not None else make_source(
            cfg, process_count=process_count, log=log)
        self.factor_table = factor_table if factor_table is not None else grading.FactorTable()
        self.dead_letter = DeadLetter(self.workdir / "dead_letter.jsonl", enabled=self.writer,
                                      max_record_bytes=cfg.max_record_bytes)
        self.ledger = Ledger()
        self.buffer: list = []        # validated mixed groups waiting for a batch (FIFO)
        # group_id -> policy_version, for the duplicate check; see `_forget_old_ids`.
        self.seen_group_ids: dict = {}
        self.exhausted = False
        self.on_idle, self.stopped = on_idle, stopped
        self.agree = agree or (agree_across_processes if process_count > 1 else
                               (lambda failures: failures))
        self._busy = False            # inside next_batch: the ledger is mid-update
        self.published_version = published_version
        self._warn = warner(log)
        self._warned_versions: set = set()    # future versions already warned about
        self._ledger_written = -math.inf
        if hasattr(self.source, "events"):
            self.source.events = LedgerEvents(lambda: self.ledger, lambda: self.on_idle(), log)

    # ---- intake -----------------------------------------------------------------------------
    def _forget_old_ids(self, learner_step: int) -> None:
        """Bounds `seen_group_ids`: an id whose policy_version is older than the staleness
        window is forgotten (a re-sent copy of it is stale, so it can never train twice); at
        most SEEN_IDS_MAX ids are kept, the oldest versions dropped first."""
        floor = learner_step - self.cfg.max_staleness
        seen = self.seen_group_ids
        if seen and (min(seen.values()) < floor or len(seen) > SEEN_IDS_MAX):
            keep = sorted(((v, g) for g, v in seen.items() if v >= floor), reverse=True)
            self.seen_group_ids = {g: v for v, g in keep[:SEEN_IDS_MAX]}

    # ---- intake -----------------------------------------------------------------------------
    def _reject(self, raw: RawRecord, reason: str, detail: str,
                group_id: Optional[str] = None) -> None:
        if group_id is None:     # the record failed before its group_id was read: try it alone
            group_id = _peek_group_id(raw, self.cfg.max_record_bytes)
        self.ledger.quarantine(reason)
        self.dead_letter.write(reason, detail, raw.payload, raw.encoding, raw.origin, group_id)

    def _decode(self, raw: RawRecord) -> schema.Group:
        if isinstance(raw.payload, Oversized):
            raise Rejected(Reason.RECORD_TOO_LARGE, f"{raw.payload.size} bytes > "
                           f"max_record_bytes {self.cfg.max_record_bytes}")
        if raw.encoding == "object":
            if isinstance(raw.payload, schema.Group):
                return raw.payload
            return msgspec.convert(raw.payload, schema.Group)
        size = len(raw.payload)
        if size > self.cfg.max_record_bytes:
            raise Rejected(Reason.RECORD_TOO_LARGE,
                           f"{size} bytes > max_record_bytes {self.cfg.max_record_bytes}")
        return schema.decode(raw.payload, raw.encoding)

    def _fits_alone(self, pg: ParsedGroup) -> Optional[str]:
        if len(pg.trajectories) > self.cfg.max_trajectories:
            return (
                f"{len(pg.trajectories)} trajectories > max_trajectories "
                f"{self.cfg.max_trajectories}"
            )
        if self._plan(pg.lengths) is None:
            if self.cfg.buckets:
                return (f"{sum(pg.lengths)} tokens do not pack into micro-batches of "
                        f"{self.cfg.bucket_rows} rows of {self.cfg.buckets} within "
                        f"{self.cfg.tokens_per_batch} token slots")
            return (f"{sum(pg.lengths)} tokens do not pack into {self.cfg.rows_per_batch} rows of "
                    f"{self.cfg.seq_len}")
        return None

    def _plan(self, lengths: list):
        """Their packing into this feed's rows: a `PackPlan`, a `BucketPlan` with length
        buckets, or None when they do not fit."""
        cfg = self.cfg
        if cfg.buckets:
            return buckets.bucket_pack(lengths, cfg.buckets, cfg.bucket_rows,
                                       cfg.bucket_micro_batches, cfg.tokens_per_batch)
        return packing.first_fit_decreasing(lengths, cfg.rows_per_batch, cfg.seq_len)

    def _check_future(self, pg: ParsedGroup, learner_step: int) -> None:
        """Counts (and warns once per version about) a group whose policy_version is ahead of
        the learner's newest version; raises `Rejected` beyond `max_future_versions`.

        Per-token versions are never newer than the group's (validate), so the group's
        policy_version is its newest token's, whatever `staleness_from` says."""
        newest = max(learner_step, self.published_version)
        ahead = pg.policy_version - newest
        if ahead <= 0:
            return
        self.ledger.ahead_of_learner += 1
        limit = self.cfg.max_future_versions
        quarantined = ahead > limit
        if pg.policy_version not in self._warned_versions:
            self._warned_versions.add(pg.policy_version)
            fate = ("quarantined as from_the_future" if quarantined
                    else "trained (within feed.max_future_versions)")
            self._warn(f"feed: WARNING group {pg.group_id[:64]!r} has policy_version "
                       f"{pg.policy_version}, {ahead} ahead of the learner's newest version "
                       f"{newest}: {fate}, with feed.max_future_versions = {limit}; is the "
                       f"producer numbering versions as learner steps (docs/feed.md)? Further "
                       f"groups of version {pg.policy_version} are counted in ahead_of_learner "
                       f"without a line")
        if quarantined:
            raise Rejected(Reason.FROM_THE_FUTURE,
                           f"group {pg.group_id!r}: policy_version {pg.policy_version} is "
                           f"{ahead} ahead of the learner's newest version {newest} "
                           f"(feed.max_future_versions = {limit})")

    def _stale(self, pg: ParsedGroup, learner_step: int) -> bool:
        return learner_step - pg.staleness_version(self.cfg.staleness_from) > self.cfg.max_staleness

    def _intake(self, raw: RawRecord, learner_step: int) -> Optional[ParsedGroup]:
        """Decodes, validates and filters one record; returns it if it is batchable."""
        self.ledger.received += 1
        group_id = None
        try:
            try:
                group = self._decode(raw)
            except (msgspec.DecodeError, TypeError) as e:
                raise (classify_decode_error(e) if isinstance(e, msgspec.DecodeError)
                       else Rejected(Reason.SCHEMA, str(e))) from None
            group_id = group.group_id
            if group_id in self.seen_group_ids:
                raise Rejected(Reason.DUPLICATE_GROUP,
                               f"group {group_id[:64]!r} was received before")
            pg = validate_group(group, self.cfg, self.shape)
            too_large = self._fits_alone(pg)
            if too_large:
                raise Rejected(Reason.GROUP_TOO_LARGE, f"group {group_id!r}: {too_large}")
            self._check_future(pg, learner_step)
        except Rejected as e:
            self._reject(raw, e.reason, e.detail, group_id)
            return None
        except RecursionError:
            self._reject(raw, Reason.TOO_DEEPLY_NESTED, "nesting too deep to decode", group_id)
            return None
        except (MemoryError, KeyboardInterrupt):
            raise
        except Exception as e:  # no record content may crash the learner
            self._reject(raw, Reason.INVALID, f"{type(e).__name__}: {str(e)[:500]}", group_id)
            return None
        if self._stale(pg, learner_step):   # a copy of it would be stale too: not remembered
            self.ledger.filtered_stale += 1
            return None
        self.seen_group_ids[group_id] = pg.policy_version
        pg.origin = raw.origin
        if not pg.mixed and self.cfg.filter_uniform:
            self.ledger.filtered_uniform += 1
            return None
        return pg

    # ---- batching ---------------------------------------------------------------------------
    def next_batch(self, learner_step: int) -> Optional[tuple[batch_lib.Batch, BatchInfo]]:
        """The next batch for train step `learner_step`; None when a finite feed is exhausted, or
        when `stopped()` ends a wait (then a batch still filling stays buffered, untrained).

        Returns:
          (Batch of numpy arrays, BatchInfo). Token arrays hold this process's block
          (`self.rows` x `self.cols`); per-trajectory [T] and per-group [G] arrays and the
          `BatchInfo` counts are complete (the same on every process).
        """
        self._busy = True
        try:
            return self._next_batch(learner_step)
        finally:
            self._busy = False

    def _next_batch(self, learner_step: int):
        self._forget_old_ids(learner_step)
        before = self.ledger.to_json()
        while True:
            picked = self._select(learner_step)
            if picked is None:
                self._write_ledger()
                return None
            selected, plan = picked
            batch, info, failures = self._assemble(selected, plan)
            if self._decodes_payloads(selected):   # else no process can have failed alone
                failures = self.agree(failures)
            if not failures:
                break
            self._quarantine_built(selected, failures)
        self.ledger.trained += len(selected)
        self.ledger.trained_partial += sum(pg.partial for pg in selected)
        self._write_ledger()
        after = self.ledger.to_json()
        counts = {k: after[k] - before[k] for k in
                  ("received", "trained", "filtered_uniform", "filtered_stale", "quarantined",
                   "ahead_of_learner")}
        return batch, dataclasses.replace(info, counts=counts)

    def _select(self, learner_step: int):
        """Whole groups for one batch and their packing plan (None: nothing to batch)."""
        cfg = self.cfg
        queue, self.buffer = self.buffer, []
        selected, deferred, lengths, plan = [], [], [], None
        deferred_tokens = 0
        # Pull until the batch holds G groups, or G groups / one batch of tokens wait for the
        # next one (long rows: a few groups fill a batch; reading on would only buffer).
        while (len(selected) < cfg.groups_per_batch and len(deferred) < cfg.groups_per_batch
               and deferred_tokens < cfg.batch_tokens):
            if queue:
                pg = queue.pop(0)
                if self._stale(pg, learner_step):
                    self.ledger.filtered_stale += 1
                    continue
            elif self.exhausted:
                break
            else:
                raw = self.source.next_record()
                if raw is None and self.stopped():   # a stop ended the wait: no partial batch
                    self.buffer = selected + deferred + queue
                    self.ledger.leftover = len(self.buffer)
                    return None
                if raw is None:
                    self.exhausted = True
                    break
                pg = self._intake(raw, learner_step)
                if pg is None:
                    continue
            new_plan = None
            if len(lengths) + len(pg.trajectories) <= cfg.max_trajectories:
                new_plan = self._plan(lengths + pg.lengths)
            if new_plan is None:
                deferred.append(pg)     # keeps its place for the next batch: never split
                deferred_tokens += sum(pg.lengths)
                continue
            selected.append(pg)
            lengths += pg.lengths
            plan = new_plan
        self.buffer = deferred + queue
        self.ledger.leftover = len(self.buffer)
        return (selected, plan) if selected else None

    def _decodes_payloads(self, groups: list) -> bool:
        """Whether building these groups' rows decodes a compact payload somewhere (known to
        every process alike, from the records' headers)."""
        for pg in groups:
            for t in pg.trajectories:
                if isinstance(t.tokens, packed.LazyArray) or isinstance(t.logprobs,
                                                                        packed.LazyArray):
                    return True
                if self.cfg.routing_replay and isinstance(t.routed, packed.RoutedPayload):
                    return True
        return False

    def _quarantine_built(self, selected: list, failures: dict) -> None:
        """Quarantines the groups whose rows failed to build (on every process alike); the
        others go back to the front of the buffer, in order, for the batch to be re-planned."""
        keep = []
        for pg in selected:
            if pg.group_id not in failures:
                keep.append(pg)
                continue
            reason, detail = failures[pg.group_id]
            self.ledger.quarantine(reason)
            self.dead_letter.write(reason, f"group {pg.group_id!r} {detail}",
                                   schema.encode(pg.record, "json"), "json",
                                   pg.origin or "<buffered>", pg.group_id)
            self.seen_group_ids.pop(pg.group_id, None)   # it may be re-sent, fixed
        self.buffer = keep + self.buffer
        self.ledger.leftover = len(self.buffer)

    def _assemble(self, groups: list, plan: packing.PackPlan | buckets.BucketPlan):
        return assemble(groups, plan, self.cfg, self.shape, self.factor_table, self.rows,
                        self.cols)

    # ---- ledger and checkpointed state ------------------------------------------------------
    def _write_ledger(self, force: bool = False) -> None:
        # Rate-limited: the checkpointed state is the authority; ledger.json is for people.
        now = time.monotonic()
        if self.writer and (force or now - self._ledger_written >= LEDGER_WRITE_EVERY_S):
            self.ledger.write(self.workdir / "ledger.json")
            self._ledger_written = now

    def record_trained(self, group_ids: Sequence[str], fallback_flags: Sequence[bool],
                       capped_flags: Sequence[bool]) -> None:
        """`Ledger.record_trained` plus a ledger.json rewrite (call once per trained batch)."""
        self.ledger.record_trained(group_ids, fallback_flags, capped_flags)
        if not self._busy:  # from an idle wait mid-batch: the identity holds only at its end
            self._write_ledger(force=True)

    def finish(self) -> Ledger:
        """Ends the run's accounting: still-buffered groups count as `leftover`."""
        self.ledger.leftover = len(self.buffer)
        self.ledger.finished = True
        self._write_ledger(force=True)
        return self.ledger

    def state(self) -> dict:
        """JSON-able resume state: source position, ledger, buffered groups, \
dead-letter position."""
        return {
            "version": STATE_VERSION, "source": self.source.state(),
            "ledger": self.ledger.to_json(),
            "buffer": [schema.encode(pg.record, "json").decode() for pg in self.buffer],
            "seen_group_ids": dict(sorted(self.seen_group_ids.items())),
            "dead_letter": {**self.dead_letter.position().to_json(),
                            "count": self.dead_letter.count},
        }

    def restore(self, state: dict) -> None:
        """Resumes from `state()` taken at a checkpoint (same config and source)."""
        if state.get("version") not in (1, STATE_VERSION):
            raise ValueError(f"feed state version {state.get('version')}, expected {STATE_VERSION}")
        # The ledger first: what the source reports while restoring (a shard that vanished
        # while the learner was down) is counted in the restored ledger, not overwritten.
        self.ledger = Ledger.from_json(state["ledger"])
        self.source.restore(state["source"])
        self.exhausted = False      # the source says again if it is at its end (a spool may not be)
        self.buffer = [validate_group(schema.decode(r.encode(), "json"), self.cfg, self.shape)
                       for r in state["buffer"]]
        seen = state["seen_group_ids"]
        # Version 1 kept bare ids: give them version 0, so the window forgets them in time.
        self.seen_group_ids = dict(seen) if isinstance(seen, dict) else dict.fromkeys(seen, 0)
        dl = state["dead_letter"]
        self.dead_letter.restore(int(dl["length"]), int(dl["count"]), str(dl.get("segment", "")))
        self._write_ledger(force=True)


class _GroupIdOnly(msgspec.Struct):
    group_id: str


def _peek_group_id(raw: RawRecord, max_bytes: int) -> Optional[str]:
    """The record's `group_id` if it parses on its own (the rest may be what is wrong), so that
    a dead letter names its group whenever it can; None otherwise."""
    try:
        if raw.encoding == "object":
            payload = raw.payload
            gid = payload.get("group_id") if isinstance(payload, dict) else getattr(
                payload, "group_id", None)
            return gid if isinstance(gid, str) else None
        payload = raw.payload
        if isinstance(payload, (bytes, bytearray, memoryview)) and len(payload) <= max_bytes:
            decode = msgspec.json.decode if raw.encoding == "json" else msgspec.msgpack.decode
            return decode(payload, type=_GroupIdOnly).group_id
    except (msgspec.DecodeError, RecursionError, TypeError, ValueError):
        pass
    return None


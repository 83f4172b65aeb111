"""The feed's typed configuration, built once from the `feed` section of a config file."""
from __future__ import annotations

import dataclasses
from typing import Any

from gagar_jax.config import section_dict

STALENESS_FROM = ("oldest", "newest", "mean")


OVERLONG_POLICIES = ("reject", "drop", "truncate")


@dataclasses.dataclass(frozen=True)
class FeedConfig:
    """Static batch shapes, limits and the source of the feed.

    Attributes:
      path: a file or glob of JSONL (`*.jsonl`) or ArrayRecord (`*.arrayrecord`) shards; "" when
        `spool_dir` is used.
      spool_dir: a live spool directory (writers publish shards atomically); "" for none. On a
        local or network file system it must exist at start-up unless `spool_create`.
      spool_create: create a missing `spool_dir` (and wait for its producers) instead of
        refusing to start; off by default, so a mistyped directory is an error, not a wait
        forever.
      spool_poll_s: seconds between listings of an idle spool.
      spool_timeout_s: give up (end of feed) after this long idle; 0 = wait forever.
      spool_log_every_s: seconds between "waiting for the feed" lines.
      spool_settle_s: read a spool shard only after its size and mtime stayed unchanged this
        long (local and network file systems; 0 = at once; object stores: always at once).
        Whatever it is, a JSONL shard's unterminated last line is held back and its growth
        read (docs/feed.md, "Careless writers").
      rows_per_batch: B, packed rows per global batch (0: from `tokens_per_batch`).
      seq_len: S, tokens per row.
      tokens_per_batch: the batch's size in tokens, B x S; when > 0, a multiple of `seq_len`
        that sets B = tokens_per_batch / seq_len (then `rows_per_batch` is 0 or that value).
        Long rows (128k-256k tokens) are sized this way: the tokens per step stay fixed while
        S changes.
      buckets: row lengths of length buckets, ascending; () = one row length, `seq_len`. With
        buckets (docs/feed.md, "Length buckets") a step is micro-batches of `bucket_rows` rows of
        one bucket's length each, packed by `buckets.bucket_pack` within `tokens_per_batch`
        token slots; `seq_len` is the largest bucket and `rows_per_batch` the static rows of
        all buckets together.
      bucket_rows: rows per micro-batch with buckets (a multiple of the mesh's batch shards).
      bucket_micro_batches: per bucket, the most micro-batches of a step (its static arrays);
        () = as many as `tokens_per_batch` holds.
      max_trajectories: T, trajectory slots per batch (static).
      groups_per_batch: G, mixed groups per batch (static).
      max_staleness: drop groups whose policy_version lags the learner step by more.
      staleness_from: which version of a partial rollout's generated tokens the lag is judged
        on: oldest (default) | newest | mean (token-weighted); all equal the group's
        policy_version without per-token versions.
      max_future_versions: how far a group's policy_version may run ahead of the newest version
        the learner has (its step, or the newest version published in the workdir, which a
        resume from an older checkpoint can leave ahead) before it is quarantined as
        `from_the_future`; groups ahead by less are trained. Either way they are counted
        (`ahead_of_learner`) and warned about once per version. 0: none is trained.
      max_traj_tokens: longest accepted trajectory (<= seq_len).
      overlong: the policy for a trajectory longer than `max_traj_tokens`, or marked
        `truncated` by its producer, defined once (docs/feed.md, "Overlong trajectories"):
        reject (its group is quarantined as trajectory_too_long, as before) | drop (cut to
        `max_traj_tokens` with every token's loss_mask 0: out of the
        loss, still in its group's statistics, DAPO's overlong filter) | truncate (cut to
        `max_traj_tokens` and trained).
      truncate_long: the former switch, kept for old configs: True = overlong "truncate".
      overlong_buffer_len, overlong_penalty_factor: DAPO's soft overlong penalty, added to the
        trajectory's adjustment (SPEC rule 9, outside the redistribution): 0 up to
        max_traj_tokens - buffer tokens, then falling linearly to -factor at max_traj_tokens
        (and -factor beyond, or for a `truncated` one); buffer 0 = off.
      max_record_bytes: largest accepted encoded record.
      max_group_trajectories: most trajectories per group.
      routing_replay: put a routed_experts_BxSxLxK array (-1 where absent) in every batch.
      filter_uniform: drop groups whose valid members all pass or all fail (dynamic sampling:
        their advantages are 0); False trains them too (their tokens then carry advantage 0:
        they take batch slots and, under token-mean aggregation, the loss's denominator).
    """

    path: str = ""
    spool_dir: str = ""
    spool_create: bool = False
    spool_poll_s: float = 1.0
    spool_timeout_s: float = 0.0
    spool_log_every_s: float = 30.0
    spool_settle_s: float = 2.0
    rows_per_batch: int = 16
    seq_len: int = 128
    tokens_per_batch: int = 0
    buckets: tuple = ()
    bucket_rows: int = 0
    bucket_micro_batches: tuple = ()
    max_trajectories: int = 40
    groups_per_batch: int = 6
    max_staleness: int = 4
    staleness_from: str = "oldest"
    max_future_versions: int = 0
    max_traj_tokens: int = 128
    overlong: str = "reject"
    truncate_long: bool = False
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    max_record_bytes: int = 4_000_000
    max_group_trajectories: int = 16
    routing_replay: bool = False
    filter_uniform: bool = True

    def __post_init__(self):
        if self.overlong not in OVERLONG_POLICIES:
            raise ValueError(f"feed.overlong must be one of {OVERLONG_POLICIES}, "
                             f"got {self.overlong!r}")
        if self.truncate_long and self.overlong == "reject":   # the former switch
            object.__setattr__(self, "overlong", "truncate")
        if not 0 <= self.overlong_buffer_len < max(self.max_traj_tokens, 1) or (
                self.overlong_penalty_factor < 0):
            raise ValueError("feed.overlong_buffer_len must be in [0, max_traj_tokens) and "
                             "feed.overlong_penalty_factor >= 0")
        if self.buckets:
            self._resolve_buckets()
        elif self.seq_len > 0 and self.tokens_per_batch:
            rows, rest = divmod(int(self.tokens_per_batch), int(self.seq_len))
            if rest or rows <= 0:
                raise ValueError(f"feed.tokens_per_batch ({self.tokens_per_batch}) must be a "
                                 f"positive multiple of feed.seq_len ({self.seq_len})")
            if self.rows_per_batch not in (0, rows):
                raise ValueError(
                    f"feed.rows_per_batch ({self.rows_per_batch}) disagrees with "
                    f"feed.tokens_per_batch / feed.seq_len = {rows}: set one of them (the other 0)")
            object.__setattr__(self, "rows_per_batch", rows)    # frozen: resolved once, here
        elif self.tokens_per_batch < 0:
            raise ValueError(f"feed.tokens_per_batch must be >= 0, got {self.tokens_per_batch}")
        positive = ("rows_per_batch", "seq_len", "max_trajectories", "groups_per_batch",
                    "max_traj_tokens", "max_record_bytes", "max_group_trajectories")
        for name in positive:
            if int(getattr(self, name)) <= 0:
                hint = " (or set feed.tokens_per_batch)" if name == "rows_per_batch" else ""
                raise ValueError(f"feed.{name} must be > 0{hint}, got {getattr(self, name)}")
        if self.max_traj_tokens > self.seq_len:
            raise ValueError(f"feed.max_traj_tokens ({self.max_traj_tokens}) must be <= "
                             f"feed.seq_len ({self.seq_len}): a trajectory lives in one row")
        if self.max_staleness < 0:
            raise ValueError(f"feed.max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_future_versions < 0:
            raise ValueError(
                f"feed.max_future_versions must be >= 0, got {self.max_future_versions}")
        if self.staleness_from not in STALENESS_FROM:
            raise ValueError(f"feed.staleness_from must be one of {STALENESS_FROM}, "
                             f"got {self.staleness_from!r}")
        if self.spool_poll_s <= 0 or self.spool_timeout_s < 0 or self.spool_settle_s < 0:
            raise ValueError("feed.spool_poll_s must be > 0, feed.spool_timeout_s and "
                             "feed.spool_settle_s >= 0")
        if self.groups_per_batch > self.max_trajectories:
            raise ValueError("feed.groups_per_batch must be <= feed.max_trajectories "
                             "(every mixed group has at least two trajectories)")

    def _resolve_buckets(self) -> None:
        from gagar_jax.feed.buckets import max_micro_batches
        b = tuple(int(x) for x in self.buckets)
        if any(x <= 0 for x in b) or list(b) != sorted(set(b)):
            raise ValueError(f"feed.buckets must be ascending positive row lengths, got {b}")
        if self.bucket_rows <= 0 or self.tokens_per_batch <= 0:
            raise ValueError("feed.buckets needs feed.bucket_rows > 0 (rows per micro-batch) "
                             "and feed.tokens_per_batch > 0 (the step's token slots)")
        if self.seq_len not in (0, b[-1]):
            raise ValueError(f"feed.seq_len ({self.seq_len}) must be 0 or the largest bucket "
                             f"({b[-1]}) with feed.buckets")
        micro = max_micro_batches(b, self.bucket_rows, self.tokens_per_batch,
                                  tuple(self.bucket_micro_batches))
        object.__setattr__(self, "buckets", b)
        object.__setattr__(self, "bucket_micro_batches", micro)
        object.__setattr__(self, "seq_len", b[-1])
        object.__setattr__(self, "rows_per_batch", self.bucket_rows * sum(micro))

    @property
    def bucket_shapes(self) -> tuple[tuple[int, int], ...]:
        """(rows, row length) of each bucket's static arrays; ((B, S),) without buckets."""
        if not self.buckets:
            return ((self.rows_per_batch, self.seq_len),)
        return tuple((self.bucket_rows * u, s)
                     for u, s in zip(self.bucket_micro_batches, self.buckets, strict=True))

    @property
    def batch_tokens(self) -> int:
        """The batch's size in tokens: B x S, or with buckets the step's token budget."""
        if self.buckets:
            return self.tokens_per_batch
        return self.rows_per_batch * self.seq_len

    @classmethod
    def from_config(cls, cfg: Any) -> FeedConfig:
        """Builds the dataclass from a ConfigDict (or dict); unknown keys are an error."""
        return cls(**section_dict(cfg, cls, "feed"))

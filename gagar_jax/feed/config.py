"""The feed's typed configuration, built once from the `feed` section of a config file."""
from __future__ import annotations

import dataclasses
from typing import Any

from gagar_jax.config import section_dict


@dataclasses.dataclass(frozen=True)
class FeedConfig:
    """Static batch shapes, limits and the source of the feed.

    Attributes:
      path: a file or glob of JSONL (`*.jsonl`) or ArrayRecord (`*.arrayrecord`) shards; "" when
        `spool_dir` is used.
      spool_dir: a live spool directory (writers publish shards atomically); "" for none.
      spool_poll_s: seconds between listings of an idle spool.
      spool_timeout_s: give up (end of feed) after this long idle; 0 = wait forever.
      spool_log_every_s: seconds between "waiting for the feed" lines.
      spool_settle_s: read a spool shard only after its size and mtime stayed unchanged this
        long (local and network file systems; 0 = at once; object stores: always at once).
      rows_per_batch: B, packed rows per global batch.
      seq_len: S, tokens per row.
      max_trajectories: T, trajectory slots per batch (static).
      groups_per_batch: G, mixed groups per batch (static).
      max_staleness: drop groups whose policy_version lags the learner step by more.
      max_traj_tokens: longest accepted trajectory (<= seq_len).
      truncate_long: cut longer trajectories to `max_traj_tokens` instead of rejecting them.
      max_record_bytes: largest accepted encoded record.
      max_group_trajectories: most trajectories per group.
      routing_replay: put a routed_experts_BxSxLxK array (-1 where absent) in every batch.
    """

    path: str = ""
    spool_dir: str = ""
    spool_poll_s: float = 1.0
    spool_timeout_s: float = 0.0
    spool_log_every_s: float = 30.0
    spool_settle_s: float = 2.0
    rows_per_batch: int = 16
    seq_len: int = 128
    max_trajectories: int = 40
    groups_per_batch: int = 6
    max_staleness: int = 4
    max_traj_tokens: int = 128
    truncate_long: bool = False
    max_record_bytes: int = 4_000_000
    max_group_trajectories: int = 16
    routing_replay: bool = False

    def __post_init__(self):
        positive = ("rows_per_batch", "seq_len", "max_trajectories", "groups_per_batch",
                    "max_traj_tokens", "max_record_bytes", "max_group_trajectories")
        for name in positive:
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"feed.{name} must be > 0, got {getattr(self, name)}")
        if self.max_traj_tokens > self.seq_len:
            raise ValueError(f"feed.max_traj_tokens ({self.max_traj_tokens}) must be <= "
                             f"feed.seq_len ({self.seq_len}): a trajectory lives in one row")
        if self.max_staleness < 0:
            raise ValueError(f"feed.max_staleness must be >= 0, got {self.max_staleness}")
        if self.spool_poll_s <= 0 or self.spool_timeout_s < 0 or self.spool_settle_s < 0:
            raise ValueError("feed.spool_poll_s must be > 0, feed.spool_timeout_s and "
                             "feed.spool_settle_s >= 0")
        if self.groups_per_batch > self.max_trajectories:
            raise ValueError("feed.groups_per_batch must be <= feed.max_trajectories "
                             "(every mixed group has at least two trajectories)")

    @classmethod
    def from_config(cls, cfg: Any) -> "FeedConfig":
        """Builds the dataclass from a ConfigDict (or dict); unknown keys are an error."""
        return cls(**section_dict(cfg, cls, "feed"))

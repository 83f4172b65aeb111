"""Record validation: a decoded `Group` becomes a `ParsedGroup` (numpy arrays) or is rejected
with one of the documented reasons (docs/feed.md lists them for grader authors)."""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

import msgspec
import numpy as np

from gagar_jax import grading
from gagar_jax.feed import packed, schema
from gagar_jax.feed.config import FeedConfig


class Reason:
    """Quarantine reasons, as written to dead_letter.jsonl and ledger.json."""

    UNPARSEABLE = "unparseable"                  # not valid JSON / msgpack
    SCHEMA = "schema"                            # missing field or wrong type
    UNKNOWN_OUTCOME = "unknown_outcome"          # outcome not pass | fail | infra_error
    SCHEMA_VERSION = "unsupported_schema_version"
    DUPLICATE_GROUP = "duplicate_group_id"       # group_id seen before in this run
    RECORD_TOO_LARGE = "record_too_large"        # encoded record over max_record_bytes
    TOO_MANY_TRAJECTORIES = "too_many_trajectories"
    DUPLICATE_TRAJECTORY = "duplicate_trajectory_id"
    LENGTH_MISMATCH = "length_mismatch"          # loss_mask / logprobs length != tokens length
    BAD_LOSS_MASK = "bad_loss_mask"              # values other than 0/1, or first token generated
    TOKEN_OUT_OF_VOCAB = packed.VOCAB
    NON_FINITE = packed.NON_FINITE               # NaN/inf log-prob or adjustment
    BAD_QUALITY = "bad_quality"                  # tier without rank, tier and factor together
    TOO_LONG = "trajectory_too_long"             # over max_traj_tokens (feed.overlong reject)
    NO_GENERATED_TOKENS = "no_generated_tokens"  # a valid trajectory with no loss_mask=1 token
    ROUTED_EXPERTS = packed.SHAPE                # routed_experts does not match the model
    BAD_ENCODING = packed.ENCODING               # a compact array that cannot be read
    NO_VALID_TRAJECTORY = "no_valid_trajectory"  # empty, or every trajectory an infra error
    GROUP_TOO_LARGE = "group_too_large"          # cannot fit one global batch
    ID_TOO_LONG = "id_too_long"                  # group/task/trajectory id over MAX_ID_CHARS
    NEGATIVE_POLICY_VERSION = "negative_policy_version"
    TOO_DEEPLY_NESTED = "too_deeply_nested"      # nesting beyond what the decoder can follow
    VERSION_SPANS_UNSORTED = "policy_version_spans_unsorted"   # span starts not increasing
    VERSION_OUT_OF_RANGE = "policy_version_out_of_range"       # bad start / length / version < 0
    VERSION_SPANS_EMPTY = "policy_version_spans_empty"         # [] : no token has a version
    VERSION_NEWER = "policy_version_newer_than_group"          # a token newer than the group
    FROM_THE_FUTURE = "from_the_future"          # policy_version ahead of the learner's newest
                                                 # version by more than max_future_versions
    INVALID = "invalid_record"                   # any other failure while decoding/validating

    @classmethod
    def all(cls) -> tuple[str, ...]:
        return tuple(v for k, v in vars(cls).items() if k.isupper())


class Rejected(Exception):
    """A record failed validation; `reason` is a `Reason` value, `detail` says where/why."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the records must agree with: vocabulary and routing-replay shape."""

    vocab_size: int
    num_moe_layers: int = 0
    top_k: int = 0
    num_experts: Optional[int] = None


@dataclasses.dataclass
class ParsedTrajectory:
    trajectory_id: str
    tokens: Any                     # int32 [n], or a `packed.LazyArray` (decoded when built)
    loss_mask: np.ndarray           # float32 [n] 0/1
    logprobs: Any                   # float32 [n], or a `packed.LazyArray`
    # int32 [n, L, K] (token t as the input), a `packed.RoutedPayload` decoded only when its
    # row is built (`routed_rows`), or None.
    routed: Any
    reward: float                   # 1.0 pass, 0.0 fail (hacked passes keep 1: the loss zeroes
                                    # them)
    hacked: bool
    tier: int                       # a grading tier code, or grading.DIRECT (factor sent or none)
    rank: int
    factor: float                   # direct factor; NaN when missing (rule-5 fallback)
    adjustment: float
    versions: Optional[np.ndarray] = None   # int64 [n] policy version per token (partial rollouts)

    @property
    def length(self) -> int:
        return int(self.loss_mask.shape[0])

    def generated_versions(self, group_version: int) -> np.ndarray:
        """The policy version of every generated token (the group's where none was sent)."""
        n_gen = int(self.loss_mask.sum())
        if self.versions is None:
            return np.full(n_gen, group_version, np.int64)
        return self.versions[self.loss_mask > 0]

    def token_rows(self, window: Optional[slice] = None) -> np.ndarray:
        """int32 [n] token ids (those of `window` only, if given); a compact payload is
        decoded (and checked) now, the window's part only."""
        if isinstance(self.tokens, packed.LazyArray):
            return packed.decode_array(self.tokens, window)
        return self.tokens if window is None else self.tokens[window]

    def logprob_rows(self, window: Optional[slice] = None) -> np.ndarray:
        """float32 [n] behavior log-probs (those of `window` only, if given); a compact
        payload is decoded (and checked) now, the window's part only."""
        if isinstance(self.logprobs, packed.LazyArray):
            return packed.decode_array(self.logprobs, window)
        return self.logprobs if window is None else self.logprobs[window]

    def routed_rows(self, out: Optional[np.ndarray] = None,
                    window: Optional[slice] = None) -> Optional[np.ndarray]:
        """int32 [n, L, K] routed ids (-1 = no record), decoding a packed payload now.

        Args:
          out: optional int32 destination holding -1 (a slice of the batch), [n, L, K], or
            the window's [stop - start, L, K].
          window: optional token range [start, stop) to fill `out` with (a host's S range).
        Raises `packed.PayloadError` for a packed payload that is not valid base64 or has an
        expert id >= E (found only here: hosts decode only the rows they build).
        """
        if isinstance(self.routed, packed.RoutedPayload):
            return packed.decode_routed(self.routed, self.loss_mask, out, window)
        if out is not None and self.routed is not None:
            out[:] = self.routed if window is None else self.routed[window]
            return out
        return self.routed


@dataclasses.dataclass
class ParsedGroup:
    """A validated group; `trajectories` holds the non-infra (valid) members only."""

    record: schema.Group
    trajectories: list
    grading_ok: bool
    num_infra: int
    origin: str = ""                # where the record came from (for a late dead-letter entry)

    @property
    def group_id(self) -> str:
        return self.record.group_id

    @property
    def policy_version(self) -> int:
        return self.record.policy_version

    def staleness_version(self, mode: str = "oldest") -> float:
        """The version staleness is judged on: the oldest, newest or token-weighted mean
        version of the group's generated tokens (partial rollouts; else the group's)."""
        v = np.concatenate([t.generated_versions(self.policy_version) for t in self.trajectories])
        if not v.size:
            return float(self.policy_version)
        return float({"oldest": v.min, "newest": v.max, "mean": v.mean}[mode]())

    @property
    def partial(self) -> bool:
        """Whether the generated tokens came from more than one policy version."""
        v = np.concatenate([t.generated_versions(self.policy_version) for t in self.trajectories])
        return bool(v.size) and int(v.min()) != int(v.max())

    @property
    def mixed(self) -> bool:
        """0 < passes < valid members, with hacked passes counted as failures \
(docs/advantage.md rules 2, 3)."""
        k = sum(1 for t in self.trajectories if t.reward > 0 and not t.hacked)
        return 0 < k < len(self.trajectories)

    @property
    def lengths(self) -> list:
        return [t.length for t in self.trajectories]


_PATH = re.compile(r"at `([^`]*)`")


def classify_decode_error(err: msgspec.DecodeError) -> Rejected:
    """Maps a msgspec error to a reason; the message keeps msgspec's JSON path."""
    msg = str(err)
    if not isinstance(err, msgspec.ValidationError):
        return Rejected(Reason.UNPARSEABLE, msg)
    m = _PATH.search(msg)
    if m and m.group(1).endswith(".outcome") and "enum" in msg:
        return Rejected(Reason.UNKNOWN_OUTCOME, msg)
    return Rejected(Reason.SCHEMA, msg)


def _routed(traj: schema.Trajectory, mask: np.ndarray, shape: ModelShape, where: str,
            length: int):
    if traj.routed_experts is None:
        return None
    L, K = shape.num_moe_layers, shape.top_k
    if isinstance(traj.routed_experts, schema.PackedArray):
        n, n_gen = mask.shape[0], int(mask.sum())
        err = packed.header_error(traj.routed_experts, n, n_gen, L, K)
        if err is not None:
            raise Rejected(err.reason, f"{where}: {err.detail}")
        per_generated = traj.routed_experts.shape[0] != n
        return packed.RoutedPayload(traj.routed_experts, shape.num_experts, length,
                                    per_generated, bool(length < n and mask[length]))
    try:
        arr = np.asarray(traj.routed_experts, dtype=np.int64)
    except ValueError:
        raise Rejected(Reason.ROUTED_EXPERTS, f"{where}: ragged routed_experts") from None
    n, n_gen = mask.shape[0], int(mask.sum())
    if arr.ndim != 3 or arr.shape[1:] != (L, K) or arr.shape[0] not in (n, n_gen):
        raise Rejected(Reason.ROUTED_EXPERTS,
                       f"{where}: routed_experts shape {arr.shape}, expected [n, {L}, {K}] with "
                       f"n = {n_gen} generated tokens or {n} tokens")
    hi = shape.num_experts if shape.num_experts is not None else np.iinfo(np.int32).max
    if arr.size and (arr.min() < -1 or arr.max() >= hi):
        raise Rejected(Reason.ROUTED_EXPERTS, f"{where}: expert id outside [-1, {hi})")
    if arr.shape[0] == n:
        return arr.astype(np.int32)
    # Entry j produced the j-th generated token at position t: its input was token t - 1.
    full = np.full((n, L, K), -1, np.int32)
    full[np.flatnonzero(mask) - 1] = arr
    return full


def _quality(traj: schema.Trajectory, where: str) -> tuple[int, int, float]:
    q = traj.quality
    if q is None:
        return grading.DIRECT, 0, float("nan")
    if q.factor is not None and (q.tier is not None or q.rank is not None):
        raise Rejected(Reason.BAD_QUALITY, f"{where}: quality has both a factor and a tier/rank")
    if q.factor is not None:
        return grading.DIRECT, 0, float(q.factor)
    if q.tier is None or q.rank is None:
        raise Rejected(Reason.BAD_QUALITY, f"{where}: quality needs tier and rank, or factor")
    return grading.TIER_NAMES[q.tier], int(q.rank), float("nan")


def _length(values: list | schema.PackedArray, field: str, dtypes: tuple, where: str) -> int:
    """A list's length, or a compact array's (after checking its header)."""
    if isinstance(values, schema.PackedArray):
        err = packed.array_error(values, field, dtypes, 1)
        if err is not None:
            raise Rejected(err.reason, f"{where}: {err.detail}")
        return int(values.shape[0])
    return len(values)


def _versions(traj: schema.Trajectory, n: int, mask: np.ndarray, group_version: int,
              where: str) -> Optional[np.ndarray]:
    """Per-token policy versions (int64 [n]) from either form, or None when none was sent."""
    per_token, spans = traj.policy_versions, traj.policy_version_spans
    if per_token is None and spans is None:
        return None
    if per_token is not None and spans is not None:
        raise Rejected(Reason.VERSION_OUT_OF_RANGE,
                       f"{where}: both policy_versions and policy_version_spans")
    if per_token is not None:
        if isinstance(per_token, schema.PackedArray):
            err = packed.array_error(per_token, "policy_versions", schema.VERSION_DTYPES, 1)
            if err is not None:
                raise Rejected(err.reason, f"{where}: {err.detail}")
            v = packed.decode_ints(per_token, "policy_versions")
        else:
            try:
                v = np.asarray(per_token, np.int64)
            except OverflowError:
                raise Rejected(Reason.VERSION_OUT_OF_RANGE, f"{where}: version too large") from None
        if v.shape != (n,):
            raise Rejected(Reason.LENGTH_MISMATCH,
                           f"{where}: {v.size} policy_versions for {n} tokens")
    else:
        if not spans:
            raise Rejected(Reason.VERSION_SPANS_EMPTY, f"{where}: policy_version_spans is [] "
                           "(omit it, or give at least [[0, version]])")
        if any(len(s) != 2 for s in spans):
            raise Rejected(Reason.VERSION_OUT_OF_RANGE,
                           f"{where}: policy_version_spans entries must be [start, version]")
        starts = [s[0] for s in spans]
        if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
            raise Rejected(Reason.VERSION_SPANS_UNSORTED,
                           f"{where}: policy_version_spans starts {starts} not increasing")
        if starts[0] < 0 or starts[-1] >= n:
            raise Rejected(Reason.VERSION_OUT_OF_RANGE,
                           f"{where}: a span start outside [0, {n})")
        versions = [s[1] for s in spans]
        if any(not -(2**63) <= x < 2**63 for x in versions):   # numpy would raise OverflowError
            raise Rejected(Reason.VERSION_OUT_OF_RANGE,
                           f"{where}: a policy_version_spans version over 64 bits")
        v = np.full(n, -1, np.int64)
        for (start, version), stop in zip(spans, starts[1:] + [n], strict=True):
            v[start:stop] = version
    gen = v[mask > 0]
    if gen.size and gen.min() < 0:
        raise Rejected(Reason.VERSION_OUT_OF_RANGE,
                       f"{where}: a generated token without a policy version >= 0")
    if gen.size and gen.max() > group_version:
        raise Rejected(Reason.VERSION_NEWER, f"{where}: policy version {int(gen.max())} newer "
                       f"than the group's policy_version {group_version}")
    return v


def _trajectory(traj: schema.Trajectory, limits: FeedConfig, shape: ModelShape, where: str,
                group_version: int = 0):
    n = _length(traj.tokens, "tokens", schema.TOKEN_DTYPES, where)
    n_logprobs = _length(traj.logprobs, "logprobs", schema.LOGPROB_DTYPES, where)
    if len(traj.loss_mask) != n or n_logprobs != n:
        raise Rejected(Reason.LENGTH_MISMATCH,
                       f"{where}: {n} tokens, {len(traj.loss_mask)} loss_mask, "
                       f"{n_logprobs} logprobs")
    # Compact tokens / logprobs are checked (vocabulary, finite) when their row is built.
    compact_tokens = isinstance(traj.tokens, schema.PackedArray)
    compact_logprobs = isinstance(traj.logprobs, schema.PackedArray)
    try:
        tokens = None if compact_tokens else np.asarray(traj.tokens, np.int64)
        mask = np.asarray(traj.loss_mask, np.int64)
    except OverflowError:
        raise Rejected(Reason.TOKEN_OUT_OF_VOCAB, f"{where}: integer out of range") from None
    if tokens is not None and n and (tokens.min() < 0 or tokens.max() >= shape.vocab_size):
        raise Rejected(Reason.TOKEN_OUT_OF_VOCAB, f"{where}: token ids must be in "
                       f"[0, {shape.vocab_size}), got [{tokens.min()}, {tokens.max()}]")
    if n and (((mask != 0) & (mask != 1)).any() or mask[0] == 1):
        raise Rejected(Reason.BAD_LOSS_MASK, f"{where}: loss_mask must be 0/1 and 0 at the "
                       "first token (it has no context to be predicted from)")
    logprobs = None if compact_logprobs else np.asarray(traj.logprobs, np.float64)
    if (logprobs is not None and not np.isfinite(logprobs).all()) or not np.isfinite(
            traj.adjustment):
        raise Rejected(Reason.NON_FINITE, f"{where}: non-finite logprobs or adjustment")
    tier, rank, factor = _quality(traj, where)
    versions = _versions(traj, n, mask, group_version, where)
    keep = min(n, limits.max_traj_tokens)
    routed = _routed(traj, mask, shape, where, keep)
    adjustment = float(traj.adjustment) + overlong_penalty(n, bool(traj.truncated), limits)
    dropped = limits.overlong == "drop" and (n > keep or traj.truncated)
    if limits.overlong == "reject" and (n > keep or traj.truncated):
        raise Rejected(Reason.TOO_LONG, f"{where}: " + (
            "truncated by its producer" if n <= keep else
            f"{n} tokens > max_traj_tokens {limits.max_traj_tokens}") + " (feed.overlong reject)")
    if n > keep:
        n = keep
        mask = mask[:n]
        tokens = tokens if tokens is None else tokens[:n]
        logprobs = logprobs if logprobs is None else logprobs[:n]
        routed = routed[:n] if isinstance(routed, np.ndarray) else routed
        versions = versions if versions is None else versions[:n]
    if not mask.any():
        raise Rejected(Reason.NO_GENERATED_TOKENS, f"{where}: no loss_mask=1 token")
    if dropped:        # out of the loss, still a member of its group's statistics
        mask, routed = np.zeros_like(mask), None       # no loss token: nothing to replay
    return ParsedTrajectory(
        trajectory_id=traj.trajectory_id,
        tokens=(packed.LazyArray(traj.tokens, "tokens", n, shape.vocab_size) if compact_tokens
                else tokens.astype(np.int32)),
        loss_mask=mask.astype(np.float32),
        logprobs=(packed.LazyArray(traj.logprobs, "logprobs", n) if compact_logprobs
                  else logprobs.astype(np.float32)),
        routed=routed, reward=1.0 if traj.outcome == "pass" else 0.0, hacked=bool(traj.hacked),
        tier=tier, rank=rank, factor=factor, adjustment=adjustment, versions=versions)


def overlong_penalty(n: int, truncated: bool, limits: FeedConfig) -> float:
    """DAPO's soft overlong penalty of a trajectory of `n` tokens (0 when off): 0 up to
    `max_traj_tokens - overlong_buffer_len`, then linear down to `-overlong_penalty_factor` at
    `max_traj_tokens`, and that beyond it or for one its producer `truncated`."""
    buffer, limit = limits.overlong_buffer_len, limits.max_traj_tokens
    if not buffer:
        return 0.0
    if truncated or n >= limit:
        return -float(limits.overlong_penalty_factor)
    return float(min(0.0, (limit - buffer - n) / buffer) * limits.overlong_penalty_factor)


def validate_group(group: schema.Group, limits: FeedConfig, shape: ModelShape) -> ParsedGroup:
    """Checks one decoded record against the schema's semantic rules and the model.

    Args:
      group: the decoded record.
      limits: a `FeedConfig` (max_group_trajectories, max_traj_tokens, truncate_long).
      shape: the model's vocabulary and routing shape.
    Returns:
      The `ParsedGroup`; raises `Rejected` with the first problem found.
    """
    gid = group.group_id
    if len(gid) > schema.MAX_ID_CHARS or len(group.task_id) > schema.MAX_ID_CHARS:
        raise Rejected(Reason.ID_TOO_LONG, f"group_id or task_id over {schema.MAX_ID_CHARS} "
                       f"characters (group_id starts {gid[:64]!r})")
    if group.policy_version < 0:
        raise Rejected(Reason.NEGATIVE_POLICY_VERSION,
                       f"group {gid!r}: policy_version {group.policy_version} < 0")
    if group.schema_version not in schema.SUPPORTED_SCHEMA_VERSIONS:
        raise Rejected(Reason.SCHEMA_VERSION, f"group {gid!r}: schema_version "
                       f"{group.schema_version}, supported {schema.SUPPORTED_SCHEMA_VERSIONS}")
    if len(group.trajectories) > limits.max_group_trajectories:
        raise Rejected(Reason.TOO_MANY_TRAJECTORIES, f"group {gid!r}: {len(group.trajectories)} "
                       f"> max_group_trajectories {limits.max_group_trajectories}")
    ids = [t.trajectory_id for t in group.trajectories]
    if any(len(i) > schema.MAX_ID_CHARS for i in ids):
        raise Rejected(Reason.ID_TOO_LONG,
                       f"group {gid!r}: a trajectory_id over {schema.MAX_ID_CHARS} characters")
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise Rejected(Reason.DUPLICATE_TRAJECTORY, f"group {gid!r}: repeated ids {dup}")
    parsed, num_infra = [], 0
    for i, traj in enumerate(group.trajectories):
        if traj.outcome == "infra_error":
            num_infra += 1
            continue
        where = f"group {gid!r} trajectories[{i}] ({traj.trajectory_id!r})"
        parsed.append(_trajectory(traj, limits, shape, where, group.policy_version))
    if not parsed:
        raise Rejected(Reason.NO_VALID_TRAJECTORY,
                       f"group {gid!r}: no trajectory other than infra errors")
    return ParsedGroup(record=group, trajectories=parsed,
                       grading_ok=group.grading.status == "ok", num_infra=num_infra)

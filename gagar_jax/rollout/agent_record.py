"""A multi-turn trajectory as the agent loop grows it, and the feed record of a group of them.

Token ids in, token ids out (SPEC section 6): `observe` appends what the environment showed the
model (the prompt, each tool result; `loss_mask` 0, log-prob 0), `generated` appends exactly the
ids the engine produced for a turn with their behaviour log-probs, the experts each was routed
to and the policy version that generated it (`loss_mask` 1). Nothing is decoded and re-encoded.

    t = AgentTrajectory()
    t.observe(prompt_ids)
    t.generated(turn.tokens, turn.logprobs, turn.routed_experts, version=3)
    t.observe(tool_output_ids)
    t.generated(...)                                     # after a move to version 4
    t.feed_dict("t0", {"outcome": "pass"})
    # {"tokens", "loss_mask", "logprobs", "routed_experts" [g][L][K] (every generated token, in
    #  order, across turns), "policy_version_spans": [[start of turn 1, 3], [start of turn 2, 4]],
    #  "truncated", ...}

Routing uses the feed's generated-token layout (entry j = the forward that produced generated
token j, whose input is the token before it; docs/feed.md). A trajectory longer than
`COMPACT_FROM` tokens sends tokens, log-probs and routing as compact base64 arrays
(`gagar_jax.feed.packed`). Imports no JAX.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gagar_jax.feed import packed, schema

COMPACT_FROM = 4096       # tokens: longer trajectories use the compact array form


class AgentTrajectory:
    """One trajectory's tokens, loss mask, log-probs, routing and per-token versions.

    Attributes:
      tokens, loss_mask, logprobs: the feed's per-token lists.
      routed: per generated token, [L][K] expert ids, or None where the engine recorded none.
      versions: per generated token, the policy version that generated it.
      turn_starts: the index in `tokens` of each model turn's first token.
    """

    def __init__(self):
        self.tokens: list = []
        self.loss_mask: list = []
        self.logprobs: list = []
        self.routed: list = []
        self.versions: list = []
        self.turn_starts: list = []

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def generated_count(self) -> int:
        return len(self.versions)

    @property
    def oldest_version(self) -> int | None:
        """The version of the oldest generated token (None before the first turn)."""
        return min(self.versions) if self.versions else None

    @property
    def newest_version(self) -> int | None:
        return max(self.versions) if self.versions else None

    def observe(self, ids: Sequence[int]) -> None:
        """Appends environment tokens (the prompt, a tool's output): loss_mask 0, log-prob 0."""
        ids = [int(t) for t in ids]
        self.tokens += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def generated(self, ids: Sequence[int], logprobs: Sequence[float],
                  routed: Sequence | None, version: int) -> None:
        """Appends one model turn: the engine's ids, their log-probs, their routing ([g][L][K]
        or None) and the version whose weights produced them."""
        if not self.tokens:
            raise ValueError("a model turn needs a prompt before it")
        if len(logprobs) != len(ids) or (routed is not None and len(routed) != len(ids)):
            raise ValueError(f"a turn of {len(ids)} tokens with {len(logprobs)} log-probs and "
                             f"{'no' if routed is None else len(routed)} routing rows")
        self.turn_starts.append(len(self.tokens))
        self.tokens += [int(t) for t in ids]
        self.loss_mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs]
        self.routed += list(routed) if routed is not None else [None] * len(ids)
        self.versions += [int(version)] * len(ids)

    def version_spans(self) -> list:
        """`[[start, version], ...]`: each run of generated tokens from one version starts a
        span at its first token (the prompt and observations before it carry no version)."""
        spans, g = [], 0
        for t, m in enumerate(self.loss_mask):
            if not m:
                continue
            v = self.versions[g]
            if not spans or spans[-1][1] != v:
                spans.append([t, v])
            g += 1
        return spans

    def routed_array(self) -> np.ndarray | None:
        """[g, L, K] int32 (-1 where a turn had no record), or None when no turn had one."""
        rows = [r for r in self.routed if r is not None]
        if not rows:
            return None
        shape = np.asarray(rows[0]).shape
        out = np.full((len(self.routed), *shape), -1, np.int32)
        for j, r in enumerate(self.routed):
            if r is not None:
                out[j] = np.asarray(r, np.int32)
        return out

    def feed_dict(self, tid: str, verdict: dict, *, truncated: bool = False) -> dict:
        """The feed's trajectory fields (docs/feed.md); `policy_version_spans` always (one span
        when every turn came from one version).

        Args:
          tid: the trajectory id.
          verdict: {"outcome", optional "hacked", "quality", "adjustment"}.
          truncated: the loop cut it (token limit, context): the learner's `feed.overlong`.
        """
        compact = len(self.tokens) > COMPACT_FROM
        t = {"trajectory_id": tid,
             "tokens": (packed.pack_array(np.asarray(self.tokens), "int32") if compact
                        else list(self.tokens)),
             "loss_mask": list(self.loss_mask),
             "logprobs": (packed.pack_array(np.asarray(self.logprobs), "float32") if compact
                          else list(self.logprobs)),
             "outcome": verdict["outcome"]}
        for key in ("quality", "hacked", "adjustment"):
            if verdict.get(key) is not None:
                t[key] = verdict[key]
        routed = self.routed_array()
        if routed is not None:
            t["routed_experts"] = packed.pack(routed) if compact else routed.tolist()
        if self.versions:
            t["policy_version_spans"] = self.version_spans()
        if truncated:
            t["truncated"] = True
        return t


def agent_group_record(group_id: str, task_id: str, trajectories: Sequence[dict],
                       grading: dict, *, version: int, sampling: dict | None = None
                       ) -> schema.Group:
    """One feed record (validated by the learner's msgspec schema) of a finished group.

    Args:
      trajectories: `AgentTrajectory.feed_dict` answers.
      grading: the record's `grading` ({"status", "grader", "evidence"}).
      version: the group's `policy_version` when no trajectory generated a token (all
        infra errors); otherwise the newest version of any generated token is used.
      sampling: the engine's sampling parameters (`SamplingSpec.record()`).
    Returns:
      The `schema.Group`.
    """
    newest = [s[1] for t in trajectories for s in t.get("policy_version_spans", ())]
    rec = {"schema_version": schema.SCHEMA_VERSION, "group_id": group_id, "task_id": task_id,
           "policy_version": max(newest, default=int(version)), "grading": grading,
           "trajectories": list(trajectories)}
    if sampling is not None:
        rec["sampling"] = sampling
    return schema.from_builtins(rec)

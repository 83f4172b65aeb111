"""Feed records from a rollout worker, written as atomic spool shards (docs/feed.md, section 3).

    rec = group_record(group_id, task_id, policy_version, prompt, completions, grades, ...)
    SpoolWriter(spool_dir, "worker0").write([rec])     # .name.tmp, fsync, rename: atomic

Records are built and type-checked with the learner's own schema (`gagar_jax.feed.schema`, msgspec
Structs), which imports no JAX: this module runs in the vLLM environment.
"""
from __future__ import annotations

import os
import time
from collections.abc import Sequence

from gagar_jax.feed import schema


def trajectory(tid: str, prompt: Sequence[int], completion: Sequence[int],
               logprobs: Sequence[float], grade: dict,
               routed_experts: Sequence | None = None) -> dict:
    """One trajectory of the feed: prompt tokens (loss_mask 0, log-prob 0) then the completion.

    `grade` is the grader's verdict for it: {"outcome": "pass" | "fail" | "infra_error",
    optionally "quality": {"tier", "rank"} | {"factor"}, "hacked", "adjustment"}.
    `routed_experts` ([g][L][K], g = len(completion)) uses the feed's generated-token layout.
    """
    if len(logprobs) != len(completion):
        raise ValueError(f"{tid}: {len(logprobs)} log-probs for {len(completion)} tokens")
    t = {"trajectory_id": tid, "tokens": [*prompt, *completion],
         "loss_mask": [0] * len(prompt) + [1] * len(completion),
         "logprobs": [0.0] * len(prompt) + [float(x) for x in logprobs],
         "outcome": grade["outcome"]}
    for key in ("quality", "hacked", "adjustment"):
        if grade.get(key) is not None:
            t[key] = grade[key]
    if routed_experts is not None:
        if len(routed_experts) != len(completion):
            raise ValueError(f"{tid}: routing for {len(routed_experts)} of {len(completion)} "
                             "generated tokens")
        t["routed_experts"] = [[list(k) for k in layer] for layer in routed_experts]
    return t


def group_record(group_id: str, task_id: str, policy_version: int, prompt: Sequence[int],
                 completions: Sequence, grades: Sequence[dict], *, grader: str,
                 sampling: dict | None = None, evidence: object = None,
                 grading_ok: bool = True) -> schema.Group:
    """One feed record (a `schema.Group`, validated by msgspec) for a sampled and graded group.

    Args:
      completions: objects with `tokens`, `logprobs` and `routed_experts` (engine.Completion).
      grades: one grader verdict per completion (see `trajectory`).
      sampling: the engine's sampling parameters (`engine.SamplingSpec.record()`).
    """
    if len(grades) != len(completions):
        raise ValueError(f"{group_id}: {len(grades)} grades for {len(completions)} completions")
    rec = {"schema_version": schema.SCHEMA_VERSION, "group_id": group_id, "task_id": task_id,
           "policy_version": int(policy_version),
           "grading": {"status": "ok" if grading_ok else "failed", "grader": grader,
                       **({"evidence": evidence} if evidence is not None else {})},
           "trajectories": [trajectory(f"t{j}", prompt, c.tokens, c.logprobs, g,
                                       c.routed_experts)
                            for j, (c, g) in enumerate(zip(completions, grades, strict=True))]}
    if sampling is not None:
        rec["sampling"] = sampling
    return schema.from_builtins(rec)


class SpoolWriter:
    """Publishes shards into a learner's spool: a name it ignores, fsync, then an atomic rename.

    Names sort in publish order (zero-padded nanoseconds, the writer id, a sequence number),
    which is the order the learner consumes them in.
    """

    def __init__(self, spool_dir: str, writer_id: str):
        if not writer_id or "/" in writer_id or writer_id.startswith((".", "_")):
            raise ValueError(f"writer_id must be a plain name, got {writer_id!r}")
        self.dir, self.writer_id, self.count = spool_dir, writer_id, 0
        os.makedirs(spool_dir, exist_ok=True)

    def write(self, groups: Sequence[schema.Group]) -> str:
        """Writes one shard holding `groups` (JSON Lines); returns its final path."""
        name = f"{time.time_ns():020d}-{self.writer_id}-{self.count:06d}.jsonl"
        self.count += 1
        tmp = os.path.join(self.dir, f".{name}.tmp")
        with open(tmp, "wb") as f:
            for g in groups:
                f.write(schema.encode(g, "json") + b"\n")
            f.flush()
            os.fsync(f.fileno())
        final = os.path.join(self.dir, name)
        os.rename(tmp, final)
        return final

    def done(self) -> None:
        """Creates `_DONE`: the learner ends its feed once every shard is consumed."""
        open(os.path.join(self.dir, "_DONE"), "w").close()

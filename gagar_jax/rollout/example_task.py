"""The example task and grader: "answer with digits", a verifiable reward a tiny model learns fast.

Tokens are bytes (vocab 256, no tokenizer). A task's prompt is `b"digits: "` followed by eight
random lowercase letters; a completion passes when it contains at least one digit token
(`b"0"`..`b"9"`, ids 48-57). A model with near-uniform next-token probabilities passes with
1 - (246/256)^8 = 27% of 8-token completions; a policy that learns to emit digits passes always.

The grader also ranks the passes (Gagar's quality factors, docs/advantage.md): completions made
mostly of digits are `strong`, others `intermediate`, ranked within their tier by how many
non-digit tokens they carry (fewer = better).

    python -m gagar_jax.rollout.worker --tasks gagar_jax.rollout.example_task:tasks \\
        --grader gagar_jax.rollout.example_task:grade ...

Grader interface (`--grader module:function`): `grade(task, completions) -> verdicts`, where
`task` is the task dict the task source yielded, `completions` the group's generated token
lists, and `verdicts` one dict per completion: {"outcome": "pass" | "fail" | "infra_error",
"quality": {"tier": "strong" | "intermediate" | "defective", "rank": int} or {"factor": f}
(passes), optional "hacked" and "adjustment"}. A grader may instead return {"verdicts": [...],
"status": "ok" | "failed", "evidence": ...}; an exception skips the group (logged). Task
sources (`--tasks module:function`): `tasks(seed) -> iterator of {"task_id", "prompt": [ids]}`
(other keys are passed through to the grader).
"""
from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

PREFIX = list(b"digits: ")
DIGITS = frozenset(range(ord("0"), ord("9") + 1))


def tasks(seed: int = 0) -> Iterator[dict]:
    """An endless stream of tasks; the same seed gives the same stream."""
    rng = random.Random(seed)
    i = 0
    while True:
        letters = [rng.randrange(ord("a"), ord("z") + 1) for _ in range(8)]
        yield {"task_id": f"digits-{seed}-{i}", "prompt": PREFIX + letters}
        i += 1


def passes(completion: Sequence[int]) -> bool:
    """The verifiable reward: at least one digit token."""
    return any(t in DIGITS for t in completion)


def grade(task: dict, completions: Sequence[Sequence[int]]) -> list:
    """One verdict per completion (the interface above)."""
    out = []
    for c in completions:
        if not passes(c):
            out.append({"outcome": "fail"})
            continue
        other = sum(t not in DIGITS for t in c)
        tier = "strong" if 2 * other <= len(c) else "intermediate"
        out.append({"outcome": "pass", "quality": {"tier": tier, "rank": other}})
    return out

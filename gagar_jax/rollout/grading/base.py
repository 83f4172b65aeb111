"""The group-grader protocol and the one adapter to the agent loop's `--grader` function.

A group grader is any object with `grade(ws: GroupWorkspace) -> GroupGrade`; it is called only
for mixed groups (`agent_grading.is_mixed`) and ranks `ws.passing()`. `as_grader_fn` wraps one
into the `grade(task, views) -> {"verdicts", "status", "evidence"}` function the agent loop
loads with `--grader module:name` (the package docstring says how). Imports no JAX.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from gagar_jax.rollout import agent_grading
from gagar_jax.rollout.grading import tiers
from gagar_jax.rollout.grading.workspace import GroupWorkspace


@dataclasses.dataclass(frozen=True)
class GroupGrade:
    """What a group grader answers.

    Attributes:
      ranking: [{"trajectory_id", "tier", "rank"}], one per valid passing candidate
        (`tiers.check_ranking`); may be empty when status is "failed".
      status: "ok", or "failed" (timeout, invalid output, crash): binary credit for the group.
      evidence: JSON-able; why (the axes' scores, Kendall's tau, the failure's reason...).
      hacked: trajectory ids the grader found relying on leaked answers or edited tests (OR-ed
        with the environment's flag: their reward is zeroed, SPEC section 2 rule 2).
    """
    ranking: tuple = ()
    status: str = "ok"
    evidence: object = None
    hacked: frozenset = frozenset()

    def __post_init__(self):
        object.__setattr__(self, "ranking", tuple(self.ranking))
        object.__setattr__(self, "hacked", frozenset(self.hacked))


@runtime_checkable
class GroupGrader(Protocol):
    """The protocol every group grader implements (heuristic, LLM, a user's)."""

    name: str

    def grade(self, ws: GroupWorkspace) -> GroupGrade:
        """Ranks `ws.passing()`; may flag any candidate hacked. May raise (= status failed)."""
        ...


def grade_workspace(grader: GroupGrader, ws: GroupWorkspace) -> dict:
    """One mixed group through `grader`, as the agent loop's answer dict (a crash or an invalid
    ranking gives status "failed" with the reason in the evidence, never an exception)."""
    ids = ws.ids()
    passing = [c.trajectory_id for c in ws.passing()]
    t0 = time.monotonic()
    try:
        answer = tiers.verdicts(ids, passing, grader.grade(ws), grader.name)
    except agent_grading.GraderCrashed:
        raise                       # the pool re-queues the group
    except Exception as e:          # any grader bug or bad answer: binary credit, with reason
        answer = {"verdicts": [{} for _ in ids], "status": "failed",
                  "evidence": {"grader": grader.name, "error": f"{type(e).__name__}: {e}"[:2000]}}
    answer["evidence"]["latency_s"] = round(time.monotonic() - t0, 4)
    return answer


def as_grader_fn(grader: GroupGrader) -> Callable:
    """The agent loop's `--grader` function for `grader`: `fn(task, views) -> answer`.

    Groups that are not mixed are not graded here (the loop never sends them; if called
    anyway, every pass gets no quality and the loop's binary default applies)."""
    if not isinstance(grader, GroupGrader):
        raise TypeError(f"{grader!r} does not implement GroupGrader (name + grade(ws))")

    def grade(task: Mapping, views: Sequence[Mapping]) -> dict:
        if not agent_grading.is_mixed(list(views)):
            return {"verdicts": [{} for _ in views], "status": "ok",
                    "evidence": {"grader": grader.name, "skipped": "not mixed"}}
        return grade_workspace(grader, GroupWorkspace.from_views(task, views))

    grade.group_grader = grader
    grade.__name__ = f"grade_{grader.name}"
    return grade

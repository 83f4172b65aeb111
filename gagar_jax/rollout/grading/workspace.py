"""A mixed group as one shared workspace: the task and every candidate's artifacts, read once.

`GroupWorkspace.from_views(task, views)` takes what the agent loop hands a `--grader` (the task
dict and one `agent_grading.grader_view` per trajectory) and reads each view's workspace
directory (docs/rollout.md, "The trajectory workspace"): final.diff, tests/run_*.log,
tests/verdict.log, transcript.jsonl. A view without a workspace (`workspace` None: another
environment) still becomes a candidate: its diff is empty and its transcript is the view's
decoded turns; a workspace named but missing is an error (the group's grading fails, loudly).
Imports no JAX.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence

from gagar_jax.rollout.envs import patch, repo_tasks


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One trajectory of the group, as the grader reads it.

    Attributes:
      trajectory_id: the record's id ("t0", "t1", ...).
      outcome: the environment's verdict ("pass" / "fail" / "infra_error"); final.
      hacked: the environment's test-infrastructure flag.
      end_reason: why the episode ended (`envs.base.END_REASONS`) or None.
      diff: the final unified diff against the task's repository ("" = unchanged).
      files_touched: repository paths the diff adds, changes or deletes, sorted.
      lines_added, lines_removed: `+` / `-` lines of the diff's hunks.
      test_logs: ((name, text), ...) of each visible `run_tests`, in order.
      verdict_log: the held-out verdict run's output ("" if none).
      transcript: the workspace's transcript.jsonl events (dicts), or the view's decoded turns.
      workspace: the trajectory's workspace directory, or None.
      evidence: the environment's verdict evidence.
    """
    trajectory_id: str
    outcome: str
    hacked: bool
    end_reason: str | None = None
    diff: str = ""
    files_touched: tuple = ()
    lines_added: int = 0
    lines_removed: int = 0
    test_logs: tuple = ()
    verdict_log: str = ""
    transcript: tuple = ()
    workspace: str | None = None
    evidence: object = None

    @property
    def passes(self) -> bool:
        """A valid pass: the outcome is "pass" and the environment saw no hack."""
        return self.outcome == "pass" and not self.hacked

    @property
    def repo_dir(self) -> str | None:
        """The working copy as the agent left it (None without a workspace)."""
        return None if self.workspace is None else os.path.join(self.workspace, "repo")


def diff_stats(diff_text: str) -> tuple:
    """(files touched (sorted tuple), lines added, lines removed) of a unified diff.

    Raises:
      ValueError (`patch.PatchError`) on a diff that does not parse.
    """
    files, added, removed = set(), 0, 0
    for fp in patch.parse(diff_text) if diff_text.strip() else ():
        files.add(fp.new if fp.new is not None else fp.old)
        for _, lines in fp.hunks:
            added += sum(tag == "+" for tag, _ in lines)
            removed += sum(tag == "-" for tag, _ in lines)
    return tuple(sorted(files)), added, removed


def _read(path: str) -> str:
    if not os.path.isfile(path):
        return ""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _transcript(ws: str, view: Mapping) -> tuple:
    text = _read(os.path.join(ws, "transcript.jsonl")) if ws else ""
    if not text:
        return tuple(view.get("transcript") or ())
    events = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{ws}/transcript.jsonl line {n}: not JSON ({e})") from None
    return tuple(events)


def candidate_from_view(view: Mapping) -> Candidate:
    """One `agent_grading.grader_view` (and its workspace directory) as a Candidate.

    Raises:
      ValueError naming the trajectory when a key is missing or its final.diff does not parse.
    """
    for key in ("trajectory_id", "outcome"):
        if key not in view:
            raise ValueError(f"grader view lacks {key!r} (keys: {sorted(view)})")
    tid = view["trajectory_id"]
    ws = view.get("workspace")
    if ws is not None and not os.path.isdir(ws):
        raise ValueError(f"trajectory {tid}: workspace {ws!r} is not a directory")
    diff = _read(os.path.join(ws, "final.diff")) if ws else ""
    try:
        files, added, removed = diff_stats(diff)
    except ValueError as e:
        raise ValueError(f"trajectory {tid}: final.diff does not parse: {e}") from None
    logs = []
    tests_dir = os.path.join(ws, "tests") if ws else ""
    if tests_dir and os.path.isdir(tests_dir):
        for name in sorted(os.listdir(tests_dir)):
            if name.startswith("run_") and name.endswith(".log"):
                logs.append((name, _read(os.path.join(tests_dir, name))))
    return Candidate(
        trajectory_id=tid, outcome=view["outcome"], hacked=bool(view.get("hacked", False)),
        end_reason=view.get("end_reason"), diff=diff, files_touched=files,
        lines_added=added, lines_removed=removed, test_logs=tuple(logs),
        verdict_log=_read(os.path.join(tests_dir, "verdict.log")) if tests_dir else "",
        transcript=_transcript(ws, view), workspace=ws, evidence=view.get("evidence"))


@dataclasses.dataclass(frozen=True)
class GroupWorkspace:
    """The group a grader ranks: the task and its candidates, in the views' order.

    Attributes:
      task_id: the task's id.
      prompt: the issue statement shown to the agents ("" when the task has no task_dir).
      visible_tests: repository paths of the tests the agents could run.
      task_dir: the task directory (repository tasks) or None.
      task: the task dict as the agent loop passed it.
      candidates: one Candidate per trajectory, in the views' order.
    """
    task_id: str
    prompt: str
    visible_tests: tuple
    task_dir: str | None
    task: Mapping
    candidates: tuple

    @classmethod
    def from_views(cls, task: Mapping, views: Sequence[Mapping]) -> GroupWorkspace:
        """The group's workspace from the agent loop's `grader(task, views)` arguments.

        Raises:
          ValueError on a duplicate trajectory id, a missing key or an unreadable artifact.
        """
        cands = tuple(candidate_from_view(v) for v in views)
        ids = [c.trajectory_id for c in cands]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate trajectory ids in the group: {ids}")
        task_dir = task.get("task_dir")
        prompt, visible = str(task.get("statement", "")), tuple(task.get("visible_tests", ()))
        if task_dir is not None:
            t = repo_tasks.load_task(task_dir)
            prompt, visible = t.statement, t.visible_tests
        return cls(task_id=str(task.get("task_id", "")), prompt=prompt, visible_tests=visible,
                   task_dir=task_dir, task=dict(task), candidates=cands)

    def passing(self) -> tuple:
        """The valid passing candidates (outcome "pass", not hacked): the ones a grader ranks."""
        return tuple(c for c in self.candidates if c.passes)

    def ids(self) -> tuple:
        return tuple(c.trajectory_id for c in self.candidates)

    def by_id(self, trajectory_id: str) -> Candidate:
        for c in self.candidates:
            if c.trajectory_id == trajectory_id:
                return c
        raise KeyError(f"no candidate {trajectory_id!r} in group {self.task_id} ({self.ids()})")

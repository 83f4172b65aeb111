"""The repository tasks: one directory per task, loaded and checked here.

A task directory (the shipped ones: `data/repo_tasks/`; docs/rollout.md, "Adding tasks"):

    <task>/task.json    {"task_id", "bug_class", "statement", "visible_tests": [paths],
                         "heldout_tests": [paths], "expected_tests": int,
                         "protected": [extra globs, optional]}
    <task>/repo/        the buggy repository the agent gets (with the visible tests)
    <task>/heldout/     the held-out tests, at the paths `heldout_tests` names
    <task>/fix.diff     the reference fix (a unified diff against repo/)

`expected_tests` counts the test cases the verdict runs (visible and held-out together): a
verdict passes only when exactly these all pass. `protected` adds globs (fnmatch on the
repository path) to the test infrastructure a submission must leave alone.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
from collections.abc import Iterator

from gagar_jax.rollout.envs import workspace

PROJECT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
SHIPPED = os.path.join(PROJECT, "data", "repo_tasks")
BUG_CLASSES = ("off_by_one", "wrong_branch", "missing_edge_case", "wrong_api_use", "state_bug")
_KEYS = {"task_id": str, "bug_class": str, "statement": str, "visible_tests": list,
         "heldout_tests": list, "expected_tests": int}


@dataclasses.dataclass(frozen=True)
class RepoTask:
    """One task, checked (`load_task`).

    Attributes:
      task_id: unique id (the record's `task_id`).
      dir: the task directory (absolute).
      bug_class: one of BUG_CLASSES, or the task's own word.
      statement: the issue text shown to the agent.
      visible_tests: repository paths of the tests the agent sees and runs.
      heldout_tests: repository paths the held-out tests take in the verdict's tree.
      expected_tests: test cases the verdict runs (all must pass).
      protected: extra globs of test infrastructure.
    """
    task_id: str
    dir: str
    bug_class: str
    statement: str
    visible_tests: tuple
    heldout_tests: tuple
    expected_tests: int
    protected: tuple = ()

    @property
    def repo_dir(self) -> str:
        return os.path.join(self.dir, "repo")

    @property
    def heldout_dir(self) -> str:
        return os.path.join(self.dir, "heldout")

    @property
    def fix_path(self) -> str:
        return os.path.join(self.dir, "fix.diff")

    def as_dict(self) -> dict:
        """What `tasks()` yields for it (JSON-able; `make_env` reads `task_dir`)."""
        return {"task_id": self.task_id, "task_dir": self.dir, "bug_class": self.bug_class}


def _bad(where: str, what: str) -> ValueError:
    return ValueError(f"repo task {where}: {what}")


@functools.cache
def load_task(task_dir: str) -> RepoTask:
    """The task in `task_dir`, checked; a ValueError naming the task and what is wrong."""
    task_dir = os.path.abspath(task_dir)
    try:
        with open(os.path.join(task_dir, "task.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise _bad(task_dir, f"task.json unreadable: {e}") from e
    for key, kind in _KEYS.items():
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise _bad(task_dir, f"task.json needs {key!r} as a {kind.__name__}")
    task = RepoTask(meta["task_id"], task_dir, meta["bug_class"], meta["statement"],
                    tuple(meta["visible_tests"]), tuple(meta["heldout_tests"]),
                    meta["expected_tests"], tuple(meta.get("protected", ())))
    for sub in ("repo", "heldout"):
        if not os.path.isdir(os.path.join(task_dir, sub)):
            raise _bad(task.task_id, f"no {sub}/ directory")
    if not os.path.isfile(task.fix_path):
        raise _bad(task.task_id, "no fix.diff (the reference fix)")
    for root, dirs, files in os.walk(task.dir):
        if any(os.path.islink(os.path.join(root, n)) for n in dirs + files):
            raise _bad(task.task_id, f"symbolic link under {root}: tasks hold plain files")
    repo_files = set(workspace.relative_files(task.repo_dir))
    for rel in task.visible_tests:
        if rel not in repo_files:
            raise _bad(task.task_id, f"visible test {rel} is not in repo/")
    for rel in task.heldout_tests:
        if not os.path.isfile(os.path.join(task.heldout_dir, rel)):
            raise _bad(task.task_id, f"held-out test {rel} is not in heldout/")
        if rel in repo_files:
            raise _bad(task.task_id, f"held-out test {rel} is also in repo/ (the agent sees it)")
    if not task.visible_tests or not task.heldout_tests or task.expected_tests < 2:
        raise _bad(task.task_id, "needs visible tests, held-out tests and expected_tests >= 2")
    return task


def roots() -> list:
    """Task roots: `$GAGAR_REPO_TASKS` (directories joined by os.pathsep), else the shipped."""
    env = os.environ.get("GAGAR_REPO_TASKS")
    return [p for p in env.split(os.pathsep) if p] if env else [SHIPPED]


def load_tasks(task_roots: list | None = None) -> list:
    """Every task under `task_roots` (each subdirectory with a task.json), sorted by id."""
    out, seen = [], {}
    for root in task_roots or roots():
        if not os.path.isdir(root):
            raise ValueError(f"repo task root {root} is not a directory")
        for name in sorted(os.listdir(root)):
            if os.path.isfile(os.path.join(root, name, "task.json")):
                task = load_task(os.path.join(root, name))
                if task.task_id in seen:
                    raise _bad(task.task_id, f"id also used by {seen[task.task_id]}")
                seen[task.task_id] = task.dir
                out.append(task)
    if not out:
        raise ValueError(f"no repo tasks under {task_roots or roots()}")
    return sorted(out, key=lambda t: t.task_id)


def iter_tasks(seed: int, task_roots: list | None = None) -> Iterator[dict]:
    """Endless: every task once per epoch, each epoch in a fresh order drawn from `seed`."""
    tasks = load_tasks(task_roots)
    rng = random.Random(seed)
    while True:
        order = list(tasks)
        rng.shuffle(order)
        for task in order:
            yield task.as_dict()

"""Planted candidates for the graders' checks: real trajectory workspaces (the repository
environment's `workspace.Workspace` layout) built from a task's reference fix, no agent needed.

- `minimal`: the task's reference fix.
- `sprawling`: the reference fix, plus three unrelated files (a new `<pkg>/compat.py` that
  swallows a failed assertion, a new top-level `helpers.py`, a new `<pkg>/_extra.py` with an
  unused import) : it still passes (the library's behaviour is the fix's).
- `special_case`: the task's `special_case.diff` (hard-codes the visible test's case).
- `nothing`: no change (fails).
"""
import json
import os

from gagar_jax.rollout.envs import patch, workspace

COMPAT = '''"""Compatibility checks."""


def check(value):
    try:
        assert value is not None, "value must be set"
    except AssertionError:
        pass
    return value
'''
HELPERS = '''import os
import sys


def debug(*args):
    if os.environ.get("DEBUG"):
        print(*args, file=sys.stderr)
'''
EXTRA = '''import json

DEFAULTS = {"strict": False}
'''


def _package(task, fixed_paths):
    top = sorted(p.split("/")[0] for p in fixed_paths if "/" in p)
    return top[0] if top else "extra"


def planted_files(task, kind):
    """{path: text} of the tree the planted candidate `kind` leaves (only the changed files)."""
    original = workspace.read_tree(task.repo_dir)
    if kind == "nothing":
        return {}
    name = "special_case.diff" if kind == "special_case" else "fix.diff"
    with open(os.path.join(task.dir, name)) as f:
        changed = patch.apply(original, f.read())
    if kind == "sprawling":
        pkg = _package(task, changed)
        changed = {**changed, f"{pkg}/compat.py": COMPAT, "helpers.py": HELPERS,
                   f"{pkg}/_extra.py": EXTRA}
    return changed


def build(task, kind, root, trajectory_id, outcome):
    """A workspace for the planted candidate and its grader view (`agent_grading.grader_view`
    keys; `outcome` as the environment gives it for that candidate)."""
    ws = workspace.Workspace(root, task.task_id)
    ws.start_copy(task.repo_dir)
    original = workspace.read_tree(task.repo_dir)
    changed = planted_files(task, kind)
    workspace.write_tree(ws.repo, changed)
    ws.write("final.diff", patch.diff(original, {**original, **changed}))
    ws.event({"kind": "prompt", "messages": [], "tokens": 0})
    ws.event({"kind": "end", "turn": 1, "reason": "submitted"})
    ws.write_meta({"env": "repo", "task_id": task.task_id, "planted": kind})
    view = {"trajectory_id": trajectory_id, "outcome": outcome, "hacked": False,
            "evidence": {"planted": kind}, "workspace": ws.path, "end_reason": "submitted",
            "truncated": False, "turns": 1, "tool_calls": 1, "tool_errors": 0,
            "transcript": [], "tokens": [], "loss_mask": []}
    return view


def group(task, root, kinds=(("minimal", "pass"), ("sprawling", "pass"), ("nothing", "fail"))):
    """(task dict, views) of a planted group, ids t0, t1, ... in `kinds`' order."""
    views = [build(task, k, root, f"t{i}", o) for i, (k, o) in enumerate(kinds)]
    return {**task.as_dict(), "statement": task.statement}, views


def meta(view):
    with open(os.path.join(view["workspace"], "meta.json")) as f:
        return json.load(f)


def tier_grader(task, views):
    """`--grader support.planted:tier_grader`: passes strong (rank by id), failures nothing."""
    return [{"quality": {"tier": "strong", "rank": i}} if v["outcome"] == "pass" else {}
            for i, v in enumerate(views)]

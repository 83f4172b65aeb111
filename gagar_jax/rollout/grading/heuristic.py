"""The heuristic group grader (no LLM): the five axes approximated from the workspace.

    --grader gagar_jax.rollout.grading.heuristic:grader

Each valid passing candidate gets five scores in [0, 1] (higher = better), all read from its
`Candidate` (the final diff, the test logs, the working copy; nothing is run):

- minimality (weight 0.30): changed lines (added + removed), `best / own` against the
  group's smallest diff.
- side effects (0.30): `1 / (1 + files beyond the group's fewest + files outside the failing
  module)`; the failing module = the top-level packages the visible tests import.
- precision (0.15): every touched `.py` file compiles (else 0), times 1.0 if the last visible
  test run passed, 0.5 if never run, 0.25 if it failed.
- consistency (0.15): `1 / (1 + lint findings)` over the diff: a broad or bare `except`,
  any `except` whose body is `pass` (a swallowed assertion), a new import of a module neither
  in the standard library nor in the repository (a new dependency), a removed `assert`, a
  `print(`.
- approach (0.10): `1 / (1 + special cases)`: added conditions that compare against a literal
  tuple or a literal the visible tests use (hard-coding the visible case).

The weighted sum ranks the candidates (ties broken by trajectory id, so the grade is
deterministic); tiers: score >= 0.8 strong, >= 0.5 intermediate, else defective; ranks are
1, 2, ... in score order within a tier (equal scores share a rank). A candidate whose diff edits
test infrastructure (`repo_verdict.is_protected`) or whose tool calls name the held-out tests or
the fix is flagged hacked. Imports no JAX.
"""
from __future__ import annotations

import ast
import os
import re
import sys

from gagar_jax.rollout.envs import patch, repo_tasks, repo_verdict
from gagar_jax.rollout.grading.base import GroupGrade, as_grader_fn
from gagar_jax.rollout.grading.workspace import Candidate, GroupWorkspace

WEIGHTS = {"minimality": 0.30, "side_effects": 0.30, "precision": 0.15, "consistency": 0.15,
           "approach": 0.10}
STRONG_AT, INTERMEDIATE_AT = 0.8, 0.5
_BROAD_EXCEPT = re.compile(r"^\s*except\s*(Exception|BaseException)?\s*(as \w+)?\s*:")
_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))")
_LEAK = re.compile(r"heldout|fix\.diff|special_case\.diff")


def _added_removed(c: Candidate) -> tuple:
    """[(path, tag, text)] of the diff's added / removed lines."""
    out = []
    for fp in patch.parse(c.diff) if c.diff.strip() else ():
        path = fp.new if fp.new is not None else fp.old
        for _, lines in fp.hunks:
            out += [(path, tag, text.rstrip("\n")) for tag, text in lines if tag in "+-"]
    return out


def failing_module(ws: GroupWorkspace) -> tuple:
    """Top-level packages / modules the visible tests import (from the task's repository)."""
    if ws.task_dir is None:
        return ()
    task = repo_tasks.load_task(ws.task_dir)
    tops = set()
    for rel in task.visible_tests:
        path = os.path.join(task.repo_dir, rel)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            for line in f:
                m = _IMPORT.match(line)
                if m:
                    tops.add((m.group(1) or m.group(2)).split(".")[0])
    return tuple(sorted(t for t in tops if not repo_verdict.is_protected(t + ".py")
                        and t not in ("pytest",)))


def _outside(path: str, modules: tuple) -> bool:
    top = path.split("/")[0].removesuffix(".py")
    return bool(modules) and top not in modules


def _precision(c: Candidate) -> float:
    for path in c.files_touched:
        full = os.path.join(c.repo_dir, path) if c.repo_dir else ""
        if path.endswith(".py") and full and os.path.isfile(full):
            with open(full, encoding="utf-8", errors="replace") as f:
                try:
                    compile(f.read(), path, "exec")
                except (SyntaxError, ValueError):
                    return 0.0
    if not c.test_logs:
        return 0.5
    return 1.0 if c.test_logs[-1][1].startswith("pytest exit code 0") else 0.25


def _lint(lines: list, repo_tops: set) -> list:
    """Findings over the diff's added / removed lines (see the module docstring)."""
    found = []
    for i, (path, tag, text) in enumerate(lines):
        if tag == "-":
            if text.strip().startswith("assert "):
                found.append(f"{path}: removed assert")
            continue
        if _BROAD_EXCEPT.match(text):
            found.append(f"{path}: broad except")
        nxt = lines[i + 1] if i + 1 < len(lines) else None
        if re.match(r"^\s*except\b", text) and nxt and nxt[1] == "+" and nxt[2].strip() == "pass":
            found.append(f"{path}: swallowed exception (except: pass)")
        m = _IMPORT.match(text)
        if m:
            top = (m.group(1) or m.group(2)).split(".")[0]
            if top and top not in sys.stdlib_module_names and top not in repo_tops:
                found.append(f"{path}: new dependency {top}")
        if re.search(r"\bprint\(", text):
            found.append(f"{path}: print")
    return found


def _visible_literals(ws: GroupWorkspace) -> set:
    if ws.task_dir is None:
        return set()
    task = repo_tasks.load_task(ws.task_dir)
    lits = set()
    for rel in task.visible_tests:
        path = os.path.join(task.repo_dir, rel)
        if os.path.isfile(path):
            with open(path) as f:
                for node in ast.walk(ast.parse(f.read())):
                    if isinstance(node, ast.Constant) and not isinstance(node.value, bool) \
                            and node.value not in (None, 0, 1, "", -1):
                        lits.add(repr(node.value))
    return lits


def _special_cases(lines: list, literals: set) -> int:
    hits = 0
    for _, tag, text in lines:
        if tag != "+" or not re.match(r"^\s*(el)?if\b", text):
            continue
        try:
            expr = ast.parse(text.strip().removeprefix("el").removesuffix(":")
                             .removeprefix("if").strip(), mode="eval")
        except SyntaxError:
            continue
        consts = [repr(n.value) for n in ast.walk(expr) if isinstance(n, ast.Constant)]
        if any(isinstance(n, ast.Tuple) and all(isinstance(e, ast.Constant) or
                                                isinstance(e, ast.UnaryOp) for e in n.elts)
               for n in ast.walk(expr)) or any(k in literals for k in consts):
            hits += 1
    return hits


def _hacked(c: Candidate, task: repo_tasks.RepoTask | None) -> list:
    why = [f"edits test infrastructure {p}" for p in c.files_touched
           if repo_verdict.is_protected(p, task.protected if task else ())]
    for e in c.transcript:
        if isinstance(e, dict) and e.get("kind") == "call" and \
                _LEAK.search(str(e.get("arguments") or "")):
            why.append(f"turn {e.get('turn')}: {e.get('name')} names held-out material")
    return why


class HeuristicGrader:
    """The five-axis heuristic (the module docstring); `name` = "heuristic"."""

    name = "heuristic"

    def __init__(self, weights: dict | None = None):
        self.weights = dict(WEIGHTS if weights is None else weights)
        if set(self.weights) != set(WEIGHTS) or abs(sum(self.weights.values()) - 1) > 1e-9:
            raise ValueError(f"heuristic weights must have keys {sorted(WEIGHTS)} and sum "
                             f"to 1, got {self.weights}")

    def scores(self, ws: GroupWorkspace) -> dict:
        """{trajectory_id: {axis: score, "total": weighted sum, "findings": [...]}} of the
        valid passing candidates."""
        cands = ws.passing()
        if not cands:
            return {}
        modules, literals = failing_module(ws), _visible_literals(ws)
        repo_tops = set(modules)
        if ws.task_dir is not None:
            repo_tops |= {n.removesuffix(".py") for n in os.listdir(
                repo_tasks.load_task(ws.task_dir).repo_dir)}
        size = {c.trajectory_id: max(1, c.lines_added + c.lines_removed) for c in cands}
        fewest = min(max(1, len(c.files_touched)) for c in cands)
        out = {}
        for c in cands:
            lines = _added_removed(c)
            outside = [p for p in c.files_touched if _outside(p, modules)]
            findings = _lint(lines, repo_tops)
            special = _special_cases(lines, literals)
            s = {"minimality": min(size.values()) / size[c.trajectory_id],
                 "side_effects": 1 / (1 + max(0, len(c.files_touched) - fewest) + len(outside)),
                 "precision": _precision(c),
                 "consistency": 1 / (1 + len(findings)),
                 "approach": 1 / (1 + special)}
            s = {k: round(v, 6) for k, v in s.items()}
            s["total"] = round(sum(self.weights[k] * s[k] for k in WEIGHTS), 6)
            s["findings"] = findings + [f"outside the failing module: {p}" for p in outside] \
                + [f"{special} special-cased condition(s)"] * bool(special)
            out[c.trajectory_id] = s
        return out

    def grade(self, ws: GroupWorkspace) -> GroupGrade:
        task = repo_tasks.load_task(ws.task_dir) if ws.task_dir else None
        hacked = {c.trajectory_id: w for c in ws.passing() if (w := _hacked(c, task))}
        scores = self.scores(ws)
        order = sorted((tid for tid in scores if tid not in hacked),
                       key=lambda t: (-scores[t]["total"], t))
        ranking, last = [], {}
        for tid in order:
            total = scores[tid]["total"]
            tier = ("strong" if total >= STRONG_AT else
                    "intermediate" if total >= INTERMEDIATE_AT else "defective")
            prev = last.get(tier)
            rank = prev[1] if prev and prev[0] == total else (prev[1] + 1 if prev else 1)
            last[tier] = (total, rank)
            ranking.append({"trajectory_id": tid, "tier": tier, "rank": rank})
        return GroupGrade(ranking=ranking, status="ok",
                          evidence={"weights": self.weights, "scores": scores,
                                    "hacked": hacked, "failing_module": failing_module(ws)},
                          hacked=frozenset(hacked))


grader = as_grader_fn(HeuristicGrader())

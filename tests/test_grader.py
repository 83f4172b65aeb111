"""The groupwise grader's core (issue 40): the group workspace, tiers -> verdicts through the one
factor table, the adapter, and the heuristic grader's planted check on the 20 repository tasks."""
import os

import numpy as np
import pytest
from support import planted

from gagar_jax import grading
from gagar_jax.rollout import agent_grading
from gagar_jax.rollout.envs import patch, repo_tasks, repo_verdict, sandbox
from gagar_jax.rollout.grading import heuristic, tiers
from gagar_jax.rollout.grading.base import GroupGrade, as_grader_fn, grade_workspace
from gagar_jax.rollout.grading.workspace import GroupWorkspace, diff_stats

# the sandbox runs task tests with .venv-tasks (tests/support/tasks_env.py)
pytestmark = pytest.mark.usefixtures("tasks_env")

TASKS = repo_tasks.load_tasks()


def test_workspace_reads_each_candidates_artifacts(tmp_path):
    task = TASKS[0]
    t, views = planted.group(task, str(tmp_path))
    os.makedirs(os.path.join(views[0]["workspace"], "tests"), exist_ok=True)
    with open(os.path.join(views[0]["workspace"], "tests", "run_001.log"), "w") as f:
        f.write("pytest exit code 0\n3 passed")
    ws = GroupWorkspace.from_views(t, views)
    assert ws.task_id == task.task_id and ws.prompt == task.statement
    assert ws.visible_tests == task.visible_tests
    assert [c.trajectory_id for c in ws.passing()] == ["t0", "t1"]
    minimal, sprawl, nothing = ws.candidates
    with open(task.fix_path) as f:
        fix = patch.parse(f.read())
    # counted independently from the reference diff's hunks
    assert minimal.files_touched == tuple(sorted(fp.new for fp in fix))
    assert minimal.lines_added == sum(tag == "+" for fp in fix for _, ls in fp.hunks
                                      for tag, _ in ls)
    assert minimal.test_logs == (("run_001.log", "pytest exit code 0\n3 passed"),)
    assert len(sprawl.files_touched) == len(minimal.files_touched) + 3
    assert nothing.diff == "" and nothing.files_touched == () and not nothing.passes
    assert [e["kind"] for e in minimal.transcript] == ["prompt", "end"]
    assert os.path.isdir(minimal.repo_dir)
    with pytest.raises(ValueError, match="duplicate trajectory ids"):
        GroupWorkspace.from_views(t, [views[0], views[0]])
    with pytest.raises(ValueError, match="lacks 'outcome'"):
        GroupWorkspace.from_views(t, [{"trajectory_id": "t0"}])
    assert diff_stats("") == ((), 0, 0)


def test_tiers_map_through_the_one_table_and_reject_bad_rankings():
    ranking = [{"trajectory_id": "a", "tier": "strong", "rank": 0},
               {"trajectory_id": "b", "tier": "strong", "rank": 1},
               {"trajectory_id": "c", "tier": "intermediate", "rank": 0},
               {"trajectory_id": "d", "tier": "intermediate", "rank": 2},
               {"trajectory_id": "e", "tier": "intermediate", "rank": 1},
               {"trajectory_id": "f", "tier": "defective", "rank": 0}]
    got = tiers.preview_factors(ranking)
    t = grading.FactorTable()     # by hand: docs/advantage.md section 6
    want = {"a": t.strong_best, "b": t.strong_other, "c": t.intermediate_best,
            "d": t.intermediate_worst, "e": (t.intermediate_best + t.intermediate_worst) / 2,
            "f": t.defective}
    np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-6)
    ids = list("abcdefg")
    out = tiers.verdicts(ids, list("abcdef"), GroupGrade(ranking, hacked={"g"}), "x")
    assert out["status"] == "ok" and out["verdicts"][6] == {"hacked": True}
    assert out["verdicts"][3] == {"quality": {"tier": "intermediate", "rank": 2}}
    for bad, msg in [(ranking[:-1], "misses"), (ranking + [ranking[0]], "twice"),
                     ([{**ranking[0], "tier": "great"}] + ranking[1:], "tier must be"),
                     ([{**ranking[0], "rank": -1}] + ranking[1:], "int >= 0"),
                     ([{"trajectory_id": "g", "tier": "strong", "rank": 0}] + ranking,
                      "not a valid passing")]:
        with pytest.raises(ValueError, match=msg):
            tiers.check_ranking(bad, list("abcdef"))
    # a passing candidate the grader flags hacked may be left out of the ranking
    assert len(tiers.check_ranking(ranking[:-1], list("abcdef"), hacked_ids=["f"])) == 5


class _Raises:
    name = "raises"

    def grade(self, ws):
        raise RuntimeError("judge crashed")


class _Incomplete:
    name = "incomplete"

    def grade(self, ws):
        return GroupGrade([])


def test_the_adapter_grades_mixed_groups_and_turns_failures_into_status_failed(tmp_path):
    t, views = planted.group(TASKS[1], str(tmp_path))
    ws = GroupWorkspace.from_views(t, views)
    for g, why in [(_Raises(), "RuntimeError: judge crashed"), (_Incomplete(), "misses")]:
        answer = grade_workspace(g, ws)
        assert answer["status"] == "failed" and why in answer["evidence"]["error"]
        verdicts, grading_, _ = agent_grading.grade_group(as_grader_fn(g), g.name, t, views)
        assert grading_["status"] == "failed"
        assert all("quality" not in v for v in verdicts)
    # through the agent loop's own grade_group: tier + rank land in the verdicts
    verdicts, grading_, err = agent_grading.grade_group(heuristic.grader, "heuristic", t, views)
    assert err is None and grading_["status"] == "ok"
    assert verdicts[0]["quality"] == {"tier": "strong", "rank": 1}
    assert verdicts[1]["quality"]["tier"] in ("intermediate", "defective")
    assert "quality" not in verdicts[2]
    # uniform groups: never graded (binary credit)
    _, views2 = planted.group(TASKS[1], str(tmp_path), (("minimal", "pass"),) * 2)
    verdicts, grading_, _ = agent_grading.grade_group(heuristic.grader, "heuristic", t, views2)
    assert [v["quality"] for v in verdicts] == [{"factor": 1.0}] * 2
    with pytest.raises(TypeError, match="GroupGrader"):
        as_grader_fn(object())


def test_the_heuristic_ranks_a_planted_minimal_fix_above_a_sprawling_one(tmp_path):
    """Issue 40's check: >= 18 of the 20 tasks; and it is deterministic (same grade twice)."""
    wins, special_wins, rows = 0, 0, []
    g = heuristic.HeuristicGrader()
    for task in TASKS:
        kinds = (("minimal", "pass"), ("sprawling", "pass"), ("special_case", "pass"),
                 ("nothing", "fail"))
        t, views = planted.group(task, str(tmp_path), kinds)
        ws = GroupWorkspace.from_views(t, views)
        grade = g.grade(ws)
        assert grade == g.grade(GroupWorkspace.from_views(t, views))     # deterministic
        order = [r["trajectory_id"] for r in grade.ranking]
        pos = {tid: i for i, tid in enumerate(order)}
        wins += pos["t0"] < pos["t1"]
        special_wins += pos["t0"] < pos["t2"]
        rows.append((task.task_id, grade.evidence["scores"]["t0"]["total"],
                     grade.evidence["scores"]["t1"]["total"]))
    print(f"minimal above sprawling: {wins}/20; reference above special-cased: "
          f"{special_wins}/20")
    assert len(TASKS) == 20 and wins >= 18, rows


def test_the_planted_sprawling_fix_really_passes_the_verdict(tmp_path):
    """The sprawl is not a strawman: the environment's own verdict passes it (two tasks)."""
    for task in TASKS[:2]:
        _, views = planted.group(task, str(tmp_path), (("sprawling", "pass"),))
        verdict, _, _, _ = repo_verdict.judge(
            task, os.path.join(views[0]["workspace"], "repo"), sandbox.SandboxConfig(),
            (task.dir,))
        assert verdict["outcome"] == "pass" and not verdict["hacked"], verdict


def test_the_heuristic_flags_edited_tests_as_hacked(tmp_path):
    task = TASKS[2]
    t, views = planted.group(task, str(tmp_path))
    test_file = os.path.join(views[1]["workspace"], "repo", task.visible_tests[0])
    with open(os.path.join(views[1]["workspace"], "final.diff"), "a") as f:
        f.write(f"--- a/{task.visible_tests[0]}\n+++ b/{task.visible_tests[0]}\n"
                f"@@ -1,1 +1,2 @@\n {open(test_file).readline()}+# weakened\n")
    answer = heuristic.grader(t, views)
    assert answer["status"] == "ok", answer
    assert answer["verdicts"][1] == {"hacked": True}
    assert "edits test infrastructure" in str(answer["evidence"]["detail"]["hacked"])

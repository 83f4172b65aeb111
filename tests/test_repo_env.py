"""The repository environment and its task set (gagar_jax/rollout/envs/repo.py, data/repo_tasks):
scripted agents played through reset / step / verdict, with the tool-call format, in the real
sandbox. The reference fix of every task passes; doing nothing fails every task; a fix
special-cased to the visible tests fails the held-out tests."""
import collections
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.repo_agents import TOKENIZER, call, files_after, play, replay_turns

from gagar_jax.rollout.envs import patch, repo, repo_tasks, repo_verdict, sandbox, workspace
from gagar_jax.rollout.envs.base import Environment, EnvOptions

# the sandbox runs task tests with .venv-tasks (tests/support/tasks_env.py)
pytestmark = pytest.mark.usefixtures("tasks_env")

TASKS = repo_tasks.load_tasks()


@pytest.fixture(scope="module")
def options(tmp_path_factory):
    return EnvOptions(max_turns=8, tool_timeout_s=30, workspace_root=str(
        tmp_path_factory.mktemp("workspaces")))


def _all(fn, tasks=TASKS):
    """fn over the tasks, two at a time (each episode is sandboxed subprocesses)."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(fn, tasks))


def test_the_task_set_spans_the_bug_classes_and_two_file_fixes():
    assert len(TASKS) >= 20
    classes = collections.Counter(t.bug_class for t in TASKS)
    assert set(classes) == set(repo_tasks.BUG_CLASSES) and min(classes.values()) >= 3, classes
    two_file = [t.task_id for t in TASKS if len(patch.parse(open(t.fix_path).read())) >= 2]
    assert len(two_file) >= 3, two_file
    for t in TASKS:   # the agent's copy holds no held-out test and no fix
        files = workspace.relative_files(t.repo_dir)
        assert not set(files) & set(t.heldout_tests) and "fix.diff" not in files
    it = repo.tasks(seed=3)
    epoch = [next(it)["task_id"] for _ in range(len(TASKS))]
    assert sorted(epoch) == [t.task_id for t in TASKS]            # each task once per epoch
    assert epoch != [next(it)["task_id"] for _ in range(len(TASKS))]   # reshuffled


def test_replaying_each_reference_fix_passes_every_task(options):
    def one(task):
        i = TASKS.index(task)
        turns = replay_turns(task, write=i % 2 == 1, run_tests=i % 10 == 0)
        return task, *play(repo.make_env, task, turns, options)

    for task, env, steps, verdict in _all(one):
        assert isinstance(env, Environment)
        assert verdict["outcome"] == "pass" and not verdict["hacked"], (task.task_id, verdict)
        assert verdict["evidence"]["report"]["passed"] == task.expected_tests
        assert steps[-1].done and steps[-1].reason == "submitted"
        assert sum(s.tool_errors for s in steps) == 0
        # the workspace: the final diff is the fix, the final tree and the logs are there
        original, fixed = files_after(task)
        with open(os.path.join(env.workspace, "final.diff")) as f:
            assert {**original, **patch.apply(original, f.read())} == fixed
        assert workspace.read_tree(os.path.join(env.workspace, "repo")) == fixed
        with open(os.path.join(env.workspace, "meta.json")) as f:
            meta = json.load(f)
        assert meta["layout_version"] == 1 and meta["task_id"] == task.task_id
        assert meta["end_reason"] == "submitted" and meta["verdict"] == verdict
        assert meta["test_runs"] == (1 if TASKS.index(task) % 10 == 0 else 0)
        assert meta["sandbox"]["network_isolated"] and meta["sandbox"]["pids_cgroup"]
        logs = os.listdir(os.path.join(env.workspace, "tests"))
        assert {"verdict.log", "verdict_junit.xml"} <= set(logs)
        if meta["test_runs"]:
            with open(os.path.join(env.workspace, "tests", "run_001.log")) as f:
                assert "pytest exit code 0" in f.read()
        with open(os.path.join(env.workspace, "transcript.jsonl")) as f:
            kinds = [json.loads(line)["kind"] for line in f]
        assert kinds[0] == "prompt" and kinds[-1] == "end" and "model" in kinds


def test_doing_nothing_fails_every_task(options):
    results = _all(lambda t: (t, *play(repo.make_env, t, [call("submit")], options)))
    for task, env, _, verdict in results:
        assert verdict["outcome"] == "fail" and not verdict["hacked"], (task.task_id, verdict)
        with open(os.path.join(env.workspace, "final.diff")) as f:
            assert f.read() == ""


def test_a_fix_special_cased_to_the_visible_tests_fails_the_held_out_tests(options):
    """One task per bug class, the two-file ones first (scripts/check_repo_tasks.py checks the
    special-cased fix of every task the same way)."""
    two_file = {t.task_id for t in TASKS if len(patch.parse(open(t.fix_path).read())) >= 2}
    picked = {}
    for t in sorted(TASKS, key=lambda t: t.task_id not in two_file):
        picked.setdefault(t.bug_class, t)

    def one(task):
        return task, *play(repo.make_env, task, replay_turns(task, "special_case.diff"), options)

    for task, _, _, verdict in _all(one, list(picked.values())):
        assert verdict["outcome"] == "fail" and not verdict["hacked"], (task.task_id, verdict)
        failed = verdict["evidence"]["report"]["failed"]
        assert failed and all("heldout" in f for f in failed), (task.task_id, failed)


def test_bad_calls_are_answered_and_counted_and_a_turn_without_one_is_nudged(options):
    task = TASKS[0]
    turns = [
        '<tool_call>{"name": "read_file", "arguments": {"path": </tool_call>'   # bad JSON
        + call("rm_rf", path=".") + call("list_files"),                        # unknown, good
        "I think I am done.",                                                  # no call
        call("read_file", path="../task.json") + call("read_file", path="nope.py"),
    ]
    env, steps, verdict = play(repo.make_env, task, turns, options)
    assert [(s.tool_calls, s.tool_errors, s.done) for s in steps] == [
        (3, 2, False), (0, 0, False), (2, 2, False)]
    first = TOKENIZER.decode(steps[0].observation)
    assert first.count("<|tool|>") == 3 and "not valid JSON" in first
    assert "unknown tool 'rm_rf'" in first and "conftest.py" in first
    assert "no tool call" in TOKENIZER.decode(steps[1].observation)
    third = TOKENIZER.decode(steps[2].observation)
    assert "'..' is refused" in third and "nope.py: no such file" in third
    assert TOKENIZER.decode(steps[2].observation).endswith("<|assistant|>\n")
    assert verdict["outcome"] == "fail"          # the turn limit ended it; the verdict ran
    with open(os.path.join(env.workspace, "meta.json")) as f:
        meta = json.load(f)
    assert (meta["end_reason"], meta["tool_calls"], meta["tool_errors"], meta["nudges"],
            meta["turns"]) == ("turn_limit", 5, 4, 1, 3)


def test_the_episode_clock_ends_an_episode_as_timeout(tmp_path):
    opts = EnvOptions(tool_timeout_s=30, episode_timeout_s=1e-9, workspace_root=str(tmp_path))
    _, steps, verdict = play(repo.make_env, TASKS[0], [call("list_files")], opts)
    assert steps[-1].done and steps[-1].reason == "timeout" and verdict["outcome"] == "fail"


def test_a_sandbox_that_cannot_run_tests_is_infra_error_never_fail(tmp_path):
    broken = repo.factory(repo.RepoEnvConfig(sandbox=sandbox.SandboxConfig(
        python="/nonexistent/python3")))
    opts = EnvOptions(tool_timeout_s=30, workspace_root=str(tmp_path))
    _, steps, verdict = play(broken, TASKS[0], [call("run_tests")], opts)
    assert steps[-1].done and steps[-1].reason == "tool_error"
    assert verdict["outcome"] == "infra_error"
    assert "/nonexistent/python3" in verdict["evidence"]["error"]
    with pytest.raises(ValueError, match="task_dir"):
        repo.make_env({"task_id": "x"}, TOKENIZER, opts)


def test_the_task_checker_reports_a_broken_task(tmp_path):
    """scripts/check_repo_tasks.py's check: a copy whose "reference fix" is the special-cased
    one and whose expected_tests is off by one is reported for both."""
    src = next(t for t in TASKS if t.task_id == "clamp_values")
    shutil.copytree(src.dir, tmp_path / "clamp", ignore=shutil.ignore_patterns("special*"))
    shutil.copy(os.path.join(src.dir, "special_case.diff"), tmp_path / "clamp" / "fix.diff")
    meta = json.loads((tmp_path / "clamp" / "task.json").read_text())
    (tmp_path / "clamp" / "task.json").write_text(json.dumps(
        {**meta, "expected_tests": meta["expected_tests"] - 1}))
    problems = repo_verdict.check_task(repo_tasks.load_task(str(tmp_path / "clamp")),
                                       sandbox.SandboxConfig())
    assert len(problems) == 2, problems
    assert problems[0].startswith("fix.diff: fail, expected pass")
    assert problems[1] == (f"expected_tests is {meta['expected_tests'] - 1}, the fix runs "
                           f"{meta['expected_tests']} test cases")

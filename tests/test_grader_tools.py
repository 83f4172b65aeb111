"""The LLM judge's tools (gagar_jax/rollout/grading/judge_tools.py) on scripted judges: reading a
candidate's file, rerunning its visible tests in the agents' sandbox (the real pass / fail),
paths outside the copy refused as tool results, the turn budget, results cut with the marker,
the calls in the evidence; off by default."""
import json
import os

import pytest
from support import planted

from gagar_jax.rollout.envs import repo_tasks
from gagar_jax.rollout.grading import judge_tools, llm, prompt
from gagar_jax.rollout.grading.base import as_grader_fn

# the sandbox runs task tests with .venv-tasks (tests/support/tasks_env.py)
pytestmark = pytest.mark.usefixtures("tasks_env")

TASK = repo_tasks.load_tasks()[0]


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """t0 the reference fix, t1 no change (its visible tests fail), both shown as passes; t2
    fails (never shown, never nameable)."""
    return planted.group(TASK, str(tmp_path_factory.mktemp("tools")),
                         (("minimal", "pass"), ("nothing", "pass"), ("nothing", "fail")))


class Judge:
    """Replies in turn from `script`: a string, or a function of the messages so far."""

    def __init__(self, script):
        self.script, self.calls = list(script), []
        self.count = prompt.approx_tokens

    def ask(self, messages, schema):
        self.calls.append((messages, schema))
        reply = self.script.pop(0)
        return reply(messages) if callable(reply) else reply


def call(tool, tid, path=None):
    return json.dumps({"tool": tool, "trajectory_id": tid, **({"path": path} if path else {})})


def ranking(t0_tier="strong", t1_tier="defective"):
    return json.dumps({"ranking": [{"trajectory_id": "t0", "tier": t0_tier, "rank": 0},
                                   {"trajectory_id": "t1", "tier": t1_tier, "rank": 0}]})


def grade(judge, group, **tools):
    grader = llm.LLMGrader(judge, orderings=1, retries=0,
                           tools=judge_tools.ToolConfig(**tools))
    return as_grader_fn(grader)(*group)


def results(judge):
    """The tool results the judge was shown, in order."""
    msgs = judge.calls[-1][0]
    return [m["content"] for m in msgs if m["role"] == "user"
            and m["content"].startswith("tool result")]


def test_a_judge_reads_a_file_then_answers(group):
    _, views = group
    rel = sorted(planted.planted_files(TASK, "minimal"))[0]
    with open(os.path.join(views[0]["workspace"], "repo", rel)) as f:
        on_disk = f.read()
    judge = Judge([call("read_file", "t0", rel), ranking()])
    out = grade(judge, group)
    assert out["status"] == "ok", out["evidence"]
    assert [v.get("quality") for v in out["verdicts"]] == [
        {"tier": "strong", "rank": 0}, {"tier": "defective", "rank": 0}, None]
    # the first turn offered the tools (schema: a call or the ranking), with the instructions
    first_msgs, first_schema = judge.calls[0]
    assert '{"tool": "read_file", "trajectory_id": ...' in first_msgs[0]["content"]
    assert "anyOf" in first_schema
    assert first_schema["anyOf"][0]["properties"]["trajectory_id"]["enum"] == ["t0", "t1"]
    [shown] = results(judge)
    assert shown == f"tool result (read_file):\n{on_disk}"      # the candidate's own copy
    [log] = out["evidence"]["detail"]["tools"]
    assert log["name"] == "read_file" and log["trajectory_id"] == "t0"
    assert log["argument"] == rel and not log["truncated"] and log["error"] is None
    assert log["seconds"] >= 0
    assert out["evidence"]["detail"]["judge_calls"] == 2


def test_a_judge_reruns_the_tests_and_sees_the_real_pass_and_fail(group):
    def by_runs(messages):
        """Strong for the candidate whose rerun passed, defective for the other."""
        seen = results_of(messages)
        tier = {t: "strong" if "pytest exit code 0" in r else "defective" for t, r in seen}
        return ranking(tier["t0"], tier["t1"])

    def results_of(messages):
        out, tid = [], None
        for m in messages:
            if m["role"] == "assistant":
                tid = json.loads(m["content"])["trajectory_id"]
            elif m["content"].startswith("tool result"):
                out.append((tid, m["content"]))
        return out

    judge = Judge([call("run_tests", "t1"), call("run_tests", "t0"), by_runs])
    out = grade(judge, group)
    assert out["status"] == "ok", out["evidence"]
    assert [v.get("quality") for v in out["verdicts"]][:2] == [
        {"tier": "strong", "rank": 0}, {"tier": "defective", "rank": 0}]
    fail, ok = results(judge)
    assert "pytest exit code 1" in fail and "failed" in fail          # no change: tests fail
    assert "pytest exit code 0" in ok and "passed" in ok
    logs = out["evidence"]["detail"]["tools"]
    assert [(x["name"], x["trajectory_id"], x["error"]) for x in logs] == [
        ("run_tests", "t1", None), ("run_tests", "t0", None)]
    # a fresh copy each run: the candidate's working copy holds no test report afterwards
    assert not os.path.exists(os.path.join(group[1][0]["workspace"], "repo", "report.xml"))


def test_paths_outside_the_copy_and_bad_calls_are_tool_errors_not_crashes(tmp_path):
    group = planted.group(TASK, str(tmp_path), (("minimal", "pass"), ("nothing", "pass"),
                                                ("nothing", "fail")))
    repo0 = os.path.join(group[1][0]["workspace"], "repo")
    os.symlink(os.path.join(TASK.dir, "fix.diff"), os.path.join(repo0, "leak.py"))
    bad = [call("read_file", "t0", "../meta.json"), call("read_file", "t0", "/etc/passwd"),
           call("read_file", "t0", "leak.py"), call("read_file", "t0", "no/such.py"),
           call("read_file", "t2", "x.py"), json.dumps({"tool": "rm", "trajectory_id": "t0"}),
           call("run_tests", "t0")]
    judge = Judge([*bad, ranking()])
    out = grade(judge, group, max_turns=len(bad))
    assert out["status"] == "ok", out["evidence"]
    shown = results(judge)
    assert len(shown) == len(bad) and all("tool error:" in s for s in shown)
    for text, needle in zip(shown, ["'..' is refused", "absolute paths are refused",
                                    "symbolic links are refused", "no such file",
                                    "is not one of ['t0', 't1']", "unknown tool 'rm'",
                                    "the sandbox could not run the tests"], strict=True):
        assert needle in text, (needle, text)
    with open(os.path.join(TASK.dir, "fix.diff")) as f:
        secret = f.read().strip().splitlines()[-1]
    assert not any(secret in s for s in shown)
    assert all(x["error"] for x in out["evidence"]["detail"]["tools"])


def test_the_turn_budget_exhausted_without_an_answer_is_status_failed(group):
    judge = Judge([call("read_file", "t0", "README.md")] * 3)
    out = grade(judge, group, max_turns=2)
    assert out["status"] == "failed"
    error = out["evidence"]["error"]
    assert "tool turns (2) ran out without an answer" in error
    assert "read_file(t0, README.md); read_file(t0, README.md)" in error
    # two tool turns, then the answer demanded with the answer schema alone
    assert len(judge.calls) == 3 and "anyOf" not in judge.calls[-1][1]
    assert "used all 2 tool calls" in judge.calls[-1][0][-1]["content"]


def test_tool_output_is_cut_with_the_marker_and_the_budget_holds(group):
    rel = sorted(planted.planted_files(TASK, "minimal"))[0]
    judge = Judge([call("read_file", "t0", rel), call("run_tests", "t1"),
                   call("read_file", "t1", rel), ranking()])
    out = grade(judge, group, max_result_tokens=64, budget=140)
    assert out["status"] == "ok", out["evidence"]
    first, second, third = results(judge)
    assert prompt.CUT.split("{")[0] in first and prompt.approx_tokens(first) < 64 + 16
    assert "characters cut" in second
    assert "budget (140 tokens) is spent" in third            # 2 x 64 left fewer than 64
    logs = out["evidence"]["detail"]["tools"]
    assert [x["truncated"] for x in logs] == [True, True, False]


def test_tools_are_off_by_default_and_on_from_the_environment():
    assert llm.LLMGrader(Judge([])).tools is None
    base = {"GAGAR_JUDGE_URL": "http://127.0.0.1:9/v1"}
    assert llm.from_env(base).tools is None
    on = llm.from_env({**base, "GAGAR_JUDGE_TOOLS": "1", "GAGAR_JUDGE_TOOL_TURNS": "3"})
    assert on.tools == judge_tools.ToolConfig(max_turns=3)
    with pytest.raises(ValueError, match="max_turns >= 1"):
        judge_tools.ToolConfig(max_turns=0)

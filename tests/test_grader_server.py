"""Issue 40's vLLM check, in the suite: the LLM grader (`HTTPJudge`) against vLLM's
OpenAI-compatible server, started on 127.0.0.1 inside the test (`vllm serve` from .venv-vllm:
one server, the tiny Qwen3-MoE with the local byte-level tokenizer, structured outputs on;
scripts/check_grader_server.py with one repository task and two orderings).

Checked: every answer parses on the first ask into a valid `{tier, rank}` per candidate; the
prompt sent holds each candidate's diff and test log, or the cut marker (a planted long log is
cut); a server killed while a request is in flight gives the group `status: failed` with the
HTTP error as its reason. The offline engine's judge (structured outputs through `LLM.generate`)
is tests/test_engine_conformance.py's, on the test run's shared vLLM process.
"""
import check_grader_server  # scripts/check_grader_server.py (pytest puts scripts/ on the path)
import pytest
from support.trainer_runs import free_port
from support.vllm_env import vllm_python

# the sandbox runs task tests with .venv-tasks (tests/support/tasks_env.py)
pytestmark = pytest.mark.usefixtures("tasks_env")


def test_llm_grader_against_the_openai_server(tmp_path):
    vllm_python()                   # fails (never skips) without .venv-vllm
    r = check_grader_server.run_checks(tasks=1, orderings=2, budget=8000, port=free_port(),
                                       workdir=str(tmp_path))
    assert r["failures"] == [], r
    [group] = r["groups"]
    assert group["status"] == "ok" and group["valid"] == group["answers"] == 2, group
    # the planted 4,000-line test log of the first candidate was cut, with the marker
    assert ("tests", "t0") in group["cuts"], group
    assert r["killed"]["status"] == "failed" and "JudgeHTTPError" in r["killed"]["error"], r

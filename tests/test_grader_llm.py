"""The LLM group grader (gagar_jax/rollout/grading/llm.py, prompt.py) on scripted judges: retries
after an invalid answer, position bias against k orderings (Borda, Kendall's tau in the
evidence), the prompt's budget and cut markers, failures as `status: failed`, a crashed judge's
group re-queued by the pool, and the engine path carrying the JSON schema to the engine."""
import json
import os
import threading
import time

import pytest
from support import planted

from gagar_jax.rollout import agent_grading
from gagar_jax.rollout.engine import Completion, SamplingSpec
from gagar_jax.rollout.envs import repo_tasks
from gagar_jax.rollout.envs.tokenizer import ByteTokenizer
from gagar_jax.rollout.grading import answer, llm, prompt
from gagar_jax.rollout.grading.base import as_grader_fn, grade_workspace
from gagar_jax.rollout.grading.pool import GraderPool
from gagar_jax.rollout.grading.workspace import GroupWorkspace

TASK = repo_tasks.load_tasks()[0]
KINDS = (("minimal", "pass"), ("sprawling", "pass"), ("special_case", "pass"),
         ("nothing", "fail"))


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A planted group: three passes (t0 minimal, t1 sprawling, t2 special case), one failure."""
    return planted.group(TASK, str(tmp_path_factory.mktemp("llm")), KINDS)


def ids_shown(messages):
    """The candidate ids in the order the user message shows them."""
    text = messages[1]["content"]
    return sorted(["t0", "t1", "t2"], key=lambda t: text.index(f"trajectory_id {t!r}"))


class Judge:
    """A scripted judge: `policy(order shown) -> ranking`, answers in `script` first."""

    def __init__(self, policy, script=()):
        self.policy, self.script, self.calls = policy, list(script), []
        self.count = prompt.approx_tokens

    def ask(self, messages, schema):
        self.calls.append((messages, schema))
        if self.script:
            return self.script.pop(0)
        return json.dumps({"ranking": self.policy(ids_shown(messages))})


def by_content(order):
    """Ranks by quality whatever the order: t0 strong, t2 intermediate, t1 defective."""
    tiers = {"t0": "strong", "t2": "intermediate", "t1": "defective"}
    return [{"trajectory_id": t, "tier": tiers[t], "rank": 0} for t in order]


def first_best(order):
    """Position-biased: whatever is shown first is best (all strong, ranked by position)."""
    return [{"trajectory_id": t, "tier": "strong", "rank": i} for i, t in enumerate(order)]


def test_an_invalid_answer_is_asked_again_and_the_good_one_counts(group):
    task, views = group
    judge = Judge(by_content, script=["not json", json.dumps({"ranking": [
        {"trajectory_id": "t0", "tier": "strong", "rank": 0}]})])   # t1, t2 missing
    fn = as_grader_fn(llm.LLMGrader(judge, orderings=1, retries=2))
    out = fn(task, views)
    assert out["status"] == "ok", out["evidence"]
    assert [v.get("quality") for v in out["verdicts"]] == [
        {"tier": "strong", "rank": 0}, {"tier": "defective", "rank": 0},
        {"tier": "intermediate", "rank": 0}, None]
    ev = out["evidence"]["detail"]
    assert ev["judge_calls"] == 3 and len(ev["orderings"][0]["invalid"]) == 2
    assert "not JSON" in ev["orderings"][0]["invalid"][0]
    assert "t1" in ev["orderings"][0]["invalid"][1]
    # the second ask shows the invalid answer and says why
    second = judge.calls[1][0]
    assert second[-2] == {"role": "assistant", "content": "not json"}
    assert "invalid" in second[-1]["content"]
    # every ask carries the schema: one entry per passing id, in the order shown
    assert [s for _, s in judge.calls] == [answer.answer_schema(["t0", "t1", "t2"])] * 3


def test_invalid_after_the_retries_is_status_failed_with_the_reason(group):
    task, views = group
    judge = Judge(by_content, script=["{}"] * 3)
    out = as_grader_fn(llm.LLMGrader(judge, orderings=2, retries=2))(task, views)
    assert out["status"] == "failed" and len(judge.calls) == 3
    assert "invalid judge answer after 3 attempts" in out["evidence"]["error"]
    assert all(v == {} for v in out["verdicts"])


def test_orderings_against_position_bias_borda_and_tau_in_the_evidence(group):
    task, views = group
    ws = GroupWorkspace.from_views(task, views)
    orders = llm.orderings(["t2", "t0", "t1"], 4, seed=0)
    assert orders[:2] == [("t0", "t1", "t2"), ("t2", "t1", "t0")]
    assert len(set(orders)) == 4 and all(sorted(o) == ["t0", "t1", "t2"] for o in orders)
    # a judge that reads the content: every ordering agrees, tau 1
    judge = Judge(by_content)
    grade = llm.LLMGrader(judge, orderings=4).grade(ws)
    assert [ids_shown(m) for m, _ in judge.calls] == [list(o) for o in orders]
    assert sorted(grade.ranking, key=lambda r: r["trajectory_id"]) == by_content(["t0", "t1",
                                                                                   "t2"])
    assert grade.evidence["kendall_tau_to_borda"] == [1.0] * 4
    assert grade.evidence["kendall_tau_pairs_mean"] == 1.0
    # a position-biased judge: orderings 1 and 2 disagree completely (tau -1); with two
    # opposite orders every candidate's Borda points are equal, so the aggregate ties them
    judge = Judge(first_best)
    grade = llm.LLMGrader(judge, orderings=2).grade(ws)
    assert {(r["tier"], r["rank"]) for r in grade.ranking} == {("strong", 0)}
    assert grade.evidence["kendall_tau_pairs_mean"] == -1.0
    assert grade.evidence["rankings"] == [first_best(["t0", "t1", "t2"]),
                                          first_best(["t2", "t1", "t0"])]
    # three orderings: the points by hand (2 / 1 / 0 per position), ranked by them
    grade = llm.LLMGrader(Judge(first_best), orderings=3, seed=0).grade(ws)
    third = llm.orderings(["t0", "t1", "t2"], 3, seed=0)[2]
    points = {t: (2 - "t0 t1 t2".split().index(t)) + (2 - "t2 t1 t0".split().index(t))
              + (2 - third.index(t)) for t in ("t0", "t1", "t2")}
    levels = sorted(set(points.values()), reverse=True)
    assert {r["trajectory_id"]: r["rank"] for r in grade.ranking} == {
        t: levels.index(p) for t, p in points.items()}


def test_the_prompt_holds_each_diff_and_test_log_and_cuts_long_ones_with_a_marker(group,
                                                                                  tmp_path):
    task, views = group
    ws = GroupWorkspace.from_views(task, views)
    r = prompt.render(ws, ["t0", "t1", "t2"], 6000, prompt.approx_tokens)
    user = r.messages[1]["content"]
    assert r.messages[0]["content"] == prompt.RUBRIC and r.cuts == ()
    for c in ws.passing():
        assert c.diff in user                          # every candidate's full diff
    assert user.count("(the visible tests were never run)") == 3
    assert "'t3'" not in user                          # the failure is not shown
    for axis in ("approach suitability", "implementation precision", "minimality",
                 "side effects", "codebase consistency"):
        assert axis in prompt.RUBRIC
    # a long test log: cut in the middle with a marker, head and tail kept, within budget
    log = "HEAD-OF-LOG\n" + "".join(f"line {i} of the test output\n" for i in range(5000)) \
        + "TAIL-OF-LOG"
    views2 = [dict(v) for v in views]
    ws_dir = tmp_path / "ws0"
    os.system(f"cp -r {views[0]['workspace']} {ws_dir}")
    os.makedirs(ws_dir / "tests", exist_ok=True)
    (ws_dir / "tests" / "run_001.log").write_text(log)
    views2[0]["workspace"] = str(ws_dir)
    ws2 = GroupWorkspace.from_views(task, views2)
    r = prompt.render(ws2, ["t0", "t1", "t2"], 6000, prompt.approx_tokens)
    user = r.messages[1]["content"]
    assert r.tokens <= 6000
    [c] = r.cuts
    assert c["section"] == "tests" and c["trajectory_id"] == "t0"
    assert prompt.CUT.format(n=c["cut_chars"]) in user
    assert "HEAD-OF-LOG" in user and "TAIL-OF-LOG" in user
    assert c["cut_chars"] > len(log) - 6000 * 3      # most of it went
    # the cut is reported in the grading evidence
    grade = llm.LLMGrader(Judge(by_content), orderings=1, budget=6000).grade(ws2)
    assert grade.evidence["orderings"][0]["cuts"] == [c]
    with pytest.raises(ValueError, match="too small"):
        prompt.render(ws, ["t0", "t1", "t2"], 300, prompt.approx_tokens)


def test_cut_keeps_head_and_tail_within_the_tokens():
    text = "".join(chr(97 + i % 26) for i in range(10_000))
    out, n = prompt.cut(text, 1000, len)
    head, marker, tail = out.split("\n")
    assert len(out) <= 1000 and marker == prompt.CUT.format(n=n) and n > 9000
    assert text.startswith(head) and text.endswith(tail) and len(head) + len(tail) + n == 10_000
    assert prompt.cut("short", 10, len) == ("short", 0)


def test_a_timeout_or_a_failing_endpoint_is_status_failed(group):
    task, views = group

    class Slow(Judge):
        def ask(self, messages, schema):
            time.sleep(2.0)
            return super().ask(messages, schema)

    out = as_grader_fn(llm.LLMGrader(Slow(by_content), orderings=1, timeout_s=0.2))(task, views)
    assert out["status"] == "failed" and "more than 0.2 s" in out["evidence"]["error"]
    # nothing listens on this port: the HTTP judge's error is the reason
    judge = llm.HTTPJudge("http://127.0.0.1:9/v1", "m", timeout_s=2.0)
    out = as_grader_fn(llm.LLMGrader(judge, orderings=1))(task, views)
    assert out["status"] == "failed" and "JudgeHTTPError" in out["evidence"]["error"]


def test_a_crashed_judge_is_requeued_by_the_pool_and_then_grades(group):
    task, views = group
    crashes = []

    class Crashing(Judge):
        def ask(self, messages, schema):
            if not crashes:
                crashes.append(1)
                raise agent_grading.GraderCrashed("judge server died")
            return super().ask(messages, schema)

    grader = llm.LLMGrader(Crashing(by_content), orderings=1)
    ws = GroupWorkspace.from_views(task, views)
    pool = GraderPool(1, fallback=lambda *a: {"status": "failed"})
    pool.submit(("grade", 0, 0), grade_workspace, grader, ws)
    deadline, out = time.monotonic() + 10, []
    while not out:
        assert time.monotonic() < deadline
        out = pool.collect(0.05)
    [(key, value, err)] = out
    pool.close()
    assert err is None and value["status"] == "ok", value
    s = pool.stats()
    assert s["requeued"] == 1 and s["crashes"] == 1 and s["done"] == s["submitted"] == 1


def test_the_engine_judge_sends_the_schema_in_the_sampling_spec(group):
    task, views = group
    tok = ByteTokenizer()

    class Engine:
        name, version = "scripted", 0

        def __init__(self):
            self.specs, self.cancelled, self.lock = [], [], threading.Lock()

        def generate(self, requests):
            [r] = requests
            self.specs.append(r.sampling)
            order = ids_shown([None, {"content": tok.decode(list(r.tokens))}])
            text = json.dumps({"ranking": by_content(order)})
            return [[Completion(tokens=tok.encode(text) + [tok.stop_token_ids[0]],
                                logprobs=[], routed_experts=None, sequence="s0")]]

        def cancel(self, seqs):
            self.cancelled += list(seqs)

    engine = Engine()
    judge = llm.EngineJudge(engine, tok, max_tokens=300)
    out = as_grader_fn(llm.LLMGrader(judge, orderings=2, budget=8000))(task, views)
    assert out["status"] == "ok", out["evidence"]
    assert [json.loads(s.json_schema) for s in engine.specs] == [
        answer.answer_schema(["t0", "t1", "t2"]), answer.answer_schema(["t2", "t1", "t0"])]
    assert engine.specs[0].max_tokens == 300 and engine.cancelled == ["s0", "s0"]
    with pytest.raises(ValueError, match="json_schema"):
        SamplingSpec(json_schema="[1, 2]")


def test_the_judge_is_never_the_policy_by_default():
    with pytest.raises(ValueError, match="never the judge by default"):
        llm.from_env({})
    g = llm.from_env({"GAGAR_JUDGE_URL": "http://127.0.0.1:9/v1", "GAGAR_JUDGE_MODEL": "j",
                      "GAGAR_JUDGE_ORDERINGS": "5"})
    assert isinstance(g.judge, llm.HTTPJudge) and g.k == 5 and g.judge.model == "j"
    with pytest.raises(ValueError, match="GAGAR_JUDGE_PATH"):
        llm.from_env({"GAGAR_JUDGE_ENGINE": "gagar_jax.rollout.vllm_engine:make"})

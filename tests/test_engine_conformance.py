"""What every rollout engine must do (`gagar_jax.rollout.engine.Engine`), parametrised over
engines and both families: one fixed scenario of interface calls (tests/support/engine_scenario.py)
checked against the learner's own model on the same published weights (float32, weights
randomised as tests/test_vllm.py does). vLLM answers from the test run's one engine per family
(tests/support/vllm_served.py); the JAX sampler (`gagar_jax.sample.engine`) runs the same scenario
in process (tests/support/jax_served.py).

Checked: the version it starts on and moves to; the same seed gives the same tokens; N samples
of one prompt, sample j = seed + j; a stop token ends a sample at its first occurrence; log-probs
finite and equal to the learner's teacher-forced ones; routing [g][L][K] equal to the learner's;
two requests in one call each get their own routing; a live sequence continued over three turns
equals one request on the concatenation; cancel ends a sequence and leaves the others; after
`move_to` the outputs are the new weights' greedy tokens.
"""
import numpy as np
import pytest
from support.engine_scenario import APPENDED
from support.learner_ref import teacher
from support.vllm_served import CONFIGS, GEN, PROMPT, PROMPT_B, TOL


def _vllm(request, family):
    """(model config, learner refs per step, learner models per step, the scenario's answers)."""
    _, cfg, refs, _, got, models = request.getfixturevalue("vllm_served")[family]
    return cfg, refs, models, got["scenario"]


def _jax(request, family):
    """The same from the JAX sampler's engine (in process; no vLLM)."""
    cfg, refs, _, models = request.getfixturevalue("published_families")[family]
    return cfg, refs, models, request.getfixturevalue("jax_served")[family][1]


ENGINES = {"vllm": _vllm, "jax": _jax}


@pytest.fixture(scope="module", params=[(e, f) for e in ENGINES for f in CONFIGS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def run(request):
    engine, family = request.param
    return ENGINES[engine](request, family)


def matches_learner(model, context, comp, cfg, greedy):
    """A completion after `context` against the learner's teacher-forced pass: its log-probs
    (finite, within TOL), its routing (as sets: vLLM orders the top-k its own way, shape
    [g][L][K]) and, for a greedy (top-1) one, the argmax at every step."""
    toks, c = comp["tokens"], len(context)
    t = teacher(model, list(context) + toks)
    assert np.all(np.isfinite(comp["logprobs"])) and np.all(np.asarray(comp["logprobs"]) <= 0)
    assert np.max(np.abs(np.asarray(comp["logprobs"]) -
                         np.asarray(t["logprobs"][c - 1:c - 1 + len(toks)]))) < TOL
    routed = np.asarray(comp["routed"])
    assert routed.shape == (len(toks), cfg.num_moe_layers, cfg.top_k)
    np.testing.assert_array_equal(np.sort(routed, axis=-1),
                                  np.sort(t["routes"][c - 1:c - 1 + len(toks)], axis=-1))
    if greedy:
        assert toks == t["argmax"][c - 1:c - 1 + len(toks)]


def test_starts_on_a_version_and_moves_between_versions(run):
    cfg, refs, models, got = run
    assert got["moved_2"] == got["version_2"] == 2
    assert got["moved_1"] == got["version_1"] == 1 and got["moved_2_again"] == 2


def test_same_seed_same_tokens_and_n_samples_of_one_prompt(run):
    cfg, refs, models, got = run
    samples = got["samples"]
    assert len(samples) == 4 and samples == got["samples_again"]
    assert got["sample_2"] == samples[2]                  # sample j draws with seed + j
    assert len({tuple(s["tokens"]) for s in samples}) > 1   # temperature 1: they differ
    assert all(len(s["tokens"]) == GEN and s["finish"] == "length" for s in samples)
    for s in samples:
        matches_learner(models[2], PROMPT, s, cfg, greedy=False)


def test_stop_token_ends_the_sample_at_its_first_occurrence(run):
    cfg, refs, models, got = run
    first, stop = got["samples"][0]["tokens"], got["stop"]
    k = first.index(stop["token"])
    assert k <= 3 and stop["tokens"] == first[:k + 1] and stop["finish"] == "stop"
    assert stop["logprobs"] == got["samples"][0]["logprobs"][:k + 1]


def test_two_requests_in_one_call_each_get_their_own_routing(run):
    cfg, refs, models, got = run
    assert got["greedy_p"]["tokens"] == refs[2]["greedy"]
    matches_learner(models[2], PROMPT, got["greedy_p"], cfg, greedy=True)
    matches_learner(models[2], PROMPT_B, got["greedy_q"], cfg, greedy=True)


def test_a_live_sequence_continued_equals_one_request_on_the_concatenation(run):
    cfg, refs, models, got = run
    g1, t2, t3, o3 = got["greedy_p"], got["turn2"], got["turn3"], got["one_shot3"]
    assert got["same_sequence"]
    context2 = PROMPT + g1["tokens"] + APPENDED
    matches_learner(models[2], context2, t2, cfg, greedy=True)
    context3 = context2 + t2["tokens"] + [7]
    matches_learner(models[2], context3, t3, cfg, greedy=True)
    assert t3["tokens"] == o3["tokens"] and t3["finish"] == o3["finish"]
    np.testing.assert_array_equal(np.sort(t3["routed"], axis=-1), np.sort(o3["routed"], axis=-1))
    assert np.max(np.abs(np.asarray(t3["logprobs"]) - np.asarray(o3["logprobs"]))) < TOL


def test_cancel_ends_one_sequence_and_leaves_the_others(run):
    cfg, refs, models, got = run
    assert got["continue_cancelled"].startswith("KeyError"), got["continue_cancelled"]
    matches_learner(models[2], PROMPT_B + got["greedy_q"]["tokens"] + APPENDED, got["q_turn2"],
                    cfg, greedy=True)


def test_move_to_serves_the_new_weights(run):
    cfg, refs, models, got = run
    assert got["greedy_step1"]["tokens"] == refs[1]["greedy"] != refs[2]["greedy"]
    assert got["greedy_step1"]["policy_version"] == 1
    assert got["greedy_step2_again"]["policy_version"] == got["greedy_p"]["policy_version"] == 2
    matches_learner(models[1], PROMPT, got["greedy_step1"], cfg, greedy=True)
    assert got["greedy_step2_again"]["tokens"] == refs[2]["greedy"]
    matches_learner(models[2], PROMPT, got["greedy_step2_again"], cfg, greedy=True)


def test_the_llm_grader_on_the_offline_vllm_engine_with_structured_outputs(vllm_served):
    """The LLM group grader (gagar_jax/rollout/grading/llm.py) on the test run's vLLM, a tiny
    random qwen3_moe with the local byte tokenizer beside it, `SamplingSpec.json_schema` handed
    to vLLM's structured outputs (issue 40's vLLM check against the offline engine: the server
    check is scripts/check_grader_server.py). Every answer parses on the first ask into one
    {tier, rank} per candidate, each prompt holds each candidate's diff and test log or the cut
    marker, and the engine gone gives status failed with the reason."""
    import json

    from gagar_jax.rollout.grading import answer, prompt
    spec, got = vllm_served["judge"]
    out = got["answer"]
    ids = ["t0", "t1"]
    assert out["status"] == "ok", out["evidence"]
    assert len(got["answers"]) == spec["orderings"] == out["evidence"]["detail"]["judge_calls"]
    for raw in got["answers"]:
        ranking = answer.parse_answer(raw, ids, renumber=True)
        assert sorted(r["trajectory_id"] for r in ranking) == ids
        entries = json.loads(raw)["ranking"]
        assert len(entries) == 2 and all(set(e) == {"trajectory_id", "tier", "rank"}
                                         for e in entries)
    assert [v.get("quality") is not None for v in out["verdicts"]] == [True, True, False]
    views = {v["trajectory_id"]: v for v in spec["views"]}
    cut_marker = prompt.CUT.split("{")[0]
    for user in got["sent"]:
        assert "'t2'" not in user                       # the failure is not shown
        for tid in ids:
            diff = open(f"{views[tid]['workspace']}/final.diff").read()
            section = user.split(f"trajectory_id {tid!r}")[1].split("## Candidate")[0]
            assert diff in section or cut_marker in section.split("### last visible")[0]
        t0 = user.split("trajectory_id 't0'")[1].split("## Candidate")[0]
        tests = t0.split("### last visible test run")[1].split("### transcript")[0]
        assert "LOG-HEAD" in tests and "LOG-TAIL" in tests and cut_marker in tests
    cuts = out["evidence"]["detail"]["orderings"][0]["cuts"]
    assert {"section": "tests", "trajectory_id": "t0"}.items() <= cuts[[
        c["section"] for c in cuts].index("tests")].items()
    assert all(o["tokens"] <= spec["budget"] for o in out["evidence"]["detail"]["orderings"])
    closed = got["closed"]
    assert closed["status"] == "failed" and closed["evidence"]["error"], closed

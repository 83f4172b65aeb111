"""vLLM side of tests/test_vllm.py and tests/test_engine_conformance.py (runs in .venv-vllm; no
JAX): one engine per family, three weight sets, then the conformance scenario on the same engine.

    .venv-vllm/bin/python tests/support/vllm_parity_driver.py SPEC.json OUT.json

SPEC: {name: {"workdir", "step1", "step2", "prompt", "gen", "delta"?, "prompt_b"?}}; `latest`
names step2. Each engine (`vllm_engine.make`) starts on step 2 (a fresh load), then reloads
step 1 in place, then `latest` (step 2) again. For each: the greedy tokens, their log-probs, the
prompt log-probs and the captured routing [rows][L][K]. With "delta" ({"base", "delta",
"full"}): then the chain's base and its delta applied (`gagar_apply_version`), against a full
reload of the delta's step (answers and `gagar_weights_digest`). With "prompt_b": then
`engine_scenario.run` through the engine interface (it moves back to step 2 first). With
"parity_prompts": then, on step 2, the greedy continuations of every one of those prompts in
one batched `LLM.generate` (no routing capture), for the JAX sampler's argmax parity. The spec
named "judge" ({"dir", "task", "views", "orderings", "budget", "max_tokens"}) is the LLM grader on
an engine with a tokenizer and structured outputs (`judge`).
"""
import json
import sys


def greedy(llm, prompt, gen):
    from vllm import SamplingParams

    from gagar_jax.rollout.vllm_engine import routes_array
    sp = SamplingParams(temperature=0.0, max_tokens=gen, logprobs=1, prompt_logprobs=1,
                        detokenize=False, ignore_eos=True)
    llm.collective_rpc("gagar_capture_routes", args=(True,))
    o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    toks = list(o.outputs[0].token_ids)
    return {"greedy": toks,
            "gen_logprobs": [o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(toks)],
            "prompt_logprobs": [o.prompt_logprobs[i][prompt[i]].logprob
                                for i in range(1, len(prompt))],
            "routes": routes_array(llm.collective_rpc("gagar_pop_routes")[0])}


def one(spec):
    import time

    from gagar_jax.rollout.engine import EngineOptions
    from gagar_jax.rollout.vllm_engine import make
    from gagar_jax.rollout.vllm_extension import reload_latest
    t0 = time.perf_counter()
    engine = make(spec["step2"], EngineOptions(seed=0, max_model_len=64))
    llm = engine.llm
    res = {"start_s": time.perf_counter() - t0}
    res["fresh"] = greedy(llm, spec["prompt"], spec["gen"])
    res["reload_info_1"] = llm.collective_rpc("gagar_reload_from", args=(spec["step1"],))[0]
    assert llm.reset_prefix_cache()
    res["step1"] = greedy(llm, spec["prompt"], spec["gen"])
    t0 = time.perf_counter()
    info = reload_latest(llm, spec["workdir"])
    res["reload_s"] = time.perf_counter() - t0
    res["reload_info_2"] = {k: v for k, v in info.items() if k != "path"}
    res["reloaded"] = greedy(llm, spec["prompt"], spec["gen"])
    if "delta" in spec:
        res["delta"] = delta(llm, spec)
    res["agent"] = agent(engine, spec)
    if "prompt_b" in spec:
        import engine_scenario
        res["scenario"] = engine_scenario.run(engine, spec)
    if "parity_prompts" in spec:
        res["parity"] = batch_greedy(llm, spec["parity_prompts"], spec["gen"])
    return engine, res


def batch_greedy(llm, prompts, gen):
    """The greedy continuation of each prompt (one batched call; `latest` = step 2 served)."""
    from vllm import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=gen, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def agent(engine, spec):
    """The agent loop's multi-turn groups on this engine across a version move
    (tests/support/agent_scenario.py; tests/test_agent_vllm.py reads them)."""
    import agent_scenario
    return agent_scenario.run(engine, spec)


def delta(llm, spec):
    """The delta chain's base, then its delta (the fast apply), against a full reload of the
    same step: answers and weight digests of both; then the next delta applied the old way
    (`fast=False`, which reads the host copy the fast apply left lagging), the same."""
    d = spec["delta"]
    for path in (d["base"], d["delta"]):
        info = llm.collective_rpc("gagar_apply_version", args=(path,))[0]
        assert llm.reset_prefix_cache()
    out = {"info": {k: info[k] for k in ("deltas", "changed", "rebuilt", "slow_groups",
                                         "tiled", "patched", "patched_tensors",
                                         "patched_elements", "reprocessed")},
           **_against_full(llm, spec, d["full"], "")}
    for path in (d["base"], d["delta"]):
        llm.collective_rpc("gagar_apply_version", args=(path,))
    info = llm.collective_rpc("gagar_apply_version", args=(d["delta4"],),
                              kwargs={"fast": False})[0]
    assert llm.reset_prefix_cache()
    out["info4"] = {k: info.get(k) for k in ("deltas", "rebuilt", "reloaded")}
    out.update(_against_full(llm, spec, d["full4"], "4"))
    return out


def _against_full(llm, spec, full, key):
    """The engine's answers and weight digest as applied, then after a full reload of `full`:
    {applied, reloaded, digest_n, digest_outs, digest_diff} (each name + `key`)."""
    out = {"applied" + key: greedy(llm, spec["prompt"], spec["gen"])}
    applied = llm.collective_rpc("gagar_weights_digest")[0]
    llm.collective_rpc("gagar_reload_from", args=(full,))
    assert llm.reset_prefix_cache()
    out["reloaded" + key] = greedy(llm, spec["prompt"], spec["gen"])
    ref = llm.collective_rpc("gagar_weights_digest")[0]
    out["digest_n" + key] = len(ref)
    out["digest_outs" + key] = sum(k.endswith(":out") for k in ref)
    out["digest_diff" + key] = sorted(k for k in ref.keys() | applied.keys()
                                      if ref.get(k) != applied.get(k))
    return out


def judge(spec):
    """The LLM grader on an offline vLLM engine with the byte tokenizer and structured outputs
    (tests/test_engine_conformance.py reads it): a planted group's workspace graded with k
    orderings; then, the engine closed, the same group again (status failed)."""
    import time

    from transformers import AutoTokenizer

    from gagar_jax.rollout.engine import EngineOptions
    from gagar_jax.rollout.envs.hf_tokenizer import HFTokenizer
    from gagar_jax.rollout.grading import llm
    from gagar_jax.rollout.grading.base import grade_workspace
    from gagar_jax.rollout.grading.workspace import GroupWorkspace
    from gagar_jax.rollout.vllm_engine import VLLMEngine, make_llm
    t0 = time.perf_counter()
    opts = EngineOptions(seed=0, max_model_len=spec["budget"] + 512, routing=False)
    engine = VLLMEngine(make_llm(spec["dir"], max_model_len=opts.max_model_len,
                                 skip_tokenizer_init=False), spec["dir"], opts)
    start_s = time.perf_counter() - t0
    tok = HFTokenizer(AutoTokenizer.from_pretrained(spec["dir"]))
    base = llm.EngineJudge(engine, tok, max_tokens=spec["max_tokens"])
    sent, answers = [], []

    class Recording:
        count = staticmethod(base.count)

        def ask(self, messages, schema):
            sent.append(messages[1]["content"])
            answers.append(base.ask(messages, schema))
            return answers[-1]

    ws = GroupWorkspace.from_views(spec["task"], spec["views"])
    grader = llm.LLMGrader(Recording(), orderings=spec["orderings"], retries=0,
                           budget=spec["budget"])
    t0 = time.perf_counter()
    out = grade_workspace(grader, ws)
    grade_s = time.perf_counter() - t0
    engine.close()
    closed = grade_workspace(grader, ws)
    return {"start_s": start_s, "grade_s": grade_s, "answer": out, "sent": sent,
            "answers": answers, "closed": closed}


def main(spec_path, out_path):
    """SPEC.json holds {name: spec}: the engines run one after the other in this process (one
    import of vLLM), each shut down before the next starts; the spec named "judge" runs
    `judge`."""
    out = {}
    for name, spec in json.load(open(spec_path)).items():
        if name == "judge":
            out[name] = judge(spec)
            continue
        engine, out[name] = one(spec)
        engine.close()
    json.dump(out, open(out_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:3])

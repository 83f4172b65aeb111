"""The engine conformance scenario: one fixed script of calls on the engine interface only
(`gagar_jax.rollout.engine`), whose answers tests/test_engine_conformance.py checks against the
learner's own model. JAX-free: the vLLM driver runs it in .venv-vllm
(tests/support/vllm_parity_driver.py); an in-process engine (the JAX sampler) runs it as is.

    answers = run(engine, {"step1": dir, "step2": dir, "prompt": [...], "prompt_b": [...],
                           "gen": 8})
"""
from __future__ import annotations

import dataclasses

from gagar_jax.rollout.engine import Request, SamplingSpec

APPENDED = [3, 44, 12]       # a later turn's tokens (a tool's output) appended to a sequence
SEED = 11


def _dict(c) -> dict:
    return {"tokens": list(c.tokens), "logprobs": list(c.logprobs),
            "routed": c.routed_experts, "finish": c.finish_reason,
            "policy_version": c.policy_version}


def run(engine, spec: dict) -> dict:
    """Drives `engine` (serving anything: it first moves to step 2) through the scenario; returns
    its answers as JSON-able dicts (see tests/test_engine_conformance.py for what each must be).
    """
    p, q, gen = list(spec["prompt"]), list(spec["prompt_b"]), spec["gen"]
    hot = SamplingSpec(temperature=1.0, max_tokens=gen)
    greedy = SamplingSpec(temperature=1.0, top_k=1, max_tokens=gen)   # top-1: the argmax
    out = {"moved_2": engine.move_to(spec["step2"])["policy_version"],
           "version_2": engine.version}
    # N samples of one prompt, seeded; the same request again; sample 2 alone (seed + 2)
    [a] = engine.generate([Request(p, hot, seed=SEED, n=4)])
    [b] = engine.generate([Request(p, hot, seed=SEED, n=4)])
    [[c]] = engine.generate([Request(p, hot, seed=SEED + 2)])
    out["samples"], out["samples_again"], out["sample_2"] = (
        [_dict(x) for x in a], [_dict(x) for x in b], _dict(c))
    # a stop token: the 4th token sample 0 drew; the same seed stops at its first occurrence
    stop = a[0].tokens[3]
    [[s]] = engine.generate([Request(p, dataclasses.replace(hot, stop_token_ids=(stop,)),
                                     seed=SEED)])
    out["stop"] = {"token": stop, **_dict(s)}
    engine.cancel([x.sequence for x in a + b + [c, s]])
    # two requests in one call (routing attributed to each), greedy
    [[g1], [g2]] = engine.generate([Request(p, greedy, seed=0), Request(q, greedy, seed=0)])
    out["greedy_p"], out["greedy_q"] = _dict(g1), _dict(g2)
    # a live sequence continued twice, against one request on the concatenation
    [[t2]] = engine.generate([Request(APPENDED, greedy, seed=0, sequence=g1.sequence)])
    [[t3]] = engine.generate([Request([7], greedy, seed=0, sequence=g1.sequence)])
    one_shot = p + g1.tokens + APPENDED + t2.tokens + [7]
    [[o3]] = engine.generate([Request(one_shot, greedy, seed=0)])
    out["turn2"], out["turn3"], out["one_shot3"] = _dict(t2), _dict(t3), _dict(o3)
    out["same_sequence"] = t2.sequence == t3.sequence == g1.sequence
    # cancel: the sequence is gone, the other live one still continues
    engine.cancel([g1.sequence, "no-such-sequence"])
    try:
        engine.generate([Request([1], greedy, sequence=g1.sequence)])
        out["continue_cancelled"] = "no error"
    except KeyError as e:
        out["continue_cancelled"] = f"KeyError: {e}"
    [[q2]] = engine.generate([Request(APPENDED, greedy, seed=0, sequence=g2.sequence)])
    out["q_turn2"] = _dict(q2)
    # move to step 1 and back: the outputs follow the weights
    out["moved_1"] = engine.move_to(spec["step1"])["policy_version"]
    out["version_1"] = engine.version
    [[m1]] = engine.generate([Request(p, greedy, seed=0)])
    out["moved_2_again"] = engine.move_to(spec["step2"])["policy_version"]
    [[m2]] = engine.generate([Request(p, greedy, seed=0)])
    out["greedy_step1"], out["greedy_step2_again"] = _dict(m1), _dict(m2)
    engine.cancel([g2.sequence, m1.sequence, m2.sequence])
    return out

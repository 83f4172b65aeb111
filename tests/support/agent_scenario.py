"""The agent loop on a real engine: three groups of two multi-turn trajectories through
`AgentLoop` (the worker's agent mode) on the engine interface only, JAX-free. The vLLM driver
runs it on each family's engine (tests/support/vllm_parity_driver.py, `agent`);
tests/test_agent_vllm.py checks the records against the learner.

    answers = run(engine, {"step1": dir, "step2": dir, "prompt": [...]})

The engine starts on step 1 (`latest` of a workdir of its own names it). Groups "a" and "b" run
4 turns (4 generated tokens each, 3-token observations); after turn 2 their first trajectory's
environment points `latest` at step 2, so the loop moves the engine between turns and turns 3-4
come from version 2. Group "c" (10-token observations, no submit) runs into the engine's context
(64 tokens) and ends "context_full", truncated. Trajectory 0 passes in "a", 1 in "b" and "c".
"""
from __future__ import annotations

import json
import tempfile
import time

import agent_fakes

from gagar_jax.feed import schema
from gagar_jax.rollout.agent_loop import AgentLoop, AgentOptions
from gagar_jax.rollout.engine import SamplingSpec

CONTEXT = 64            # the driver's engines: EngineOptions(max_model_len=64)
TURN = 4                # generated tokens per turn


def tasks(spec: dict, workdir: str) -> list:
    move = {"move_latest_at": 2, "workdir": workdir, "move_path": spec["step2"]}
    return [{"task_id": "agent-a", "turns": 4, "obs": 3, "pass": [True, False], "n": 2,
             "prompt": spec["prompt"], **move},
            {"task_id": "agent-b", "turns": 4, "obs": 3, "pass": [False, True], "n": 2,
             "prompt": spec["prompt"], **move},
            {"task_id": "agent-c", "turns": 10, "obs": 10, "pass": [False, True], "n": 2,
             "prompt": spec["prompt"]}]


def run(engine: object, spec: dict) -> dict:
    """Runs the three groups; returns {"records": [JSON text], "infos": [per-group log line],
    "counts": the loop's counts, "version": the engine's version at the end, "s": seconds}."""
    t0 = time.perf_counter()
    engine.move_to(spec["step1"])
    with tempfile.TemporaryDirectory(prefix="agent_scenario_") as workdir:
        return _run(engine, spec, workdir, t0)


def _run(engine: object, spec: dict, workdir: str, t0: float) -> dict:
    agent_fakes.point(workdir, spec["step1"])
    out = {"records": [], "infos": []}

    def emit(rec, info):
        out["records"].append(schema.encode(rec, "json").decode())
        out["infos"].append(info)
    loop = AgentLoop(engine, agent_fakes.make_env, agent_fakes.Tok(),
                     SamplingSpec(temperature=1.0, max_tokens=TURN),
                     AgentOptions(n=2, max_turns=8, max_model_len=CONTEXT, concurrent_groups=3,
                                  seed=3, threads=False),
                     workdir=workdir, emit=emit, prefix="scenario")
    for task in tasks(spec, workdir):
        loop.start(task)
    while loop.live:
        loop.sync()
        loop.tick(0.01)
    out.update(counts=loop.counts, version=engine.version, s=time.perf_counter() - t0)
    json.dumps(out)             # JSON-able, for the driver's answer file
    return out

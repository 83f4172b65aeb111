"""The colocated loop (`gagar_jax/run/colocated.py`, `gagar-loop --engine jax --colocated`): the
learner and the JAX sampler in one program on 8 CPU devices, the weights handed over in memory.

Two steps of the tiny Qwen3-MoE loop on the rollout worker's example task, the sampler reading
the learner's own arrays: every group is on-policy (staleness 0), the ledger balances, and the
learner's recomputed log-probs equal the sampler's to float round-off (`rollout/logp_abs_diff`,
which a vLLM engine on bf16 publishes puts at ~5e-3 mean, docs/rollout.md).
"""
import json
import os

import pytest

from gagar_jax.config import load_config_file
from gagar_jax.rollout.engine import SamplingSpec
from gagar_jax.run import colocated, loop
from gagar_jax.sample.sampler import SamplerConfig


def test_two_colocated_steps_on_policy_with_round_off_mismatch(repo_root, tmp_path):
    cfg = load_config_file(os.path.join(repo_root, "configs", "tiny_vllm.py"))
    cfg.train.steps, cfg.train.publish_every = 2, 0
    cfg.feed.groups_per_batch, cfg.feed.max_trajectories, cfg.feed.rows_per_batch = 2, 16, 8
    opts = colocated.ColocatedOptions(n=8, spec=SamplingSpec(max_tokens=8),
                                      sampler=SamplerConfig(slots=16, page=8, max_len=32,
                                                            decode_steps=8))
    summary = colocated.run_colocated(cfg, str(tmp_path), opts)
    assert summary["steps"] == 2 and summary["ledger"]["balanced"]
    assert not os.listdir(tmp_path / "published") if (tmp_path / "published").exists() else True
    metrics = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    for m in metrics:
        assert m["feed/staleness_max"] == 0
        assert m["rollout/logp_abs_diff_max"] < 2e-5, m
    lines = [json.loads(line) for line in open(tmp_path / "rollout" / f"{colocated.WRITER}.jsonl")]
    handovers = [x for x in lines if "handover" in x]
    assert {x["handover"] for x in handovers} == {"same"}
    assert {x["policy_version"] for x in handovers} == {0, 1}
    rep = loop.report(str(tmp_path), 2)
    assert rep["steps_trained"] == 2 and rep["groups_sampled"] >= 4


def test_loop_cli_colocated_flags_and_overrides(repo_root, capsys):
    from gagar_jax.run import loop_cli
    assert loop_cli.main(["--workdir", "/nonexistent/x", "--colocated"]) == 2
    assert "--colocated needs --engine jax" in capsys.readouterr().err
    # --init-from without weights there: a one-line error before any process or compile, both
    # for the two-process loop and the colocated one (the loop itself: tests/test_grader_loop.py)
    for extra in ([], ["--colocated"]):
        assert loop_cli.main(["--workdir", "/nonexistent/x", "--engine", "jax",
                              "--init-from", "/nonexistent/sft", *extra]) == 2
        err = capsys.readouterr().err
        assert "/nonexistent/sft" in err and "config.json" in err, err
        assert not os.path.exists("/nonexistent/x")
    cfg = load_config_file(os.path.join(repo_root, "configs", "tiny_vllm.py"))
    loop_cli.apply_overrides(cfg, ["--config.train.steps=7", "--config.optim.learning_rate=0.5",
                                   "--config.feed.routing_replay=false"])
    assert (cfg.train.steps, cfg.optim.learning_rate, cfg.feed.routing_replay) == (7, 0.5, False)
    for bad, msg in (("--config.train.nope=1", "no config key"),
                     ("--config.feed.routing_replay=maybe", "expected true or false")):
        with pytest.raises(ValueError, match=msg):
            loop_cli.apply_overrides(cfg, [bad])


def test_colocated_agent_loop_multi_turn_on_policy(repo_root, tmp_path):
    """Learner, sampler and the agent environments in one program (`--colocated --env`): the
    lookup task's three-turn episodes, on-policy, the learner's log-probs equal the sampler's at
    every generated token of every turn, and the trajectories are the environment's."""
    cfg = load_config_file(os.path.join(repo_root, "configs", "tiny_agent.py"))
    cfg.train.steps, cfg.train.publish_every = 2, 0
    cfg.feed.groups_per_batch, cfg.feed.max_trajectories, cfg.feed.rows_per_batch = 2, 16, 8
    env = "gagar_jax.rollout.envs.lookup"
    opts = colocated.ColocatedOptions(
        n=8, spec=SamplingSpec(max_tokens=4), env=f"{env}:make_env",
        tokenizer=f"{env}:tokenizer",
        agent=colocated.AgentOptions(max_turns=3, threads=False),
        sampler=SamplerConfig(slots=16, page=8, max_len=32, decode_steps=4))
    summary = colocated.run_colocated(cfg, str(tmp_path), opts)
    assert summary["steps"] == 2 and summary["ledger"]["balanced"]
    for m in map(json.loads, open(tmp_path / "metrics.jsonl")):
        assert m["feed/staleness_max"] == 0
        assert m["rollout/logp_abs_diff_max"] < 2e-5, m
    rows = [json.loads(x) for x in open(tmp_path / "rollout" / f"{colocated.WRITER}.jsonl")]
    groups = [r for r in rows if "group_id" in r]
    assert groups and all(r["turns"] == 8 * 3 and r["spanning"] == 0 for r in groups)
    assert {r["policy_version"] for r in groups} >= {0, 1}
    assert len({r["group_id"] for r in groups}) == len(groups)
    assert loop.report(str(tmp_path), 2)["steps_trained"] == 2


def test_loop_cli_colocated_agent_flags_reach_the_options(monkeypatch, tmp_path):
    from gagar_jax.run import loop_cli
    seen = {}

    def fake(cfg, workdir, opts):
        seen.update(opts=opts, steps=cfg.train.steps)
        raise KeyboardInterrupt        # stop before the report

    monkeypatch.setattr(colocated, "run_colocated", fake)
    env = "gagar_jax.rollout.envs.lookup"
    with pytest.raises(KeyboardInterrupt):
        loop_cli.main(["--workdir", str(tmp_path), "--engine", "jax", "--colocated",
                       "--env", f"{env}:make_env", "--tokenizer", f"{env}:tokenizer",
                       "--max-turns", "3", "--max-tokens", "4", "--steps", "5"])
    o = seen["opts"]
    assert (o.env, o.tokenizer, o.agent.max_turns, o.spec.max_tokens, seen["steps"]) == (
        f"{env}:make_env", f"{env}:tokenizer", 3, 4, 5)
    assert (o.tasks, o.grader) == ("", "")       # the env module's tasks, no grader

"""The closed loop, short: the learner and the vLLM rollout worker as two processes, started by
the loop's entry point (`gagar-loop`, gagar_jax/run/loop_cli.py on run/loop.py).

Six learner steps on the example task (configs/tiny_vllm.py), publishing deltas between full
versions (the worker applies them in place); the learner publishes version 0 itself
(`train.publish_initial`). The full loop (3 seeds, 40 steps, a frozen control) is `make loop`;
docs/rollout.md has its numbers.
"""
import contextlib
import glob
import io
import json
import os
import re

import pytest
from support.vllm_env import vllm_python
from support.xla_flags import cpu_flags

from gagar_jax.feed import schema
from gagar_jax.run import loop_cli

STEPS = 6


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    py = vllm_python()              # fails (never skips) without .venv-vllm
    wd = str(tmp_path_factory.mktemp("loop") / "run")
    out = io.StringIO()
    # The learner on one CPU device with the subprocesses' flags (not the suite's 8 fake devices
    # at -O0 with the MLIR fusion emitters, which it would inherit): its compile is most of it.
    with contextlib.redirect_stdout(out), pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLA_FLAGS", cpu_flags(1))
        # delta publishing (a full version every 3 publishes): the worker applies the chains
        code = loop_cli.main(["--workdir", wd, f"--steps={STEPS}", "--seed=0",
                              f"--vllm-python={py}", "--timeout-s=400",
                              "--config.train.publish_full_every=3"])
    assert code == 0, out.getvalue()
    with open(os.path.join(wd, "loop_report.json")) as f:
        return wd, json.load(f), out.getvalue()


def test_the_entry_point_prints_a_line_per_policy_version(loop):
    wd, rep, out = loop
    lines = [ln for ln in out.splitlines() if ln.startswith("version")]
    shown = [int(re.match(r"version +(\d+):", ln).group(1)) for ln in lines]
    # every version the worker sampled from, once each, in order (the last when the loop ended)
    assert shown == sorted(int(v) for v in rep["pass_rate_by_version"])
    for ln, v in zip(lines, shown, strict=True):
        rate = float(re.search(r"pass rate ([\d.]+) over", ln).group(1))
        assert abs(rate - rep["pass_rate_by_version"][str(v)]) <= 6e-4, ln
    assert out.splitlines()[-1].startswith(f"gagar-loop: {rep['steps_trained']} steps")


def test_ledger_balances_and_every_step_reports_staleness_and_mismatch(loop):
    wd, rep, _ = loop
    led = rep["ledger"]
    assert rep["ledger_balanced"] and led["finished"] and led["quarantined"] == 0
    assert led["received"] == led["trained"] + led["filtered_uniform"] + led["filtered_stale"] \
        + led["leftover"]
    steps = rep["per_step"]
    assert [m["step"] for m in steps] == list(range(1, rep["steps_trained"] + 1))
    assert rep["steps_trained"] >= 3
    assert led["trained"] == sum(m["groups"] for m in steps)
    for m in steps:
        assert 0 <= m["feed/staleness_mean"] <= m["feed/staleness_max"] <= 4
        assert 0 <= m["rollout/logp_abs_diff_mean"] <= m["rollout/logp_abs_diff_max"]
    # Step 1 trains on version 0 only (staleness 0): the learner's fp32 log-probs differ from
    # the engine's on the bf16 publish of the same weights by the rounding alone.
    assert steps[0]["feed/staleness_max"] == 0
    assert 0 < steps[0]["rollout/logp_abs_diff_mean"] < 0.05


def test_records_carry_version_sampling_and_routing(loop):
    wd, rep, _ = loop
    shards = sorted(glob.glob(os.path.join(wd, "spool", "*.jsonl")))
    assert shards and not glob.glob(os.path.join(wd, "spool", ".*"))
    groups = [schema.decode(line, "json") for s in shards for line in open(s, "rb")]
    versions = [g.policy_version for g in groups]
    assert versions == sorted(versions) and versions[0] == 0
    assert max(versions) >= 2                       # the worker reloaded as the learner published
    g = groups[-1]
    assert g.sampling.engine == "vllm" and g.sampling.logprobs_mode == "raw_logprobs"
    for t in g.trajectories:
        n = sum(t.loss_mask)
        assert n == 8 and len(t.routed_experts) == n
        assert all(len(layer) == 2 and len(layer[0]) == 2 for layer in t.routed_experts)
        assert all(lp <= 0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m)
    log = [json.loads(x) for x in open(os.path.join(wd, "rollout", "worker0.jsonl"))]
    assert sum("reload" in r for r in log) >= 2
    # deltas applied to the version held (the fast apply), not reloads from a base
    assert any((r.get("deltas") or 0) >= 1 for r in log if "reload" in r), log

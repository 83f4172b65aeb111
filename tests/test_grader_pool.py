"""The grader pool (issue 40 item 4): groups graded beside the rollouts, a crashed grader's
groups re-queued and never lost, the spool (emit) receives graded groups only."""
import glob
import json
import os
import threading
import time

import pytest
from support import agent_fakes as F
from test_agent_loop import SPEC, _worker, drive, task

from gagar_jax.feed import schema
from gagar_jax.rollout import agent_grading
from gagar_jax.rollout.agent_loop import AgentLoop, AgentOptions
from gagar_jax.rollout.grading.pool import GraderPool


def _wait(pool, n, timeout_s=10.0):
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n:
        assert time.monotonic() < deadline, f"only {len(out)} of {n} answers"
        out += pool.collect(0.02)
    return out


def test_a_crashed_grader_requeues_its_group_and_the_ledger_balances():
    tries = {}
    lock = threading.Lock()

    def grade(name, crashes):
        with lock:
            tries[name] = tries.get(name, 0) + 1
            n = tries[name]
        if n <= crashes:
            raise agent_grading.GraderCrashed(f"{name} died")
        return f"graded {name}"
    pool = GraderPool(2, lambda name, crashes, err: f"fallback {name}: {err}", max_attempts=3)
    jobs = {"a": 0, "b": 2, "c": 5, "d": 1}
    for name, crashes in jobs.items():
        pool.submit(("grade", name, 0), grade, name, crashes)
    answers = {k[1]: v for k, v, err in _wait(pool, 4)}
    pool.close()
    assert answers == {"a": "graded a", "b": "graded b", "c": "fallback c: c died",
                       "d": "graded d"}
    assert tries == {"a": 1, "b": 3, "c": 3, "d": 2}   # c: max_attempts, then the fallback
    s = pool.stats()
    assert s["submitted"] == 4 == s["done"] and s["queued"] == 0 == s["in_flight"]
    assert s["requeued"] == 2 + 2 + 1 and s["crashes"] == 2 + 3 + 1 and s["fallbacks"] == 1
    assert set(pool.latency) == {("grade", k, 0) for k in jobs}
    with pytest.raises(ValueError, match="grader workers"):
        GraderPool(0, lambda *a: None)


def test_the_ledger_counts_queued_groups_while_graders_are_busy():
    gate = threading.Event()
    pool = GraderPool(1, lambda *a: None)
    for i in range(3):
        pool.submit(("grade", i, 0), gate.wait)
    deadline = time.monotonic() + 5
    while pool.stats()["in_flight"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert pool.stats()["queued"] == 2 and pool.stats()["done"] == 0
    gate.set()
    assert len(_wait(pool, 3)) == 3 and pool.stats()["queued"] == 0
    pool.close()


def test_the_loop_with_a_pool_emits_every_group_graded_and_logs_queue_and_latency():
    calls = []

    def grader(t, views):
        calls.append(t["task_id"])
        if len(calls) == 2:
            raise agent_grading.GraderCrashed("the judge's process died")   # re-queued
        time.sleep(0.05)
        return [{"quality": {"tier": "strong" if v["outcome"] == "pass" else "defective",
                             "rank": 0}} for v in views]
    opts = AgentOptions(n=3, max_turns=8, threads=False, concurrent_groups=2)
    loop = AgentLoop(F.ScriptedEngine(version=0), F.make_env, F.Tok(), SPEC, opts,
                     grader=grader, grader_name="g", grader_workers=2)
    tasks = [task(i) for i in range(6)]
    out = drive(loop, iter(tasks), 6)
    assert sorted(r.task_id for r, _ in out) == sorted(t["task_id"] for t in tasks)
    for rec, info in out:           # emitted only once graded, with the grader's tiers
        assert rec.grading.status == "ok" and rec.grading.grader == "g"
        assert rec.trajectories[0].quality.tier == "strong"
        assert info["grade_s"] is not None and info["grade_s"] >= 0.05
        assert {"queued", "in_flight", "requeued"} <= set(info["grade_queue"])
    assert len(calls) == 7 and loop.pool.stats()["requeued"] == 1
    assert loop.counts["groups"] == 6 and loop.counts["grader_errors"] == 0
    assert not loop.grading and loop.live == 0


def test_a_group_whose_grader_always_crashes_falls_back_to_binary_credit():
    def grader(t, views):
        raise agent_grading.GraderCrashed("gone")
    opts = AgentOptions(n=3, max_turns=8, threads=False)
    loop = AgentLoop(F.ScriptedEngine(version=0), F.make_env, F.Tok(), SPEC, opts,
                     grader=grader, grader_name="g", grader_workers=1)
    [(rec, _)] = drive(loop, iter([task()]), 1)
    assert rec.grading.status == "failed" and "every attempt" in str(rec.grading.evidence)
    assert rec.trajectories[0].quality is None and loop.counts["grader_errors"] == 1
    assert loop.pool.stats()["fallbacks"] == 1


def test_the_worker_flag_runs_the_pool_and_logs_queue_depth_and_latency(tmp_path):
    """`--grader-workers 2` end to end: graded groups in the spool, the ledger in the log."""
    wd = str(tmp_path)
    F.publish(wd, 1)
    proc = _worker(wd, "--env", "support.agent_fakes:make_env", "--tokenizer",
                   "support.agent_fakes:tokenizer", "--max-groups", "3", "--n", "3",
                   "--max-tokens", "4", "--concurrent-groups", "2",
                   "--grader", "support.planted:tier_grader", "--grader-workers", "2")
    assert proc.returncode == 0, proc.stderr
    shards = sorted(glob.glob(os.path.join(wd, "spool", "*.jsonl")))
    groups = [schema.decode(line, "json") for s in shards for line in open(s, "rb")]
    assert len(groups) == 3
    assert all(g.grading.grader == "support.planted:tier_grader" and
               g.trajectories[0].quality.tier == "strong" for g in groups)
    log = [json.loads(x) for x in open(os.path.join(wd, "rollout", "worker0.jsonl"))]
    assert len(log) == 3 and all(r["grade_s"] is not None for r in log)
    assert log[-1]["grade_queue"]["submitted"] >= 3 and log[-1]["grade_queue"]["queued"] >= 0

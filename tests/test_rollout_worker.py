"""The rollout worker's parts without vLLM: the example grader, routing rows, the records it
writes (accepted by the learner's feed as they are), the atomic spool shards, bad flags, and the
whole worker on a scripted engine through the engine interface (tests/support/fake_engine.py)."""
import glob
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from gagar_jax.feed import Feed, FeedConfig, IteratorSource, schema
from gagar_jax.rollout import example_task, worker
from gagar_jax.rollout.engine import Completion, SamplingSpec
from gagar_jax.rollout.feed_writer import SpoolWriter, group_record
from gagar_jax.rollout.vllm_engine import routes_array

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D = [ord(c) for c in "0123456789"]
A = ord("a")


def test_example_grader_by_hand():
    comps = [[A] * 8, [D[3]] + [A] * 7, D[:8], D[:4] + [A] * 4, [D[0]] * 2 + [A] * 6]
    assert example_task.grade({"task_id": "t"}, comps) == [
        {"outcome": "fail"},
        {"outcome": "pass", "quality": {"tier": "intermediate", "rank": 7}},
        {"outcome": "pass", "quality": {"tier": "strong", "rank": 0}},
        {"outcome": "pass", "quality": {"tier": "strong", "rank": 4}},      # half digits
        {"outcome": "pass", "quality": {"tier": "intermediate", "rank": 6}}]
    t = next(example_task.tasks(3))
    assert t["prompt"][:8] == list(b"digits: ") and len(t["prompt"]) == 16
    assert next(example_task.tasks(3)) == t                                 # seeded
    # The chance a uniform 8-token completion passes: 1 - (246/256)^8.
    rng = np.random.default_rng(0)
    rate = np.mean([example_task.passes(rng.integers(0, 256, 8)) for _ in range(20000)])
    assert abs(rate - (1 - (246 / 256) ** 8)) < 0.01


def test_normalize_grades():
    v = [{"outcome": "pass"}, {"outcome": "fail"}]
    assert worker.normalize_grades(v, 2) == (v, "ok", None)
    assert worker.normalize_grades({"verdicts": v, "status": "failed", "evidence": "x"}, 2) == (
        v, "failed", "x")
    with pytest.raises(ValueError, match="2 verdicts"):
        worker.normalize_grades(v[:1], 2)
    with pytest.raises(ValueError, match="status"):
        worker.normalize_grades({"verdicts": v, "status": "maybe"}, 2)


def test_routes_array_orders_rows_per_layer():
    # Two MoE layers; a prefill of 3 tokens, then two decode steps (one row each).
    calls = [("l0", [[0, 1], [1, 2], [2, 3]]), ("l1", [[3, 0], [2, 1], [1, 0]]),
             ("l0", [[0, 3]]), ("l1", [[1, 3]]), ("l0", [[2, 0]]), ("l1", [[3, 2]])]
    rows = routes_array(calls)
    assert rows == [[[0, 1], [3, 0]], [[1, 2], [2, 1]], [[2, 3], [1, 0]], [[0, 3], [1, 3]],
                    [[2, 0], [3, 2]]]
    with pytest.raises(RuntimeError, match="different token counts"):
        routes_array(calls[:3])


def _record(policy_version=3, routed=True):
    prompt = next(example_task.tasks(0))["prompt"]
    rng = np.random.default_rng(1)
    comps = [Completion(tokens=[D[j % 10] if j % 2 else A] * 8,
                        logprobs=list(-rng.random(8)),
                        routed_experts=rng.integers(0, 4, (8, 2, 2)).tolist() if routed else None)
             for j in range(4)]
    grades = example_task.grade({}, [c.tokens for c in comps])
    return group_record("w-g0", "task0", policy_version, prompt, comps, grades,
                        grader="example", sampling=SamplingSpec(temperature=0.7).record())


def test_record_is_what_the_learner_reads(tmp_path):
    rec = _record()
    t = rec.trajectories[1]
    assert t.loss_mask == [0] * 16 + [1] * 8 and t.logprobs[:16] == [0.0] * 16
    assert rec.sampling.temperature == 0.7 and rec.sampling.logprobs_mode == "raw_logprobs"
    assert [x.outcome for x in rec.trajectories] == ["fail", "pass", "fail", "pass"]
    # The learner's feed takes it as it is: validated, mixed, packed, routing replayed.
    cfg = FeedConfig(path="", rows_per_batch=4, seq_len=64, max_traj_tokens=64, max_trajectories=8,
                     groups_per_batch=1, max_staleness=100, routing_replay=True)
    feed = Feed(cfg, str(tmp_path), vocab_size=256, num_moe_layers=2, top_k=2, num_experts=4,
                source=IteratorSource([schema.to_builtins(rec)]))
    batch, info = feed.next_batch(3)
    assert info.group_ids == ("w-g0",) and info.policy_versions == (3,)
    assert feed.ledger.quarantined == 0
    routed = np.asarray(batch.routed_experts_BxSxLxK)
    # generated token j's routing sits at its input position (the token before it)
    assert (routed >= 0).sum() == 4 * 8 * 2 * 2


def test_spool_writer_is_atomic_and_ordered(tmp_path):
    w = SpoolWriter(str(tmp_path), "w0")
    paths = [w.write([_record()]), w.write([_record(4), _record(5)])]
    names = sorted(os.listdir(tmp_path))
    assert names == sorted(os.path.basename(p) for p in paths) and names[0] < names[1]
    assert not any(n.startswith(".") or n.endswith(".tmp") for n in names)
    lines = open(paths[1], "rb").read().splitlines()
    assert [schema.decode(x, "json").policy_version for x in lines] == [4, 5]
    w.done()
    assert os.path.exists(tmp_path / "_DONE")
    with pytest.raises(ValueError, match="writer_id"):
        SpoolWriter(str(tmp_path), ".hidden")


@pytest.mark.parametrize("flags,msg", [(["--grader", "nosuch.module:fn"], "--grader"),
                                       (["--tasks", "gagar_jax.rollout.example_task"], "--tasks"),
                                       (["--top-p", "1.5"], "sampling"), (["--n", "0"], "--n"),
                                       (["--engine", "nosuch.engine:make"], "--engine")])
def test_bad_flags_exit_2_in_one_line(tmp_path, flags, msg):
    proc = subprocess.run([sys.executable, "-m", "gagar_jax.rollout.worker", "--workdir",
                           str(tmp_path), *flags], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 2, proc.stderr
    assert msg in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def _published(tmp_path, version=3):
    """A workdir whose `latest` names version `version` (a manifest, no weights: the fake
    engine reads none)."""
    step = tmp_path / "published" / f"step_{version:08d}"
    step.mkdir(parents=True)
    (step / "gagar_publish.json").write_text(json.dumps(
        {"step": version, "policy_version": version, "seq": 1, "kind": "full"}))
    (tmp_path / "published" / "latest").write_text(
        json.dumps({"step": version, "policy_version": version, "path": str(step)}))
    return str(tmp_path)


def _worker(workdir, *flags):
    return subprocess.run([sys.executable, "-m", "gagar_jax.rollout.worker", "--workdir",
                           workdir, "--wait-s", "5", *flags], capture_output=True, text=True,
                          timeout=120,
                          env={**os.environ,
                               "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")])})


def test_worker_runs_on_any_engine_through_the_interface(tmp_path):
    """The worker with `--engine support.fake_engine:make` (a scripted engine; it refuses to
    start if a vLLM module is loaded): one request of --n samples per group, sample j seeded
    `seed * 1_000_003 + completions so far + j`, the engine's name and version in the record."""
    wd = _published(tmp_path)
    proc = _worker(wd, "--engine", "support.fake_engine:make", "--max-groups", "2", "--n", "3",
                   "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["completions"] == 6
    shards = sorted(glob.glob(os.path.join(wd, "spool", "*.jsonl")))
    groups = [schema.decode(line, "json") for s in shards for line in open(s, "rb")]
    assert len(groups) == 2 and all(g.policy_version == 3 for g in groups)
    assert all(g.sampling.engine == "fake" for g in groups)
    tasks = example_task.tasks(1)
    for i, g in enumerate(groups):
        prompt = next(tasks)["prompt"]
        for j, t in enumerate(g.trajectories):
            rng = random.Random(1_000_003 + 3 * i + j)
            assert t.tokens == prompt + [rng.randrange(256) for _ in range(8)]
            assert t.logprobs == [0.0] * len(prompt) + [-1.0] * 8


def test_an_engine_factory_without_the_interface_exits_2_in_one_line(tmp_path):
    proc = _worker(_published(tmp_path), "--engine", "support.fake_engine:not_an_engine")
    assert proc.returncode == 2, proc.stderr
    assert "--engine" in proc.stderr and "lacks" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr

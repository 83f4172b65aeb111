"""The miniature's closed loop on the real two-process path, and the sweep's report helpers.

`scripts/miniature.py --closed-loop` warm-starts a tiny policy, publishes it as policy version 0,
then runs a producer process (sampling with the newest published weights, grading, writing spool
shards) next to a `gagar-train` process (consuming the spool, publishing weights every step).
"""
import json
import math
import os
import subprocess
import sys

import numpy as np

from gagar_jax.sim import report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 5
MAX_STALENESS = 2       # configs/miniature.py feed.max_staleness


def _env():
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(REPO, ".cache", "jax")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


def _jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_two_process_closed_loop(tmp_path):
    work = str(tmp_path / "loop")
    cmd = [sys.executable, os.path.join(REPO, "scripts", "miniature.py"), "--closed-loop",
           "--workdir", work, "--groups", "4", "--group-size", "8", "--sft-steps", "100",
           "--sft-lr", "1e-2", "--rounds", "40", "--max-ahead", "2", "--wait-s", "20",
           "--train-steps", str(STEPS), "--devices", "2",
           "--set", "feed.groups_per_batch=2", "--set", "feed.max_trajectories=16",
           "--set", "feed.rows_per_batch=8"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "producer: round" in proc.stdout           # the producer process ran

    with open(os.path.join(work, "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == STEPS and not summary["preempted"]
    ledger = summary["ledger"]
    assert ledger["received"] == (ledger["trained"] + ledger["filtered_uniform"]
                                  + ledger["filtered_stale"] + ledger["quarantined"]
                                  + ledger["leftover"])
    assert ledger["balanced"] and ledger["quarantined"] == 0

    groups = _jsonl(os.path.join(work, "groups.jsonl"))
    assert len(groups) == ledger["trained"] == ledger["trained_recorded"]
    steps = sorted({g["step"] for g in groups})
    assert steps == list(range(1, STEPS + 1)), steps  # every step trained >= 1 group
    metrics = _jsonl(os.path.join(work, "metrics.jsonl"))
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["groups"] >= 1 for m in metrics)

    # Group ids are r<round>-<policy_version>-<task>: the version the producer sampled with.
    versions = [(g["step"], int(g["group_id"].split("-")[1])) for g in groups]
    for step, version in versions:
        assert 0 <= (step - 1) - version <= MAX_STALENESS   # learner step at intake - version
    assert max(v for _, v in versions) >= 1               # the producer reloaded trainer weights
    by_step = [max(v for s, v in versions if s == k) for k in steps]
    assert by_step == sorted(by_step)                     # versions never go back
    with open(os.path.join(work, "published", "latest")) as f:
        latest = json.load(f)
    assert latest["policy_version"] == STEPS
    assert os.path.exists(os.path.join(latest["path"], "config.json"))


def _rows(values_by_key, n):
    return [{k: v[i] for k, v in values_by_key.items()} for i in range(n)]


def test_report_table_and_plots(tmp_path):
    # Two seeds of one mode, three steps; the last step has no train metrics (evaluation only).
    nan = math.nan
    a = _rows({"heldout_pass_rate": [0.2, 0.4, 0.6], "pos_credit_after": [2.0, 4.0, nan],
               "neg_credit": [-3.0, -3.0, nan]}, 3)
    b = _rows({"heldout_pass_rate": [0.4, 0.4, 1.0], "pos_credit_after": [2.0, 2.0, nan],
               "neg_credit": [-1.0, -1.0, nan]}, 3)
    runs = {"downweight_only/0": a, "downweight_only/1": b}
    np.testing.assert_allclose(report.series(a, "net_credit")[:2], [-1.0, 1.0])
    assert report.window(report.series(a, "heldout_pass_rate"), True, 2) == 0.2
    assert report.window(report.series(a, "heldout_pass_rate"), False, 2) == 0.5
    assert report.window(report.series(a, "net_credit"), False, 5) == 0.0   # NaN step skipped
    table = report.markdown_table(runs, width=2)
    # pass rate: step 0 = (0.2, 0.4) -> 0.300 +- 0.141; final = (0.5, 0.7) -> 0.600 +- 0.141.
    assert "| held-out pass rate | downweight_only | 0.300 ± 0.141 | 0.600 ± 0.141 |" in table
    # net credit: step 0 = (-1, 1) -> 0.00 +- 1.41; final = (0, 1) -> 0.50 +- 0.71.
    assert "| net credit | downweight_only | 0.00 ± 1.41 | 0.50 ± 0.71 |" in table
    paths = report.plot(runs, str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["outcomes.png", "credit.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_strong_credit_share_by_hand():
    from types import SimpleNamespace as NS

    from gagar_jax.sim.experiment import strong_credit_share
    def traj(tid, tier):
        return NS(trajectory_id=tid, quality=NS(tier=tier) if tier else None)
    records = [NS(trajectories=[traj("a", "strong"), traj("b", "intermediate"), traj("c", None)]),
               NS(trajectories=[traj("d", "strong"), traj("e", None)])]
    # Slots are not in record order: the batch maps trajectory ids to slots.
    info = NS(trajectory_ids=(("a", "b", "c"), ("d", "e")), traj_slots=((3, 0, 1), (2, 4)))
    adv_T = np.array([0.3, -0.9, 0.5, 0.6, -0.5])   # b=0.3, c=-0.9, d=0.5, a=0.6, e=-0.5
    assert math.isclose(strong_credit_share(records, info, adv_T), (0.6 + 0.5) / (0.6 + 0.3 + 0.5))
    assert math.isnan(strong_credit_share(records, info, -np.abs(adv_T)))

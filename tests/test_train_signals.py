"""SIGTERM (preemption) while training and while idle on a live spool: checkpoint, exit 0, resume."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

from trainer_runs import REPO, cmd, env, ledger_adds_up, run, start


def test_sigterm_checkpoints_and_exits_zero(tmp_path):
    """SIGTERM while training or while idle on a live spool: checkpoint, exit 0, resume."""
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(os.path.join(REPO, "data", "sample_feed.jsonl"), spool / "000-sample.jsonl")
    live = ["--config.feed.path=", f"--config.feed.spool_dir={spool}", "--config.feed.spool_poll_s=0.1",
            "--config.train.steps=100", "--config.train.checkpoint_every=0"]
    proc = start(tmp_path, *live)
    deadline = time.time() + 600
    metrics = os.path.join(tmp_path, "metrics.jsonl")
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["preempted"] and summary["steps"] >= 1
    steps = [int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()]
    assert max(steps) == summary["steps"], (steps, summary["steps"])
    ledger_adds_up(summary["ledger"])
    # Resume; the producer then closes the spool, and the run ends after the last batch.
    (spool / "_DONE").touch()
    resumed = run(tmp_path, *live)
    assert not resumed["preempted"] and resumed["steps"] >= summary["steps"]
    ledger_adds_up(resumed["ledger"])
    assert resumed["ledger"]["received"] == 96   # every sample group, counted exactly once


def test_sigterm_while_idle_on_spool_saves_the_last_step(tmp_path):
    """SIGTERM while the learner waits on a drained spool: exit 0, every trained step saved."""
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(os.path.join(REPO, "data", "sample_feed.jsonl"), spool / "000-sample.jsonl")
    out = open(tmp_path / "stdout.txt", "w")
    proc = subprocess.Popen(
        cmd(tmp_path, "--config.feed.path=", f"--config.feed.spool_dir={spool}",
             "--config.feed.spool_poll_s=0.1", "--config.feed.spool_log_every_s=0.2",
             "--config.feed.spool_settle_s=0",   # the shard is complete before the start
             "--config.train.steps=100", "--config.train.checkpoint_every=0"),
        cwd=REPO, env=env(), stdout=out, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while "waiting for the feed" not in open(tmp_path / "stdout.txt").read():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    out.close()
    assert proc.returncode == 0, err[-3000:]
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["preempted"] and summary["steps"] >= 2
    steps = [int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()]
    assert steps == [summary["steps"]], (steps, summary["steps"])
    ledger_adds_up(summary["ledger"])
    assert summary["ledger"]["received"] == 96

"""Stop signals on a live spool: Ctrl-C (SIGINT) while training, SIGTERM (preemption) while idle;
each checkpoints, writes the summary and exits (130 / 0), and the resumed run logs nothing twice.
One run pair: the first is stopped mid-training, the resumed one drains the spool and is stopped
while it waits for more, a partial batch buffered, which it must not train (a closed spool
ending a run: `test_reliability.py`). Both signals set one flag (`run/preemption.py`); a second
Ctrl-C is `test_preemption.py`."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

from support.trainer_runs import REPO, cmd, env, ledger_adds_up


def _signal_when(proc, ready, log, signum: int = signal.SIGTERM, code: int = 0) -> float:
    deadline = time.time() + 300
    while not ready():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    sent = time.time()
    proc.send_signal(signum)
    proc.wait(timeout=300)
    assert proc.returncode == code, log.read_text()[-3000:]
    return sent


def test_ctrl_c_while_training_then_sigterm_while_idle_checkpoint_and_resume(tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(os.path.join(REPO, "data", "sample_feed.jsonl"), spool / "000-sample.jsonl")
    live = [
        "--config.feed.path=",
        f"--config.feed.spool_dir={spool}",
        "--config.feed.spool_poll_s=0.1",
        "--config.feed.spool_log_every_s=0.2",
        "--config.feed.spool_settle_s=0",  # the shard is complete before the start
        "--config.train.steps=100",
        "--config.train.checkpoint_every=0",
    ]
    stderr = tmp_path / "stderr.txt"   # the feed logs there; stdout keeps the summary block

    def start():
        # A file, not a pipe: the idle run logs every 0.2 s and a pipe nobody reads fills up.
        with open(stderr, "w") as err:
            return subprocess.Popen(cmd(tmp_path, *live), cwd=REPO, env=env(),
                                    stdout=subprocess.DEVNULL, stderr=err)

    # 1. Ctrl-C while training: the first metrics line is out, most of the spool is not yet
    # trained. It checkpoints and writes the summary like SIGTERM, and exits 130.
    metrics = tmp_path / "metrics.jsonl"
    _signal_when(start(), lambda: metrics.exists() and metrics.stat().st_size > 0, stderr,
                 signal.SIGINT, 130)
    first = json.load(open(tmp_path / "summary.json"))
    assert first["preempted"] and first["signal"] == "SIGINT" and first["steps"] >= 1
    assert "KeyboardInterrupt" not in stderr.read_text()
    assert "Ctrl-C: checkpointing after the current step" in stderr.read_text()
    steps = [int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()]
    assert max(steps) == first["steps"], (steps, first["steps"])   # checkpoint_every=0: at SIGTERM
    ledger_adds_up(first["ledger"])

    # 2. Resumed, it trains the rest, then waits on the drained spool and is stopped there.
    sent = _signal_when(start(), lambda: "waiting for the feed" in stderr.read_text(), stderr)
    second = json.load(open(tmp_path / "summary.json"))
    assert second["preempted"] and second["signal"] == "SIGTERM"
    # the resume is quiet: none of orbax's INFO lines ("Missing metrics for step N", ...)
    assert not any(w in stderr.read_text() for w in ("Missing metrics", "orbax", "[process="))
    assert second["steps"] > first["steps"]
    steps = [int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()]
    assert sorted(steps) == [first["steps"], second["steps"]]   # each stop saved its last step
    ledger_adds_up(second["ledger"])
    assert second["ledger"]["received"] == 96   # every sample group, counted exactly once
    # SIGTERM while a batch was still filling (groups buffered, the spool idle) trains no
    # undersized batch: no step ran after the signal (the idle wait had logged every finished
    # step), and the batch's groups stay buffered in the checkpoint for the next run.
    lines = [json.loads(x) for x in open(metrics)]
    assert [m["step"] for m in lines] == list(range(1, second["steps"] + 1))
    # Nothing logged twice across the Ctrl-C: every trained group once in groups.jsonl.
    ids = [json.loads(x)["group_id"] for x in open(tmp_path / "groups.jsonl")]
    assert len(ids) == len(set(ids)) == second["ledger"]["trained"]
    assert max(m["time"] for m in lines) < sent, "a step was trained after SIGTERM"
    assert second["ledger"]["leftover"] > 0

"""The trainer under failure: exactly-once audit logs across a SIGKILL, timely metrics on an
idle spool, and fatal errors (full disk, read-only workdir, file-size limit) that stop the
background writers and exit at once, naming the failing path.

In-process runs of configs/tiny_cpu.py share one traced and compiled step; one CLI subprocess.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
from support.paths import REPO, TINY_CONFIG
from support.paths import load_tiny_config as tiny_config
from support.warm_steps import share_train_steps
from support.xla_flags import FAST_COMPILE, cpu_flags

from gagar_jax.feed import ledger as ledger_lib
from gagar_jax.run import metrics as metrics_lib
from gagar_jax.run import train

SAMPLE = os.path.join(REPO, "data", "sample_feed.jsonl")


@pytest.fixture(autouse=True)
def _one_step_program(monkeypatch):
    """The in-process runs here share one traced train step (support/warm_steps.py)."""
    share_train_steps(monkeypatch)


def _jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _non_daemon_threads():
    return {t for t in threading.enumerate() if not t.daemon and t.is_alive()}


def test_sigkill_between_checkpoints_neither_loses_nor_repeats_an_audit_line(tmp_path):
    cfg = tiny_config(train__steps=3, train__checkpoint_every=2, train__keep_checkpoints=10)
    train.run(cfg, str(tmp_path))
    metrics, groups = _jsonl(tmp_path / "metrics.jsonl"), _jsonl(tmp_path / "groups.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    saved = json.loads((tmp_path / "checkpoints" / "2" / "audit" / "metadata").read_text())
    lines2 = [m for m in metrics if m["step"] <= 2]
    assert saved["metrics.jsonl"] == {"segment": "", "length": sum(
        len(x) for x in open(tmp_path / "metrics.jsonl", "rb").readlines()[:2])}
    # SIGKILL after step 3 was logged (and a torn line), before checkpoint 3 committed.
    shutil.rmtree(tmp_path / "checkpoints" / "3")
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "ti')
    train.run(cfg, str(tmp_path))
    metrics2, groups2 = _jsonl(tmp_path / "metrics.jsonl"), _jsonl(tmp_path / "groups.jsonl")
    assert [m["step"] for m in metrics2] == [1, 2, 3]
    assert metrics2[:2] == lines2                       # the checkpointed lines, untouched
    drop = ("time", "perf/tokens_per_s")
    assert [{k: v for k, v in m.items() if k not in drop} for m in metrics2] == \
        [{k: v for k, v in m.items() if k not in drop} for m in metrics]
    assert groups2 == groups                            # every trained group exactly once
    assert len({g["group_id"] for g in groups2}) == len(groups2)


def test_idle_spool_shows_the_finished_step_while_data_keeps_the_overlap(tmp_path, monkeypatch):
    spool = tmp_path / "spool"
    spool.mkdir()
    records = [json.loads(x) for x in open(SAMPLE).read().splitlines()[:40]]
    # A grader that timed out: passes without quality (the documented fallback), first.
    mixed = next(r for r in records if len({t["outcome"] for t in r["trajectories"]}) > 1
                 and not any(t["outcome"] == "infra_error" for t in r["trajectories"]))
    mixed = {**mixed, "group_id": "no-quality", "policy_version": 0, "trajectories": [
        {k: v for k, v in t.items() if k != "quality"} for t in mixed["trajectories"]]}
    (spool / "0001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [mixed] + records))
    events = []
    make = train.make_train_step

    def make_recording(*a, **k):
        fn = make(*a, **k)
        count = [0]

        def step(state, batch):
            out = fn(state, batch)
            count[0] += 1
            events.append(("dispatch", count[0]))
            return out
        return step

    to_host = metrics_lib.to_host
    monkeypatch.setattr(train, "make_train_step", make_recording)
    monkeypatch.setattr(metrics_lib, "to_host",
                        lambda step, m: events.append(("read", step)) or to_host(step, m))
    idle = ledger_lib.LedgerEvents.idle
    seen_when_idle = []

    def on_idle(self):
        idle(self)      # drains the finished step, before any sleep
        dispatched = max([n for kind, n in events if kind == "dispatch"], default=0)
        if dispatched and not seen_when_idle:
            logged = [m["step"] for m in _jsonl(tmp_path / "w" / "metrics.jsonl")]
            seen_when_idle.append((dispatched, logged))
            (spool / "_DONE").touch()
    monkeypatch.setattr(ledger_lib.LedgerEvents, "idle", on_idle)
    cfg = tiny_config(feed__path="", feed__spool_dir=str(spool), feed__spool_poll_s=0.2,
               feed__spool_settle_s=0.0, train__steps=10, train__checkpoint_every=0)
    summary = train.run(cfg, str(tmp_path / "w"))
    # The shard ran dry while batch d + 1 was being gathered (it ends the run, with _DONE).
    [(d, logged)] = seen_when_idle
    assert summary["steps"] in (d, d + 1) and d >= 3
    # While data flowed, step n was read only after step n + 1 was dispatched.
    for n in range(1, d):
        assert events.index(("dispatch", n + 1)) < events.index(("read", n))
    # Idle: the last finished step was in metrics.jsonl already at the first idle poll (0 s,
    # well within 2 x spool_poll_s), without waiting for another batch.
    assert logged == list(range(1, d + 1))
    # The pass without quality trained with the grading fallback; its factor is null.
    row = next(g for g in _jsonl(tmp_path / "w" / "groups.jsonl") if g["group_id"] == "no-quality")
    assert row["fallback"] is True
    assert [t["factor"] for t in row["trajectories"] if t["outcome"] == "pass"] == \
        [None] * sum(t["outcome"] == "pass" for t in mixed["trajectories"])


def test_full_disk_is_reported_at_the_first_step_naming_the_file(tmp_path):
    os.symlink("/dev/full", tmp_path / "metrics.jsonl")
    before = _non_daemon_threads()
    t0 = time.monotonic()
    with pytest.raises(OSError) as info:
        train.run(tiny_config(train__steps=6, train__checkpoint_every=1), str(tmp_path))
    assert info.value.errno == errno.ENOSPC                  # the disk really was full
    assert info.value.filename == str(tmp_path / "metrics.jsonl")
    assert not (tmp_path / "checkpoints" / "3").exists()     # surfaced at once, not steps later
    assert _non_daemon_threads() <= before and time.monotonic() - t0 < 120


def test_read_only_workdir_stops_the_writers_and_fails_fast(tmp_path, monkeypatch):
    write = ledger_lib.Ledger.write
    calls, failed_at = [0], []

    def erofs_after_two(self, path):
        calls[0] += 1
        if calls[0] > 3:    # a checkpoint save is in flight by now (checkpoint_every=1)
            failed_at.append(time.monotonic())
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return write(self, path)
    monkeypatch.setattr(ledger_lib.Ledger, "write", erofs_after_two)
    before = _non_daemon_threads()
    with pytest.raises(OSError) as info:
        train.run(tiny_config(train__steps=6, train__checkpoint_every=1), str(tmp_path))
    assert info.value.errno == errno.EROFS and failed_at
    assert info.value.filename == str(tmp_path / "ledger.json")
    assert time.monotonic() - failed_at[0] < train.ABORT_TIMEOUT_S
    assert _non_daemon_threads() <= before                   # orbax's writer stopped


def test_cli_fatal_error_is_one_line_exit_1_and_no_libtpu_noise(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    # -O0 (FAST_COMPILE): the step is compiled for the few steps before the limit (xla_flags.py)
    env.update(XLA_FLAGS=cpu_flags(8, FAST_COMPILE), PYTHONPATH=REPO,
               JAX_COMPILATION_CACHE_DIR=os.environ["JAX_COMPILATION_CACHE_DIR"],
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    limit = 12_000      # groups.jsonl passes it within a few steps; nothing else does before
    args = ["gagar-train", "--workdir", str(tmp_path), "--config",
            TINY_CONFIG, "--config.train.steps=8",
            "--config.train.checkpoint_every=0"]
    # RLIMIT_FSIZE set inside the child (Python ignores SIGXFSZ, so writes fail with EFBIG).
    code = ("import resource, runpy, sys; "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
            f"sys.argv = {args!r}; runpy.run_module('gagar_jax.run.cli', run_name='__main__')")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip() and "step/s" not in x
             and "it/s" not in x]
    assert lines[-1].startswith("gagar-train: fatal: File too large: ")
    assert str(tmp_path / "groups.jsonl") in lines[-1]
    assert os.path.getsize(tmp_path / "groups.jsonl") <= limit  # the limit really was hit
    assert "Traceback" not in proc.stderr and "E0000" not in proc.stderr
    assert "INVALID_ARGUMENT" not in proc.stderr
    assert "Traceback" in (tmp_path / "fatal_error.txt").read_text()
    assert time.monotonic() - t0 < 240


def test_cpu_only_machines_never_probe_libtpu(monkeypatch):
    from gagar_jax.run import cli
    nodes = []
    monkeypatch.setattr(cli.glob, "glob", lambda pattern: [p for p in nodes
                                                           if p.startswith(pattern[:8])])
    env = {}
    cli._default_platform(env)
    assert env == {"JAX_PLATFORMS": "cpu"}            # no accelerator: CPU, libtpu untouched
    env = {"JAX_PLATFORMS": "tpu"}
    cli._default_platform(env)
    assert env == {"JAX_PLATFORMS": "tpu"}            # an explicit choice is kept
    nodes.append("/dev/accel0")
    env = {}
    cli._default_platform(env)
    assert env == {}                                  # a TPU VM: JAX picks the accelerator


def test_a_run_killed_before_its_first_checkpoint_reruns_without_repeating_a_line(tmp_path):
    """Issue 36 item 2, end to end: a run's audit lines with no checkpoint at all (killed
    before its first one) and a plain rerun: each step and group id once in the new files,
    the old ones in before_fresh_start-<t>/ (today: steps 1, 2, 1, 2 and every id twice)."""
    cfg = tiny_config(train__steps=2, train__checkpoint_every=0)
    train.run(cfg, str(tmp_path))
    shutil.rmtree(tmp_path / "checkpoints")          # as if killed before it was written
    first = _jsonl(tmp_path / "groups.jsonl")
    train.run(cfg, str(tmp_path))
    assert [m["step"] for m in _jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
    ids = [g["group_id"] for g in _jsonl(tmp_path / "groups.jsonl")]
    assert len(ids) == len(set(ids)) == len(first)
    [aside] = [d for d in os.listdir(tmp_path) if d.startswith("before_fresh_start-")]
    assert _jsonl(tmp_path / aside / "groups.jsonl") == first

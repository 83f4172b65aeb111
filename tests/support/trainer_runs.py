"""Running `gagar-train` in subprocesses for the trainer tests: one shared compilation cache, and
one uninterrupted reference run per test session, shared by the pytest-xdist workers."""
from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import time

from support.paths import REPO, TINY_CONFIG
from support.xla_flags import SUBPROCESS, cpu_flags

STEPS = 4
COMMON = [f"--config.train.steps={STEPS}", "--config.train.checkpoint_every=1",
          "--config.train.keep_checkpoints=10"]


def env(devices: int = 8, level: str = SUBPROCESS) -> dict:
    """The trainer subprocesses' environment: `level` is xla_flags.SUBPROCESS (-O1: fast steps,
    for the programs the cache serves to several runs) or FAST_COMPILE (-O0: for a program
    compiled for one short run, where the compile is most of the cost)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = cpu_flags(devices, level)   # fast compiles, fast steps (xla_flags.py)
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(REPO, ".cache", "jax")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    return env


def cmd(workdir, *extra) -> list:
    return [
        sys.executable,
        "-m",
        "gagar_jax.run.cli",
        "--config",
        TINY_CONFIG,
        "--workdir",
        str(workdir),
        *COMMON,
        *extra,
    ]


def output_path(workdir) -> str:
    """Where `run` keeps what the CLI printed (stderr, then stdout): beside the workdir."""
    return os.path.join(os.path.dirname(os.path.abspath(workdir)),
                        os.path.basename(os.path.abspath(workdir)) + ".cli_output.txt")


def run(workdir, *extra, devices: int = 8, level: str = SUBPROCESS, timeout: int = 600) -> dict:
    proc = subprocess.run(cmd(workdir, *extra), cwd=REPO, env=env(devices, level),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(output_path(workdir), "w") as f:
        f.write(proc.stderr + proc.stdout)
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)


def run_in_process(workdir, *extra) -> dict:
    """`run`'s command through the CLI's entry point in this process: no second interpreter,
    JAX start-up or exit (~3 s a run), for tests that check what the run did, not its process
    (exit on a signal, bit-identity with `run`'s: these processes compile at another XLA
    optimisation level, xla_flags.py). A fatal error is raised here instead of ending the
    process with exit 1; the workdir lock is released after the run."""
    import pytest

    from gagar_jax.run import cli, workdir_lock

    def raise_it(err, workdir):
        raise err

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "_fatal", raise_it)
        code = cli.main(["gagar-train", *cmd(workdir, *extra)[3:]])
    workdir_lock.release(str(workdir))
    assert code == 0, f"gagar-train exited {code}"
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)


def start(workdir, *extra) -> subprocess.Popen:
    return subprocess.Popen(cmd(workdir, *extra), cwd=REPO, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def wait_for_checkpoint(proc, workdir, step: int, timeout: float = 600) -> None:
    marker = os.path.join(workdir, "checkpoints", str(step), "commit_success.txt")
    meta = os.path.join(workdir, "checkpoints", str(step), "_CHECKPOINT_METADATA")
    deadline = time.time() + timeout
    while not (os.path.exists(marker) or os.path.exists(meta)):
        assert proc.poll() is None, f"trainer ended early: {proc.stderr.read()[-3000:]}"
        assert time.time() < deadline, "no checkpoint in time"
        time.sleep(0.2)


def ledger_adds_up(ledger: dict) -> None:
    parts = (ledger["trained"] + ledger["filtered_uniform"] + ledger["filtered_stale"]
             + ledger["quarantined"] + ledger["leftover"])
    assert ledger["received"] == parts, ledger
    assert ledger["trained"] == ledger["trained_recorded"]
    assert sum(ledger["quarantined_by_reason"].values()) == ledger["quarantined"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shared_reference(tmp_path_factory) -> tuple:
    """(workdir, summary) of the uninterrupted reference run, computed once per session: the
    first xdist worker to ask runs it under a file lock, the others wait and read it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent   # shared by every worker of this session
    workdir = root / "trainer_reference"
    with open(root / "trainer_reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (workdir / "summary.json").exists():
            workdir.mkdir(exist_ok=True)
            run(workdir)
    with open(workdir / "summary.json") as f:
        return workdir, json.load(f)

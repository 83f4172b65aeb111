"""The trainer end to end, through `gagar-train` subprocesses sharing one compilation cache.

One uninterrupted reference run; a SIGKILLed-and-resumed run and a SIGTERMed-and-resumed run must
end with bit-identical parameters; a run resumed from a corrupt latest checkpoint falls back to
the previous one; two CPU processes (4 devices each, gloo) match one process with 8 devices.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from gagar_jax import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4
COMMON = [f"--config.train.steps={STEPS}", "--config.train.checkpoint_every=1",
          "--config.train.keep_checkpoints=10"]


def _env(devices: int = 8) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(REPO, ".cache", "jax")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    return env


def _cmd(workdir, *extra) -> list:
    return [sys.executable, "-m", "gagar_jax.cli", "--config", os.path.join(REPO, "configs", "tiny_cpu.py"),
            "--workdir", str(workdir), *COMMON, *extra]


def _run(workdir, *extra, devices: int = 8, timeout: int = 600) -> dict:
    proc = subprocess.run(_cmd(workdir, *extra), cwd=REPO, env=_env(devices), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)


def _start(workdir, *extra) -> subprocess.Popen:
    return subprocess.Popen(_cmd(workdir, *extra), cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_checkpoint(proc, workdir, step: int, timeout: float = 600) -> None:
    marker = os.path.join(workdir, "checkpoints", str(step), "commit_success.txt")
    meta = os.path.join(workdir, "checkpoints", str(step), "_CHECKPOINT_METADATA")
    deadline = time.time() + timeout
    while not (os.path.exists(marker) or os.path.exists(meta)):
        assert proc.poll() is None, f"trainer ended early: {proc.stderr.read()[-3000:]}"
        assert time.time() < deadline, "no checkpoint in time"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("reference")
    return workdir, _run(workdir)


def _ledger_adds_up(ledger: dict) -> None:
    parts = (ledger["trained"] + ledger["filtered_uniform"] + ledger["filtered_stale"]
             + ledger["quarantined"] + ledger["leftover"])
    assert ledger["received"] == parts, ledger
    assert ledger["trained"] == ledger["trained_recorded"]
    assert sum(ledger["quarantined_by_reason"].values()) == ledger["quarantined"]


def test_end_to_end_on_sample_feed(reference):
    workdir, summary = reference
    assert summary["steps"] == STEPS and not summary["preempted"]
    _ledger_adds_up(summary["ledger"])
    assert summary["ledger"]["trained"] > 0
    lines = [json.loads(x) for x in open(workdir / "metrics.jsonl")]
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    assert all(m["mixed_groups"] >= 1 and m["lam_max"] <= 1.5 for m in lines)
    groups = [json.loads(x) for x in open(workdir / "groups.jsonl")]
    assert len(groups) == summary["ledger"]["trained"]
    # The audit log carries the conservation the advantage promises (uncapped groups).
    for g in groups:
        if g["mixed"] and not g["capped"]:
            adv = [t["advantage"] for t in g["trajectories"] if t["valid"]]
            assert abs(sum(adv)) < 1e-4
    assert os.path.isdir(workdir / "tensorboard")
    assert len(summary["params_sha256"]) == 64 and summary["params_l2"] > 0


def test_sigkill_then_resume_is_bit_identical(reference, tmp_path):
    _, ref = reference
    proc = _start(tmp_path)
    _wait_for_checkpoint(proc, tmp_path, 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    resumed = _run(tmp_path)
    assert resumed["steps"] == STEPS and resumed["steps_this_run"] < STEPS
    assert resumed["params_sha256"] == ref["params_sha256"]
    _ledger_adds_up(resumed["ledger"])
    assert resumed["ledger"]["received"] == ref["ledger"]["received"]
    assert resumed["ledger"]["trained"] == ref["ledger"]["trained"]


def test_sigterm_checkpoints_and_exits_zero(tmp_path):
    """SIGTERM while training or while idle on a live spool: checkpoint, exit 0, resume."""
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(os.path.join(REPO, "data", "sample_feed.jsonl"), spool / "000-sample.jsonl")
    live = ["--config.feed.path=", f"--config.feed.spool_dir={spool}", "--config.feed.spool_poll_s=0.1",
            "--config.train.steps=100", "--config.train.checkpoint_every=0"]
    proc = _start(tmp_path, *live)
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
    _ledger_adds_up(summary["ledger"])
    # Resume; the producer then closes the spool, and the run ends after the last batch.
    (spool / "_DONE").touch()
    resumed = _run(tmp_path, *live)
    assert not resumed["preempted"] and resumed["steps"] >= summary["steps"]
    _ledger_adds_up(resumed["ledger"])
    assert resumed["ledger"]["received"] == 96   # every sample group, counted exactly once


def test_sigterm_while_idle_on_spool_saves_the_last_step(tmp_path):
    """SIGTERM while the learner waits on a drained spool: exit 0, every trained step saved."""
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(os.path.join(REPO, "data", "sample_feed.jsonl"), spool / "000-sample.jsonl")
    out = open(tmp_path / "stdout.txt", "w")
    proc = subprocess.Popen(
        _cmd(tmp_path, "--config.feed.path=", f"--config.feed.spool_dir={spool}",
             "--config.feed.spool_poll_s=0.1", "--config.feed.spool_log_every_s=0.2",
             "--config.feed.spool_settle_s=0",   # the shard is complete before the start
             "--config.train.steps=100", "--config.train.checkpoint_every=0"),
        cwd=REPO, env=_env(), stdout=out, stderr=subprocess.PIPE, text=True)
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
    _ledger_adds_up(summary["ledger"])
    assert summary["ledger"]["received"] == 96


def test_corrupt_latest_checkpoint_falls_back(reference, tmp_path):
    ref_dir, ref = reference
    shutil.copytree(ref_dir / "checkpoints", tmp_path / "checkpoints")
    # Damage the newest step (array data truncated), and resume with one more step.
    latest = max(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
    state_dir = tmp_path / "checkpoints" / str(latest) / "state"
    for root, _, files in os.walk(state_dir):
        for name in files:
            path = os.path.join(root, name)
            if os.path.getsize(path) > 64:
                with open(path, "r+b") as f:
                    f.truncate(16)
    proc = subprocess.run(_cmd(tmp_path), cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "falling back" in proc.stderr
    summary = json.load(open(tmp_path / "summary.json"))
    # Resumed from latest-1 and re-ran the last step on the same feed position.
    assert summary["steps_this_run"] == 1
    assert summary["params_sha256"] == ref["params_sha256"]


def test_resume_on_fewer_devices(reference, tmp_path):
    """A checkpoint written on 8 devices resumes on 4 (different mesh) and trains on."""
    ref_dir, ref = reference
    shutil.copytree(ref_dir / "checkpoints", tmp_path / "checkpoints")
    for d in os.listdir(tmp_path / "checkpoints"):
        if d.isdigit() and int(d) > 2:
            shutil.rmtree(tmp_path / "checkpoints" / d)
    summary = _run(tmp_path, "--config.mesh.data=2", "--config.mesh.expert=2", devices=4)
    assert summary["steps"] == STEPS and summary["steps_this_run"] == STEPS - 2
    _ledger_adds_up(summary["ledger"])
    assert summary["ledger"]["trained"] == ref["ledger"]["trained"]
    # Same math on another partitioning: equal up to reduction order.
    assert abs(summary["params_l2"] - ref["params_l2"]) <= 1e-5 * ref["params_l2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(reference, tmp_path):
    _, ref = reference
    port = _free_port()
    procs = []
    for pid in range(2):
        cmd = _cmd(tmp_path, f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                   f"--process_id={pid}")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=_env(4), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["steps"] == STEPS
    _ledger_adds_up(summary["ledger"])
    # Bit-identical where gloo's reductions match XLA's in-process ones; else within 1e-6.
    if summary["params_sha256"] != ref["params_sha256"]:
        assert abs(summary["params_l2"] - ref["params_l2"]) <= 1e-6 * ref["params_l2"]


def test_cli_errors_are_one_line_exit_2(capsys, tmp_path):
    cfg = os.path.join(REPO, "configs", "tiny_cpu.py")
    cases = [
        (["--config", cfg, "--workdir", str(tmp_path), "--config.model.nope=1"], "model.nope"),
        (["--config", cfg, "--workdir", str(tmp_path), "--config.train.steps=abc"], "train.steps"),
        (["--config", str(tmp_path / "missing.py"), "--workdir", str(tmp_path)], "missing.py"),
        (["--config", cfg, "--workdir", str(tmp_path), "--bogus=1"], "bogus"),
        (["--config", cfg], "--workdir"),
        (["--config", cfg, "--workdir", str(tmp_path), "--config.feed.path=/no/such.jsonl"],
         "/no/such.jsonl"),
        (["--config", cfg, "--workdir", str(tmp_path), "--config.train.steps=0"], "train.steps"),
        (["--config", cfg, "--workdir", str(tmp_path), "--config.model.expert_backend=nope"],
         "model.expert_backend"),
        (["--config", cfg, "--workdir", str(tmp_path), "--config.train.stepz=3"],
         'unknown config key: train.stepz (did you mean "steps"'),
    ]
    for args, needle in cases:
        code = cli.main(["gagar-train", *args])
        err = capsys.readouterr().err.strip()
        assert code == 2, (args, err)
        assert len(err.splitlines()) == 1 and needle in err, (args, err)
        assert "Traceback" not in err and "\\" not in err, err   # plain text, no repr escapes


def test_cli_help_lists_usage_keys_and_docs(capsys):
    for flag in ("--help", "-h"):
        assert cli.main(["gagar-train", flag]) == 0
        out = capsys.readouterr().out
        assert "--workdir" in out and "--config.KEY=VALUE" in out
        assert "train.steps = " in out and "model.expert_backend = " in out   # every key
        assert "docs/" in out


def test_cli_overrides_reach_the_run(tmp_path, monkeypatch):
    seen = {}

    def fake_run(cfg, workdir):
        seen.update(steps=cfg.train.steps, path=cfg.feed.path, seed=cfg.seed, workdir=workdir)
        return None

    monkeypatch.setattr("gagar_jax.train.run", fake_run)
    code = cli.main(["gagar-train", "--config", os.path.join(REPO, "configs", "tiny_cpu.py"),
                     "--workdir", str(tmp_path), "--config.train.steps=7", "--config.seed=3",
                     "--config.feed.path=data/other.jsonl"])
    assert code == 0
    assert seen == {"steps": 7, "path": "data/other.jsonl", "seed": 3, "workdir": str(tmp_path)}


def test_init_from_hf_checkpoint(tmp_path):
    """`train.init_from`: a Qwen3-MoE directory becomes the (sharded) initial parameters."""
    import jax
    import numpy as np
    from flax import nnx

    from gagar_jax import hf, train
    from gagar_jax.config import ConfigError, load_config_file
    from gagar_jax.model import Transformer
    from gagar_jax.sharding import make_mesh
    from gagar_jax.train_step import StepConfig, split_model, init_train_state

    cfg = load_config_file(os.path.join(REPO, "configs", "tiny_cpu.py"))
    step_cfg = StepConfig.from_config(cfg)
    source = Transformer(step_cfg.model, rngs=nnx.Rngs(123))
    hf.save_pretrained(source, str(tmp_path / "hf"))
    mesh = make_mesh(cfg.mesh)
    state, _, shardings = init_train_state(step_cfg, mesh, jax.random.PRNGKey(0))
    params = train._load_hf_params(str(tmp_path / "hf"), step_cfg, state.params, shardings.params)
    want = split_model(source)[1]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 params, want)
    assert jax.tree.leaves(params)[0].sharding == jax.tree.leaves(shardings.params)[0]
    # A checkpoint of another shape is refused with a clear message.
    with cfg.unlocked():
        cfg.model.hidden_size = 32
        cfg.model.intermediate_size = 64
    other = StepConfig.from_config(cfg)
    hf.save_pretrained(Transformer(other.model, rngs=nnx.Rngs(1)), str(tmp_path / "other"))
    with pytest.raises(ConfigError, match="does not match"):
        train._load_hf_params(str(tmp_path / "other"), step_cfg, state.params, shardings.params)

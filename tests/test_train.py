"""The trainer end to end, through `gagar-train` subprocesses sharing one compilation cache.

One uninterrupted reference run (shared by the test files, `trainer_runs.shared_reference`); a
SIGKILLed-and-resumed run must end with bit-identical parameters; a run resumed from a corrupt
latest checkpoint falls back to the previous one. SIGTERM is in `test_train_signals.py`, other
meshes and process counts in `test_train_mesh.py`.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess

import pytest
from support.paths import TINY_CONFIG
from support.trainer_runs import (
    REPO,
    STEPS,
    cmd,
    env,
    ledger_adds_up,
    run,
    shared_reference,
    start,
    wait_for_checkpoint,
)

from gagar_jax.run import cli


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return shared_reference(tmp_path_factory)

def test_end_to_end_on_sample_feed(reference):
    workdir, summary = reference
    assert summary["steps"] == STEPS and not summary["preempted"]
    ledger_adds_up(summary["ledger"])
    assert summary["ledger"]["trained"] > 0
    lines = [json.loads(x) for x in open(workdir / "metrics.jsonl")]
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    assert all(m["mixed_groups"] >= 1 and m["lam_max"] <= 1.5 for m in lines)
    # The sample feed's versions never run ahead of the learner (feed.max_future_versions).
    assert all(m["feed/ahead_of_learner"] == 0 for m in lines)
    assert summary["ledger"]["ahead_of_learner"] == 0
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
    proc = start(tmp_path)
    wait_for_checkpoint(proc, tmp_path, 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    resumed = run(tmp_path)
    assert resumed["steps"] == STEPS and resumed["steps_this_run"] < STEPS
    assert resumed["params_sha256"] == ref["params_sha256"]
    ledger_adds_up(resumed["ledger"])
    assert resumed["ledger"]["received"] == ref["ledger"]["received"]
    assert resumed["ledger"]["trained"] == ref["ledger"]["trained"]


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
    proc = subprocess.run(cmd(tmp_path), cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "falling back" in proc.stderr
    summary = json.load(open(tmp_path / "summary.json"))
    # Resumed from latest-1 and re-ran the last step on the same feed position.
    assert summary["steps_this_run"] == 1
    assert summary["params_sha256"] == ref["params_sha256"]


def test_cli_errors_are_one_line_exit_2(capsys, tmp_path):
    cfg = TINY_CONFIG
    other = tmp_path / "other_model"        # a checkpoint's config.json alone is enough to refuse
    other.mkdir()
    (other / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "intermediate_size": 128, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6}))
    cases = [
        (["--config", cfg, "--workdir", str(tmp_path / "w"), f"--config.train.init_from={other}"],
         "train.init_from: checkpoint architecture does not match"),
        (["--config", cfg, "--workdir", str(tmp_path / "w"), "--config.train.micro_batches=3"],
         "train.micro_batches"),
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

    monkeypatch.setattr("gagar_jax.run.train.run", fake_run)
    code = cli.main(["gagar-train", "--config", TINY_CONFIG,
                     "--workdir", str(tmp_path), "--config.train.steps=7", "--config.seed=3",
                     "--config.feed.path=data/other.jsonl"])
    assert code == 0
    assert seen == {"steps": 7, "path": "data/other.jsonl", "seed": 3, "workdir": str(tmp_path)}


def test_init_from_hf_checkpoint(tmp_path):
    """`train.init_from`: a Qwen3-MoE directory becomes the (sharded) initial parameters."""
    import jax
    import numpy as np
    from flax import nnx

    from gagar_jax.config import ConfigError, load_config_file
    from gagar_jax.hf import api as hf
    from gagar_jax.model.transformer import Transformer
    from gagar_jax.run import train
    from gagar_jax.run.step import StepConfig, init_train_state, split_model
    from gagar_jax.sharding import make_mesh

    cfg = load_config_file(TINY_CONFIG)
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

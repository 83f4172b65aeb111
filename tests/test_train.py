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
    output_path,
    run,
    shared_reference,
    start,
    wait_for_checkpoint,
)

from gagar_jax.run import cli, resume, workdir_lock


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
    # The sample feed is scored by the initial policy (scripts/make_sample_feed.py
    # --rescore-config): step 1 is on-policy, as a real run's first step.
    assert lines[0]["approx_kl"] < 0.05 and abs(lines[0]["ppo_kl"]) < 0.05
    assert lines[0]["clip_frac_low"] + lines[0]["clip_frac_high"] < 0.05
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


def test_cli_output_is_short_and_ends_with_the_summary_block(reference):
    """Quiet by default: no orbax INFO lines, the progress bar is one line (carriage returns),
    and the run ends with the plain summary block (its numbers from summary.json)."""
    workdir, summary = reference
    out = open(output_path(workdir)).read()
    lines = out.splitlines()
    assert len(lines) <= 40, out
    assert not any(w in out for w in ("orbax", "Failed to get flag", "Traceback", "[process="))
    block = out[out.index("gagar-train: done:"):].splitlines()
    led = summary["ledger"]
    assert block[0] == f"gagar-train: done: {STEPS} steps ({STEPS} this run)"
    assert block[1].split()[:4] == ["groups", "received", f"{led['received']}:", "trained"]
    assert f"trained {led['trained']}, uniform {led['filtered_uniform']}" in block[1]
    assert f"quarantined {led['quarantined']} (dead-lettered {summary['dead_lettered']})" \
        in block[1] and block[1].endswith("ledger balanced")
    assert block[2] == (f"  tokens/s   {summary['tokens_per_s_steady']:,.0f} steady, "
                        f"{summary['tokens_per_s']:,.0f} with compilation "
                        f"({summary['wall_s']:.1f} s)")
    assert f"workdir    {workdir}" in out and f"{workdir}/metrics.jsonl" in out
    assert f"tensorboard --logdir {workdir}/tensorboard" in out
    assert "published  none (train.publish_every = 0)" in out
    assert block == lines[-len(block):]           # the block is the end of the output


def test_sigkill_then_resume_is_bit_identical(reference, tmp_path):
    _, ref = reference
    every2 = "--config.train.checkpoint_every=2"     # the saves it reads: step 2 (and the end)
    proc = start(tmp_path, every2)
    wait_for_checkpoint(proc, tmp_path, 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    resumed = run(tmp_path, every2)
    assert resumed["steps"] == STEPS and resumed["steps_this_run"] < STEPS
    assert resumed["params_sha256"] == ref["params_sha256"]
    ledger_adds_up(resumed["ledger"])
    assert resumed["ledger"]["received"] == ref["ledger"]["received"]
    assert resumed["ledger"]["trained"] == ref["ledger"]["trained"]


def _truncate_state(step_dir) -> None:
    """Damage a step: its array data files cut to 16 bytes (its metadata stays readable)."""
    for root, _, files in os.walk(step_dir / "state"):
        for name in files:
            path = os.path.join(root, name)
            if os.path.getsize(path) > 64:
                with open(path, "r+b") as f:
                    f.truncate(16)


def _tree(path) -> dict:
    return {os.path.relpath(os.path.join(r, f), path): os.stat(os.path.join(r, f)).st_mtime_ns
            for r, _, files in os.walk(path) for f in files}


def test_corrupt_latest_checkpoint_falls_back(reference, tmp_path, capsys):
    """A config of another train state on resume is refused (exit 2, keys named) and touches no
    checkpoint, not even a damaged one; the correct launch then falls back past the damage."""
    ref_dir, ref = reference
    shutil.copytree(ref_dir / "checkpoints", tmp_path / "checkpoints")
    # Damage the newest step (array data truncated), and resume with one more step.
    latest = max(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
    _truncate_state(tmp_path / "checkpoints" / str(latest))
    before = _tree(tmp_path / "checkpoints")
    base = ["gagar-train", "--config", os.path.join(REPO, "configs", "tiny_cpu.py"),
            "--workdir", str(tmp_path)]
    for flag, needle in (("--config.model.hidden_size=128", "model.hidden_size: 64 -> 128"),
                         ("--config.loss.kl_coef=0.1", "loss.kl_coef: 0.0 -> 0.1")):
        code = cli.main([*base, flag])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert code == 2 and needle in err and "checkpoints are untouched" in err, err
        assert _tree(tmp_path / "checkpoints") == before     # nothing renamed, moved or written
    workdir_lock.release(str(tmp_path))     # the in-process launches took the lock
    proc = subprocess.run(cmd(tmp_path), cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "falling back" in proc.stderr
    summary = json.load(open(tmp_path / "summary.json"))
    # Resumed from latest-1 and re-ran the last step on the same feed position.
    assert summary["steps_this_run"] == 1
    assert summary["params_sha256"] == ref["params_sha256"]


def test_no_readable_checkpoint_over_audit_lines_exits_1_until_start_fresh(reference, tmp_path):
    """Every checkpoint truncated while metrics/groups hold their steps' lines: exit 1 in one
    line naming the situation (not a silent start from step 0 that logs steps twice), and the
    next launch refuses too; `--start_fresh` then trains from step 0 (the reference's step 1
    again), the old audit files moved aside."""
    ref_dir, ref = reference
    for name in ("checkpoints", "metrics.jsonl", "groups.jsonl", "ledger.json"):
        copy = shutil.copytree if name == "checkpoints" else shutil.copy
        copy(ref_dir / name, tmp_path / name)
    for step in os.listdir(tmp_path / "checkpoints"):
        _truncate_state(tmp_path / "checkpoints" / step)
    old_metrics = (tmp_path / "metrics.jsonl").read_bytes()
    proc = subprocess.run(cmd(tmp_path), cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=600)
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and line.startswith(
        "gagar-train: fatal: ResumeRefused: no readable checkpoint"), proc.stderr[-2000:]
    assert "--start_fresh" in line and "metrics.jsonl and groups.jsonl" in line
    assert (tmp_path / "metrics.jsonl").read_bytes() == old_metrics
    assert not [d for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()]
    # The next launch finds no checkpoint, only the damaged steps: it refuses too.
    with pytest.raises(resume.ResumeRefused, match="unreadable steps moved aside: 1.corrupt-"):
        resume.guard_fresh_start(str(tmp_path), str(tmp_path / "checkpoints"),
                                 start_fresh=False)
    # One step is enough: it must be the reference's step 1 again, logged once.
    fresh = run(tmp_path, "--start_fresh", "--config.train.steps=1",
                "--config.train.checkpoint_every=0")
    assert fresh["steps"] == fresh["steps_this_run"] == 1
    [line] = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    want = json.loads(old_metrics.decode().splitlines()[0])
    assert {k: v for k, v in line.items() if not k.startswith(("time", "perf/"))} == {
        k: v for k, v in want.items() if not k.startswith(("time", "perf/"))}
    [aside] = [d for d in os.listdir(tmp_path) if d.startswith("before_fresh_start-")]
    assert (tmp_path / aside / "metrics.jsonl").read_bytes() == old_metrics
    assert sorted(os.listdir(tmp_path / aside / "checkpoints")) == sorted(
        d for d in os.listdir(tmp_path / aside / "checkpoints") if ".corrupt-" in d)


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
    syntax, raises = tmp_path / "syntax.py", tmp_path / "raises.py"
    syntax.write_text("import ml_collections\ndef get_config(:\n    pass\n")
    raises.write_text("def get_config():\n    return undefined\n")
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
        (["--config", str(syntax), "--workdir", str(tmp_path)],
         f"could not load config {syntax}: syntax error ({syntax}, line 2)"),
        (["--config", str(raises), "--workdir", str(tmp_path)],
         f"could not load config {raises} (line 2): NameError: name 'undefined' is not defined"),
        (["--config", cfg, "--workdir", str(tmp_path), "--config.feed.path="], "no feed source"),
        (["--config", cfg, "--workdir", str(tmp_path), "--config.feed.path=",
          f"--config.feed.spool_dir={tmp_path / 'spoool'}"],
         f"feed.spool_dir='{tmp_path / 'spoool'}' does not exist: create it first, or set "
         "feed.spool_create=true"),
        (["--config", cfg, "--workdir", str(tmp_path), f"--config.feed.spool_dir={tmp_path}"],
         "are both set; the feed reads one source"),
        (["--config", cfg, "--workdir", str(tmp_path), f"--config.train.reference_from={other}"],
         "is never read with loss.kl_coef=0.0"),
        (["--config", cfg, "--workdir", str(tmp_path), "--config.loss.rollout_rs_threshold=2.0",
          "--config.loss.recompute_old_logprobs=true"],
         "loss.rollout_rs_threshold='2.0' is set but loss.rollout_rs is not"),
        (["--config", cfg, "--workdir", str(tmp_path), "--config.loss.rollout_is_threshold=nan"],
         "loss.rollout_is_threshold=nan: not a finite number"),
        (["--config", cfg, "--workdir", str(tmp_path), "--config.optim.learning_rate=inf"],
         "optim.learning_rate=inf: not a finite number"),
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

    def fake_run(cfg, workdir, **kw):
        seen.update(steps=cfg.train.steps, path=cfg.feed.path, seed=cfg.seed, workdir=workdir,
                    **kw)
        return None

    monkeypatch.setattr("gagar_jax.run.train.run", fake_run)
    code = cli.main(["gagar-train", "--config", TINY_CONFIG,
                     "--workdir", str(tmp_path), "--config.train.steps=7", "--config.seed=3",
                     "--config.feed.path=data/other.jsonl", "--start_fresh"])
    assert code == 0
    assert seen == {"steps": 7, "path": "data/other.jsonl", "seed": 3, "workdir": str(tmp_path),
                    "start_fresh": True,
                    "explicit": {"train.steps", "seed", "feed.path"}}   # a recipe keeps them


def test_cli_from_another_directory_finds_the_default_feed_and_splits_layer_types(
        tmp_path, monkeypatch):
    """The README command from another cwd: the default relative feed.path resolves against the
    config file's repository; `--config.model.layer_types=full,sliding` is two layer types."""
    from gagar_jax.model.config import ModelConfig
    seen = {}
    monkeypatch.setattr("gagar_jax.run.train.run", lambda cfg, workdir, **kw: seen.update(
        path=cfg.feed.path, types=ModelConfig.from_config(cfg.model).layer_types))
    monkeypatch.chdir(tmp_path)
    code = cli.main(["gagar-train", "--config", os.path.join(REPO, "configs", "tiny_cpu.py"),
                     "--workdir", str(tmp_path / "w"), "--config.model.layer_types=full,sliding",
                     "--config.model.sliding_window=8"])
    assert code == 0
    assert seen == {"path": os.path.join(REPO, "data", "sample_feed.jsonl"),
                    "types": ("full", "sliding")}


def test_init_from_hf_checkpoint(tmp_path):
    """`train.init_from`: a Qwen3-MoE directory becomes the (sharded) initial parameters."""
    import jax
    import numpy as np
    from flax import nnx

    from gagar_jax.config import ConfigError, load_config_file
    from gagar_jax.hf import api as hf
    from gagar_jax.model.transformer import Transformer
    from gagar_jax.run import init_weights
    from gagar_jax.run.step import StepConfig, init_train_state, split_model
    from gagar_jax.sharding import make_mesh

    cfg = load_config_file(TINY_CONFIG)
    step_cfg = StepConfig.from_config(cfg)
    source = Transformer(step_cfg.model, rngs=nnx.Rngs(123))
    hf.save_pretrained(source, str(tmp_path / "hf"))
    mesh = make_mesh(cfg.mesh)
    state, _, shardings = init_train_state(step_cfg, mesh, jax.random.PRNGKey(0))
    params = init_weights.load_hf_params(str(tmp_path / "hf"), step_cfg, state.params,
                                         shardings.params)
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
        init_weights.load_hf_params(str(tmp_path / "other"), step_cfg, state.params,
                                    shardings.params)

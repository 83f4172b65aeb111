"""Start-up validation and outside weights: every cross-section rule fails before anything
compiles; a KL run started from `init_from` trains; a resume never reads `init_from`.

One in-process run pair of configs/tiny_cpu.py with kl_coef > 0 (one extra step compile), its
workdir in an in-memory object store (tests/support/objectstore.py).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
from support.paths import load_tiny_config as tiny_config
from support.warm_steps import share_train_steps

from gagar_jax.config import ConfigError
from gagar_jax.run import init_weights, train


def _hf_config(cfg, **changes) -> dict:
    """config.json of the configured tiny model (what `hf.save_pretrained` would write)."""
    from gagar_jax.hf.config_json import config_to_hf
    from gagar_jax.model.config import ModelConfig
    hf = config_to_hf(ModelConfig.from_config(cfg.model))
    hf.update(changes)
    return hf


def test_cross_section_rules_fail_before_compiling(tmp_path, monkeypatch):
    def compiled(*a, **k):
        raise AssertionError("compiled before validating")
    monkeypatch.setattr(train, "init_train_state", compiled)
    base = tiny_config()
    only_json = tmp_path / "ckpt"          # a config.json and no tensors: enough to refuse
    only_json.mkdir()
    (only_json / "config.json").write_text(json.dumps(_hf_config(base, hidden_size=32)))
    short = tmp_path / "short"
    short.mkdir()
    (short / "config.json").write_text(json.dumps(_hf_config(base, max_position_embeddings=64)))
    cases = [
        (dict(train__init_from=str(only_json)), "train.init_from: checkpoint architecture does "
         "not match the config's model section: checkpoint has hidden_size=32; config has "
         "hidden_size=64"),
        (dict(train__reference_from=str(tmp_path / "none"), loss__kl_coef=0.1),
         f"train.reference_from: no config.json in {tmp_path / 'none'}"),
        (dict(train__init_from=str(short)),
         "feed.max_traj_tokens=128 exceeds train.init_from's max_position_embeddings=64"),
        (dict(train__micro_batches=3), "feed.rows_per_batch=16 must divide by "
         "train.mini_batches * train.micro_batches = 1 * 3"),
        (dict(model__expert_backend="ep", model__num_experts=6, mesh__expert=4, mesh__data=-1),
         "model.expert_backend='ep': model.num_experts=6 must divide by mesh.expert=4"),
        (dict(model__expert_backend="ep", mesh__expert=2, feed__rows_per_batch=8,
              feed__seq_len=125, feed__max_traj_tokens=125),
         "model.expert_backend='ep': a micro-batch's 500 tokens"),
        (dict(mesh__expert=3), "mesh: mesh"),
    ]
    for i, (over, needle) in enumerate(cases):
        with pytest.raises(ConfigError) as info:
            train.run(tiny_config(**over), str(tmp_path / f"w{i}"))
        msg = str(info.value)
        assert needle in msg and "\n" not in msg, (over, msg)


def test_feed_source_rules(tmp_path):
    """One feed source; a missing local spool is an error unless feed.spool_create (an object
    store has no directories: never checked); a caller's own source needs neither key."""
    from gagar_jax.run.startup import check_run
    rc = train.RunConfig.from_config(tiny_config())
    missing = str(tmp_path / "spool")
    feed = lambda **kw: dataclasses.replace(rc.feed, **{"path": "", **kw})
    with pytest.raises(ConfigError, match="does not exist"):
        check_run(rc.step, feed(spool_dir=missing), rc.train)
    check_run(rc.step, feed(spool_dir=missing, spool_create=True), rc.train)
    check_run(rc.step, feed(spool_dir="gs://bucket/not-yet"), rc.train)
    check_run(rc.step, feed(), rc.train, source_given=True)
    with pytest.raises(ConfigError, match="no feed source"):
        check_run(rc.step, feed(), rc.train)
    with pytest.raises(ConfigError, match="relative paths resolve against the current directory"):
        check_run(rc.step, feed(path="no/such.jsonl"), rc.train)


def test_kl_run_from_init_from_in_a_bucket_workdir_trains_and_resumes_without_it(
        tmp_path, monkeypatch):
    """kl_coef > 0 with init_from trains (it used to donate one buffer twice); the resume
    restores the checkpoint and never reads init_from; checkpoint_every = 0 saves at the end
    only. The workdir is an object store (in-memory bucket: no append, no rename), so metrics,
    groups, ledger and summary go there, across the resume. The orbax checkpoint goes to local
    disk: its arrays are written by tensorstore, which speaks gs:// itself, not fsspec."""
    import jax
    import numpy as np
    from flax import nnx
    from support.objectstore import use_memory_bucket

    from gagar_jax.audit_file import read_lines
    from gagar_jax.hf import api as hf
    from gagar_jax.run.checkpoint import Checkpointer
    from gagar_jax.run.step import StepConfig, init_train_state
    from gagar_jax.sharding import make_mesh

    fs = use_memory_bucket(monkeypatch)
    monkeypatch.chdir(tmp_path)
    ckpt_dirs = []

    def local_checkpointer(directory, **kw):
        ckpt_dirs.append(directory)
        return Checkpointer(tmp_path / "checkpoints", **kw)
    monkeypatch.setattr(train, "Checkpointer", local_checkpointer)
    cfg = tiny_config(train__steps=1, train__checkpoint_every=0, loss__kl_coef=0.05,
               optim__warmup_steps=0)      # the first update moves the weights
    hf_dir = tmp_path / "hf"
    # Weights other than the run's own seed-0 init, made by the run's own jitted init (one
    # program for both: cheaper than an eager model build).
    init, graphdef, _ = init_train_state(StepConfig.from_config(cfg), make_mesh(cfg.mesh),
                                         jax.random.PRNGKey(7))
    hf.save_pretrained(nnx.merge(graphdef, init.params, init.router_bias), str(hf_dir))
    with cfg.unlocked():
        cfg.train.init_from = str(hf_dir)
    work = "gs://bucket/run"
    share_train_steps(monkeypatch)          # the resume reuses the first run's traced step
    summary = train.run(cfg, work)       # before: "attempt to donate the same buffer twice"
    assert summary["steps"] == 1 and np.isfinite(summary["final_loss"])

    # The resume restores step 1 and never touches init_from: gone, and any read would fail.
    shutil.rmtree(hf_dir)
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{corrupt")

    def touched(*a, **k):
        raise AssertionError("init_from read on resume")
    monkeypatch.setattr(init_weights, "load_hf_params", touched)
    monkeypatch.setattr(train, "check_hf_dir", touched)
    with cfg.unlocked():
        cfg.train.steps = 2
    resumed = train.run(cfg, work)
    assert resumed["steps"] == 2 and resumed["steps_this_run"] == 1
    assert ckpt_dirs == [f"{work}/checkpoints"] * 2
    # checkpoint_every = 0: each run saved at its end only.
    assert sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()) == [1, 2]
    metrics = [json.loads(x) for x in read_lines(f"{work}/metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2]          # across the resume, exactly once
    # Step 1's only update ran at the init_from weights, which the reference is: KL ~ 0. Step 2
    # ran at updated weights against the reference restored from the checkpoint: KL > 0.
    assert abs(metrics[0]["kl_loss"]) < 1e-6 and metrics[1]["kl_loss"] > 1e-7
    objects = fs.objects()
    assert json.loads(objects["bucket/run/summary.json"])["steps"] == 2
    ledger = json.loads(objects["bucket/run/ledger.json"])
    assert ledger["balanced"] and ledger["trained"] == resumed["ledger"]["trained"]
    assert len(read_lines(f"{work}/groups.jsonl")) == ledger["trained"]
    assert not os.path.exists(tmp_path / "gs:")             # nothing local named after the URI


def test_every_float_key_refuses_nan_and_inf_naming_the_key():
    """Issue 36 item 8: each of tiny_cpu's float keys (placeholders included), set to NaN, inf
    or -inf, is refused before anything compiles with a ConfigError naming that key; today
    they were accepted (a NaN rollout_is_threshold trained with every token masked)."""
    cfg = tiny_config()
    keys = [f"{sec}.{k}" for sec in cfg.keys() if hasattr(cfg[sec], "keys")
            for k in cfg[sec].keys() if cfg[sec].get_type(k) is float]
    assert len(keys) >= 25 and "loss.rollout_is_threshold" in keys
    train.RunConfig.from_config(cfg)        # finite values pass
    for key in keys:
        sec, name = key.split(".")
        for bad in (float("nan"), float("inf"), -float("inf")):
            c = tiny_config()
            c.unlock()
            c[sec][name] = bad
            with pytest.raises(ConfigError, match=rf"^{key}={bad}: not a finite number"):
                train.RunConfig.from_config(c)

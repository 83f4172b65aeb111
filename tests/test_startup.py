"""Start-up validation and outside weights: every cross-section rule fails before anything
compiles; a KL run started from `init_from` trains; a resume never reads `init_from`.

One in-process run pair of configs/tiny_cpu.py with kl_coef > 0 (one extra step compile).
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from gagar_jax import startup, train
from gagar_jax.config import ConfigError, load_config_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(REPO, "data", "sample_feed.jsonl")


def _cfg(**over):
    cfg = load_config_file(os.path.join(REPO, "configs", "tiny_cpu.py"))
    with cfg.unlocked():
        cfg.feed.path = SAMPLE
        for key, value in over.items():
            section, name = key.split("__")
            cfg[section][name] = value
    return cfg


def _hf_config(cfg, **changes) -> dict:
    """config.json of the configured tiny model (what `hf.save_pretrained` would write)."""
    from gagar_jax.hf_config import config_to_hf
    from gagar_jax.model import ModelConfig
    hf = config_to_hf(ModelConfig.from_config(cfg.model))
    hf.update(changes)
    return hf


def test_cross_section_rules_fail_before_compiling(tmp_path, monkeypatch):
    def compiled(*a, **k):
        raise AssertionError("compiled before validating")
    monkeypatch.setattr(train, "init_train_state", compiled)
    base = _cfg()
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
            train.run(_cfg(**over), str(tmp_path / f"w{i}"))
        msg = str(info.value)
        assert needle in msg and "\n" not in msg, (over, msg)


def test_kl_run_from_init_from_trains_and_a_resume_never_reads_it(tmp_path, monkeypatch):
    import numpy as np
    from flax import nnx

    from gagar_jax import hf
    from gagar_jax.model import ModelConfig, Transformer

    cfg = _cfg(train__steps=2, train__checkpoint_every=0, loss__kl_coef=0.05,
               optim__warmup_steps=0)      # the first update moves the weights
    hf_dir = tmp_path / "hf"
    hf.save_pretrained(Transformer(ModelConfig.from_config(cfg.model), rngs=nnx.Rngs(7)),
                       str(hf_dir))
    with cfg.unlocked():
        cfg.train.init_from = str(hf_dir)
    work = tmp_path / "w"
    summary = train.run(cfg, str(work))       # before: "donate the same buffer twice"
    assert summary["steps"] == 2 and np.isfinite(summary["final_loss"])
    metrics = [json.loads(x) for x in open(work / "metrics.jsonl")]
    # Step 1's only update runs at the init_from weights, which the reference is: KL ~ 0.
    # Step 2 runs at updated weights: the reference stayed behind.
    assert abs(metrics[0]["kl_loss"]) < 1e-6 and metrics[1]["kl_loss"] > 1e-7
    # checkpoint_every = 0: the end of the run saves, no step before it did.
    assert sorted(int(d) for d in os.listdir(work / "checkpoints") if d.isdigit()) == [2]

    # The resume restores step 2 and never touches init_from: gone, and any read would fail.
    shutil.rmtree(hf_dir)
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{corrupt")

    def touched(*a, **k):
        raise AssertionError("init_from read on resume")
    monkeypatch.setattr(train, "_load_hf_params", touched)
    monkeypatch.setattr(train, "check_hf_dir", touched)
    with cfg.unlocked():
        cfg.train.steps = 3
    resumed = train.run(cfg, str(work))
    assert resumed["steps"] == 3 and resumed["steps_this_run"] == 1
    assert resumed["ledger"]["balanced"]
    assert [json.loads(x)["step"] for x in open(work / "metrics.jsonl")] == [1, 2, 3]

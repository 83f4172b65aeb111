"""verl's recipes by name (`run/recipes.py`): each resolves to docs/loss.md's recipe table, read
from the doc itself; explicit keys win; verl's key names are aliases."""
from __future__ import annotations

import logging
import os
import re

import pytest
from support.paths import REPO, TINY_CONFIG

from gagar_jax.algo.loss import LossConfig
from gagar_jax.config import ConfigError, load_config_file
from gagar_jax.run import cli, recipes
from gagar_jax.run.train import RunConfig

COLUMNS = {"GRPO": "grpo", "DAPO": "dapo", "Dr. GRPO": "drgrpo", "GSPO": "gspo", "CISPO": "cispo"}


def _cell(text: str):
    """A table cell's value: its first word as a number / None / string; `...` = not set."""
    word = text.strip().split(" ")[0].strip("`,")
    if word in ("—", "the"):         # not set by the recipe ("the generation budget")
        return ...
    if word == "None":
        return None
    if word in ("True", "False"):
        return word == "True"
    try:
        return float(word)
    except ValueError:
        return word


def doc_table() -> dict:
    """{recipe: {key: value}} from docs/loss.md's "Recipes" table."""
    text = open(os.path.join(REPO, "docs", "loss.md")).read()
    section = text[text.index("## Recipes"):]
    lines = section.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    rows = []
    for ln in lines[start:]:                   # the first table only
        if not ln.startswith("|"):
            break
        rows.append(ln)
    header = [c.strip() for c in rows[0].strip("|").split("|")][1:]
    out = {COLUMNS[h]: {} for h in header}
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        keys = re.findall(r"`((?:loss|optim|train)\.\w+)`", cells[0].split("(")[0])
        for name, cell in zip(header, cells[1:], strict=True):
            recipe = COLUMNS[name]
            if cell.startswith("as "):                  # "as GRPO"
                values = [out[COLUMNS[cell[3:]]].get(k, ...) for k in keys]
            else:
                values = [_cell(v) for v in cell.split(", ")] if len(keys) > 1 else [_cell(cell)]
                values = values * len(keys) if len(values) == 1 else values   # "—" for both
            for k, v in zip(keys, values, strict=True):
                if v is not ...:
                    out[recipe][k] = v
    return out


@pytest.mark.parametrize("name", sorted(COLUMNS.values()))
def test_each_recipe_resolves_to_the_table_of_docs_loss_md(name, caplog):
    want = doc_table()[name]
    assert len(want) >= 9, want
    cfg = load_config_file(TINY_CONFIG)
    cfg.recipe = name
    with caplog.at_level(logging.INFO, logger="gagar_jax.run.recipes"):
        resolved = recipes.apply(cfg)
    assert {k: v for k, v in resolved.items() if k in want} == pytest.approx(want)
    assert set(resolved) == set(want)                  # the recipe sets what the table says
    assert caplog.records[-1].getMessage().startswith(f"recipe {name}: loss.policy_loss=")
    rc = RunConfig.from_config(cfg)                    # and the learner takes it as resolved
    assert rc.step.loss.policy_loss == want["loss.policy_loss"]
    assert rc.step.loss.clip_low == want["loss.clip_low"]
    assert rc.step.mini_batches == want["train.mini_batches"]


def test_explicit_keys_win_and_no_recipe_changes_nothing():
    cfg = load_config_file(TINY_CONFIG)
    before = cfg.to_dict()
    assert recipes.apply(cfg) == {} and cfg.to_dict() == before
    cfg.recipe = "dapo"
    cfg.loss.clip_high = 0.3
    resolved = recipes.apply(cfg, explicit={"loss.clip_high"})
    assert resolved["loss.clip_high"] == 0.3 and cfg.loss.clip_low == 0.2
    assert cfg.optim.weight_decay == 0.1 and cfg.train.mini_batches == 16
    cfg.recipe = "ppo2"
    with pytest.raises(ConfigError, match="recipe must be one of"):
        recipes.apply(cfg)


def test_verl_key_names_are_aliases():
    assert recipes.alias_overrides(["x", "--config.loss.clip_ratio_low=0.1",
                                    "--config.loss.loss_agg_mode=token-mean"]) == [
        "x", "--config.loss.clip_low=0.1", "--config.loss.aggregation=token-mean"]
    with pytest.raises(ConfigError, match="given under both its names"):
        recipes.alias_overrides(["--config.loss.clip_ratio_c=3", "--config.loss.dual_clip=4"])
    # a key repeated under one name is an ordinary override (the last wins)
    assert recipes.alias_overrides(["--config.train.steps=4", "--config.train.steps=1"]) == [
        "--config.train.steps=4", "--config.train.steps=1"]
    assert recipes.explicit_keys(["--config.loss.clip_ratio_high=0.3", "--workdir=w"]) == {
        "loss.clip_high"}
    # in a config's loss section (a file may use verl's names)
    cfg = LossConfig.from_config({"clip_ratio_low": 0.1, "clip_ratio_high": 0.3,
                                  "clip_ratio_c": 4.0, "loss_agg_mode": "seq-mean-token-mean"})
    assert (cfg.clip_low, cfg.clip_high, cfg.dual_clip, cfg.aggregation) == (
        0.1, 0.3, 4.0, "seq-mean-token-mean")
    with pytest.raises(ValueError, match="give one"):
        LossConfig.from_config({"clip_ratio_low": 0.1, "clip_low": 0.2})


def test_cli_recipe_with_an_explicit_override_and_a_verl_name(tmp_path, monkeypatch):
    seen = {}

    def fake_run(cfg, workdir, **kw):
        recipes.apply(cfg, kw["explicit"])       # what train.run does first
        seen.update(clip_low=cfg.loss.clip_low, clip_high=cfg.loss.clip_high,
                    agg=cfg.loss.aggregation, lr=cfg.optim.learning_rate)

    monkeypatch.setattr("gagar_jax.run.train.run", fake_run)
    assert cli.main(["gagar-train", "--config", TINY_CONFIG, "--workdir", str(tmp_path),
                     "--config.recipe=gspo", "--config.loss.clip_ratio_high=5e-4"]) == 0
    assert seen == {"clip_low": 3e-4, "clip_high": 5e-4, "agg": "seq-mean-token-mean",
                    "lr": 1e-6}

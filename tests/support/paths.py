"""The repository root and the embedded default config, for helpers and module-level constants.

Test functions take the `repo_root` and `tiny_config` fixtures (conftest.py) instead.
"""
from __future__ import annotations

import os

import ml_collections

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_CONFIG = os.path.join(REPO, "configs", "tiny_cpu.py")


def config_path(name: str) -> str:
    """configs/<name>.py."""
    return os.path.join(REPO, "configs", f"{name}.py")


def load_config(name: str) -> ml_collections.ConfigDict:
    """A fresh configs/<name>.py (as the CLI loads it)."""
    from gagar_jax.config import load_config_file
    return load_config_file(config_path(name))


def load_tiny_config(**over: object) -> ml_collections.ConfigDict:
    """A fresh configs/tiny_cpu.py with its feed path made absolute (runs from any directory);
    keyword `section__name=value` overrides (e.g. `train__steps=3`)."""
    from gagar_jax.config import load_config_file
    cfg = load_config_file(TINY_CONFIG)
    with cfg.unlocked():
        cfg.feed.path = os.path.join(REPO, "data", "sample_feed.jsonl")
        for key, value in over.items():
            section, name = key.split("__")
            cfg[section][name] = value
    return cfg

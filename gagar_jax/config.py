"""Config files (ConfigDict) in, frozen dataclasses out: the library edge.

This module does not import ml_collections itself (config files do): the model and the train
step import `section_dict` from here, and must run where only jax, flax, optax, chex, orbax,
numpy, etils and safetensors are installed (`scripts/bench_device.py`).

A config file is a Python module with `get_config() -> ml_collections.ConfigDict` (see
`configs/tiny_cpu.py`). The trainer locks it, applies command-line overrides, and converts each
section once into the frozen dataclass of the module that owns it.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ml_collections


# verl's key names (actor_rollout_ref.actor.*) accepted for the loss section's own keys.
VERL_LOSS_ALIASES = {"clip_ratio_low": "clip_low", "clip_ratio_high": "clip_high",
                     "clip_ratio_c": "dual_clip", "loss_agg_mode": "aggregation",
                     "norm_adv_by_std_in_grpo": "norm_adv_by_std"}


class ConfigError(ValueError):
    """A config file, key or value the user gave is wrong; the message names it."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The visible loop's own settings (`cfg.train`)."""

    steps: int                 # train steps; one step consumes one feed batch
    checkpoint_every: int      # orbax save interval in steps (0 = only at the end / on SIGTERM)
    keep_checkpoints: int      # keep the last K checkpoints
    publish_every: int         # publish HF weights every N steps (0 = never)
    publish_initial: bool      # with publish_every > 0: publish the initial policy as version 0
                               # before a fresh run's first step (rollout workers wait for it)
    keep_published: int        # keep the last K published weight sets
    publish_dtype: str         # dtype of published weights ("bfloat16" | "float32" | "float16")
    publish_full_every: int    # K: a full version every K publishes, deltas between (1 = no deltas)
    log_every: int             # metrics interval in steps
    init_from: str             # HF Qwen3-MoE / MiMo-V2-Flash directory to start from ("" = random);
                               # read on a fresh run only, never on a resume
    reference_from: str        # KL reference policy directory ("" = initial weights); fresh run
                               # only

    @classmethod
    def from_config(cls, c: ml_collections.ConfigDict) -> TrainConfig:
        out = cls(**{f.name: c[f.name] for f in dataclasses.fields(cls)})
        for name in ("steps", "keep_checkpoints", "keep_published", "log_every",
                     "publish_full_every"):
            if getattr(out, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(out, name)}")
        for name in ("checkpoint_every", "publish_every"):
            if getattr(out, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(out, name)}")
        if out.publish_dtype not in ("bfloat16", "float32", "float16"):
            raise ConfigError(f"train.publish_dtype must be bfloat16, float32 or float16, "
                              f"got {out.publish_dtype!r}")
        # init_from / reference_from are checked at start-up, on a fresh run only (a resume
        # never reads them): `startup.check_hf_dir`.
        return out


def load_config_file(path: str) -> ml_collections.ConfigDict:
    """Imports a config file and returns its locked `get_config()`."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    spec = importlib.util.spec_from_file_location("gagar_user_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path} has no get_config()")
    cfg = module.get_config()
    cfg.lock()
    return cfg


# Float keys whose documented meaning of inf is "off" (none today). Every other float key
# refuses NaN and inf (`check_finite`): a NaN threshold would train with every token masked,
# or fail only at the first checkpoint's JSON.
INF_MEANS_OFF: frozenset = frozenset()


def check_finite(cfg: Any, allow_inf: frozenset = INF_MEANS_OFF) -> None:
    """Refuses a NaN or inf anywhere in a config (one generic walk over every key, nested
    sections and tuples included).

    Args:
      cfg: a ConfigDict or a (nested) dict.
      allow_inf: dotted keys where inf documents "off" (NaN is refused everywhere).
    Raises:
      ConfigError naming the first key with a non-finite value.
    """
    def walk(key: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{key}.{k}" if key else str(k), v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{key}[{i}]", v)
        elif isinstance(value, float) and not math.isfinite(value):
            if math.isinf(value) and key in allow_inf:
                return
            raise ConfigError(f"{key}={value}: not a finite number (NaN and inf are refused; "
                              "see the key's comment for how to switch it off)")

    walk("", cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg))


def section_dict(section: ml_collections.ConfigDict | dict, cls: type, name: str) -> dict:
    """A config section (ConfigDict or dict) as a dict of `cls`'s fields.

    Raises:
      ConfigError naming the unknown keys (and the known ones) of section `name`.
    """
    d = dict(section.to_dict() if hasattr(section, "to_dict") else section)
    known = sorted(f.name for f in dataclasses.fields(cls))
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ConfigError(f"unknown keys in the {name} config section: {unknown}; known: {known}")
    return d

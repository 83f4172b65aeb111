"""verl's recipes by name, and verl's key names as aliases of this learner's.

    changed = apply(cfg, explicit={"loss.clip_high"})   # cfg.recipe = "dapo": its keys set
    argv = alias_overrides(argv)   # --config.loss.clip_ratio_low=X -> --config.loss.clip_low=X

A top-level `recipe = grpo | dapo | drgrpo | gspo | cispo` sets the keys of `docs/loss.md`'s
recipe table at once, in whatever section they live (`loss`, `optim`, `train`); the keys the
user gave explicitly (command-line overrides; `explicit` from Python) keep their values. The
recipe overrides the config file's own values of those keys: a file that wants another value
for one of them names it on the command line, or leaves `recipe` empty. `""` (the default)
changes nothing. The resolved values are logged, and the saved config holds them (a resume
compares resolved values).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gagar_jax.config import VERL_LOSS_ALIASES, ConfigError

log = logging.getLogger(__name__)

# docs/loss.md, "Recipes": verl's example scripts for each method; "—" cells are not set.
RECIPES: Mapping[str, Mapping[str, Any]] = {
    "grpo": {"loss.policy_loss": "ppo", "loss.clip_low": 0.2, "loss.clip_high": 0.2,
             "loss.dual_clip": 3.0, "loss.aggregation": "token-mean", "loss.kl_coef": 0.001,
             "loss.kl_estimator": "k3", "loss.entropy_coef": 0.0, "train.mini_batches": 4,
             "optim.learning_rate": 1e-6, "loss.norm_adv_by_std": True},
    "dapo": {"loss.policy_loss": "ppo", "loss.clip_low": 0.2, "loss.clip_high": 0.28,
             "loss.dual_clip": 10.0, "loss.aggregation": "token-mean", "loss.kl_coef": 0.0,
             "loss.entropy_coef": 0.0, "train.mini_batches": 16, "optim.learning_rate": 1e-6,
             "optim.weight_decay": 0.1, "optim.grad_clip_norm": 1.0},
    "drgrpo": {"loss.policy_loss": "ppo", "loss.clip_low": 0.2, "loss.clip_high": 0.2,
               "loss.dual_clip": 3.0, "loss.aggregation": "seq-mean-token-sum-norm",
               "loss.kl_coef": 0.0, "loss.entropy_coef": 0.0, "train.mini_batches": 4,
               "optim.learning_rate": 1e-6, "loss.norm_adv_by_std": False},
    "gspo": {"loss.policy_loss": "gspo", "loss.clip_low": 3e-4, "loss.clip_high": 4e-4,
             "loss.dual_clip": None, "loss.aggregation": "seq-mean-token-mean",
             "loss.kl_coef": 0.0, "loss.entropy_coef": 0.0, "train.mini_batches": 4,
             "optim.learning_rate": 1e-6, "optim.weight_decay": 0.1,
             "optim.grad_clip_norm": 1.0},
    "cispo": {"loss.policy_loss": "cispo", "loss.clip_low": 10.0, "loss.clip_high": 0.2,
              "loss.dual_clip": None, "loss.aggregation": "token-mean", "loss.kl_coef": 0.001,
              "loss.kl_estimator": "k3", "loss.entropy_coef": 0.0, "train.mini_batches": 2,
              "optim.learning_rate": 1e-6},
}
# verl's names (actor_rollout_ref.actor.*) -> this learner's keys (the loss section's table).
ALIASES: Mapping[str, str] = {f"loss.{verl}": f"loss.{ours}" for verl, ours in
                              VERL_LOSS_ALIASES.items()}


def alias_overrides(argv: Sequence[str]) -> list:
    """`--config.loss.clip_ratio_low=X` (verl's name) -> `--config.loss.clip_low=X`; the rest
    unchanged (a key repeated under one name: the last wins, as always). One key under both
    names is an error."""
    out, spelled = [], {}       # our key -> {the names it was given under: the argument}
    for arg in argv:
        name, eq, value = arg.partition("=")
        key = name[len("--config."):] if name.startswith("--config.") else None
        if key is not None:
            ours = ALIASES.get(key, key)
            spelled.setdefault(ours, {})[key] = arg
            if len(spelled[ours]) > 1:
                first, second = spelled[ours].values()
                raise ConfigError(f"{ours} is given under both its names (verl's and ours): "
                                  f"{first} and {second}")
            arg = f"--config.{ours}{eq}{value}"
        out.append(arg)
    return out


def explicit_keys(argv: Iterable[str]) -> set:
    """The config keys a command line sets (`--config.KEY=VALUE`, aliases resolved)."""
    return {a.partition("=")[0][len("--config."):] for a in alias_overrides(list(argv))
            if a.startswith("--config.")}


def _set(cfg: Any, key: str, value: Any) -> None:
    section, _, name = key.rpartition(".")
    node = cfg
    for part in section.split(".") if section else ():
        node = node[part]
    node[name] = value


def _get(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def apply(cfg: Any, explicit: Iterable[str] = ()) -> dict:
    """Sets the keys of `cfg.recipe`'s row (docs/loss.md), except the `explicit` ones.

    Args:
      cfg: the ConfigDict (locked is fine: only existing keys are set).
      explicit: keys the user set themselves (they keep their values).
    Returns:
      {key: value} of every key of the recipe, as resolved (also logged); {} without a recipe.
    Raises:
      ConfigError: an unknown recipe name.
    """
    name = str(cfg.get("recipe", "") or "") if hasattr(cfg, "get") else ""
    if not name:
        return {}
    if name not in RECIPES:
        raise ConfigError(f"recipe must be one of {sorted(RECIPES)} (or empty), got {name!r}")
    keep = set(explicit)
    resolved = {}
    for key, value in RECIPES[name].items():
        if key not in keep:
            try:
                _set(cfg, key, value)
            except (TypeError, KeyError, AttributeError) as e:   # ConfigDict type checks
                raise ConfigError(f"recipe {name}: cannot set {key}={value!r}: {e}") from e
        resolved[key] = _get(cfg, key)
    log.info("recipe %s: %s", name, ", ".join(
        f"{k}={v!r}" + (" (explicit)" if k in keep else "") for k, v in resolved.items()))
    return resolved

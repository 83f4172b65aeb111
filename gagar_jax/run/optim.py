"""AdamW with warmup + cosine/constant schedule, global-norm clipping, masked weight decay.

Parameters and optimizer state stay in float32 (the master copy); the model casts to its
`compute_dtype` (e.g. bfloat16) at compute time, so bf16 compute needs nothing here.
The schedule counts optimizer updates (epochs x mini_batches per train step), not train steps.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import optax

from gagar_jax.config import section_dict
from gagar_jax.sharding import leaf_path

if TYPE_CHECKING:
    import ml_collections

PyTree = Any

SCHEDULES = ("cosine", "constant")
# Parameters whose path contains one of these names are never weight-decayed.
_NO_DECAY_NAMES = ("norm", "bias", "scale")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimizer settings (the `optim` section of a config).

    Attributes:
      learning_rate: peak learning rate.
      warmup_steps: linear warm-up over this many optimizer updates, the first at
        learning_rate / warmup_steps (`make_schedule`).
      schedule: cosine (decay to min_lr_ratio * peak at decay_steps) | constant.
      decay_steps: total updates of the cosine schedule, warmup included.
      min_lr_ratio: final learning rate as a fraction of the peak (cosine only).
      b1, b2, eps: Adam moments.
      weight_decay: decoupled weight decay on matrices only (never norms, biases or vectors).
      grad_clip_norm: global-norm clipping threshold; 0 = off.
    """
    learning_rate: float = 1e-6
    warmup_steps: int = 0
    schedule: str = "constant"
    decay_steps: int = 1000
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip_norm: float = 1.0

    def __post_init__(self):
        if self.learning_rate < 0:
            raise ValueError(f"optim.learning_rate must be >= 0, got {self.learning_rate}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.schedule == "cosine" and self.decay_steps <= self.warmup_steps:
            raise ValueError(
                f"optim.decay_steps ({self.decay_steps}) must exceed optim.warmup_steps "
                f"({self.warmup_steps}) for the cosine schedule"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0 or self.grad_clip_norm < 0:
            raise ValueError("optim.weight_decay and optim.grad_clip_norm must be >= 0")

    @classmethod
    def from_config(cls, section: ml_collections.ConfigDict | dict) -> OptimConfig:
        """Builds the frozen config from a ConfigDict (or dict) `optim` section."""
        return cls(**section_dict(section, cls, "optim"))


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Learning rate as a function of the optimizer update count (0 = the first update).

    Warm-up over W = `warmup_steps` updates is linear and starts at update 0 with step 1's value:
    update c < W runs at peak * (c + 1) / W (the first update moves the weights; a warm-up
    from 0 would waste it), update W - 1 at the peak. After the warm-up: constant, or the cosine
    from the peak at update W to `min_lr_ratio` * peak at `decay_steps`.
    """
    peak, w = cfg.learning_rate, cfg.warmup_steps
    if cfg.schedule == "constant":
        after = optax.constant_schedule(peak)
    else:
        after = optax.cosine_decay_schedule(peak, cfg.decay_steps - w, alpha=cfg.min_lr_ratio)
    if w == 0:
        return after
    warmup = optax.linear_schedule(peak / w, peak, w - 1) if w > 1 else (
        optax.constant_schedule(peak))
    return optax.join_schedules([warmup, after], [w])


def decay_mask(params: PyTree) -> PyTree:
    """True for leaves that get weight decay: rank >= 2 and no norm/bias/scale in the path."""
    def decide(path: tuple, leaf: jax.Array):
        name = leaf_path(path).lower()
        return leaf.ndim >= 2 and not any(n in name for n in _NO_DECAY_NAMES)
    return jax.tree_util.tree_map_with_path(decide, params)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW with the schedule and the decay mask."""
    parts = []
    if cfg.grad_clip_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip_norm))
    parts.append(optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=decay_mask))
    return optax.chain(*parts)

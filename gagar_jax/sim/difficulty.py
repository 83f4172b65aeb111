"""Adaptive difficulty for long runs: a flaky test runner that keeps groups mixed.

Round three's sim solved its task in about ten steps: groups went all-pass, the advantages of
every arm went to zero, and with them the net credit whose effect the study measures. Round
four's B-long keeps groups mixed for its whole length with a *flaky runner*: each passing
rollout of a training batch is reported as a failure with probability q (the grader then sees
a failure: no tier, no rank, and the group's other passes are ranked among themselves), and q
follows the policy's true pass rate so that the reported pass rate stays near a target:

    q_t = max(0, 1 - target / p_hat),   p_hat = EMA of the true pass rate of batches before t

What the policy can learn is unchanged (a flake does not depend on what it wrote); what changes
is that every group keeps both passes and failures, so downweight-only keeps its net-negative
credit, about -(1 - f_bar) p (1 - p) per trajectory, as long as the run lasts. Held-out
evaluation never flakes: it measures the true pass rate.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Optional

import numpy as np

from gagar_jax.sim import task as task_lib


@dataclasses.dataclass
class FlakyRunner:
    """The flake-probability controller (module docstring).

    Attributes:
      target: the reported pass rate it aims for (0.5 maximises p (1 - p): the most mixed groups).
      smoothing: weight of the newest batch in the EMA of the true pass rate.
      estimate: the EMA (None before the first batch: q = 0).
    """
    target: float = 0.5
    smoothing: float = 0.5
    estimate: Optional[float] = None

    def __post_init__(self):
        if not 0.0 < self.target < 1.0:
            raise ValueError(f"target must lie in (0, 1), got {self.target}")
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"smoothing must lie in (0, 1], got {self.smoothing}")

    def prob(self) -> float:
        """The flake probability for the next batch."""
        if self.estimate is None or self.estimate <= self.target:
            return 0.0
        return 1.0 - self.target / self.estimate

    def update(self, true_pass_rate: float) -> None:
        """Folds one batch's true (unflaked) pass rate into the estimate."""
        if self.estimate is None:
            self.estimate = float(true_pass_rate)
        else:
            self.estimate += self.smoothing * (float(true_pass_rate) - self.estimate)


def flake(episodes: Sequence[task_lib.Episode], prob: float, seed: int) -> np.ndarray:
    """Reports each passing episode as failed with probability `prob`, in place.

    Args:
      episodes: finished episodes (before grading). prob: the flake probability.
      seed: the draws' seed (one uniform per episode, so the same seed flakes the same slots).
    Returns:
      bool[len(episodes)]: which episodes were flaked (their outcome is now "fail").
    """
    if not 0.0 <= prob <= 1.0:
        raise ValueError(f"flake prob must lie in [0, 1], got {prob}")
    u = np.random.default_rng(seed).random(len(episodes))
    flaked = np.array([ep.outcome == "pass" for ep in episodes], bool) & (u < prob)
    for ep, f in zip(episodes, flaked, strict=True):
        if f:
            ep.outcome = "fail"
    return flaked

"""Per-token aggregation weights: each mini-batch's loss is sum_t w_t * loss_t.

Shared by the objectives (`policy_loss.py`) and the loss glue (`loss.py`), so the pure functions
and the train step aggregate the same way (see docs/loss.md, "Aggregation modes").
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def aggregation_weights(mask_BxS: jax.Array, traj_index_BxS: jax.Array, num_trajectories: int,
                        cfg: Any, mini_batches: int = 1,
                        aggregation: str | None = None) -> jax.Array:
    """Per-token weights w such that each mini-batch's loss is sum_t w_t * loss_t.

    Denominators are global over a mini-batch (row b in mini-batch b % mini_batches).
      token-mean:              1 / (trained tokens in the mini-batch)
      seq-mean-token-mean:     1 / (n_i * N)   n_i tokens of trajectory i, N trajectories
      seq-mean-token-sum:      1 / N
      seq-mean-token-sum-norm: 1 / (N * max_response_len)   (Dr. GRPO's constant normalizer)
    N counts trajectories with at least one trained token in the mini-batch.

    Args:
      mask_BxS: 1 on trained tokens.
      traj_index_BxS: global trajectory index of every position.
      num_trajectories: T (static).
      cfg: anything with `aggregation` and `max_response_len` (a LossConfig).
      mini_batches: rows are split b % mini_batches.
      aggregation: overrides `cfg.aggregation` (GSPO's policy term is always seq-mean-token-mean).
    Returns:
      weights [B, S].
    """
    agg = cfg.aggregation if aggregation is None else aggregation
    n_T = jax.ops.segment_sum(mask_BxS.reshape(-1), traj_index_BxS.reshape(-1),
                              num_segments=num_trajectories)
    inv_n_BxS = mask_BxS / jnp.maximum(n_T[traj_index_BxS], 1.0)

    mini_B = jnp.arange(mask_BxS.shape[0]) % mini_batches  # the mini-batch of each row

    def per_mini(x_BxS: jax.Array) -> jax.Array:  # mini-batch totals broadcast back to [B, S]
        tot_M = jax.ops.segment_sum(x_BxS.sum(axis=1), mini_B, num_segments=mini_batches)
        return tot_M[mini_B][:, None]

    tokens = per_mini(mask_BxS)
    # Each trajectory's 1/n_i sums to exactly 1 over its tokens; round away float error.
    n_traj = jnp.round(per_mini(inv_n_BxS))
    safe = lambda d: jnp.where(d > 0, d, 1.0)  # empty mini-batch: weights stay 0
    if agg == "token-mean":
        return mask_BxS / safe(tokens)
    if agg == "seq-mean-token-mean":
        return inv_n_BxS / safe(n_traj)
    if agg == "seq-mean-token-sum":
        return mask_BxS / safe(n_traj)
    if agg == "seq-mean-token-sum-norm":
        return mask_BxS / (safe(n_traj) * cfg.max_response_len)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {agg!r}")


def rows_as_sequences(mask_BxS: jax.Array, traj_index_BxS: jax.Array | None = None,
                      num_trajectories: int | None = None) -> tuple[jax.Array, int]:
    """(traj_index_BxS, T): the given packing, or one sequence per row (verl's layout)."""
    if traj_index_BxS is None:
        B, S = mask_BxS.shape
        return jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, S)), B
    if num_trajectories is None:
        raise ValueError("num_trajectories must be given with traj_index_BxS")
    return traj_index_BxS, int(num_trajectories)

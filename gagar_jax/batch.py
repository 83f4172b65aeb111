"""The packed batch the learner consumes: one feed batch, fixed shapes.

Shape letters (used across the package): B batch rows, S sequence length, T trajectories,
G groups, L MoE layers, K top-k, E experts, D model width, F expert width, V vocabulary, H heads;
M mini-batches (optimizer updates per epoch), U micro-batches (gradient-accumulation chunks).

Token arrays are packed: a row holds several trajectories (segments) back to back.
Conventions every module relies on:
  * `segment_ids_BxS`: 1, 2, ... per trajectory within a row; 0 = padding. Attention never
    crosses a segment.
  * `positions_BxS`: restart at 0 at the start of every segment.
  * `traj_index_BxS`: index of the token's trajectory in the per-trajectory arrays ([0, T));
    padding tokens carry 0 and are masked by `loss_mask_BxS`.
  * `loss_mask_BxS`: 1 on model-generated tokens (the only trained ones), 0 on prompt,
    tool-output and padding tokens. The first token of a segment is never generated.
  * `old_logprobs_BxS[b, t]`: behavior-policy log p(tokens[b, t] | tokens[b, <t]) -- the
    log-prob *of* token t (predicted at t - 1); 0 where not generated.
  * `routed_experts_BxSxLxK`: optional routing replay; the experts the rollout engine used when
    token t was the input at MoE layer l; -1 = no record, the learner's router selects.
Per-trajectory arrays are padded to a static T (padding: valid = False); per-group arrays to a
static G (padding groups have no valid member and are inert).
"""
from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Batch:
    # Packed token arrays [B, S].
    tokens_BxS: jax.Array          # int32
    segment_ids_BxS: jax.Array     # int32, 0 = padding
    positions_BxS: jax.Array       # int32
    traj_index_BxS: jax.Array      # int32 in [0, T)
    loss_mask_BxS: jax.Array       # float32 0/1
    old_logprobs_BxS: jax.Array    # float32
    # Per trajectory [T].
    group_ids_T: jax.Array         # int32 in [0, G)
    rewards_T: jax.Array           # float32 0/1 (binary test outcome; infra errors -> 0, invalid)
    valid_T: jax.Array             # bool
    hacked_T: jax.Array            # bool
    factors_T: jax.Array           # float32, read for passes only
    adjustments_T: jax.Array       # float32, additive reward adjustments (rule 9)
    # Per group [G].
    grading_ok_G: jax.Array        # bool
    # Optional routing replay [B, S, L, K] (int32, -1 = none).
    routed_experts_BxSxLxK: Optional[jax.Array] = None

    @property
    def num_groups(self) -> int:
        return self.grading_ok_G.shape[0]

    @property
    def num_trajectories(self) -> int:
        return self.group_ids_T.shape[0]


def dummy_batch(
    B: int, S: int, T: int, G: int, *, num_moe_layers: int = 0, top_k: int = 0
) -> Batch:
    """An all-padding batch with the given static shapes (for eval_shape / AOT / warm-up)."""
    z = lambda shape, dt: jnp.zeros(shape, dt)
    routed = None
    if num_moe_layers and top_k:
        routed = jnp.full((B, S, num_moe_layers, top_k), -1, jnp.int32)
    return Batch(
        tokens_BxS=z((B, S), jnp.int32), segment_ids_BxS=z((B, S), jnp.int32),
        positions_BxS=z((B, S), jnp.int32), traj_index_BxS=z((B, S), jnp.int32),
        loss_mask_BxS=z((B, S), jnp.float32), old_logprobs_BxS=z((B, S), jnp.float32),
        group_ids_T=z((T,), jnp.int32), rewards_T=z((T,), jnp.float32),
        valid_T=z((T,), jnp.bool_), hacked_T=z((T,), jnp.bool_),
        factors_T=jnp.ones((T,), jnp.float32), adjustments_T=z((T,), jnp.float32),
        grading_ok_G=z((G,), jnp.bool_), routed_experts_BxSxLxK=routed,
    )


@flax.struct.dataclass
class BucketedBatch:
    """One step's batch in length buckets (`feed/buckets.py`): `buckets[k]` is a `Batch` of
    U_k x r rows of the k-th row length. Every bucket carries the step's whole per-trajectory
    and per-group arrays (the same in each); a trajectory lives in exactly one bucket's rows."""

    buckets: tuple

    @property
    def num_groups(self) -> int:
        return self.buckets[0].num_groups

    @property
    def num_trajectories(self) -> int:
        return self.buckets[0].num_trajectories


def dummy_bucketed_batch(shapes: tuple, T: int, G: int, *, num_moe_layers: int = 0,
                         top_k: int = 0) -> BucketedBatch:
    """An all-padding `BucketedBatch` of buckets with (rows, row length) `shapes`."""
    return BucketedBatch(buckets=tuple(dummy_batch(b, s, T, G, num_moe_layers=num_moe_layers,
                                                   top_k=top_k) for b, s in shapes))

"""Argument checks shared by every attention path (plain, blockwise, splash, splash per shard).

One place for the shape contract, so the paths cannot drift apart: \
q [B, S, H, Dh], k [B, K, Kv, Dh],
v [B, K, Kv, Dv] with H a multiple of Kv; K = S unless the keys carry segment ids of their own
(a context shard's queries against gathered keys). Window rules differ per path and stay there.
"""
from __future__ import annotations

import jax


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids_BxS: jax.Array, *,
              sinks_H: jax.Array | None = None,
              kv_segment_ids_BxK: jax.Array | None = None) -> None:
    """Raises ValueError naming the first argument whose shape breaks the contract."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"q must be [B,S,H,Dh], k [B,K,Kv,Dh] and v [B,K,Kv,Dv]; "
                         f"got {q.shape}, {k.shape}, {v.shape}")
    same_len = kv_segment_ids_BxK is None
    if (q.shape[0] != k.shape[0] or (same_len and q.shape[1] != k.shape[1])
            or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]):
        raise ValueError(f"q {q.shape} and k {k.shape} disagree (H must be a multiple of Kv)")
    if segment_ids_BxS.shape != q.shape[:2]:
        raise ValueError(f"segment_ids_BxS {segment_ids_BxS.shape} must be {q.shape[:2]}")
    if not same_len and kv_segment_ids_BxK.shape != k.shape[:2]:
        raise ValueError(f"kv segment ids (kv_segment_ids_BxK) {kv_segment_ids_BxK.shape} must "
                         f"be {k.shape[:2]}")
    if sinks_H is not None and sinks_H.shape != (q.shape[2],):
        raise ValueError(f"sinks_H {sinks_H.shape} must be [H] = ({q.shape[2]},)")

"""Splash attention: the Pallas TPU flash-attention kernel behind `attention="splash"`.

Same contract as `attention.plain_attention` (packed rows, causal inside each segment, GQA),
computed by `jax.experimental.pallas.ops.tpu.splash_attention`: a block-sparse kernel that skips
the key blocks its mask rules out (above the diagonal; outside the window of a local mask) and
applies segment ids inside the blocks it visits. Its backward pass is the kernel's own (dq and
dk/dv kernels).

Beyond the reference path it already takes the two features of sliding-window layers:
  * `window`: a query sees only the `window` most recent keys of its segment, itself included
    (key j is visible from query i iff i - window < j <= i; transformers' sliding-window
    convention), through the kernel's `LocalMask`, so skipped blocks cost nothing;
  * `sinks_H`: one learned logit per query head that enters the softmax denominator only
    (`exp(sink)` is added to every row's sum; no value is attached).

Platforms: the kernel compiles for TPU only; elsewhere it runs in Pallas interpret mode (tests on
CPU). `interpret=None` decides from the platform the code is compiled for
(`sharding.device_platform`). The kernel needs sequence blocks of a multiple of 128: S is padded
up to a multiple of the block with its own segment id, after every real token, so causality
hides it from real queries.

Under a mesh, the kernel runs per shard inside `shard_map` (a Pallas call has no SPMD
partitioning rule): rows split over the batch axes, heads over 'tensor' where it divides the KV
heads.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec as P

from gagar_jax import sharding

LANES = 128   # the kernel's sequence blocks are multiples of this


def _check(q, k, v, segment_ids_BxS, window, sinks_H):
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"q must be [B,S,H,Dh] and k, v [B,S,Kv,Dh]; got {q.shape}, {k.shape}, "
                         f"{v.shape}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree (H must be a multiple of Kv)")
    if segment_ids_BxS.shape != q.shape[:2]:
        raise ValueError(f"segment_ids_BxS {segment_ids_BxS.shape} must be {q.shape[:2]}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 (or None for full causal), got {window}")
    if sinks_H is not None and sinks_H.shape != (q.shape[2],):
        raise ValueError(f"sinks_H {sinks_H.shape} must be [H] = ({q.shape[2]},)")


def _kernel(s: int, num_heads: int, block: int, window: Optional[int], interpret: bool):
    if window is None:
        mask = splash.CausalMask((s, s))
    else:
        mask = splash.LocalMask((s, s), window_size=(window - 1, 0), offset=0)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                              block_q_dq=block, block_kv_dq=block)
    return splash.make_splash_mha(splash.MultiHeadMask([mask] * num_heads), block_sizes=sizes,
                                  head_shards=1, q_seq_shards=1, interpret=interpret)


def _local(q, k, v, seg, sinks, *, block, window, interpret):
    """One shard: q [B, S, H, Dh], k/v [B, S, Kv, Dh], seg [B, S] (S a multiple of block)."""
    b, s, h, dh = q.shape
    kernel = _kernel(s, h, block, window, interpret)
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B, H, S, Dh]
    qs = heads_first(q * jnp.asarray(dh ** -0.5, q.dtype))

    def one_row(q_r, k_r, v_r, seg_r):
        return kernel(q_r, k_r, v_r, segment_ids=splash.SegmentIds(q=seg_r, kv=seg_r),
                      sinks=sinks)

    o = jax.vmap(one_row)(qs, heads_first(k), heads_first(v), seg)
    return heads_first(o).astype(q.dtype)


def splash_attention(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, *,
                     window: Optional[int] = None, sinks_H: Optional[jax.Array] = None,
                     block: int = 512, mesh=None, interpret: Optional[bool] = None) -> jax.Array:
    """Packed causal GQA attention with the Pallas splash kernel.

    Args:
      q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS: as `attention.plain_attention`.
      window: sliding window in keys, the query itself included (None = full causal).
      sinks_H: optional float per-head sink logits (softmax denominator only).
      block: query/key block, rounded to a multiple of 128 and at most S rounded up.
      mesh: the mesh (default the ambient one); its batch/tensor axes split rows/heads.
      interpret: Pallas interpret mode (None: unless compiling for TPU).
    Returns:
      [B, S, H, Dh] attention output in q's dtype.
    """
    _check(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, window, sinks_H)
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if interpret is None:
        interpret = sharding.device_platform(mesh) != "tpu"
    b, s, h, _ = q_BxSxHxD.shape
    kv = k_BxSxKxD.shape[2]
    blk = min(-(-block // LANES) * LANES, -(-s // LANES) * LANES)
    pad = -s % blk
    q, k, v, seg = q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS.astype(jnp.int32)
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
        seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=-1)
    sinks = None if sinks_H is None else sinks_H.astype(jnp.float32)
    local = lambda q, k, v, seg, sinks: _local(  # noqa: E731
        q, k, v, seg, sinks, block=blk, window=window, interpret=interpret)
    row_axes, head_axes = (), ()
    if mesh is not None and not mesh.empty:
        row_axes = _dividing(sharding.mesh_axes("batch", mesh), mesh, b)
        head_axes = _dividing(sharding.mesh_axes("kv_heads", mesh), mesh, kv)
    if not row_axes and not head_axes:
        out = local(q, k, v, seg, sinks)
    else:
        rows, heads = row_axes or None, head_axes or None
        x_spec = P(rows, None, heads, None)
        fn = jax.shard_map(local, mesh=mesh,
                           in_specs=(x_spec, x_spec, x_spec, P(rows, None),
                                     None if sinks is None else P(heads)),
                           out_specs=x_spec, check_vma=False)   # kernel outputs carry no vma
        out = fn(q, k, v, seg, sinks)
    return out[:, :s]


def _dividing(axes: tuple, mesh, size: int) -> tuple:
    """The leading mesh axes (of size > 1) whose product divides `size`."""
    axes = tuple(a for a in axes if mesh.shape[a] > 1)
    while axes and size % math.prod(mesh.shape[a] for a in axes):
        axes = axes[:-1]
    return axes

"""Splash attention: the Pallas TPU flash-attention kernel behind `attention="splash"`.

Same contract as `blockwise.plain_attention` (packed rows, causal inside each segment, GQA),
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
heads. With rows split along S over the context axis, `context.py` runs
`splash_local_attention` per shard instead: a chip's queries against the keys it gathered (keys
of their own length and segment ids), its first query at key index `q_offset`, through the
masks' `offset` (`CausalMask((S, K), offset)`, `LocalMask((S, K), (W - 1, 0), offset)`).
The value head width may differ from the query / key width (MiMo: 128 / 192).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec as P

from gagar_jax import sharding
from gagar_jax.kernels.attention.checks import check_qkv

LANES = 128   # the kernel's sequence blocks are multiples of this


def _plain_slice(s: object) -> bool:
    return isinstance(s, slice) and s.step in (None, 1) and None not in (s.start, s.stop)


class _BandBlocks:
    """Mixin for the kernel's causal and local masks (`CausalMask`, `LocalMask` below; the
    kernel evaluates them block by block in-kernel as before): query i sees keys
    [i + offset - left, i + offset]. When the kernel is built, its mask processing asks for
    every [block_q, block_kv] block of the mask (`mask[q_slice, kv_slice]`) to find the blocks
    it skips; evaluating each one in NumPy takes ~0.5 ms, minutes for the 16k x 256k masks of
    a context shard's full layer. A block wholly inside or outside the band is answered here
    without evaluating it; the others (the band's edges) as before."""

    _left: Optional[int]   # None = no left edge (causal)

    def __getitem__(self, idx: tuple):
        q_s, k_s = idx
        if _plain_slice(q_s) and _plain_slice(k_s):
            q0, q1 = q_s.start, min(q_s.stop, self.shape[0])
            k0, k1 = k_s.start, min(k_s.stop, self.shape[1])
            if 0 <= q0 < q1 and 0 <= k0 < k1:
                hi_first, hi_last = q0 + self.offset, q1 - 1 + self.offset
                left = self._left
                if k0 > hi_last or (left is not None and k1 - 1 < hi_first - left):
                    return np.zeros((q1 - q0, k1 - k0), np.bool_)
                if k1 - 1 <= hi_first and (left is None or k0 >= hi_last - left):
                    return np.ones((q1 - q0, k1 - k0), np.bool_)
        return super().__getitem__(idx)


class CausalMask(_BandBlocks, splash.CausalMask):
    """The kernel's `CausalMask` (query i sees keys j <= i + offset), fast to process."""
    _left = None


class LocalMask(_BandBlocks, splash.LocalMask):
    """The kernel's `LocalMask` with window (left, 0): query i sees keys
    [i + offset - left, i + offset]; fast to process."""

    def __init__(self, shape: tuple[int, int], left: int, offset: int):
        super().__init__(shape, window_size=(left, 0), offset=offset)
        self._left = left


def _kernel(q_len: int, kv_len: int, num_heads: int, block_q: int, block_kv: int,
            window: Optional[int], offset: int, interpret: bool):
    """The kernel for queries [offset, offset + q_len) against keys [0, kv_len) of one row."""
    shape = (q_len, kv_len)
    if window is None:
        mask = CausalMask(shape, offset=offset)
    else:
        mask = LocalMask(shape, left=window - 1, offset=offset)
    sizes = splash.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
                              block_q_dkv=block_q, block_kv_dkv=block_kv,
                              block_kv_dkv_compute=block_kv, block_q_dq=block_q,
                              block_kv_dq=block_kv)
    return splash.make_splash_mha(splash.MultiHeadMask([mask] * num_heads), block_sizes=sizes,
                                  head_shards=1, q_seq_shards=1, interpret=interpret)


def _block(block: int, length: int) -> int:
    """`block` rounded up to a multiple of 128, and at most `length` rounded up to one."""
    return min(-(-block // LANES) * LANES, -(-length // LANES) * LANES)


def _pad(x: jax.Array, blk: int, fill: int = 0):
    extra = -x.shape[1] % blk
    if not extra:
        return x
    return jnp.pad(x, ((0, 0), (0, extra)) + ((0, 0),) * (x.ndim - 2), constant_values=fill)


def _local(q: jax.Array, k: jax.Array, v: jax.Array, seg_q: jax.Array, seg_k: jax.Array,
           sinks: Optional[jax.Array], *, block: int, window: Optional[int], offset: int,
           interpret: bool):
    """One shard's rows: q [B, S, H, Dh] at key index `offset` (a Python int), k [B, K, Kv, Dh],
    v [B, K, Kv, Dv], seg_q [B, S], seg_k [B, K]; S and K are padded here to multiples of the
    blocks."""
    b, s, h, dh = q.shape
    bq, bkv = _block(block, s), _block(block, k.shape[1])
    # Padding gets ids of its own (no real token is negative): padded queries see padded keys
    # or nothing, real queries never see padding; the output rows are cut off below.
    q, seg_q = _pad(q, bq), _pad(seg_q.astype(jnp.int32), bq, fill=-2)
    k, v, seg_k = _pad(k, bkv), _pad(v, bkv), _pad(seg_k.astype(jnp.int32), bkv, fill=-3)
    kernel = _kernel(q.shape[1], k.shape[1], h, bq, bkv, window, offset, interpret)
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # [B, H, S, Dh]
    qs = heads_first(q * jnp.asarray(dh ** -0.5, q.dtype))

    def one_row(q_r: jax.Array, k_r: jax.Array, v_r: jax.Array, seg_q_r: jax.Array,
                seg_k_r: jax.Array):
        return kernel(q_r, k_r, v_r, segment_ids=splash.SegmentIds(q=seg_q_r, kv=seg_k_r),
                      sinks=sinks)

    o = jax.vmap(one_row)(qs, heads_first(k), heads_first(v), seg_q, seg_k)
    return heads_first(o)[:, :s].astype(q.dtype)


def splash_local_attention(q_BxSxHxD: jax.Array, k_BxKxKvxD: jax.Array, v_BxKxKvxD: jax.Array,
                           segment_ids_BxS: jax.Array, *,
                           kv_segment_ids_BxK: Optional[jax.Array] = None,
                           q_offset: int | jax.Array = 0, q_offsets: Optional[Sequence[int]] = None,
                           window: int = 0,
                           sinks_H: Optional[jax.Array] = None, block: int = 512,
                           interpret: Optional[bool] = None) -> jax.Array:
    """The splash kernel on one shard, with the per-shard contract of
    `blockwise.blockwise_attention` (context parallelism, its `local` in `registry.py`):
    queries against keys of their own length K with their own segment ids, the first query at
    key index `q_offset`.

    The kernel's masks (and the blocks it skips) are static NumPy, so the offset must be known
    when tracing: `q_offset` is a Python int, or a traced int scalar together with `q_offsets`,
    the static tuple of the values it can take (a chip's offset depends on `axis_index`); then
    one kernel per value is built and `lax.switch` runs the one whose value equals `q_offset`
    (an offset outside `q_offsets` is a caller bug: the first kernel would run).

    Args:
      q_BxSxHxD, k_BxKxKvxD, v_BxKxKvxD: queries and the keys / values they may see (no mesh
        here: this runs inside a `shard_map` or on one device); v may have its own head width.
      segment_ids_BxS, kv_segment_ids_BxK: segment ids of queries and of keys (default: keys
        are the queries' rows).
      q_offset, q_offsets: as above.
      window: sliding window W (0 = full causal), as in `blockwise.plain_attention`.
      sinks_H: optional per-head sink logits.
      block: query / key block (rounded to a multiple of 128, at most the length rounded up).
      interpret: Pallas interpret mode (None: unless the ambient mesh's devices are TPUs).
    Returns:
      [B, S, H, Dv] attention output in q's dtype.
    """
    q, k, v = q_BxSxHxD, k_BxKxKvxD, v_BxKxKvxD
    seg_k = segment_ids_BxS if kv_segment_ids_BxK is None else kv_segment_ids_BxK
    check_qkv(q, k, v, segment_ids_BxS, sinks_H=sinks_H, kv_segment_ids_BxK=seg_k)
    if window < 0:
        raise ValueError(f"window must be >= 0 (0 = full attention), got {window}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if interpret is None:
        interpret = sharding.device_platform() != "tpu"
    sinks = None if sinks_H is None else sinks_H.astype(jnp.float32)
    args = (q, k, v, segment_ids_BxS.astype(jnp.int32), seg_k.astype(jnp.int32), sinks)
    run = lambda offset, *a: _local(*a, block=block, window=int(window) or None,
                                    offset=offset, interpret=interpret)
    if isinstance(q_offset, (int, np.integer)):
        return run(int(q_offset), *args)
    if not q_offsets:
        raise ValueError("a traced q_offset needs q_offsets, the static values it can take "
                         "(the splash kernel's mask is static)")
    offsets = tuple(sorted({int(o) for o in q_offsets}))
    if len(offsets) == 1:
        return run(offsets[0], *args)
    index = jnp.argmax(jnp.asarray(offsets, jnp.int32) == q_offset)
    return jax.lax.switch(index, [functools.partial(run, o) for o in offsets], *args)


def splash_attention(q_BxSxHxD: jax.Array, k_BxSxKxD: jax.Array, v_BxSxKxD: jax.Array,
                     segment_ids_BxS: jax.Array, *,
                     window: Optional[int] = None, sinks_H: Optional[jax.Array] = None,
                     block: int = 512,
                     mesh: Optional[jax.sharding.Mesh | jax.sharding.AbstractMesh] = None,
                     interpret: Optional[bool] = None) -> jax.Array:
    """Packed causal GQA attention with the Pallas splash kernel.

    Args:
      q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS: as `blockwise.plain_attention`.
      window: sliding window in keys, the query itself included (None = full causal).
      sinks_H: optional float per-head sink logits (softmax denominator only).
      block: query/key block, rounded to a multiple of 128 and at most S rounded up.
      mesh: the mesh (default the ambient one); its batch/tensor axes split rows/heads.
      interpret: Pallas interpret mode (None: unless compiling for TPU).
    Returns:
      [B, S, H, Dh] attention output in q's dtype.
    """
    check_qkv(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, sinks_H=sinks_H)
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 (or None for full causal), got {window}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if interpret is None:
        interpret = sharding.device_platform(mesh) != "tpu"
    b, kv = q_BxSxHxD.shape[0], k_BxSxKxD.shape[2]
    seg = segment_ids_BxS.astype(jnp.int32)
    sinks = None if sinks_H is None else sinks_H.astype(jnp.float32)
    local = lambda q, k, v, seg, sinks: _local(
        q, k, v, seg, seg, sinks, block=block, window=window, offset=0, interpret=interpret)
    q, k, v = q_BxSxHxD, k_BxSxKxD, v_BxSxKxD
    row_axes, head_axes = (), ()
    if mesh is not None and not mesh.empty:
        row_axes = _dividing(sharding.mesh_axes("batch", mesh), mesh, b)
        head_axes = _dividing(sharding.mesh_axes("kv_heads", mesh), mesh, kv)
    if not row_axes and not head_axes:
        return local(q, k, v, seg, sinks)
    rows, heads = row_axes or None, head_axes or None
    x_spec = P(rows, None, heads, None)
    fn = jax.shard_map(local, mesh=mesh,
                       in_specs=(x_spec, x_spec, x_spec, P(rows, None),
                                 None if sinks is None else P(heads)),
                       out_specs=x_spec, check_vma=False)   # kernel outputs carry no vma
    return fn(q, k, v, seg, sinks)


def _dividing(axes: tuple, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, size: int) -> tuple:
    """The leading mesh axes (of size > 1) whose product divides `size`."""
    axes = tuple(a for a in axes if mesh.shape[a] > 1)
    while axes and size % math.prod(mesh.shape[a] for a in axes):
        axes = axes[:-1]
    return axes

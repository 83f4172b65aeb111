"""Paged attention for the sampler (`gagar_jax/sample/`): keys and values kept in fixed-size pages.

A pool holds one layer's keys (values alike) as `[Kv, NP, T, D]`: NP pages of T positions per KV
head (the layout of JAX's Pallas `paged_attention`). A sequence owns a list of pages, its
**page table** `[M]` (page ids), in one of two ways:

  * full layers ("pages"): position p sits at page `table[p // T]`, offset `p % T`; M pages hold
    M * T positions, the whole context;
  * sliding-window layers ("ring"): only the last `Wr = M * T` positions are kept, position p at
    ring index `p % Wr` (page `table[(p % Wr) // T]`). A query needs the W - 1 keys before it,
    so `Wr >= W - 1` keeps everything a window of W can see: a window layer holds its window,
    whatever the context length.

One call attends a chunk of N new tokens per row (a prefill chunk, or N = 1 in decode) at
positions `start_B + i`, against the keys the row cached before the chunk (positions below
`start_B`) and the chunk's own keys, causally, inside the window where there is one, with the
sink logit in the denominator (MiMo). `write` then stores the chunk's keys and values in the
row's pages (the last Wr of them in a ring). The XLA reference (`paged_attention_xla`) gathers a
row's pages whole: simple and exact on every platform, memory linear in the context.
`paged_decode_pallas` serves decode (N = 1, full layers, no sinks, equal q/k and v widths) with
JAX's Pallas TPU kernel, after the new key is written; it reads keys and values in bfloat16.
`registry.py` holds the records and chooses.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gagar_jax import sharding
from gagar_jax.kernels.attention.blockwise import softmax_values

_NEG = -1e30   # finite "minus infinity" (no inf - inf in the softmax)


def gather(pool_KvxPxTxD: jax.Array, table_BxM: jax.Array) -> jax.Array:
    """Row b's pages in table order: [B, M * T, Kv, D]."""
    g = pool_KvxPxTxD[:, table_BxM]                       # [Kv, B, M, T, D]
    kv, b, m, t, d = g.shape
    return jnp.moveaxis(g.reshape(kv, b, m * t, d), 0, 2)


def cached_positions(table_BxM: jax.Array, start_B: jax.Array, page: int,
                     ring: bool) -> jax.Array:
    """The position each gathered key slot holds before the chunk, -1 where it holds none:
    [B, M * T]. Pages: slot j holds position j (if j < start). Ring: slot r holds the latest
    position below start that is r modulo the ring length."""
    n = table_BxM.shape[1] * page
    j = jnp.arange(n, dtype=jnp.int32)[None, :]
    s = start_B.astype(jnp.int32)[:, None]
    if not ring:
        return jnp.where(j < s, j, -1)
    p = (s - 1) - jnp.mod(s - 1 - j, n)
    return jnp.where(p >= 0, p, -1)


def paged_attention_xla(q_BxNxHxD: jax.Array, k_new_BxNxKvxD: jax.Array,
                        v_new_BxNxKvxD: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                        table_BxM: jax.Array, start_B: jax.Array, n_B: jax.Array, *,
                        window: int = 0, ring: bool = False,
                        sinks_H: jax.Array | None = None) -> jax.Array:
    """Attention of a chunk over a row's cached pages and the chunk itself (the reference).

    Args:
      q_BxNxHxD: queries at positions start_B + i (RoPE applied).
      k_new_BxNxKvxD, v_new_BxNxKvxD: the chunk's keys and values (the same positions).
      k_pool, v_pool: [Kv, NP, T, Dh] / [Kv, NP, T, Dv]: the layer's pages, before the chunk.
      table_BxM: each row's page table (ring pages for a ring).
      start_B: positions cached before the chunk. n_B: the chunk's real tokens (the rest of
        the N columns is padding: never a key; its query outputs are unused).
      window: W > 0: a query sees the W most recent positions, itself included.
      ring: the pool is a window ring (`cached_positions`).
      sinks_H: per-head sink logits (denominator only), or None.
    Returns:
      [B, N, H, Dv] in q's dtype (scores and softmax in float32).
    """
    B, N, H, Dh = q_BxNxHxD.shape
    Kv, Dv, page = k_pool.shape[0], v_pool.shape[-1], k_pool.shape[2]
    q = q_BxNxHxD.reshape(B, N, Kv, H // Kv, Dh)
    k_old = gather(k_pool, table_BxM).astype(q.dtype)
    v_old = gather(v_pool, table_BxM).astype(q.dtype)
    q_pos = start_B[:, None] + jnp.arange(N, dtype=jnp.int32)[None, :]         # [B, N]
    old_pos = cached_positions(table_BxM, start_B, page, ring)                 # [B, C]
    new_pos = jnp.where(jnp.arange(N)[None, :] < n_B[:, None], q_pos, -1)      # [B, N]
    k_pos = jnp.concatenate([old_pos, new_pos], axis=1)                         # [B, C + N]
    ago = q_pos[:, :, None] - k_pos[:, None, :]                                 # [B, N, C + N]
    visible = (k_pos[:, None, :] >= 0) & (ago >= 0)
    if window:
        visible = visible & (ago < window)
    keys = jnp.concatenate([k_old, k_new_BxNxKvxD.astype(q.dtype)], axis=1)
    vals = jnp.concatenate([v_old, v_new_BxNxKvxD.astype(q.dtype)], axis=1)
    s = jnp.einsum("bqkgd,bskd->bkgqs", q, keys, preferred_element_type=jnp.float32)
    s = jnp.where(visible[:, None, None], s * (Dh ** -0.5), _NEG)
    o = softmax_values(s, vals, sinks_H)
    return o.reshape(B, N, H, Dv).astype(q_BxNxHxD.dtype)


def write(pool_KvxPxTxD: jax.Array, new_BxNxKvxD: jax.Array, table_BxM: jax.Array,
          start_B: jax.Array, n_B: jax.Array, *, ring: bool = False,
          after: jax.Array | None = None) -> jax.Array:
    """The pool with the chunk's real tokens written at their pages (a ring keeps only the last
    Wr of them). Rows with n_B = 0 write nothing (inactive slots, padding).

    `after`: a result computed from the pool before this write (the attention output). The
    written values are made to depend on it (+ 0 * one of its elements), so the in-place write
    is ordered after every read of the old pool: without that data dependency XLA copies the
    whole pool (twice, in a loop) to keep the old one readable. It must be finite.
    """
    if after is not None:
        new_BxNxKvxD = new_BxNxKvxD + 0 * jnp.min(after[:, :1]).astype(new_BxNxKvxD.dtype)
    Kv, NP, T, D = pool_KvxPxTxD.shape
    B, N = new_BxNxKvxD.shape[:2]
    M = table_BxM.shape[1]
    i = jnp.arange(N, dtype=jnp.int32)[None, :]
    p = start_B[:, None] + i                                                   # [B, N]
    valid = i < n_B[:, None]
    if ring:
        valid = valid & (i >= n_B[:, None] - M * T)
        p = jnp.mod(p, M * T)
    slot = jnp.clip(p // T, 0, M - 1)
    page = jnp.where(valid, jnp.take_along_axis(table_BxM, slot, axis=1), NP)   # NP: dropped
    vals = jnp.moveaxis(new_BxNxKvxD.astype(pool_KvxPxTxD.dtype), 2, 0)         # [Kv, B, N, D]
    return pool_KvxPxTxD.at[:, page, p % T].set(vals, mode="drop")


def paged_decode_pallas(q_BxHxD: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                        lengths_B: jax.Array, table_BxM: jax.Array, *, interpret: bool = False,
                        pages_per_block: int = 0) -> jax.Array:
    """One decode query per row against its pages (new key already written): JAX's Pallas TPU
    `paged_attention`, run in TPU interpret mode (`pltpu.force_tpu_interpret_mode`) when
    `interpret`. No window, no sinks, q/k width = v width (a multiple of 128 on TPU); K and V
    are read in bfloat16. Under a mesh it runs per shard in `shard_map` (a Pallas call has no
    SPMD rule): rows over the batch axes, heads over `tensor` where they divide.

    Args:
      q_BxHxD: queries (RoPE applied; scaled here by Dh ** -0.5).
      k_pool, v_pool: [Kv, NP, T, D].
      lengths_B: keys per row (0: the row is skipped; its output is unused).
      table_BxM: page tables.
      pages_per_block: pages per compute block (0: the largest power of two <= 8 dividing M).
    Returns:
      [B, H, D] in q's dtype.
    """
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    M, Dh = table_BxM.shape[1], q_BxHxD.shape[-1]
    if k_pool.shape != v_pool.shape:
        raise ValueError(f"the Pallas paged kernel needs equal k and v pages, got {k_pool.shape} "
                         f"and {v_pool.shape}")
    block = pages_per_block or next(b for b in (8, 4, 2, 1) if M % b == 0)
    q = (q_BxHxD.astype(jnp.float32) * Dh ** -0.5).astype(q_BxHxD.dtype)

    def local(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
              table: jax.Array) -> jax.Array:
        def call() -> jax.Array:
            return paged_attention(q, k, v, lengths, table, pages_per_compute_block=block)
        if not interpret:
            return call()
        with pltpu.force_tpu_interpret_mode():
            return call()
    args = (q, k_pool, v_pool, lengths_B.astype(jnp.int32), table_BxM.astype(jnp.int32))
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return local(*args)
    rows = _dividing(sharding.mesh_axes("batch", mesh), mesh, q.shape[0]) or None
    heads = _dividing(sharding.mesh_axes("kv_heads", mesh), mesh, k_pool.shape[0]) or None
    if rows is None and heads is None:
        return local(*args)
    pool = P(heads, None, None, None)
    return jax.shard_map(local, mesh=mesh,
                         in_specs=(P(rows, heads, None), pool, pool, P(rows), P(rows, None)),
                         out_specs=P(rows, heads, None), check_vma=False)(*args)


def _dividing(axes: tuple, mesh: jax.sharding.AbstractMesh, size: int) -> tuple:
    """The leading mesh axes (of size > 1) whose product divides `size`."""
    axes = tuple(a for a in axes if mesh.shape[a] > 1)
    while axes and size % math.prod(mesh.shape[a] for a in axes):
        axes = axes[:-1]
    return axes

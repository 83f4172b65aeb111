"""Packed-sequence causal attention: a plain reference path and a memory-efficient blockwise path.

Rows are packed: several segments (trajectories) back to back, `segment_ids_BxS` 1, 2, ... per
segment and 0 on padding. A query attends to a key iff both carry the same segment id and the key
is not later in the row. Because segments are contiguous, "causal in the row" and "same segment"
together are exactly "causal inside the segment". Every query sees at least itself, so no softmax
row is ever empty (padding attends to padding and is masked downstream).

The blockwise path (`blockwise_attention`) is flash-attention written in pure JAX: the forward
pass walks key blocks with an online softmax and keeps only the output and the per-row
log-sum-exp; a `jax.custom_vjp` backward pass recomputes each block's scores. Neither pass holds
more than one [block, block] tile of scores per head, so memory grows linearly with S (plain
autodiff through a scan would save every tile). Key blocks strictly above the diagonal are
skipped (the loops run to the diagonal only), halving the work of a dense causal mask.

Shapes: q [B, S, H, Dh], k/v [B, S, Kv, Dh] with H a multiple of Kv (grouped-query attention).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_NEG = -1e30  # finite "minus infinity": keeps exp(m_old - m_new) free of inf - inf


def _check(q, k, v, segment_ids_BxS):
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"q must be [B,S,H,Dh] and k, v [B,S,Kv,Dh]; got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree (H must be a multiple of Kv)")
    if segment_ids_BxS.shape != q.shape[:2]:
        raise ValueError(f"segment_ids_BxS {segment_ids_BxS.shape} must be {q.shape[:2]}")


def _mask(seg_q_BxQ, seg_k_BxK, idx_q_Q, idx_k_K):
    """[B, Q, K] bool: same segment and key not after query."""
    same = seg_q_BxQ[:, :, None] == seg_k_BxK[:, None, :]
    return same & (idx_q_Q[:, None] >= idx_k_K[None, :])[None]


def plain_attention(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS):
    """Reference attention materializing [B, H, S, S] scores (tests and short sequences).

    Args:
      q_BxSxHxD, k_BxSxKxD, v_BxSxKxD: queries, keys, values (any float dtype).
      segment_ids_BxS: int segment ids, 0 = padding.
    Returns:
      [B, S, H, Dh] attention output in q's dtype (softmax in float32).
    """
    _check(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS)
    B, S, H, Dh = q_BxSxHxD.shape
    Kv = k_BxSxKxD.shape[2]
    q = q_BxSxHxD.reshape(B, S, Kv, H // Kv, Dh)
    s = jnp.einsum("bqkgd,bskd->bkgqs", q, k_BxSxKxD, preferred_element_type=jnp.float32)
    s = s * (Dh ** -0.5)
    idx = jnp.arange(S)
    m = _mask(segment_ids_BxS, segment_ids_BxS, idx, idx)
    s = jnp.where(m[:, None, None], s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgqs,bskd->bqkgd", p.astype(v_BxSxKxD.dtype), v_BxSxKxD,
                   preferred_element_type=jnp.float32)
    return o.reshape(B, S, H, Dh).astype(q_BxSxHxD.dtype)


# ----------------------------------------------------------------------------- blockwise
# Internal layout: the block index leads so loops can index it dynamically.
#   q: [N, B, blk, Kv, G, Dh]   k, v: [N, B, blk, Kv, Dh]   seg: [N, B, blk]
#   o: [N, B, Kv, G, blk, Dh] (f32 accumulators)   lse / delta: [N, B, Kv, G, blk]


def _tile(q_i, k_j, seg_i, seg_j, i, j, blk, scale):
    """Masked f32 scores of query block i against key block j: [B, Kv, G, blk, blk] and mask."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", q_i, k_j, preferred_element_type=jnp.float32) * scale
    ar = jnp.arange(blk)
    m = _mask(seg_i, seg_j, i * blk + ar, j * blk + ar)[:, None, None]
    return jnp.where(m, s, _NEG), m


def _fwd_blocks(q, k, v, seg, blk):
    n, B, _, Kv, G, Dh = q.shape
    scale = Dh ** -0.5

    def one_query_block(args):
        i, q_i, seg_i = args

        def body(j, carry):
            o, m_run, l_run = carry
            k_j, v_j, seg_j = k[j], v[j], seg[j]
            s, mask = _tile(q_i, k_j, seg_i, seg_j, i, j, blk, scale)
            m_new = jnp.maximum(m_run, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            corr = jnp.exp(m_run - m_new)
            l_run = l_run * corr + p.sum(-1)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v_j.dtype), v_j,
                            preferred_element_type=jnp.float32)
            return o * corr[..., None] + pv, m_new, l_run

        init = (jnp.zeros((B, Kv, G, blk, Dh), jnp.float32),
                jnp.full((B, Kv, G, blk), _NEG, jnp.float32),
                jnp.zeros((B, Kv, G, blk), jnp.float32))
        o, m_run, l_run = jax.lax.fori_loop(0, i + 1, body, init)  # causal: keys up to diagonal
        return o / l_run[..., None], m_run + jnp.log(l_run)

    return jax.lax.map(one_query_block, (jnp.arange(n), q, seg))


def _bwd_blocks(q, k, v, seg, o, lse, do, blk):
    n, B, _, Kv, G, Dh = q.shape
    scale = Dh ** -0.5
    delta = jnp.sum(do * o, axis=-1)  # [N, B, Kv, G, blk]: rowsum(dO * O), the softmax-jacobian term

    def probs_and_ds(i, j):
        s, mask = _tile(q[i], k[j], seg[i], seg[j], i, j, blk, scale)
        p = jnp.where(mask, jnp.exp(s - lse[i][..., None]), 0.0)
        dp = jnp.einsum("bkgqd,bskd->bkgqs", do[i], v[j], preferred_element_type=jnp.float32)
        return p, p * (dp - delta[i][..., None])

    def dq_block(i):
        def body(j, dq):
            _, ds = probs_and_ds(i, j)
            return dq + jnp.einsum("bkgqs,bskd->bqkgd", ds, k[j].astype(jnp.float32)) * scale
        return jax.lax.fori_loop(0, i + 1, body, jnp.zeros((B, blk, Kv, G, Dh), jnp.float32))

    def dkv_block(j):
        def body(i, carry):
            dk, dv = carry
            p, ds = probs_and_ds(i, j)
            dv = dv + jnp.einsum("bkgqs,bkgqd->bskd", p, do[i])
            dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, q[i].astype(jnp.float32)) * scale
            return dk, dv
        zeros = jnp.zeros((B, blk, Kv, Dh), jnp.float32)
        return jax.lax.fori_loop(j, n, body, (zeros, zeros))  # causal: queries from the diagonal on

    dq = jax.lax.map(dq_block, jnp.arange(n))
    dk, dv = jax.lax.map(dkv_block, jnp.arange(n))
    return dq, dk, dv


def _to_blocks(x, n, blk):
    return jnp.moveaxis(x.reshape(x.shape[0], n, blk, *x.shape[2:]), 1, 0)


def _from_blocks(x):
    return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, seg, blk):
    return _flash_fwd(q, k, v, seg, blk)[0]


def _flash_fwd(q, k, v, seg, blk):
    B, S, H, Dh = q.shape
    Kv = k.shape[2]
    n = S // blk
    qb = _to_blocks(q.reshape(B, S, Kv, H // Kv, Dh), n, blk)
    o, lse = _fwd_blocks(qb, _to_blocks(k, n, blk), _to_blocks(v, n, blk), _to_blocks(seg, n, blk), blk)
    out = _from_blocks(jnp.moveaxis(o, 4, 2)).reshape(B, S, H, Dh).astype(q.dtype)
    return out, (q, k, v, seg, o, lse)


def _flash_bwd(blk, res, dout):
    q, k, v, seg, o, lse = res
    B, S, H, Dh = q.shape
    Kv = k.shape[2]
    n = S // blk
    do = _to_blocks(dout.astype(jnp.float32).reshape(B, S, Kv, H // Kv, Dh), n, blk)
    do = jnp.moveaxis(do, 2, 4)  # to the accumulator layout [N, B, Kv, G, blk, Dh]
    dq, dk, dv = _bwd_blocks(_to_blocks(q.reshape(B, S, Kv, H // Kv, Dh), n, blk),
                             _to_blocks(k, n, blk), _to_blocks(v, n, blk), _to_blocks(seg, n, blk),
                             o, lse, do, blk)
    dq = _from_blocks(dq).reshape(B, S, H, Dh).astype(q.dtype)
    return dq, _from_blocks(dk).astype(k.dtype), _from_blocks(dv).astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_attention(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, *, block: int = 512):
    """Flash-style attention in pure JAX; same contract as `plain_attention`.

    Args:
      q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS: as in `plain_attention`.
      block: query/key block length; S is padded up to a multiple of it (padding sits after
        every real token, so causality hides it from real queries).
    Returns:
      [B, S, H, Dh] attention output in q's dtype.
    """
    _check(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS)
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    S = q_BxSxHxD.shape[1]
    blk = min(block, S)
    pad = -S % blk
    q, k, v, seg = q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
        seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=-1)
    return _flash(q, k, v, seg, blk)[:, :S]


def attention(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, *, impl: str = "blockwise",
              block: int = 512):
    """Dispatch on `impl` ("blockwise" | "plain")."""
    if impl == "blockwise":
        return blockwise_attention(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, block=block)
    if impl == "plain":
        return plain_attention(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS)
    raise ValueError(f"attention impl must be 'blockwise' or 'plain', got {impl!r}")

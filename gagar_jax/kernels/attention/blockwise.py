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

Sliding-window layers (`window` = W > 0, the Hugging Face convention): a query at row index q
also needs q - k < W, i.e. it sees W keys counting itself (`transformers`' `sliding_window`:
`kv_idx > q_idx - W`). The blockwise loops start at the first key block the window reaches and
the backward key loop stops at the last query block that sees the key block, so a sliding layer
costs O(S * W), not O(S^2). Within a packed row the window is measured in row positions; since
segments are contiguous that equals the distance inside the segment, and the segment mask keeps
a window from crossing into the previous segment.

Attention sinks (`sinks_H`, gpt-oss / MiMo-V2-Flash): one learned logit per head that joins every
softmax denominator and contributes no value: p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k)).

On TPU the same contract is served by the Pallas splash kernel (`splash.py`); `registry.py`
holds the kernels and chooses one.

Shapes: q [B, S, H, Dh], k [B, S, Kv, Dh], v [B, S, Kv, Dv] with H a multiple of Kv (grouped-query
attention); the value head width Dv may differ from the q/k width Dh (MiMo: 192 / 128). Scores
are scaled by Dh ** -0.5.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gagar_jax.kernels.attention.checks import check_qkv

_NEG = -1e30  # finite "minus infinity": keeps exp(m_old - m_new) free of inf - inf


def _check(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids_BxS: jax.Array, window: int = 0,
           sinks_H: jax.Array | None = None, kv_segment_ids_BxK: jax.Array | None = None):
    check_qkv(q, k, v, segment_ids_BxS, sinks_H=sinks_H, kv_segment_ids_BxK=kv_segment_ids_BxK)
    if window < 0:
        raise ValueError(f"window must be >= 0 (0 = full attention), got {window}")


def _mask(seg_q_BxQ: jax.Array, seg_k_BxK: jax.Array, idx_q_Q: jax.Array, idx_k_K: jax.Array,
          window: int = 0):
    """[B, Q, K] bool: same segment, key not after query, and (window > 0) q - k < window."""
    same = seg_q_BxQ[:, :, None] == seg_k_BxK[:, None, :]
    diff = idx_q_Q[:, None] - idx_k_K[None, :]
    ok = diff >= 0
    if window:
        ok = ok & (diff < window)
    return same & ok[None]


def plain_attention(q_BxSxHxD: jax.Array, k_BxSxKxD: jax.Array, v_BxSxKxD: jax.Array,
                    segment_ids_BxS: jax.Array, *, window: int = 0,
                    sinks_H: jax.Array | None = None, kv_segment_ids_BxK: jax.Array | None = None,
                    q_offset: int | jax.Array = 0) -> jax.Array:
    """Reference attention materializing [B, H, S, S] scores (tests and short sequences).

    Args:
      q_BxSxHxD, k_BxSxKxD, v_BxSxKxD: queries, keys, values (any float dtype); v may have its
        own head width Dv.
      segment_ids_BxS: int segment ids, 0 = padding.
      window: sliding window W (a query sees W keys counting itself); 0 = full causal.
      sinks_H: optional per-head sink logits (denominator only).
      kv_segment_ids_BxK, q_offset: keys of their own length K (context parallelism: a shard's
        queries against gathered keys): the keys' segment ids, and the key index of query 0
        (an int or a traced int scalar). Default: keys are the queries' rows, offset 0.
    Returns:
      [B, S, H, Dv] attention output in q's dtype (softmax in float32).
    """
    _check(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, window, sinks_H, kv_segment_ids_BxK)
    seg_k = segment_ids_BxS if kv_segment_ids_BxK is None else kv_segment_ids_BxK
    B, S, H, Dh = q_BxSxHxD.shape
    Kv, Dv = k_BxSxKxD.shape[2], v_BxSxKxD.shape[3]
    q = q_BxSxHxD.reshape(B, S, Kv, H // Kv, Dh)
    s = jnp.einsum("bqkgd,bskd->bkgqs", q, k_BxSxKxD, preferred_element_type=jnp.float32)
    s = s * (Dh ** -0.5)
    m = _mask(segment_ids_BxS, seg_k, jnp.arange(S) + q_offset, jnp.arange(seg_k.shape[1]), window)
    s = jnp.where(m[:, None, None], s, _NEG)
    o = softmax_values(s, v_BxSxKxD, sinks_H)
    return o.reshape(B, S, H, Dv).astype(q_BxSxHxD.dtype)


def softmax_values(s_BxKvxGxQxK: jax.Array, v_BxKxKvxD: jax.Array,
                   sinks_H: jax.Array | None = None) -> jax.Array:
    """The attention output of masked float32 scores: their softmax over the keys (a head's sink
    logit joins every denominator and contributes no value) times the values, [B, Q, Kv, G, Dv]
    float32. The plain reference above and the sampler's paged attention (`paged.py`) share it.
    """
    if sinks_H is None:
        p = jax.nn.softmax(s_BxKvxGxQxK, axis=-1)
    else:
        _, Kv, G = s_BxKvxGxQxK.shape[:3]
        sink = jnp.broadcast_to(sinks_H.astype(jnp.float32).reshape(1, Kv, G, 1, 1),
                                s_BxKvxGxQxK.shape[:-1] + (1,))
        p = jax.nn.softmax(jnp.concatenate([s_BxKvxGxQxK, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bkgqs,bskd->bqkgd", p.astype(v_BxKxKvxD.dtype), v_BxKxKvxD,
                      preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- blockwise
# Internal layout: the block index leads so loops can index it dynamically, and the head axes
# come before the block's rows so every tile product is a plain batched matmul over (B, Kv)
# with the contraction last (XLA:CPU then runs it without per-tile transposes).
#   q: [Nq, B, Kv, G, blk, Dh]   k: [Nk, B, Kv, blk, Dh]   v: [Nk, B, Kv, blk, Dv]
#   seg_q: [Nq, B, blk]   seg_k: [Nk, B, blk]
#   o: [Nq, B, Kv, G, blk, Dv] (f32)   lse / delta: [Nq, B, Kv, G, blk]   sink: [Kv, G]
# `d` is the key index of query row 0 (0 when queries and keys are the same rows; a context
# shard's offset into the gathered keys otherwise), an int32 scalar that may be traced.


def _rows(x: jax.Array):
    """[B, Kv, G, blk, X] -> [B, Kv, G * blk, X]: a query tile's G heads share each key head."""
    return x.reshape(x.shape[0], x.shape[1], x.shape[2] * x.shape[3], x.shape[4])


def _tile(q_i: jax.Array, k_j: jax.Array, seg_i: jax.Array, seg_j: jax.Array, i: jax.Array,
          j: jax.Array, d: jax.Array, blk: int, scale: float, window: int):
    """Masked f32 scores of query block i against key block j: [B, Kv, G, blk, blk] and mask."""
    B, Kv, G = q_i.shape[:3]
    s = jnp.einsum("bkrd,bksd->bkrs", _rows(q_i), k_j, preferred_element_type=jnp.float32)
    s = s.reshape(B, Kv, G, blk, blk) * scale
    ar = jnp.arange(blk)
    m = _mask(seg_i, seg_j, d + i * blk + ar, j * blk + ar, window)[:, None, None]
    return jnp.where(m, s, _NEG), m


def _key_block_range(i: jax.Array, nk: int, d: jax.Array, blk: int, window: int):
    """Key blocks [lo, hi) that query block i can see (causal, and inside the window)."""
    q_lo = d + i * blk
    hi = jnp.minimum((q_lo + blk - 1) // blk + 1, nk)
    lo = 0 if not window else jnp.maximum((q_lo - (window - 1)) // blk, 0)
    return lo, hi


def _query_block_range(j: jax.Array, nq: int, d: jax.Array, blk: int, window: int):
    """Query blocks [lo, hi) that can see key block j."""
    lo = jnp.maximum(-((d + blk - 1 - j * blk) // blk), 0)
    hi = nq if not window else jnp.minimum((j * blk + blk - 1 + window - 1 - d) // blk + 1, nq)
    return lo, hi


def _fwd_blocks(q: jax.Array, k: jax.Array, v: jax.Array, seg_q: jax.Array, seg_k: jax.Array,
                sink: jax.Array, d: jax.Array, blk: int, window: int, has_sink: bool):
    nq, B, Kv, G = q.shape[:4]
    nk, Dv = k.shape[0], v.shape[-1]
    scale = q.shape[-1] ** -0.5

    def one_query_block(args: tuple[jax.Array, jax.Array, jax.Array]):
        i, q_i, seg_i = args

        def body(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
            o, m_run, l_run = carry
            v_j = v[j]
            s, mask = _tile(q_i, k[j], seg_i, seg_k[j], i, j, d, blk, scale, window)
            m_new = jnp.maximum(m_run, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            corr = jnp.exp(m_run - m_new)
            l_run = l_run * corr + p.sum(-1)
            pv = jnp.einsum("bkrs,bksd->bkrd", _rows(p.astype(v_j.dtype)), v_j,
                            preferred_element_type=jnp.float32)
            return o * corr[..., None] + pv.reshape(o.shape), m_new, l_run

        # A sink starts the online softmax as one extra score: max = sink, sum = exp(0) = 1.
        m0 = (jnp.broadcast_to(sink[None, :, :, None], (B, Kv, G, blk)) if has_sink
              else jnp.full((B, Kv, G, blk), _NEG, jnp.float32))
        l0 = jnp.full((B, Kv, G, blk), 1.0 if has_sink else 0.0, jnp.float32)
        init = (jnp.zeros((B, Kv, G, blk, Dv), jnp.float32), m0, l0)
        lo, hi = _key_block_range(i, nk, d, blk, window)
        o, m_run, l_run = jax.lax.fori_loop(lo, hi, body, init)
        # Only padding rows past the keys see no key at all: give them o = 0, not 0 / 0.
        l_run = jnp.where(l_run > 0, l_run, 1.0)
        return o / l_run[..., None], m_run + jnp.log(l_run)

    return jax.lax.map(one_query_block, (jnp.arange(nq), q, seg_q))


def _bwd_blocks(q: jax.Array, k: jax.Array, v: jax.Array, seg_q: jax.Array, seg_k: jax.Array,
                sink: jax.Array, d: jax.Array, o: jax.Array, lse: jax.Array, do: jax.Array,
                blk: int, window: int, has_sink: bool):
    """dq, dk, dv in ONE pass over the visible tiles (each tile's scores and probabilities are
    recomputed once): key blocks outside, the query blocks that see them inside; dk and dv of
    the key block accumulate in the carry, dq in a buffer updated in place."""
    nq, B, Kv, G = q.shape[:4]
    nk = k.shape[0]
    scale = q.shape[-1] ** -0.5
    delta = jnp.sum(do * o, axis=-1)  # [Nq, B, Kv, G, blk]: rowsum(dO * O), the softmax-jacobian
                                      # term

    def key_block(j: jax.Array, dq_all: jax.Array):
        k_j, v_j = k[j], v[j]
        k_j32 = k_j.astype(jnp.float32)   # once per key block, not per visible query block

        def body(i: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
            dq_all, dk, dv = carry
            q_i, do_i = q[i], do[i]
            s, mask = _tile(q_i, k_j, seg_q[i], seg_k[j], i, j, d, blk, scale, window)
            p = jnp.where(mask, jnp.exp(s - lse[i][..., None]), 0.0)
            dp = jnp.einsum("bkrd,bksd->bkrs", _rows(do_i), v_j, preferred_element_type=jnp.float32)
            ds = _rows(p * (dp.reshape(p.shape) - delta[i][..., None]))
            p = _rows(p)
            dv = dv + jnp.einsum("bkrs,bkrd->bksd", p, _rows(do_i))
            dk = dk + jnp.einsum("bkrs,bkrd->bksd", ds, _rows(q_i).astype(jnp.float32)) * scale
            dq_i = jnp.einsum("bkrs,bksd->bkrd", ds, k_j32) * scale
            dq_all = dq_all.at[i].add(dq_i.reshape(dq_all.shape[1:]))
            return dq_all, dk, dv

        lo, hi = _query_block_range(j, nq, d, blk, window)
        init = (dq_all, jnp.zeros(k_j.shape, jnp.float32), jnp.zeros(v_j.shape, jnp.float32))
        return jax.lax.fori_loop(lo, hi, body, init)

    def outer(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
        dq_all, dk_all, dv_all = carry
        dq_all, dk, dv = key_block(j, dq_all)
        return dq_all, dk_all.at[j].set(dk), dv_all.at[j].set(dv)

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
            jnp.zeros(v.shape, jnp.float32))
    dq, dk, dv = jax.lax.fori_loop(0, nk, outer, init)
    # d lse / d sink = p_sink = exp(sink - lse); d out / d sink = -p_sink * (rowsum(dO * O)).
    dsink = -jnp.sum(jnp.exp(sink[None, None, :, :, None] - lse) * delta, axis=(0, 1, 4))
    return dq, dk, dv, jnp.where(has_sink, dsink, 0.0)


def _q_blocks(q_BxSxHxD: jax.Array, Kv: int, n: int, blk: int):
    """[B, S, H, Dh] -> [Nq, B, Kv, G, blk, Dh]."""
    B, S, H, Dh = q_BxSxHxD.shape
    return q_BxSxHxD.reshape(B, n, blk, Kv, H // Kv, Dh).transpose(1, 0, 3, 4, 2, 5)


def _kv_blocks(k_BxSxKxD: jax.Array, n: int, blk: int):
    """[B, S, Kv, D] -> [Nk, B, Kv, blk, D]."""
    B, S, Kv, D = k_BxSxKxD.shape
    return k_BxSxKxD.reshape(B, n, blk, Kv, D).transpose(1, 0, 3, 2, 4)


def _seg_blocks(seg_BxS: jax.Array, n: int, blk: int):
    return jnp.moveaxis(seg_BxS.reshape(seg_BxS.shape[0], n, blk), 1, 0)


def _from_q_blocks(x: jax.Array):
    """[Nq, B, Kv, G, blk, X] -> [B, S, H, X]."""
    n, B, Kv, G, blk, X = x.shape
    return x.transpose(1, 0, 4, 2, 3, 5).reshape(B, n * blk, Kv * G, X)


def _from_kv_blocks(x: jax.Array):
    """[Nk, B, Kv, blk, X] -> [B, S, Kv, X]."""
    n, B, Kv, blk, X = x.shape
    return x.transpose(1, 0, 3, 2, 4).reshape(B, n * blk, Kv, X)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _flash(q: jax.Array, k: jax.Array, v: jax.Array, seg_q: jax.Array, seg_k: jax.Array,
           sink: jax.Array, d: jax.Array, blk: int, window: int, has_sink: bool):
    return _flash_fwd(q, k, v, seg_q, seg_k, sink, d, blk, window, has_sink)[0]


def _flash_fwd(q: jax.Array, k: jax.Array, v: jax.Array, seg_q: jax.Array, seg_k: jax.Array,
               sink: jax.Array, d: jax.Array, blk: int, window: int, has_sink: bool):
    H, Kv = q.shape[2], k.shape[2]
    nq, nk = q.shape[1] // blk, k.shape[1] // blk
    sink_kg = sink.astype(jnp.float32).reshape(Kv, H // Kv)
    o, lse = _fwd_blocks(_q_blocks(q, Kv, nq, blk), _kv_blocks(k, nk, blk),
                         _kv_blocks(v, nk, blk), _seg_blocks(seg_q, nq, blk),
                         _seg_blocks(seg_k, nk, blk), sink_kg, d, blk, window, has_sink)
    out = _from_q_blocks(o).astype(q.dtype)
    return out, (q, k, v, seg_q, seg_k, sink, d, o, lse)


def _flash_bwd(blk: int, window: int, has_sink: bool, res: tuple, dout: jax.Array):
    q, k, v, seg_q, seg_k, sink, d, o, lse = res
    H, Kv = q.shape[2], k.shape[2]
    nq, nk = q.shape[1] // blk, k.shape[1] // blk
    sink_kg = sink.astype(jnp.float32).reshape(Kv, H // Kv)
    dq, dk, dv, dsink = _bwd_blocks(_q_blocks(q, Kv, nq, blk), _kv_blocks(k, nk, blk),
                                    _kv_blocks(v, nk, blk), _seg_blocks(seg_q, nq, blk),
                                    _seg_blocks(seg_k, nk, blk), sink_kg, d, o, lse,
                                    _q_blocks(dout.astype(jnp.float32), Kv, nq, blk),
                                    blk, window, has_sink)
    return (_from_q_blocks(dq).astype(q.dtype), _from_kv_blocks(dk).astype(k.dtype),
            _from_kv_blocks(dv).astype(v.dtype), None, None,
            dsink.reshape(H).astype(sink.dtype), None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_attention(q_BxSxHxD: jax.Array, k_BxSxKxD: jax.Array, v_BxSxKxD: jax.Array,
                        segment_ids_BxS: jax.Array, *, block: int = 512,
                        window: int = 0, sinks_H: jax.Array | None = None,
                        kv_segment_ids_BxK: jax.Array | None = None,
                        q_offset: int | jax.Array = 0) -> jax.Array:
    """Flash-style attention in pure JAX; same contract as `plain_attention`.

    Args:
      q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, window, sinks_H, kv_segment_ids_BxK,
        q_offset: as in `plain_attention`.
      block: query/key block length; S (and the key length) is padded up to a multiple of it
        (padding sits after every real token, so causality hides it from real queries).
    Returns:
      [B, S, H, Dv] attention output in q's dtype.
    """
    _check(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, window, sinks_H, kv_segment_ids_BxK)
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    S, H = q_BxSxHxD.shape[1], q_BxSxHxD.shape[2]
    seg_k = segment_ids_BxS if kv_segment_ids_BxK is None else kv_segment_ids_BxK
    blk = min(block, S)

    def pad(x: jax.Array, fill: int = 0):
        extra = -x.shape[1] % blk
        if not extra:
            return x
        widths = ((0, 0), (0, extra)) + ((0, 0),) * (x.ndim - 2)
        return jnp.pad(x, widths, constant_values=fill)

    q, k, v = pad(q_BxSxHxD), pad(k_BxSxKxD), pad(v_BxSxKxD)
    seg_q, seg_k = pad(segment_ids_BxS, -1), pad(seg_k, -1)
    has_sink = sinks_H is not None
    sink = sinks_H if has_sink else jnp.zeros((H,), jnp.float32)
    d = jnp.asarray(q_offset, jnp.int32)
    return _flash(q, k, v, seg_q, seg_k, sink, d, blk, int(window), has_sink)[:, :S]

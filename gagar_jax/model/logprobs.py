"""Per-token log-probabilities and entropies, computed in vocabulary chunks.

Full float32 logits are [B, S, V] -- for a 150k vocabulary and 100k-token rows far too large. We
loop over vocabulary chunks of the output projection with an online log-sum-exp, keeping only
[N] running statistics, so at most one [N, chunk] logits tile is alive at a time.

For a chunk's logits l (and the running max m):
  lse     = m + log(sum exp(l - m))
  entropy = lse - sum softmax(l) * l      = lse - (sum exp(l - m) * l) / sum exp(l - m)
The target's logit is picked out of its chunk with a compare-and-select (no gather of w's
columns, which would cross shards when w is split over the vocabulary).

The gradient is hand-written (`jax.custom_vjp`): the forward saves lse and the entropy per token;
the backward takes each chunk's logits l again and forms, with p = exp(l - lse),
  dl = g_lp * (onehot(target) - p) - g_ent * p * (l - lse + entropy)
before the two gradient matmuls (dh += dl @ w_c^T, dw_c = h^T @ dl). Autodiff through the online
recursion instead differentiates the running max / sum / entropy element by element over every
tile. A cotangent that is symbolically zero (the policy loss reads the entropy as a metric only)
skips its term. By default the backward recomputes the chunk's logits (a fourth N x D x V matmul,
memory flat in V); `keep_logits=True` saves the forward's tiles instead (N x V float32 more
memory, three matmuls: what torch's cross-entropy does), for when they fit.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

if TYPE_CHECKING:
    from gagar_jax.model.transformer import ModelAux, Transformer

_NEG = -1e30


def chunked_logprobs_entropy(h_NxD: jax.Array, w_DxV: jax.Array, targets_N: jax.Array, chunk: int,
                             keep_logits: bool = False) -> tuple[jax.Array, jax.Array]:
    """log p(target) and entropy of softmax(h @ w), without materializing [N, V] at once.

    Args:
      h_NxD: hidden states (any leading shape instead of N works: [..., D]).
      w_DxV: output projection.
      targets_N: int target ids in [0, V), same leading shape as h.
      chunk: vocabulary chunk; V is padded up to a multiple of it (padded columns masked).
      keep_logits: the backward reuses the forward's logits tiles ([N, V] float32 held from the
        forward to the backward) instead of recomputing them.
    Returns:
      (logprob, entropy), float32 with h's leading shape.
    """
    if chunk <= 0:
        raise ValueError(f"chunk must be > 0, got {chunk}")
    D, V = w_DxV.shape
    if h_NxD.shape[-1] != D or targets_N.shape != h_NxD.shape[:-1]:
        raise ValueError(f"shapes do not fit: h {h_NxD.shape}, w {w_DxV.shape}, "
                         f"targets {targets_N.shape}")
    lead = h_NxD.shape[:-1]
    lp, ent = _head(h_NxD.reshape(-1, D), w_DxV, targets_N.reshape(-1), min(chunk, V),
                    bool(keep_logits))
    return lp.reshape(lead), ent.reshape(lead)


def logits_bytes(n_tokens: int, vocab: int, chunk: int) -> int:
    """float32 bytes of all [N, chunk] logits tiles over the padded vocabulary (`keep_logits`)."""
    chunk = min(chunk, vocab)
    return 4 * n_tokens * chunk * -(-vocab // chunk)


def _chunks(w_DxV: jax.Array, chunk: int):
    """[n, D, chunk] column chunks of w (zero-padded) and an additive column mask [n, 1, chunk]
    (0, or -1e30 on padding columns past V), or None when chunk divides V."""
    D, V = w_DxV.shape
    n = -(-V // chunk)
    w = jnp.pad(w_DxV, ((0, 0), (0, n * chunk - V)))
    w_nxDxc = jnp.moveaxis(w.reshape(D, n, chunk), 1, 0)
    if n * chunk == V:
        return w_nxDxc, None
    return w_nxDxc, jnp.where(_columns(n, chunk) < V, 0.0, _NEG).astype(jnp.float32)


def _columns(n: int, chunk: int):
    """Vocabulary id of every column of every chunk, [n, 1, chunk]."""
    return jnp.arange(n * chunk, dtype=jnp.int32).reshape(n, 1, chunk)


def _stats(h_NxD: jax.Array, w_DxV: jax.Array, targets_N: jax.Array, chunk: int, keep_logits: bool):
    """Forward: (logprob, entropy, lse, logits tiles or None), one online pass over the chunks."""
    N = h_NxD.shape[0]
    w_nxDxc, pad_nx1xc = _chunks(w_DxV, chunk)

    def body(carry: tuple, xs: tuple):
        m, s, sl, tgt = carry
        w_c, pad, cols = xs
        logits = jnp.dot(h_NxD, w_c, preferred_element_type=jnp.float32)
        if pad is not None:       # padding columns: logit -1e30, so exp(. - m) = 0 there
            logits = logits + pad
        m_new = jnp.maximum(m, logits.max(-1))
        e = jnp.exp(logits - m_new[:, None])
        corr = jnp.exp(m - m_new)
        s = s * corr + e.sum(-1)
        sl = sl * corr + jnp.sum(e * logits, -1)      # e = 0 exactly where logits = -1e30
        tgt = tgt + jnp.sum(jnp.where(cols == targets_N[:, None], logits, 0.0), -1)
        return (m_new, s, sl, tgt), (logits if keep_logits else None)

    zeros = jnp.zeros((N,), jnp.float32)
    (m, s, sl, tgt), tiles = jax.lax.scan(
        body, (jnp.full((N,), _NEG, jnp.float32), zeros, zeros, zeros),
        (w_nxDxc, pad_nx1xc, _columns(*w_nxDxc.shape[::2])))
    lse = m + jnp.log(s)
    return tgt - lse, lse - sl / s, lse, tiles


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _head(h_NxD: jax.Array, w_DxV: jax.Array, targets_N: jax.Array, chunk: int, keep_logits: bool):
    lp, ent, _, _ = _stats(h_NxD, w_DxV, targets_N, chunk, False)
    return lp, ent


def _head_fwd(h: CustomVJPPrimal, w: CustomVJPPrimal, targets: CustomVJPPrimal, chunk: int,
              keep_logits: bool):
    lp, ent, lse, tiles = _stats(h.value, w.value, targets.value, chunk, keep_logits)
    return (lp, ent), (h.value, w.value, targets.value, lse, ent, tiles)


def _head_bwd(chunk: int, keep_logits: bool, res: tuple, g: tuple):
    h_NxD, w_DxV, targets_N, lse_N, ent_N, tiles = res
    g_lp, g_ent = (None if isinstance(x, SymbolicZero) else x for x in g)
    if g_lp is None and g_ent is None:
        return jnp.zeros_like(h_NxD), jnp.zeros_like(w_DxV), None
    D, V = w_DxV.shape
    w_nxDxc, pad_nx1xc = _chunks(w_DxV, chunk)
    cols_nx1xc = _columns(*w_nxDxc.shape[::2])
    hT_DxN = h_NxD.T      # once, outside the loop: dw_c = hT @ dl is then a plain [D,N]x[N,c] dot

    def body(dh_NxD: jax.Array, xs: tuple):
        w_c, pad, cols, logits = xs
        if logits is None:
            logits = jnp.dot(h_NxD, w_c, preferred_element_type=jnp.float32)
            if pad is not None:
                logits = logits + pad
        logp = logits - lse_N[:, None]
        p = jnp.exp(logp)                    # 0 on padding columns (logit -1e30)
        dl = jnp.zeros_like(p)
        if g_lp is not None:
            dl = jnp.where(cols == targets_N[:, None], g_lp[:, None], 0.0) - g_lp[:, None] * p
        if g_ent is not None:
            ent_term = logp + ent_N[:, None]
            if pad is not None:              # keep p * (-1e30) out of it
                ent_term = jnp.where(pad == 0.0, ent_term, 0.0)
            dl = dl - g_ent[:, None] * p * ent_term
        dl = dl.astype(h_NxD.dtype)         # matmul operands in the compute dtype (bf16 on a pod)
        dh_NxD = dh_NxD + jnp.dot(dl, w_c.T, preferred_element_type=jnp.float32)
        return dh_NxD, jnp.dot(hT_DxN, dl, preferred_element_type=jnp.float32)

    # dh sums over every vocabulary chunk: accumulated in float32 whatever the compute dtype.
    dh, dw_nxDxc = jax.lax.scan(body, jnp.zeros(h_NxD.shape, jnp.float32),
                                (w_nxDxc, pad_nx1xc, cols_nx1xc, tiles))
    dw = jnp.moveaxis(dw_nxDxc, 0, 1).reshape(D, -1)[:, :V]
    return dh.astype(h_NxD.dtype), dw.astype(w_DxV.dtype), None


_head.defvjp(_head_fwd, _head_bwd, symbolic_zeros=True)


def next_token_mask(segment_ids_BxS: jax.Array) -> jax.Array:
    """1.0 where token t has a predecessor in its own segment (t > 0, same segment, not padding)."""
    seg = segment_ids_BxS
    prev = jnp.roll(seg, 1, axis=1)  # a one-column shift: cheap also when S is split over chips
    first = jnp.arange(seg.shape[1]) == 0
    return ((seg == prev) & (seg > 0) & ~first[None]).astype(jnp.float32)


def token_logprobs(model: Transformer, tokens_BxS: jax.Array, segment_ids_BxS: jax.Array,
                   positions_BxS: jax.Array, routed_experts_BxSxLxK: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array, ModelAux]:
    """Log-prob of each token under `model` and the entropy of the distribution it was drawn from.

    Token t is predicted at position t - 1, so `logprobs_BxS[b, t] = log p(tokens[b, t] |
    tokens[b, <t])` and `entropy_BxS[b, t]` is the entropy of that predictive distribution; both
    are 0 at each segment's first token and on padding.

    Every position scores the next token (the last one wraps to the row's first token, a value
    the mask then drops), and the [B, S] results shift right by one. Nothing of width D moves
    between positions, so with rows split along S over chips (context parallelism) only two
    one-column shifts of [B, S] arrays cross a chip boundary, never the hidden states.

    Args:
      model: a `Transformer`.
      tokens_BxS, segment_ids_BxS, positions_BxS: the packed batch (see `batch.py`).
      routed_experts_BxSxLxK: optional routing replay.
    Returns:
      (logprobs_BxS, entropy_BxS, ModelAux), float32.
    """
    h_BxSxD, aux = model.hidden_states(tokens_BxS, segment_ids_BxS=segment_ids_BxS,
                                       positions_BxS=positions_BxS,
                                       routed_experts_BxSxLxK=routed_experts_BxSxLxK)
    cfg = model.cfg
    B, S = tokens_BxS.shape
    keep = (logits_bytes(B * S, cfg.vocab_size, cfg.logprob_vocab_chunk)
            <= cfg.logprob_keep_logits_mib * 2**20)
    next_BxS = jnp.roll(tokens_BxS, -1, axis=1)
    lp, ent = chunked_logprobs_entropy(h_BxSxD, model.output_kernel_DxV(), next_BxS,
                                       cfg.logprob_vocab_chunk, keep)
    mask = next_token_mask(segment_ids_BxS)
    shift = lambda x: jnp.where(mask > 0, jnp.roll(x, 1, axis=1), 0.0)  # t-1 -> t
    return shift(lp), shift(ent), aux

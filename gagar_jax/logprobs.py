"""Per-token log-probabilities and entropies, computed in vocabulary chunks.

Full float32 logits are [B, S, V] -- for a 150k vocabulary and 100k-token rows far too large. We
scan over vocabulary chunks of the output projection with an online log-sum-exp, keeping only
[B, S] running statistics, and rematerialize each chunk in the backward pass (`jax.checkpoint`
on the scan body), so at most one [B, S, chunk] logits tile is alive at a time.

For a chunk's logits l (and the running max m):
  lse     = m + log(sum exp(l - m))
  entropy = lse - sum softmax(l) * l      = lse - (sum exp(l - m) * l) / sum exp(l - m)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30


def chunked_logprobs_entropy(h_NxD, w_DxV, targets_N, chunk: int):
    """log p(target) and entropy of softmax(h @ w), without materializing [N, V] at once.

    Args:
      h_NxD: hidden states (any leading shape instead of N works: [..., D]).
      w_DxV: output projection.
      targets_N: int target ids, same leading shape as h.
      chunk: vocabulary chunk; V is padded up to a multiple of it (padded columns masked).
    Returns:
      (logprob, entropy), float32 with h's leading shape.
    """
    if chunk <= 0:
        raise ValueError(f"chunk must be > 0, got {chunk}")
    D, V = w_DxV.shape
    chunk = min(chunk, V)
    n = -(-V // chunk)
    w = jnp.pad(w_DxV, ((0, 0), (0, n * chunk - V)))
    w_CxDxc = jnp.moveaxis(w.reshape(D, n, chunk), 1, 0)
    lead = h_NxD.shape[:-1]
    zeros = jnp.zeros(lead, jnp.float32)

    @jax.checkpoint  # recompute the chunk's logits in the backward pass instead of saving them
    def body(carry, xs):
        m, s, sl, tgt = carry
        w_c, c = xs
        cols = (c * chunk + jnp.arange(chunk)).reshape((1,) * len(lead) + (chunk,))
        logits = jnp.einsum("...d,dv->...v", h_NxD, w_c, preferred_element_type=jnp.float32)
        logits = jnp.where(cols < V, logits, _NEG)
        m_new = jnp.maximum(m, logits.max(-1))
        e = jnp.where(cols < V, jnp.exp(logits - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        s = s * corr + e.sum(-1)
        sl = sl * corr + jnp.sum(e * jnp.where(cols < V, logits, 0.0), -1)
        tgt = tgt + jnp.sum(jnp.where(cols == targets_N[..., None], logits, 0.0), -1)
        return (m_new, s, sl, tgt), None

    init = (jnp.full(lead, _NEG, jnp.float32), zeros, zeros, zeros)
    (m, s, sl, tgt), _ = jax.lax.scan(body, init, (w_CxDxc, jnp.arange(n)))
    lse = m + jnp.log(s)
    return tgt - lse, lse - sl / s


def next_token_mask(segment_ids_BxS):
    """1.0 where token t has a predecessor in its own segment (t > 0, same segment, not padding)."""
    seg = segment_ids_BxS
    prev = jnp.roll(seg, 1, axis=1)  # a one-column shift: cheap also when S is split over chips
    first = jnp.arange(seg.shape[1]) == 0
    return ((seg == prev) & (seg > 0) & ~first[None]).astype(jnp.float32)


def token_logprobs(model, tokens_BxS, segment_ids_BxS, positions_BxS, routed_experts_BxSxLxK=None):
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
    next_BxS = jnp.roll(tokens_BxS, -1, axis=1)
    lp, ent = chunked_logprobs_entropy(h_BxSxD, model.output_kernel_DxV(), next_BxS,
                                       model.cfg.logprob_vocab_chunk)
    mask = next_token_mask(segment_ids_BxS)
    shift = lambda x: jnp.where(mask > 0, jnp.roll(x, 1, axis=1), 0.0)  # noqa: E731  (t-1 -> t)
    return shift(lp), shift(ent), aux

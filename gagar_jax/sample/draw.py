"""Drawing the next token: temperature, top-k, top-p, a key per row; raw and processed log-probs.

Pure functions of one row each (vectorised over rows), in vLLM's order: the logits are divided
by the temperature, top-k keeps the k largest (ties at the k-th value kept), top-p keeps the
smallest set of the most likely remaining tokens whose probability (renormalised after top-k)
reaches p, and the token is drawn from the softmax of what is kept (by its inverse CDF: one
uniform number per row). Two log-probs come back per
token (`SamplingSpec.logprobs_mode`): **raw**, the log-softmax of the model's logits (what the
learner computes), and **processed**, of the distribution it was drawn from.

A row's draw depends only on its key, which the sampler derives from the request's seed and the
token's index in the completion (`row_keys`): a sample is the same alone or in any batch.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

_NEG = -1e30


@flax.struct.dataclass
class Draw:
    """One token per row: the token, its raw and processed log-probs."""
    token_B: jax.Array
    raw_logprob_B: jax.Array
    processed_logprob_B: jax.Array


def row_keys(seed_B: jax.Array, index_B: jax.Array) -> jax.Array:
    """The key of each row's draw: `fold_in(key(seed), index)` (seed as uint32)."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(
        seed_B.astype(jnp.uint32), index_B.astype(jnp.uint32))


def keep_mask(scaled_BxV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """The tokens top-k then top-p keep, per row: [B, V] bool (top_k <= 0, top_p >= 1: off)."""
    V = scaled_BxV.shape[-1]
    desc = -jnp.sort(-scaled_BxV, axis=-1)                                   # [B, V]
    k = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, V), V)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)               # [B, 1]
    in_k = desc >= kth
    p_sorted = jax.nn.softmax(jnp.where(in_k, desc, _NEG), axis=-1)
    before = jnp.cumsum(p_sorted, axis=-1) - p_sorted
    in_p = (before < top_p_B[:, None]) | (top_p_B[:, None] >= 1.0)
    count = jnp.maximum(jnp.sum(in_k & in_p, axis=-1), 1)                  # a prefix of desc
    cut = jnp.take_along_axis(desc, (count - 1)[:, None], axis=-1)
    return scaled_BxV >= cut


def processed_logits(logits_BxV: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array,
                     top_p_B: jax.Array) -> jax.Array:
    """Logits / temperature with the tokens top-k and top-p drop at -1e30 (float32). A
    temperature <= 0 is greedy (top-1)."""
    logits = logits_BxV.astype(jnp.float32)
    greedy = temperature_B <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature_B)[:, None]
    top_k = jnp.where(greedy, 1, top_k_B)
    trunc = (top_k > 0) | (top_p_B < 1.0)
    # The sort runs only when some row truncates (a plain temperature draw needs none).
    keep = jax.lax.cond(jnp.any(trunc), lambda: keep_mask(scaled, top_k, top_p_B),
                        lambda: jnp.ones(scaled.shape, bool))
    return jnp.where(keep, scaled, _NEG)


def sample(logits_BxV: jax.Array, keys_B: jax.Array, temperature_B: jax.Array,
           top_k_B: jax.Array, top_p_B: jax.Array) -> Draw:
    """Draws one token per row from its processed distribution.

    Args:
      logits_BxV: the model's logits (float32).
      keys_B: one PRNG key per row (`row_keys`).
      temperature_B, top_k_B, top_p_B: per-row sampling parameters.
    Returns:
      `Draw` with the token and both log-probs.
    """
    proc = processed_logits(logits_BxV, temperature_B, top_k_B, top_p_B)
    # Inverse CDF: one uniform per row (a Gumbel draw needs V of them: 5x the time at V = 32k).
    # Token j is drawn iff cdf[j-1] <= u < cdf[j], so a dropped token (p = 0) never is.
    cdf = jnp.cumsum(jax.nn.softmax(proc, axis=-1), axis=-1)
    u = jax.vmap(jax.random.uniform)(keys_B) * cdf[:, -1]
    token = jnp.minimum(jnp.sum(cdf <= u[:, None], axis=-1),
                        logits_BxV.shape[-1] - 1).astype(jnp.int32)
    pick = lambda lp: jnp.take_along_axis(lp, token[:, None], axis=-1)[:, 0]
    return Draw(token_B=token,
                raw_logprob_B=pick(jax.nn.log_softmax(logits_BxV.astype(jnp.float32), axis=-1)),
                processed_logprob_B=pick(jax.nn.log_softmax(proc, axis=-1)))

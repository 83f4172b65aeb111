"""MoE router: pure fp32 functions from router logits to expert ids and gate weights.

Two scoring rules (`ROUTERS`):
  * `softmax`       Qwen3-MoE: softmax over all E experts, top-k, optionally renormalized.
  * `sigmoid_bias`  DeepSeek-V3 style: sigmoid scores; a non-trainable bias shifts which experts
                    are *selected* but not the gate weights (taken from the unbiased scores and
                    normalized if `norm_topk_prob`); `update_bias` is the auxiliary-loss-free
                    balancing step.

Routing replay: where the rollout engine recorded the experts it used for a token, those ids
replace the top-k selection, and the gate weights are still the (differentiable) router
probabilities of those experts, so the router keeps learning.

Statistics (load, auxiliary loss, z-loss) are means over the non-padding tokens of the whole
array: under `jit` with a sharded token axis this is the global-batch statistic. Load and the
auxiliary loss's f_e count the experts actually used (the replayed ones where recorded).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class RouterOutput:
    idx_TxK: jax.Array       # int32 expert ids used (replayed where recorded)
    weights_TxK: jax.Array   # fp32 gate weights, differentiable w.r.t. the logits
    scores_TxE: jax.Array    # fp32 softmax probabilities or sigmoid scores
    load_E: jax.Array        # fp32 fraction of the non-padding assignments per expert (sums to 1)
    counts_E: jax.Array      # fp32 number of non-padding assignments per expert
    aux_loss: jax.Array      # fp32 scalar load-balancing loss, E * sum_e f_e * P_e (min K)
    z_loss: jax.Array        # fp32 scalar mean of logsumexp(logits)^2
    replayed_T: jax.Array    # bool: the token's experts came from the replay record


def _softmax_scores(logits_TxE: jax.Array):
    return jax.nn.softmax(logits_TxE, axis=-1)


def _sigmoid_scores(logits_TxE: jax.Array):
    return jax.nn.sigmoid(logits_TxE)


# Scoring rule -> (scores, whether the selection bias applies).
ROUTERS: Mapping[str, tuple[Callable[[jax.Array], jax.Array], bool]] = {
    "softmax": (_softmax_scores, False),
    "sigmoid_bias": (_sigmoid_scores, True),
}


def _mean_over(x_TxN: jax.Array, mask_T: jax.Array) -> jax.Array:
    """Masked mean over the token axis (0 when every token is padding)."""
    return jnp.sum(x_TxN * mask_T[:, None], axis=0) / jnp.maximum(jnp.sum(mask_T), 1.0)


def expert_counts(idx_TxK: jax.Array, num_experts: int, token_mask_T: jax.Array) -> jax.Array:
    """Number of non-padding (token, k) assignments per expert, fp32 [E]."""
    one_hot_TxE = jax.nn.one_hot(idx_TxK, num_experts, dtype=jnp.float32).sum(1)
    return jnp.sum(one_hot_TxE * token_mask_T[:, None], axis=0)


def load_balancing_loss(probs_TxE: jax.Array, idx_TxK: jax.Array,
                        token_mask_T: jax.Array) -> jax.Array:
    """Switch / Qwen3-MoE auxiliary loss E * sum_e f_e * P_e over non-padding tokens.

    f_e = (assignments to e) / tokens (sums to K), P_e = mean router probability of e.
    Equals K for a perfectly balanced router (the Hugging Face Qwen3-MoE convention).
    """
    e = probs_TxE.shape[-1]
    n = jnp.maximum(jnp.sum(token_mask_T), 1.0)
    f_E = jax.lax.stop_gradient(expert_counts(idx_TxK, e, token_mask_T)) / n
    return e * jnp.sum(f_E * _mean_over(probs_TxE, token_mask_T))


def router_z_loss(logits_TxE: jax.Array, token_mask_T: jax.Array) -> jax.Array:
    """Mean over non-padding tokens of logsumexp(logits)^2 (keeps router logits small)."""
    lse_T = jax.nn.logsumexp(logits_TxE, axis=-1)
    return _mean_over((lse_T * lse_T)[:, None], token_mask_T)[0]


def _group_limit(select_TxE: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """Selection scores with every expert outside the topk_group best groups set to -inf."""
    t, e = select_TxE.shape
    grouped = select_TxE.reshape(t, n_group, e // n_group)
    group_score_TxG = jax.lax.top_k(grouped, 2)[0].sum(-1)
    _, gidx = jax.lax.top_k(group_score_TxG, topk_group)
    keep_TxG = jax.nn.one_hot(gidx, n_group, dtype=jnp.float32).sum(1) > 0
    keep_TxE = jnp.repeat(keep_TxG, e // n_group, axis=1)
    return jnp.where(keep_TxE, select_TxE, -jnp.inf)


def route(logits_TxE: jax.Array, *, top_k: int, router: str = "softmax",
          norm_topk_prob: bool = True, bias_E: Optional[jax.Array] = None,
          n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
          token_mask_T: Optional[jax.Array] = None,
          replay_idx_TxK: Optional[jax.Array] = None) -> RouterOutput:
    """Selects K experts per token and their gate weights (all in fp32).

    Args:
      logits_TxE: router logits (cast to fp32).
      top_k: experts per token (K).
      router: a key of `ROUTERS`.
      norm_topk_prob: renormalize the K gate weights to sum to 1.
      bias_E: selection bias for `sigmoid_bias` (non-trainable; zeros if None). Ignored
        (must be None) for `softmax`.
      n_group, topk_group: group-limited selection (DeepSeek-V3 / MiMo): experts form n_group
        contiguous groups; a group scores the sum of its two best selection scores; only the
        topk_group best groups compete for the top_k.
      routed_scaling_factor: multiplies the (normalized) gate weights.
      token_mask_T: 1 for real tokens, 0 for padding (excluded from load and losses);
        default all ones.
      replay_idx_TxK: recorded expert ids; a row is replayed iff all K ids lie in [0, E),
        otherwise (e.g. -1 = no record) the router selects.
    Returns:
      RouterOutput.
    """
    if router not in ROUTERS:
        raise ValueError(f"router={router!r}; expected one of {sorted(ROUTERS)}")
    if logits_TxE.ndim != 2:
        raise ValueError(f"logits_TxE must be [T, E], got shape {logits_TxE.shape}")
    t, e = logits_TxE.shape
    if not 0 < top_k <= e:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={e}]")
    score_fn, uses_bias = ROUTERS[router]
    if bias_E is not None and not uses_bias:
        raise ValueError(f"bias_E is only used by router='sigmoid_bias', got router={router!r}")
    if bias_E is not None and bias_E.shape != (e,):
        raise ValueError(f"bias_E shape {bias_E.shape} != (num_experts={e},)")
    mask_T = (jnp.ones((t,), jnp.float32) if token_mask_T is None
              else token_mask_T.astype(jnp.float32))
    if mask_T.shape != (t,):
        raise ValueError(f"token_mask_T shape {mask_T.shape} != ({t},)")

    logits_TxE = logits_TxE.astype(jnp.float32)
    scores_TxE = score_fn(logits_TxE)
    select_TxE = scores_TxE
    if uses_bias and bias_E is not None:
        select_TxE = scores_TxE + jax.lax.stop_gradient(bias_E.astype(jnp.float32))[None, :]
    select_TxE = jax.lax.stop_gradient(select_TxE)
    if n_group > 1:
        select_TxE = _group_limit(select_TxE, n_group, topk_group)
    # Ties (equal scores) go to the lower expert id (lax.top_k); torch.topk leaves them unspecified.
    _, idx_TxK = jax.lax.top_k(select_TxE, top_k)

    replayed_T = jnp.zeros((t,), bool)
    if replay_idx_TxK is not None:
        if replay_idx_TxK.shape != (t, top_k):
            raise ValueError(f"replay_idx_TxK shape {replay_idx_TxK.shape} != ({t}, {top_k})")
        replay = replay_idx_TxK.astype(jnp.int32)
        replayed_T = jnp.all((replay >= 0) & (replay < e), axis=-1)
        idx_TxK = jnp.where(replayed_T[:, None], replay, idx_TxK)
    idx_TxK = idx_TxK.astype(jnp.int32)

    # Gate weights gathered from the unbiased scores: differentiable, also for replayed ids.
    weights_TxK = jnp.take_along_axis(scores_TxE, idx_TxK, axis=-1)
    if norm_topk_prob:
        weights_TxK = weights_TxK / (weights_TxK.sum(-1, keepdims=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights_TxK = weights_TxK * routed_scaling_factor

    counts_E = expert_counts(idx_TxK, e, mask_T)
    # The balancing loss wants a distribution over experts: normalize sigmoid scores.
    probs_TxE = scores_TxE / scores_TxE.sum(-1, keepdims=True) if uses_bias else scores_TxE
    return RouterOutput(
        idx_TxK=idx_TxK, weights_TxK=weights_TxK, scores_TxE=scores_TxE,
        load_E=counts_E / jnp.maximum(counts_E.sum(), 1.0), counts_E=counts_E,
        aux_loss=load_balancing_loss(probs_TxE, idx_TxK, mask_T),
        z_loss=router_z_loss(logits_TxE, mask_T), replayed_T=replayed_T)


def update_bias(bias_E: jax.Array, load_E: jax.Array, rate: float) -> jax.Array:
    """Auxiliary-loss-free balancing step: bias += rate * sign(mean(load) - load).

    Under-loaded experts gain selection bias, over-loaded ones lose it. `load_E` may be
    counts or fractions (only the sign matters).
    """
    load_E = jax.lax.stop_gradient(load_E.astype(jnp.float32))
    return bias_E + rate * jnp.sign(jnp.mean(load_E) - load_E).astype(bias_E.dtype)

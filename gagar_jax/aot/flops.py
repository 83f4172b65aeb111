"""Parameter counts, model FLOPs and memory worked out on paper from a model config.

The counts follow the layouts the model implements (see `gagar_jax/model/`): per layer GQA attention
(full or sliding-window, with the MiMo-V2-Flash options: value head width, sliding-layer KV heads
and sinks, optional q/k RMS norms), two RMSNorms, and either a SwiGLU dense MLP (the first
`num_dense_layers` layers) or a softmax/sigmoid router over `num_experts` SwiGLU experts of which
`top_k` run per token. `cfg` is anything with the attributes of the `model` section of
`configs/tiny_cpu.py` (a `ModelConfig` or the ConfigDict itself).

Used by `tests/test_configs.py` (the configs' docstrings state these numbers) and by
`compile.py` / `docs/scaling.md` (the paper-side memory estimate beside the compiler's).
"""
from __future__ import annotations

import dataclasses
from typing import Any

# Bytes per element of the dtype names configs use.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of one model, split the way memory and FLOPs need them."""

    embedding: int       # input embedding table V x D
    lm_head: int         # output projection V x D (0 when tied to the embedding)
    attention: int       # all layers: q, k, v, o projections and the q/k norms
    dense_mlp: int       # the first num_dense_layers SwiGLU MLPs
    router: int          # all MoE layers' router matrices D x E
    experts: int         # all MoE layers' experts, E x 3 x D x F each
    norms: int           # per-layer RMSNorms and the final norm
    active_experts: int  # the experts a token runs through: K x 3 x D x F per MoE layer

    @property
    def total(self) -> int:
        return (self.embedding + self.lm_head + self.attention + self.dense_mlp + self.router
                + self.experts + self.norms)

    @property
    def active(self) -> int:
        """Parameters one token touches (the embedding row counts as the whole table, as usual)."""
        return self.total - self.experts + self.active_experts

    @property
    def active_matmul(self) -> int:
        """Active parameters that take part in a matmul (all but the embedding lookup and norms)."""
        return self.active - self.embedding - self.norms


def _get(cfg: Any, name: str, default: Any):
    """A model field that older ConfigDicts may lack (the MiMo-family fields)."""
    try:
        return getattr(cfg, name)
    except (AttributeError, KeyError):
        return default


def attention_layout(cfg: Any) -> list[tuple[bool, int, int]]:
    """Per layer (sliding, KV heads, value head width) for the model's layer types."""
    types = tuple(_get(cfg, "layer_types", ()))
    kv_s = _get(cfg, "sliding_num_kv_heads", 0) or cfg.num_kv_heads
    dv = _get(cfg, "v_head_dim", 0) or cfg.head_dim
    return [(bool(types) and types[i] == "sliding", kv_s if types and types[i] == "sliding"
             else cfg.num_kv_heads, dv) for i in range(cfg.num_layers)]


def num_moe_layers(cfg: Any) -> int:
    """Layers with a routed-expert MLP."""
    return cfg.num_layers - cfg.num_dense_layers


def param_counts(cfg: Any) -> ParamCounts:
    """Analytic parameter counts of the model `cfg` describes.

    Args:
      cfg: a `ModelConfig` or the `model` ConfigDict section.
    Returns:
      `ParamCounts`; `.total` and `.active` are the headline numbers.
    """
    D, V = cfg.hidden_size, cfg.vocab_size
    H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    L, L_moe = cfg.num_layers, num_moe_layers(cfg)
    del KV  # per layer type below
    qk_norm, sinks = _get(cfg, "qk_norm", True), _get(cfg, "attention_sinks", False)
    attention = sum(D * H * hd + D * kv * (hd + dv) + H * dv * D + (2 * hd if qk_norm else 0)
                    + (H if sliding and sinks else 0)
                    for sliding, kv, dv in attention_layout(cfg))
    per_expert = 3 * D * cfg.moe_intermediate_size
    return ParamCounts(
        embedding=V * D,
        lm_head=0 if cfg.tie_embeddings else V * D,
        attention=attention,
        dense_mlp=cfg.num_dense_layers * 3 * D * cfg.intermediate_size,
        router=L_moe * D * cfg.num_experts,
        experts=L_moe * cfg.num_experts * per_expert,
        norms=2 * L * D + D,
        active_experts=L_moe * cfg.top_k * per_expert,
    )


def mean_keys_per_query(seq_len: int, window: int = 0) -> float:
    """Keys a causal query sees on average over a row: (S + 1) / 2, or with a window W < S,
    (W (W + 1) / 2 + (S - W) W) / S (a query at t sees min(t + 1, W) keys)."""
    if not window or window >= seq_len:
        return (seq_len + 1) / 2.0
    return (window * (window + 1) / 2.0 + (seq_len - window) * window) / seq_len


def attention_flops_per_token(cfg: Any, seq_len: int) -> float:
    """Forward FLOPs per token of the score and value matmuls (QK^T and PV), causal.

    Per layer and key: 2 * H * head_dim (scores) + 2 * H * v_head_dim (values); a full layer's
    query sees (seq_len + 1) / 2 keys on average, a sliding layer's at most its window.
    """
    window = _get(cfg, "sliding_window", 0)
    return sum(2.0 * cfg.num_heads * (cfg.head_dim + dv)
               * mean_keys_per_query(seq_len, window if sliding else 0)
               for sliding, _, dv in attention_layout(cfg))


def train_flops_per_token(cfg: Any, seq_len: int) -> float:
    """Model FLOPs per trained token of one forward + backward pass (3x the forward).

    Forward = 2 x active matmul parameters (the 2*N rule) + causal attention scores. Remat
    recomputation is not counted (these are model FLOPs, the MFU numerator).

    Args:
      cfg: model config.
      seq_len: tokens per packed row (attention cost grows with it).
    Returns:
      FLOPs per token.
    """
    forward = 2.0 * param_counts(cfg).active_matmul + attention_flops_per_token(cfg, seq_len)
    return 3.0 * forward


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device of the train state, worked out on paper (no activations)."""

    params: float
    grads: float
    optimizer: float

    @property
    def state(self) -> float:
        return self.params + self.grads + self.optimizer


def state_bytes_per_device(cfg: Any, expert_shards: int, other_shards: int, *,
                           optimizer_moments: int = 2, moment_bytes: int = 4) -> MemoryEstimate:
    """Parameters, gradients and optimizer moments per device.

    Expert weights are split `expert_shards` ways (expert x fsdp x tensor on a pod mesh), every
    other parameter `other_shards` ways (fsdp x tensor: attention, embeddings, dense MLPs are
    replicated over the expert axis). Gradients have the parameter dtype; Adam keeps
    `optimizer_moments` moments of `moment_bytes` each.

    Args:
      cfg: model config (`param_dtype` sets parameter and gradient bytes).
      expert_shards, other_shards: ways the two kinds of parameters are split.
    Returns:
      `MemoryEstimate` in bytes per device.
    """
    if expert_shards < 1 or other_shards < 1:
        raise ValueError(f"shard counts must be >= 1, got {expert_shards}, {other_shards}")
    p = param_counts(cfg)
    n = p.experts / expert_shards + (p.total - p.experts) / other_shards
    p_bytes = DTYPE_BYTES[cfg.param_dtype]
    return MemoryEstimate(params=n * p_bytes, grads=n * p_bytes,
                          optimizer=n * optimizer_moments * moment_bytes)


def remat_activation_bytes_per_device(cfg: Any, tokens_per_device: int) -> float:
    """Layer-boundary activations kept for the backward pass under full remat.

    With `remat="full"` each layer keeps only its input [tokens, D] in the compute dtype; the
    rest is recomputed one layer at a time. This is the dominant activation term at long
    sequence lengths (the per-layer working set comes on top, once).
    """
    return cfg.num_layers * tokens_per_device * cfg.hidden_size * DTYPE_BYTES[cfg.compute_dtype]

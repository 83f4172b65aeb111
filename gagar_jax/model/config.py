"""The model's settings (`ModelConfig`): shapes, layer kinds, kernels and their checks.

Built from a config file's `model` section; every check of one setting against another lives in
`__post_init__`, so a wrong combination fails before anything is compiled.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax

from gagar_jax.config import section_dict
from gagar_jax.kernels.attention import registry as attention_registry
from gagar_jax.kernels.experts import registry as expert_registry

if TYPE_CHECKING:
    import ml_collections

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # Save the weight matmuls (no batch dims), recompute norms, activations, attention.
    "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
DTYPES = ("float32", "bfloat16")


SLIDING_WINDOW_CONVENTIONS = ("vllm", "transformers")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Model architecture and numerics (the `model` section of a config).

    Attributes:
      vocab_size, hidden_size (D), num_layers, num_heads (H), num_kv_heads, head_dim: shape.
      moe_intermediate_size: F, each expert's SwiGLU width. intermediate_size: dense MLP width.
      num_dense_layers: the first layers use a dense MLP instead of the MoE layer.
      num_experts (E), top_k (K), norm_topk_prob: router; renormalize the top-k gate weights.
      router: "softmax" (Qwen3) | "sigmoid_bias" (DeepSeek-V3 aux-loss-free balancing bias).
      rope_theta, rms_norm_eps: RoPE base and RMSNorm epsilon.
      tie_embeddings: the output head reuses the embedding matrix.
      param_dtype, compute_dtype: "float32" | "bfloat16".
      remat: "none" | "full" | "save_matmuls" (activation rematerialization of each layer).
      attention: "auto" (the default: splash on TPU, blockwise elsewhere, from the mesh's
        devices; `kernels/attention/registry.py`) | "blockwise" (memory-linear pure JAX,
        custom VJP) | "splash" (Pallas TPU kernel; interpreted elsewhere) | "plain" (reference)
        | any registered kernel.
      attn_block: query/key block of the blockwise and splash paths.
      expert_backend: the expert FFN implementation, a kernel of `kernels/experts/registry.py`,
        or "auto" (the default): the fastest exact backend for the mesh's devices (grouped / ep
        on CPU, ragged / ep_a2a on TPU and GPU).
      ep_local_ffn: `ep_a2a`'s per-device expert FFN, "grouped" | "megablox" | "auto" (the
        default: megablox when compiling for TPU at widths its kernels lower for).
      ep_chunks: `ep_a2a` exchanges a chip's tokens in this many chunks, one after another; its
        dropless receive buffers are n_expert * T_local * K / ep_chunks rows (0, the default:
        the expert-axis size, i.e. T_local * K rows). More chunks: smaller buffers, more and
        smaller exchanges (docs/scaling.md).
      ep_row_tile: the row tile of `ep_a2a`'s megablox kernels (0: the kernel default, 512).
        Each expert's run of received rows costs whole tiles, so a tile near the rows an expert
        gets per chunk doubles the expert matmul work; 256 keeps a v5p kernel compute-bound
        (docs/scaling.md, "Hardware FLOPs as compiled").
      "auto" values are resolved once, for the mesh's devices, when the model or the train state
      is built (`resolve_kernels`).
      logprob_vocab_chunk: vocab chunk of the log-prob / entropy computation.
      logprob_keep_logits_mib: the log-prob backward reuses the forward's float32 logits when
        they take at most this many MiB per call (saves one of four N x D x V matmuls); larger
        batches, and 0 (the default), recompute them chunk by chunk (memory flat in V).
      router_aux_loss_coef, router_z_loss_coef: loss weights (read by the loss).
      router_bias_update_rate: step of the sigmoid_bias router's balancing-bias update.

    MiMo-V2-Flash family features (defaults keep the Qwen3-MoE layout; see docs/model.md):
      layer_types: per-layer "full" | "sliding" attention; () = every layer full. A string, or
        entries with commas, split on the commas (`--config.model.layer_types=full,sliding`).
      sliding_window: W of sliding layers: a query sees W keys counting itself (HF semantics).
      sliding_window_convention: how config.json's Hub key `sliding_window_size` N maps to W, i.e.
        which engine's reading of a MiMo checkpoint the learner trains with: "vllm" (the
        default; vLLM 0.32: W = N, the query included) or "transformers" (transformers 5.24 and
        the SGLang reference: W = N + 1, N keys before the query). It decides what publishing
        writes (`hf.config_json`); `sliding_window` itself always means W (docs/model.md).
      sliding_num_kv_heads: KV heads of sliding layers (0 = num_kv_heads).
      attention_sinks: sliding layers carry a learned per-head sink logit (softmax denominator).
      v_head_dim: value head width (0 = head_dim); q/k keep head_dim.
      attention_value_scale: values are multiplied by it before attention.
      partial_rotary_factor: RoPE rotates the first int(head_dim * factor) q/k dims only.
      sliding_rope_theta: RoPE base of sliding layers (0 = rope_theta).
      qk_norm: per-head RMSNorm of q and k (Qwen3 yes, MiMo no).
      n_group, topk_group: group-limited top-k: keep the topk_group groups (of n_group) whose
        two best selection scores sum highest, then pick top_k experts inside them.
      routed_scaling_factor: gate weights are multiplied by it (after normalization).
      hf_family: checkpoint family to export to: "auto" (the first of `hf.families.FAMILIES`
        that can express this config, or none) or a family name, which must express it (checked
        by the start-up checks and by `save_pretrained`: `hf.families.resolve_family`).
    """
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    moe_intermediate_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    num_dense_layers: int = 0
    norm_topk_prob: bool = True
    router: str = "softmax"
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "none"
    attention: str = "auto"
    attn_block: int = 512
    expert_backend: str = "auto"
    ep_local_ffn: str = "auto"
    ep_chunks: int = 0
    ep_row_tile: int = 0
    logprob_vocab_chunk: int = 8192
    logprob_keep_logits_mib: int = 0
    router_aux_loss_coef: float = 1e-3
    router_z_loss_coef: float = 0.0
    router_bias_update_rate: float = 1e-3
    layer_types: tuple = ()
    sliding_window: int = 0
    sliding_window_convention: str = "vllm"
    sliding_num_kv_heads: int = 0
    attention_sinks: bool = False
    v_head_dim: int = 0
    attention_value_scale: float = 1.0
    partial_rotary_factor: float = 1.0
    sliding_rope_theta: float = 0.0
    qk_norm: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    hf_family: str = "auto"

    def __post_init__(self):
        types = (self.layer_types,) if isinstance(self.layer_types, str) else self.layer_types
        # A command-line override "full,sliding" arrives as one string (or a 1-tuple of it).
        object.__setattr__(self, "layer_types", tuple(
            part.strip() for item in types for part in str(item).split(",") if part.strip()))
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "moe_intermediate_size", "intermediate_size", "num_experts",
                     "top_k", "attn_block", "logprob_vocab_chunk"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"model.{name} must be > 0, got {getattr(self, name)}")
        if self.ep_chunks < 0:
            raise ValueError(f"model.ep_chunks must be >= 0 (0 = the expert-axis size), "
                             f"got {self.ep_chunks}")
        if self.ep_row_tile < 0 or self.ep_row_tile % 16:
            raise ValueError(f"model.ep_row_tile must be 0 or a positive multiple of 16, "
                             f"got {self.ep_row_tile}")
        if self.logprob_keep_logits_mib < 0:
            raise ValueError(f"model.logprob_keep_logits_mib must be >= 0, "
                             f"got {self.logprob_keep_logits_mib}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_heads={self.num_heads} must be a multiple of "
                             f"model.num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim must be even (RoPE), got {self.head_dim}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"model.top_k={self.top_k} exceeds model.num_experts={self.num_experts}"
            )
        if not 0 <= self.num_dense_layers <= self.num_layers:
            raise ValueError(f"model.num_dense_layers must be in [0, num_layers], "
                             f"got {self.num_dense_layers}")
        checks = {
            "router": ("softmax", "sigmoid_bias"),
            "param_dtype": DTYPES,
            "compute_dtype": DTYPES,
            "remat": tuple(REMAT_POLICIES),
            "attention": attention_registry.names(),
            "expert_backend": expert_registry.names(),
            "ep_local_ffn": ("auto",) + expert_registry.LOCAL_FFNS,
        }
        for name, allowed in checks.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"model.{name} must be one of {allowed}, got {getattr(self, name)!r}"
                )
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("model.rope_theta and model.rms_norm_eps must be > 0")
        self._check_family_features()

    def _check_family_features(self):
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"model.layer_types has {len(self.layer_types)} entries for "
                                 f"num_layers={self.num_layers}")
            bad = sorted(set(self.layer_types) - {"full", "sliding"})
            if bad:
                raise ValueError(
                    f"model.layer_types entries must be 'full' or 'sliding', got {bad}"
                )
        if self.sliding_window_convention not in SLIDING_WINDOW_CONVENTIONS:
            raise ValueError(
                f"model.sliding_window_convention must be one of "
                f"{SLIDING_WINDOW_CONVENTIONS}, got {self.sliding_window_convention!r}"
            )
        if self.has_sliding and self.sliding_window < 1:
            raise ValueError(
                "model.sliding_window must be >= 1 when layer_types has sliding layers"
            )
        for name in ("sliding_window", "sliding_num_kv_heads", "v_head_dim"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.{name} must be >= 0, got {getattr(self, name)}")
        if self.num_heads % self.sliding_kv_heads:
            raise ValueError(f"model.num_heads={self.num_heads} must be a multiple of "
                             f"model.sliding_num_kv_heads={self.sliding_kv_heads}")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"model.partial_rotary_factor must be in (0, 1], "
                             f"got {self.partial_rotary_factor}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"int(head_dim * partial_rotary_factor) = {self.rotary_dim} must be "
                             "even and >= 2")
        if self.sliding_rope_theta < 0 or self.attention_value_scale <= 0:
            raise ValueError("model.sliding_rope_theta must be >= 0 and "
                             "model.attention_value_scale > 0")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"model.n_group={self.n_group} must divide "
                             f"num_experts={self.num_experts}")
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError("model.n_group > 1 needs >= 2 experts per group (groups are scored "
                             "by their two best experts)")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(
                f"model.topk_group={self.topk_group} must be in [1, n_group={self.n_group}]"
            )
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(f"model.top_k={self.top_k} exceeds the experts of topk_group="
                             f"{self.topk_group} groups")
        if self.routed_scaling_factor <= 0:
            raise ValueError("model.routed_scaling_factor must be > 0")
        if not isinstance(self.hf_family, str) or not self.hf_family:
            raise ValueError(
                f"model.hf_family must be 'auto' or a family name, got {self.hf_family!r}"
            )

    # Derived shapes and layer kinds.
    @property
    def has_sliding(self) -> bool:
        return "sliding" in self.layer_types

    @property
    def sliding_kv_heads(self) -> int:
        return self.sliding_num_kv_heads or self.num_kv_heads

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding"

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @classmethod
    def from_config(cls, section: ml_collections.ConfigDict | dict) -> ModelConfig:
        """Builds the config from the `model` section (ConfigDict or dict); unknown keys fail."""
        return cls(**section_dict(section, cls, "model"))

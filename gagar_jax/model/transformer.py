"""The policy: a decoder-only MoE transformer, Qwen3-MoE or MiMo-V2-Flash layout (Flax NNX).

    tokens -> embedding -> [dense blocks] -> [MoE blocks] -> RMSNorm -> lm_head (or tied) -> logits
    block:  x + attn(norm(x)),  then  h + mlp(norm(h))   (mlp = SwiGLU, or the MoE layer;
            attn = full or sliding-window attention, per `layer_types`)

The first `num_dense_layers` blocks use a dense MLP, the rest the MoE layer. Layers are grouped
into `LayerStack`s (`layer_stacks`): a pattern of layer kinds repeated R times, one stack of
parameters with a leading axis of R per pattern position, run by `jax.lax.scan` over R. A
uniform Qwen3 model is two stacks of pattern length 1 (`dense_layers`, `moe_layers`); MiMo's
"4 sliding + 1 full" interleave is scanned over its period. So compile time depends on the
pattern, not on depth; every block is rematerialized per `remat`.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from gagar_jax.config import section_dict
from gagar_jax.kernels.attention import registry as attention_registry
from gagar_jax.kernels.experts import registry as expert_registry
from gagar_jax.model.layer_pattern import LayerStack, layer_stacks  # noqa: F401  (re-exported)
from gagar_jax.model.layers import Attention, DenseMLP, RMSNorm, normal_init
from gagar_jax.model.moe import MoE, RouterBias
from gagar_jax.sharding import constrain

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
      "auto" values are resolved once, for the mesh's devices, when the model or the train state
      is built (`resolve_kernels`).
      logprob_vocab_chunk: vocab chunk of the log-prob / entropy computation.
      logprob_keep_logits_mib: the log-prob backward reuses the forward's float32 logits when
        they take at most this many MiB per call (saves one of four N x D x V matmuls); larger
        batches, and 0 (the default), recompute them chunk by chunk (memory flat in V).
      router_aux_loss_coef, router_z_loss_coef: loss weights (read by the loss).
      router_bias_update_rate: step of the sigmoid_bias router's balancing-bias update.

    MiMo-V2-Flash family features (defaults keep the Qwen3-MoE layout; see docs/model.md):
      layer_types: per-layer "full" | "sliding" attention; () = every layer full.
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
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "moe_intermediate_size",
            "intermediate_size",
            "num_experts",
            "top_k",
            "attn_block",
            "logprob_vocab_chunk",
        ):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"model.{name} must be > 0, got {getattr(self, name)}")
        if self.ep_chunks < 0:
            raise ValueError(f"model.ep_chunks must be >= 0 (0 = the expert-axis size), "
                             f"got {self.ep_chunks}")
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


@flax.struct.dataclass
class ModelAux:
    """Router statistics of one forward pass (MoE layers only; zeros when there are none).

    aux_loss: load-balancing loss, mean over MoE layers (unweighted).
    z_loss: router z-loss, mean over MoE layers (unweighted).
    expert_load_LxE: fraction of the (non-padding) routed token slots each expert received, per
      MoE layer; rows sum to 1. The sigmoid_bias update reads it (see `moe.update_router_bias`).
    routed_experts_BxSxLxK: int32 experts each token used per MoE layer (the replayed ones where
      replay was given): what a rollout engine would record.
    """
    aux_loss: jax.Array
    z_loss: jax.Array
    expert_load_LxE: jax.Array
    routed_experts_BxSxLxK: jax.Array


class Block(nnx.Module):
    """Pre-norm decoder block: attention (full or sliding), then a dense MLP or the MoE layer."""

    def __init__(self, cfg: ModelConfig, moe: bool, sliding: bool = False, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        self.attn = Attention(cfg, sliding, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        self.mlp = MoE(cfg, rngs=rngs) if moe else DenseMLP(cfg, rngs=rngs)
        self.is_moe = moe

    def __call__(self, x_BxSxD: jax.Array, segment_ids_BxS: jax.Array, positions_BxS: jax.Array,
                 routed_BxSxK: jax.Array | None = None):
        x_BxSxD = constrain(x_BxSxD, "batch", "seq", None)
        h = x_BxSxD + self.attn(self.attn_norm(x_BxSxD), segment_ids_BxS, positions_BxS)
        if self.is_moe:
            y, stats = self.mlp(self.mlp_norm(h), segment_ids_BxS > 0, routed_BxSxK)
            return h + y, stats
        return h + self.mlp(self.mlp_norm(h)), None


def _stack(cfg: ModelConfig, moe: bool, n: int, rngs: nnx.Rngs, sliding: bool = False) -> Block:
    """n Blocks whose parameters carry a leading layer axis."""
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=n)
    def make(r: nnx.Rngs):
        return Block(cfg, moe, sliding, rngs=r)
    return make(rngs)


class PatternStack(nnx.Module):
    """One Block stack per position of a layer pattern (attributes p0, p1, ...)."""

    def __init__(self, cfg: ModelConfig, spec: LayerStack, rngs: nnx.Rngs):
        for k, sliding in enumerate(spec.pattern):
            setattr(self, f"p{k}", _stack(cfg, spec.moe, spec.repeats, rngs, sliding))


def resolve_kernels(
    cfg: ModelConfig, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None
) -> ModelConfig:
    """`cfg` with every "auto" kernel choice resolved for the mesh's devices (default: the
    ambient mesh): attention, expert backend, ep_a2a's local FFN. The dispatchers reject "auto",
    so this runs once, where the model or the train state is built."""
    return dataclasses.replace(
        cfg, attention=attention_registry.resolve(cfg.attention, mesh),
        expert_backend=expert_registry.resolve(cfg.expert_backend, mesh, cfg.num_experts),
        ep_local_ffn=expert_registry.resolve_local(cfg.ep_local_ffn, mesh, cfg.hidden_size,
                                                   cfg.moe_intermediate_size))


class Transformer(nnx.Module):
    """Decoder-only MoE transformer; see the module docstring for the layout."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        cfg = resolve_kernels(cfg)   # "auto" kernels: for the ambient mesh (no-op if resolved)
        self.cfg = cfg
        D, V, pd = cfg.hidden_size, cfg.vocab_size, cfg.param_dtype
        self.embedding = nnx.Param((jax.random.normal(rngs.params(), (V, D)) * 0.02).astype(pd))
        self.stacks = layer_stacks(cfg)
        for spec in self.stacks:
            setattr(self, spec.name, _stack(cfg, spec.moe, spec.repeats, rngs, spec.pattern[0])
                    if len(spec.pattern) == 1 else PatternStack(cfg, spec, rngs))
        for name in ("dense_layers", "moe_layers"):
            if not hasattr(self, name):
                setattr(self, name, None)
        self.final_norm = RMSNorm(D, cfg.rms_norm_eps, pd)
        self.lm_head = None if cfg.tie_embeddings else nnx.Param(normal_init(rngs, (D, V), D, pd))

    def _scan(self, layers: Block, x: jax.Array, segment_ids_BxS: jax.Array,
              positions_BxS: jax.Array, routed_LxBxSxK: jax.Array | None):
        graphdef, state = nnx.split(layers)

        def body(x: jax.Array, inputs: tuple):
            layer_state, routed = inputs
            return nnx.merge(graphdef, layer_state)(x, segment_ids_BxS, positions_BxS, routed)

        policy = REMAT_POLICIES[self.cfg.remat]
        if self.cfg.remat != "none":
            body = jax.checkpoint(body, policy=policy, prevent_cse=False)
        return jax.lax.scan(body, x, (state, routed_LxBxSxK))

    def _scan_pattern(self, spec: LayerStack, x: jax.Array, segment_ids_BxS: jax.Array,
                      positions_BxS: jax.Array, routed_RxPxBxSxK: jax.Array | None):
        """Scans a PatternStack; MoE stats come back stacked in layer order [R * P, ...]."""
        mod, p = getattr(self, spec.name), len(spec.pattern)
        splits = [nnx.split(getattr(mod, f"p{k}")) for k in range(p)]
        graphdefs = [g for g, _ in splits]

        def one(k: int):
            def apply(x: jax.Array, layer_state: nnx.State, routed: jax.Array | None):
                return nnx.merge(graphdefs[k], layer_state)(
                    x, segment_ids_BxS, positions_BxS, routed
                )

            if self.cfg.remat != "none":
                apply = jax.checkpoint(
                    apply, policy=REMAT_POLICIES[self.cfg.remat], prevent_cse=False
                )
            return apply

        applies = [one(k) for k in range(p)]

        def body(x: jax.Array, inputs: tuple):
            states, routed = inputs
            stats = []
            for k in range(p):
                x, st = applies[k](x, states[k], None if routed is None else routed[k])
                stats.append(st)
            if not spec.moe:
                return x, None
            return x, jax.tree.map(lambda *a: jnp.stack(a), *stats)

        x, stats = jax.lax.scan(body, x, ([s for _, s in splits], routed_RxPxBxSxK))
        if stats is not None:
            stats = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stats)
        return x, stats

    def moe_router_biases(self) -> list[tuple[RouterBias, list[int]]]:
        """(RouterBias variable [R, E], MoE-layer rows it holds) per MoE block stack."""
        out = []
        for spec in self.stacks:
            if not spec.moe:
                continue
            mod = getattr(self, spec.name)
            for k in range(len(spec.pattern)):
                blocks = mod if len(spec.pattern) == 1 else getattr(mod, f"p{k}")
                rows = [i - self.cfg.num_dense_layers for i in spec.layers(k)]
                out.append((blocks.mlp.router_bias, rows))
        return out

    def hidden_states(self, tokens_BxS: jax.Array, *, segment_ids_BxS: jax.Array | None = None,
                      positions_BxS: jax.Array | None = None,
                      routed_experts_BxSxLxK: jax.Array | None = None
                      ) -> tuple[jax.Array, ModelAux]:
        """Final (normed) hidden states [B, S, D] in compute dtype, and the `ModelAux`.

        Args:
          tokens_BxS: int token ids.
          segment_ids_BxS: packed-row segment ids, 0 = padding (default: one segment per row).
          positions_BxS: positions restarting at 0 per segment (default: 0..S-1).
          routed_experts_BxSxLxK: optional routing replay over the L MoE layers (-1 = select).
        """
        cfg = self.cfg
        if tokens_BxS.ndim != 2:
            raise ValueError(f"tokens_BxS must be [B, S], got shape {tokens_BxS.shape}")
        B, S = tokens_BxS.shape
        if segment_ids_BxS is None:
            segment_ids_BxS = jnp.ones((B, S), jnp.int32)
        if positions_BxS is None:
            positions_BxS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        for name, a in (("segment_ids_BxS", segment_ids_BxS), ("positions_BxS", positions_BxS)):
            if a.shape != (B, S):
                raise ValueError(f"{name} must have shape {(B, S)}, got {a.shape}")
        routed = None
        if routed_experts_BxSxLxK is not None:
            want = (B, S, cfg.num_moe_layers, cfg.top_k)
            if routed_experts_BxSxLxK.shape != want:
                raise ValueError(f"routed_experts_BxSxLxK must have shape {want}, "
                                 f"got {routed_experts_BxSxLxK.shape}")
            routed = jnp.moveaxis(routed_experts_BxSxLxK.astype(jnp.int32), 2, 0)

        x = self.embedding[...].astype(cfg.compute_dtype)[tokens_BxS]
        moe_stats = []
        for spec in self.stacks:
            r_in = None
            if routed is not None and spec.moe:
                m0 = spec.first - cfg.num_dense_layers
                r_in = routed[m0:m0 + spec.repeats * len(spec.pattern)]
                r_in = r_in.reshape(spec.repeats, len(spec.pattern), *r_in.shape[1:])
            if len(spec.pattern) == 1:
                x, st = self._scan(getattr(self, spec.name), x, segment_ids_BxS, positions_BxS,
                                   None if r_in is None else r_in[:, 0])
            else:
                x, st = self._scan_pattern(spec, x, segment_ids_BxS, positions_BxS, r_in)
            if spec.moe:
                moe_stats.append(st)
        if moe_stats:
            stats = jax.tree.map(lambda *a: jnp.concatenate(a), *moe_stats)
            aux = ModelAux(aux_loss=jnp.mean(stats.aux_loss), z_loss=jnp.mean(stats.z_loss),
                           expert_load_LxE=stats.expert_load_E,
                           routed_experts_BxSxLxK=jnp.moveaxis(stats.routed_BxSxK, 0, 2))
        else:
            zero = jnp.zeros((), jnp.float32)
            aux = ModelAux(zero, zero, jnp.zeros((0, cfg.num_experts), jnp.float32),
                           jnp.zeros((B, S, 0, cfg.top_k), jnp.int32))
        return self.final_norm(x), aux

    def output_kernel_DxV(self) -> jax.Array:
        """The [D, V] output projection in compute dtype (the embedding's transpose if tied)."""
        w = self.embedding[...].T if self.lm_head is None else self.lm_head[...]
        return w.astype(self.cfg.compute_dtype)

    def __call__(self, tokens_BxS: jax.Array, *, segment_ids_BxS: jax.Array | None = None,
                 positions_BxS: jax.Array | None = None,
                 routed_experts_BxSxLxK: jax.Array | None = None):
        """Logits [B, S, V] (float32) and `ModelAux`; arguments as in `hidden_states`."""
        h, aux = self.hidden_states(tokens_BxS, segment_ids_BxS=segment_ids_BxS,
                                    positions_BxS=positions_BxS,
                                    routed_experts_BxSxLxK=routed_experts_BxSxLxK)
        logits = jnp.einsum("bsd,dv->bsv", h, self.output_kernel_DxV(),
                            preferred_element_type=jnp.float32)
        return constrain(logits, "batch", "seq", "vocab"), aux

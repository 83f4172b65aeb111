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

from gagar_jax.kernels.attention import registry as attention_registry
from gagar_jax.kernels.experts import registry as expert_registry
from gagar_jax.model.config import (  # noqa: F401  (re-exported: the model's settings)
    DTYPES,
    REMAT_POLICIES,
    SLIDING_WINDOW_CONVENTIONS,
    ModelConfig,
)
from gagar_jax.model.layer_pattern import LayerStack, layer_stacks  # re-exported
from gagar_jax.model.layers import Attention, DenseMLP, RMSNorm, normal_init
from gagar_jax.model.moe import MoE, RouterBias
from gagar_jax.sharding import constrain

if TYPE_CHECKING:
    pass

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
        # The block's input arrives split along D over `tensor` ("resid": what remat keeps per
        # layer is 1/tensor of the residual stream) and is gathered whole here; the output is
        # split again, so the partial sums of the output projections reduce-scatter.
        x_BxSxD = constrain(x_BxSxD, "batch", "seq", None)
        h = x_BxSxD + self.attn(self.attn_norm(x_BxSxD), segment_ids_BxS, positions_BxS)
        if self.is_moe:
            y, stats = self.mlp(self.mlp_norm(h), segment_ids_BxS > 0, routed_BxSxK)
            return constrain(h + y, "batch", "seq", "resid"), stats
        return constrain(h + self.mlp(self.mlp_norm(h)), "batch", "seq", "resid"), None


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
            x = constrain(x, "batch", "seq", "resid")   # the carry as saved: split (see below)
            return nnx.merge(graphdef, layer_state)(x, segment_ids_BxS, positions_BxS, routed)

        policy = REMAT_POLICIES[self.cfg.remat]
        if self.cfg.remat != "none":
            body = jax.checkpoint(body, policy=policy, prevent_cse=False)
        # The carry (what remat saves per layer) enters split like every block's output.
        x = constrain(x, "batch", "seq", "resid")
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
            # The carry is what the first position's remat saves: constrained here, in the body,
            # or XLA keeps that one full width (the scan's initial sharding alone does not hold).
            x = constrain(x, "batch", "seq", "resid")
            stats = []
            for k in range(p):
                x, st = applies[k](x, states[k], None if routed is None else routed[k])
                stats.append(st)
            if not spec.moe:
                return x, None
            return x, jax.tree.map(lambda *a: jnp.stack(a), *stats)

        x = constrain(x, "batch", "seq", "resid")   # the carry, split as in `_scan`
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

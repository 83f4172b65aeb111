"""The NNX MoE layer: fp32 router + routed SwiGLU experts.

Routing math lives in the pure functions of `router.py`; the expert FFNs are kernels
(`kernels/experts/`), chosen by name through their registry (`kernels/experts/registry.py`,
where "auto" is resolved). The layer owns the parameters (router kernel [D, E],
stacked experts [E, D, F] / [E, F, D]) and the non-trainable `RouterBias` [E] of the
`sigmoid_bias` router, and wires them together, honouring routing replay.
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from gagar_jax.kernels.experts.registry import expert_ffn
from gagar_jax.model import router as router_lib
from gagar_jax.model.layers import normal_init
from gagar_jax.sharding import constrain


class RouterBias(nnx.Variable):
    """Selection bias of the sigmoid_bias router: updated by `update_router_bias`, never by the
    optimizer (filter it out of the trainable params with `nnx.Param`, which it is not)."""


@flax.struct.dataclass
class MoEStats:
    """Per-layer router statistics (stacked to [L, ...] by the layer scan)."""
    aux_loss: jax.Array          # scalar load-balancing loss
    z_loss: jax.Array            # scalar router z-loss
    expert_load_E: jax.Array     # fraction of non-padding assignments per expert
    routed_BxSxK: jax.Array      # int32 experts used (replayed where given)


class MoE(nnx.Module):
    """Top-k routed SwiGLU experts."""

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs):
        D, E, F, pd = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.param_dtype
        # transformers keeps the sigmoid router (and its bias) in float32 in any model dtype.
        rd = jnp.float32 if cfg.router == "sigmoid_bias" else pd
        self.router = nnx.Param(normal_init(rngs, (D, E), D, jnp.float32).astype(rd))
        self.router_bias = RouterBias(jnp.zeros((E,), jnp.float32))
        self.expert_gate = nnx.Param(normal_init(rngs, (E, D, F), D, pd))
        self.expert_up = nnx.Param(normal_init(rngs, (E, D, F), D, pd))
        self.expert_down = nnx.Param(normal_init(rngs, (E, F, D), F, pd))
        self.cfg = cfg

    def __call__(self, x_BxSxD: jax.Array, token_mask_BxS: jax.Array,
                 routed_BxSxK: jax.Array | None = None):
        """Returns (y_BxSxD, MoEStats).

        Args:
          x_BxSxD: normed activations.
          token_mask_BxS: True on real tokens (padding takes no part in router statistics).
          routed_BxSxK: optional replayed expert ids (-1 = let the router select).
        """
        cfg, dt = self.cfg, x_BxSxD.dtype
        B, S, D = x_BxSxD.shape
        x_TxD = x_BxSxD.reshape(B * S, D)
        # Router in float32: selection is discrete, small logit errors flip experts.
        logits_TxE = jnp.einsum("td,de->te", x_TxD.astype(jnp.float32),
                                self.router[...].astype(jnp.float32))
        bias = self.router_bias[...] if cfg.router == "sigmoid_bias" else None
        out = router_lib.route(
            logits_TxE,
            top_k=cfg.top_k,
            router=cfg.router,
            norm_topk_prob=cfg.norm_topk_prob,
            bias_E=bias,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            routed_scaling_factor=cfg.routed_scaling_factor,
            token_mask_T=token_mask_BxS.reshape(B * S),
            replay_idx_TxK=None if routed_BxSxK is None else routed_BxSxK.reshape(B * S, cfg.top_k),
        )
        # Padding tokens get expert id -1 ("no expert"): they cost no expert FLOPs.
        idx_TxK = jnp.where(token_mask_BxS.reshape(B * S, 1), out.idx_TxK, -1)
        y_TxD = expert_ffn(
            x_TxD,
            self.expert_gate[...].astype(dt),
            self.expert_up[...].astype(dt),
            self.expert_down[...].astype(dt),
            idx_TxK,
            out.weights_TxK.astype(dt),
            backend=cfg.expert_backend,
            **({"local": cfg.ep_local_ffn, "chunks": cfg.ep_chunks or None,
                "row_tile": cfg.ep_row_tile or None}
               if cfg.expert_backend == "ep_a2a" else {}),
        )
        y = constrain(y_TxD.reshape(B, S, D), "batch", "seq", None)
        stats = MoEStats(aux_loss=out.aux_loss, z_loss=out.z_loss, expert_load_E=out.load_E,
                         routed_BxSxK=out.idx_TxK.reshape(B, S, cfg.top_k))
        return y, stats


def update_router_bias(model: Any, expert_load_LxE: jax.Array, rate: float) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3): nudges every MoE layer's `RouterBias`
    toward under-loaded experts, in place. `expert_load_LxE` is `ModelAux.expert_load_LxE`."""
    for bias, rows in model.moe_router_biases():  # one per MoE block stack, rows in layer order
        load = expert_load_LxE[jnp.asarray(rows)]
        bias[...] = jax.vmap(router_lib.update_bias, in_axes=(0, 0, None))(bias[...], load, rate)

"""The NNX MoE layer: fp32 router + routed SwiGLU experts, and the table of expert backends.

Routing math lives in the pure functions of `router.py`, the expert FFNs in `experts.py`
(single-shard backends), `experts_megablox.py` (Pallas TPU kernels) and `experts_ep.py`
(expert parallelism); this module picks one by name
(`BACKENDS`, or "auto": `resolve_backend`). The layer owns the parameters (router kernel [D, E],
stacked experts [E, D, F] / [E, F, D]) and the non-trainable `RouterBias` [E] of the
`sigmoid_bias` router, and wires them together, honouring routing replay.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from gagar_jax.kernels.experts import local as experts
from gagar_jax.kernels.experts import ep as experts_ep
from gagar_jax.kernels.experts import megablox as experts_megablox
from gagar_jax.model import router as router_lib
from gagar_jax.model.layers import normal_init
from gagar_jax.sharding import constrain, device_platform, mesh_axes

ExpertFn = Callable[..., jax.Array]


def _capacity_y(*args, **kw) -> jax.Array:
    return experts.capacity_ffn(*args, **kw).y_TxD


BACKENDS: Mapping[str, ExpertFn] = {
    "dense": experts.dense_ffn,        # every expert on every token: the test oracle
    "ragged": experts.ragged_ffn,      # jax.lax.ragged_dot (TPU/GPU)
    "grouped": experts.grouped_ffn,    # dropless grouped matmul, fast on XLA:CPU
    "capacity": _capacity_y,           # fixed capacity; DROPS overflow tokens
    "ep": experts_ep.ep_ffn,           # expert parallelism, all-gather dispatch (any platform)
    "ep_a2a": experts_ep.ep_a2a_ffn,   # expert parallelism, ragged_all_to_all (TPU/GPU only)
    "megablox": experts_megablox.megablox_ffn,  # Pallas gmm/tgmm kernels (TPU; interpreted elsewhere)
}
EXPERT_BACKENDS = ("auto",) + tuple(BACKENDS)   # the values `model.expert_backend` accepts

# platform -> (the fastest exact backend on one expert shard, the one over an expert axis > 1).
AUTO_BACKENDS: Mapping[str, tuple[str, str]] = {
    "cpu": ("grouped", "ep"),
    "gpu": ("ragged", "ep_a2a"),
    "tpu": ("megablox", "ep_a2a"),     # ep_a2a's local FFN is megablox on TPU
}


def resolve_backend(backend: str, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
                    num_experts: int = 0) -> str:
    """`backend` itself, or for "auto" the fastest exact backend for the mesh's devices.

    Args:
      backend: a key of `BACKENDS`, or "auto".
      mesh: a `Mesh` (default: the ambient one): its devices' platform decides
        (`sharding.device_platform`: an ahead-of-time compile for TPU on a CPU host gets the TPU
        choice), and an `expert` axis larger than 1 that divides `num_experts` selects expert
        parallelism. No mesh at all: the default backend's platform, one expert shard.
      num_experts: E (0 = do not check divisibility).
    Returns:
      A key of `BACKENDS`.
    """
    if backend != "auto":
        if backend not in BACKENDS:
            raise ValueError(f"expert_backend={backend!r}; expected one of {EXPERT_BACKENDS}")
        return backend
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    platform = device_platform(mesh)
    single, parallel = AUTO_BACKENDS.get(platform, AUTO_BACKENDS["cpu"])
    n_expert = 1 if mesh is None or mesh.empty else math.prod(
        mesh.shape[a] for a in mesh_axes("expert", mesh))
    use_ep = n_expert > 1 and (num_experts == 0 or num_experts % n_expert == 0)
    return parallel if use_ep else single


def expert_ffn(x_TxD: jax.Array, gate_ExDxF: jax.Array, up_ExDxF: jax.Array, down_ExFxD: jax.Array,
               idx_TxK: jax.Array, weights_TxK: jax.Array, *, backend: str = "auto",
               **options) -> jax.Array:
    """Routed SwiGLU experts: y_TxD = sum_k w_tk * FFN_{idx_tk}(x_t).

    Args:
      x_TxD: token activations.
      gate_ExDxF, up_ExDxF, down_ExFxD: stacked expert weights.
      idx_TxK: int expert ids; ids outside [0, E) contribute nothing.
      weights_TxK: gate weights (differentiable).
      backend: a key of `BACKENDS`, or "auto" (`resolve_backend` on the ambient mesh).
      **options: backend options (`block` for grouped/ep, `capacity_factor` for capacity,
        `mesh` for ep / ep_a2a / megablox, `chunks` and `local` for ep_a2a, `tiling` and
        `interpret` for megablox).
    Returns:
      y_TxD in x's dtype.
    """
    t, d = x_TxD.shape
    e = gate_ExDxF.shape[0]
    backend = resolve_backend(backend, options.get("mesh"), e)
    if gate_ExDxF.shape != up_ExDxF.shape or down_ExFxD.shape != (e,) + gate_ExDxF.shape[:0:-1]:
        raise ValueError(f"gate/up/down shapes {gate_ExDxF.shape}/{up_ExDxF.shape}/"
                         f"{down_ExFxD.shape} are not [E,D,F]/[E,D,F]/[E,F,D]")
    if gate_ExDxF.shape[1] != d:
        raise ValueError(f"x_TxD width {d} != gate_ExDxF D {gate_ExDxF.shape[1]}")
    if not jnp.issubdtype(idx_TxK.dtype, jnp.integer):
        raise ValueError(f"idx_TxK must hold integer expert ids, got dtype {idx_TxK.dtype}")
    if idx_TxK.shape != weights_TxK.shape or idx_TxK.shape[0] != t:
        raise ValueError(f"idx_TxK {idx_TxK.shape} / weights_TxK {weights_TxK.shape} "
                         f"do not match T={t}")
    return BACKENDS[backend](x_TxD, gate_ExDxF, up_ExDxF, down_ExFxD, idx_TxK, weights_TxK,
                             **options)


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
            logits_TxE, top_k=cfg.top_k, router=cfg.router, norm_topk_prob=cfg.norm_topk_prob,
            bias_E=bias, n_group=cfg.n_group, topk_group=cfg.topk_group,
            routed_scaling_factor=cfg.routed_scaling_factor, token_mask_T=token_mask_BxS.reshape(B * S),
            replay_idx_TxK=None if routed_BxSxK is None else routed_BxSxK.reshape(B * S, cfg.top_k))
        # Padding tokens get expert id -1 ("no expert"): they cost no expert FLOPs.
        idx_TxK = jnp.where(token_mask_BxS.reshape(B * S, 1), out.idx_TxK, -1)
        y_TxD = expert_ffn(x_TxD, self.expert_gate[...].astype(dt), self.expert_up[...].astype(dt),
                           self.expert_down[...].astype(dt), idx_TxK, out.weights_TxK.astype(dt),
                           backend=cfg.expert_backend)
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

"""The expert FFN kernels: one record per backend, and the only module that chooses one.

Each `ExpertKernel` declares the platforms it runs on natively, whether it shards over the
mesh's `expert` axis, and the options it takes (`block`, `capacity_factor`, `mesh`, `chunks`,
`local`, `tiling`, `interpret`). `"auto"` (the fastest exact backend for the mesh's devices) is
resolved once, when the model or train state is built (`resolve`, and `resolve_local` for
`ep_a2a`'s per-device FFN); `expert_ffn` rejects an unresolved "auto".
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp

from gagar_jax.kernels.experts import ep, local, megablox
from gagar_jax.sharding import device_platform, mesh_axes

MeshLike = Union[jax.sharding.Mesh, jax.sharding.AbstractMesh]


@dataclasses.dataclass(frozen=True)
class ExpertKernel:
    """One routed-SwiGLU backend: y_TxD = sum_k w_tk * FFN_{idx_tk}(x_t)."""
    name: str
    fn: Callable[..., jax.Array]      # (x_TxD, gate, up, down, idx_TxK, weights_TxK, **options)
    platforms: tuple[str, ...]        # where it is native (elsewhere: slow, emulated or
                                      # interpreted)
    expert_parallel: bool = False     # shards over the mesh's `expert` axis (shard_map)
    exact: bool = True                # dropless (capacity drops overflow tokens)
    options: tuple[str, ...] = ()


def _capacity_y(*args: jax.Array, **kw: Any) -> jax.Array:
    return local.capacity_ffn(*args, **kw).y_TxD


KERNELS: dict[str, ExpertKernel] = {}


def register(kernel: ExpertKernel) -> ExpertKernel:
    """Adds (or replaces) a backend; `model.expert_backend` may then name it."""
    if kernel.name == "auto":
        raise ValueError("'auto' is not a backend name")
    KERNELS[kernel.name] = kernel
    return kernel


_ALL = ("cpu", "gpu", "tpu")
register(ExpertKernel("dense", local.dense_ffn, _ALL))          # every expert on every token: the
                                                                # oracle
register(ExpertKernel("ragged", local.ragged_ffn, ("gpu", "tpu")))   # jax.lax.ragged_dot
register(ExpertKernel("grouped", local.grouped_ffn, ("cpu",), options=("block", "big_block")))
register(ExpertKernel("capacity", _capacity_y, _ALL, exact=False, options=("capacity_factor",)))
register(ExpertKernel("ep", ep.ep_ffn, _ALL, expert_parallel=True,
                      options=("mesh", "block", "big_block")))
register(ExpertKernel("ep_a2a", ep.ep_a2a_ffn, ("gpu", "tpu"), expert_parallel=True,
                      options=("mesh", "block", "big_block", "chunks", "exchange", "local",
                               "row_tile", "interpret")))
register(ExpertKernel("megablox", megablox.megablox_ffn, ("tpu",),
                      options=("mesh", "tiling", "interpret")))

# platform -> (the fastest exact backend on one expert shard, the one over an expert axis > 1).
AUTO: Mapping[str, tuple[str, str]] = {
    "cpu": ("grouped", "ep"),
    "gpu": ("ragged", "ep_a2a"),
    "tpu": ("megablox", "ep_a2a"),
}
LOCAL_FFNS = ep.LOCAL_FFNS   # ep_a2a's per-device FFN: grouped | megablox


def names() -> tuple[str, ...]:
    """The values `model.expert_backend` accepts."""
    return ("auto",) + tuple(KERNELS)


def resolve(backend: str, mesh: Optional[MeshLike] = None, num_experts: int = 0) -> str:
    """`backend` itself, or for "auto" the fastest exact backend for the mesh's devices.

    Args:
      backend: one of `names()`.
      mesh: a `Mesh` (default: the ambient one): its devices' platform decides
        (`sharding.device_platform`: an ahead-of-time compile for TPU on a CPU host gets the TPU
        choice), and an `expert` axis larger than 1 that divides `num_experts` selects expert
        parallelism. No mesh at all: the default backend's platform, one expert shard.
      num_experts: E (0 = do not check divisibility).
    """
    if backend != "auto":
        if backend not in KERNELS:
            raise ValueError(f"expert_backend={backend!r}; expected one of {names()}")
        return backend
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    single, parallel = AUTO.get(device_platform(mesh), AUTO["cpu"])
    n_expert = 1 if mesh is None or mesh.empty else math.prod(
        mesh.shape[a] for a in mesh_axes("expert", mesh))
    use_ep = n_expert > 1 and (num_experts == 0 or num_experts % n_expert == 0)
    return parallel if use_ep else single


def resolve_local(choice: str, mesh: Optional[MeshLike] = None, d: int = 0, f: int = 0) -> str:
    """`ep_a2a`'s per-device FFN: `choice`, or for "auto" megablox when compiling for TPU at
    widths its kernels lower for (`megablox.lowers_on_tpu`), else grouped."""
    if choice not in ("auto",) + LOCAL_FFNS:
        raise ValueError(f"ep_a2a local FFN {choice!r}; expected one of {('auto',) + LOCAL_FFNS}")
    if choice != "auto":
        return choice
    tpu = device_platform(mesh) == "tpu"
    return "megablox" if tpu and megablox.lowers_on_tpu(d, f) else "grouped"


def get(backend: str) -> ExpertKernel:
    """The record of a resolved backend name; "auto" is an error (resolve it first)."""
    if backend == "auto":
        raise ValueError("expert_backend 'auto' is unresolved here: resolve it once with "
                         "registry.resolve(backend, mesh, num_experts) when the model or train "
                         "state is built")
    if backend not in KERNELS:
        raise ValueError(f"expert_backend={backend!r}; expected one of {names()}")
    return KERNELS[backend]


def expert_ffn(x_TxD: jax.Array, gate_ExDxF: jax.Array, up_ExDxF: jax.Array,
               down_ExFxD: jax.Array, idx_TxK: jax.Array, weights_TxK: jax.Array, *,
               backend: str, **options: Any) -> jax.Array:
    """Routed SwiGLU experts: y_TxD = sum_k w_tk * FFN_{idx_tk}(x_t).

    Args:
      x_TxD: token activations.
      gate_ExDxF, up_ExDxF, down_ExFxD: stacked expert weights.
      idx_TxK: int expert ids; ids outside [0, E) contribute nothing.
      weights_TxK: gate weights (differentiable).
      backend: a resolved key of `KERNELS` (not "auto").
      **options: backend options, among the record's `options`.
    Returns:
      y_TxD in x's dtype.
    """
    kernel = get(backend)
    t, d = x_TxD.shape
    e = gate_ExDxF.shape[0]
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
    unknown = set(options) - set(kernel.options)
    if unknown:
        raise ValueError(f"expert backend {backend!r} takes options {kernel.options}, "
                         f"got {sorted(unknown)}")
    return kernel.fn(x_TxD, gate_ExDxF, up_ExDxF, down_ExFxD, idx_TxK, weights_TxK, **options)

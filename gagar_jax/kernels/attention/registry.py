"""The attention kernels: one record per kernel, and the only module that chooses one.

Each `AttentionKernel` declares what it runs on and what it needs, so the callers never test a
function's identity: `full` computes whole rows, `local` is the per-shard kernel of context
parallelism (keys of their own length via `kv_segment_ids_BxK`, the key index of the first query
as `q_offset`; `context.py`), `static_offset` says that `q_offset` must be a Python int (a traced
one then comes with the values it can take, `q_offsets`), and `options` names which of the
model's `block` and the platform's `interpret` it takes.

`"auto"` is resolved once, when the train state (or a model) is built (`resolve`); the
dispatchers (`attention` here, `context.attention`) reject an unresolved "auto".
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional, Union

import jax

from gagar_jax import sharding
from gagar_jax.kernels.attention import blockwise, splash

MeshLike = Union[jax.sharding.Mesh, jax.sharding.AbstractMesh]


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """One attention kernel and what it supports."""
    name: str
    full: Callable[..., jax.Array]    # (q, k, v, seg, *, window, sinks_H, **options)
    local: Callable[..., jax.Array]   # full's contract + kv_segment_ids_BxK, q_offset
    platforms: tuple[str, ...]        # where it runs compiled (elsewhere: interpreted, if it can)
    static_offset: bool = False       # q_offset must be static (traced: q_offsets given too)
    options: tuple[str, ...] = ()     # which of "block", "interpret" it takes

    def kwargs(self, block: int, platform: str) -> dict:
        """The options this kernel takes, for the model's block and the mesh's platform."""
        kw = {"block": block, "interpret": platform not in self.platforms}
        return {k: kw[k] for k in self.options}


def _splash_full(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array, *, window: int = 0,
                 sinks_H: Optional[jax.Array] = None, **kw: Any) -> jax.Array:
    return splash.splash_attention(q, k, v, seg, window=int(window) or None, sinks_H=sinks_H, **kw)


KERNELS: dict[str, AttentionKernel] = {}


def register(kernel: AttentionKernel) -> AttentionKernel:
    """Adds (or replaces) a kernel; `model.attention` may then name it."""
    if kernel.name == "auto":
        raise ValueError("'auto' is not a kernel name")
    KERNELS[kernel.name] = kernel
    return kernel


register(AttentionKernel("blockwise", blockwise.blockwise_attention, blockwise.blockwise_attention,
                         platforms=("cpu", "gpu", "tpu"), options=("block",)))
register(AttentionKernel("plain", blockwise.plain_attention, blockwise.plain_attention,
                         platforms=("cpu", "gpu", "tpu")))
register(AttentionKernel("splash", _splash_full, splash.splash_local_attention, platforms=("tpu",),
                         static_offset=True, options=("block", "interpret")))

# platform -> the "auto" choice. GPU keeps blockwise: jax's cuDNN attention has no segment ids.
AUTO = {"cpu": "blockwise", "gpu": "blockwise", "tpu": "splash"}


def names() -> tuple[str, ...]:
    """The values `model.attention` accepts."""
    return ("auto",) + tuple(KERNELS)


def resolve(impl: str, mesh: Optional[MeshLike] = None) -> str:
    """`impl` itself, or for "auto" the kernel for the platform of the mesh's devices.

    Args:
      impl: one of `names()`.
      mesh: a `Mesh` (default: the ambient one); its devices' platform decides
        (`sharding.device_platform`), so an ahead-of-time TPU compile on a CPU host gets splash,
        with or without a context axis.
    """
    if impl not in names():
        raise ValueError(f"attention impl must be one of {names()}, got {impl!r}")
    if impl != "auto":
        return impl
    return AUTO.get(sharding.device_platform(mesh), "blockwise")


def get(impl: str) -> AttentionKernel:
    """The record of a resolved kernel name; "auto" is an error (resolve it first)."""
    if impl == "auto":
        raise ValueError("attention impl 'auto' is unresolved here: resolve it once with "
                         "registry.resolve(impl, mesh) when the model or train state is built")
    if impl not in KERNELS:
        raise ValueError(f"attention impl must be one of {tuple(KERNELS)}, got {impl!r}")
    return KERNELS[impl]


def attention(q_BxSxHxD: jax.Array, k_BxSxKxD: jax.Array, v_BxSxKxD: jax.Array,
              segment_ids_BxS: jax.Array, *, impl: str, block: int = 512, window: int = 0,
              sinks_H: Optional[jax.Array] = None, mesh: Optional[MeshLike] = None) -> jax.Array:
    """Packed causal attention of whole rows with the kernel `impl` (resolved, not "auto");
    `window` (0 = full causal) and `sinks_H` as in `blockwise.plain_attention`."""
    kernel = get(impl)
    return kernel.full(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, window=window,
                       sinks_H=sinks_H, **kernel.kwargs(block, sharding.device_platform(mesh)))

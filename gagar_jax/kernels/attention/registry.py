"""The attention kernels: one record per kernel, and the only module that chooses one.

Each `AttentionKernel` declares what it runs on and what it needs, so the callers never test a
function's identity: `full` computes whole rows, `local` is the per-shard kernel of context
parallelism (keys of their own length via `kv_segment_ids_BxK`, the key index of the first query
as `q_offset`; `context.py`), `static_offset` says that `q_offset` must be a Python int (a traced
one then comes with the values it can take, `q_offsets`), and `options` names which of the
model's `block` and the platform's `interpret` it takes.

`"auto"` is resolved once, when the train state (or a model) is built (`resolve`); the
dispatchers (`attention` here, `context.attention`) reject an unresolved "auto".

The sampler's paged kernels (`paged.py`) have records of their own (`PagedKernel`, `PAGED`):
what each serves (prefill chunks or decode only, window rings, sinks, unequal q/k and v
widths), and `resolve_paged` picks one per layer kind: the XLA reference everywhere, JAX's
Pallas `paged_attention` for the decode of plain full layers on TPU.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional, Union

import jax

from gagar_jax import sharding
from gagar_jax.kernels.attention import blockwise, paged, splash

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


# ----------------------------------------------------------------------------- paged (sampler)
@dataclasses.dataclass(frozen=True)
class PagedKernel:
    """One paged attention kernel of the sampler and what it serves.

    `xla` takes `paged.paged_attention_xla`'s arguments (attends before the chunk is written);
    a `write_first` kernel attends one decode query per row to pages that already hold it
    (`paged.paged_decode_pallas`'s arguments).
    """
    name: str
    fn: Callable[..., jax.Array]
    platforms: tuple[str, ...]
    decode_only: bool = False      # N = 1 queries per row only
    window: bool = True            # sliding layers (a window ring)
    sinks: bool = True
    unequal_dims: bool = True      # v width != q/k width
    write_first: bool = False
    lanes: int = 1                 # the head width must be a multiple of this

    def supports(self, *, decode: bool, window: int, sinks: bool, same_dims: bool,
                 head_dim: int = 0) -> bool:
        return ((decode or not self.decode_only) and (not window or self.window)
                and (not sinks or self.sinks) and (same_dims or self.unequal_dims)
                and head_dim % self.lanes == 0)


PAGED: dict[str, PagedKernel] = {}


def register_paged(kernel: PagedKernel) -> PagedKernel:
    """Adds (or replaces) a paged kernel; the sampler's `paged_attention` option may name it."""
    if kernel.name == "auto":
        raise ValueError("'auto' is not a kernel name")
    PAGED[kernel.name] = kernel
    return kernel


register_paged(PagedKernel("xla", paged.paged_attention_xla, platforms=("cpu", "gpu", "tpu")))
register_paged(PagedKernel("pallas", paged.paged_decode_pallas, platforms=("tpu",),
                           decode_only=True, window=False, sinks=False, unequal_dims=False,
                           write_first=True, lanes=128))
PAGED_AUTO = {"tpu": "pallas"}     # platform -> the preferred kernel where it applies


def resolve_paged(impl: str, mesh: Optional[MeshLike] = None, *, decode: bool, window: int,
                  sinks: bool, same_dims: bool, head_dim: int = 0) -> str:
    """The paged kernel for one layer kind: `impl` itself (it must support the layer), or for
    "auto" the platform's preferred kernel where it supports the layer, else "xla"."""
    need = dict(decode=decode, window=window, sinks=sinks, same_dims=same_dims,
                head_dim=head_dim)
    if impl != "auto":
        if impl not in PAGED:
            raise ValueError(f"paged attention must be one of {('auto',) + tuple(PAGED)}, "
                             f"got {impl!r}")
        if not PAGED[impl].supports(**need):
            raise ValueError(f"paged kernel {impl!r} cannot serve this layer (decode={decode}, "
                             f"window={window}, sinks={sinks}, same q/k and v width={same_dims},"
                             f" head width {head_dim})")
        return impl
    pick = PAGED_AUTO.get(sharding.device_platform(mesh))
    if pick and PAGED[pick].supports(**need):
        return pick
    return "xla"


def paged_kernel(impl: str) -> PagedKernel:
    """The record of a resolved paged kernel name."""
    if impl not in PAGED:
        raise ValueError(f"paged attention {impl!r} is unresolved or unknown "
                         f"(one of {tuple(PAGED)})")
    return PAGED[impl]

"""The `megablox` expert backend: Pallas TPU grouped matmuls (`gmm` forward, `tgmm` for weights).

    rows sorted by expert -> gmm(x, gate) , gmm(x, up) -> silu(.) * (.) -> gmm(h, down) -> combine

`jax.experimental.pallas.ops.tpu.megablox.ops.gmm` multiplies each expert's run of rows by that
expert's matrix, tile by tile, visiting only the tiles the runs occupy (dropless, no padding per
expert); its custom VJP computes the input gradient with another `gmm` and the weight gradient
with `tgmm`. The sort, gather and combine are the shared plan of `dispatch.py`.

Row buffer: the T*K assignments sorted by expert, then zero rows up to a multiple of the row
tile. Rows past the routed ones (invalid ids, tile padding) belong to no group: the kernel
leaves them unwritten (garbage on TPU, NaN in interpret mode), and they are masked before the
combine and never read by it.

Platforms: the kernels compile for TPU only. Elsewhere they run in Pallas interpret mode (plain
JAX ops, slow: for tests on CPU). `interpret=None` decides from the platform the code is being
compiled for (`sharding.device_platform`), so an ahead-of-time TPU compile on a CPU host gets the
real kernels.

Under a mesh whose token axes are larger than 1, the kernel runs per shard inside `shard_map`
(a Pallas call has no SPMD partitioning rule: left to the partitioner it would gather every
token onto every device): tokens stay on their shard, experts are whole on each shard except F
split over 'tensor', whose partial sums are added with a psum. The kernels carry no mesh-axis types,
so these `shard_map`s run with `check_vma=False` (see `megablox_ffn`). Expert parallelism is
`ep_a2a` with this function as its local FFN (`ep_local_ffn="megablox"`).
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox_ops
from jax.sharding import PartitionSpec as P

from gagar_jax import sharding
from gagar_jax.kernels.experts import dispatch

# (rows, contraction, output) tile sizes. The two weight tiles are merged into one (the backward
# pass swaps the roles of D and F) and clamped to D and F.
DEFAULT_TILING = (512, 1024, 1024)
LANES = 128   # a TPU kernel's weight tile is a multiple of this, or a whole dimension


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def lowers_on_tpu(d: int, f: int) -> bool:
    """Whether the kernels lower for TPU at model width D and expert width F: their weight tiles
    must be multiples of 128 or whole dimensions, and the backward pass (dx) swaps the two roles."""
    return (d % LANES == 0 and f % LANES == 0) or d == f


def _weight_tile(tile: int, d: int, f: int) -> int:
    """One tile for both weight dimensions (valid in the forward and the swapped backward)."""
    if d % LANES == 0 and f % LANES == 0:
        return max(LANES, min(tile, d, f) // LANES * LANES)
    return d   # d == f (checked by the caller), or interpret mode, where a tile may overhang


def _gmm(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, tiles: tuple[int, int, int],
         interpret: bool) -> jax.Array:
    return megablox_ops.gmm(lhs, rhs, sizes, lhs.dtype, tiles, None, None, False, interpret)


def grouped_swiglu(x_SxD: jax.Array, gate_ExDxF: jax.Array, up_ExDxF: jax.Array,
                   down_ExFxD: jax.Array, sizes_E: jax.Array, *,
                   tiling: tuple[int, int, int] = DEFAULT_TILING,
                   interpret: Optional[bool] = None, zero_unrouted: bool = True) -> jax.Array:
    """SwiGLU of each expert's run of rows (rows sorted by expert, `sizes_E` rows each).

    Gate and up run as one `gmm` over the concatenated [E, D, 2F] weights: x is read once, and
    the backward pass makes one [S, D] input gradient instead of two summed.

    Args:
      x_SxD: rows sorted by expert; rows past sum(sizes_E) are ignored.
      gate_ExDxF, up_ExDxF, down_ExFxD: expert weights.
      sizes_E: int32 rows per expert.
      tiling: (rows, contraction, output) tile sizes of the kernels.
      interpret: run the kernels in Pallas interpret mode (None: unless compiling for TPU).
      zero_unrouted: output 0 in the rows past sum(sizes_E); False leaves them unwritten (for
        callers that never read them, like `dispatch.combine`: the select costs an [S, D]
        buffer in the forward pass and another in the backward).
    Returns:
      y_SxD in x's dtype.
    """
    if interpret is None:
        interpret = sharding.device_platform() != "tpu"
    s, d = x_SxD.shape
    f = gate_ExDxF.shape[-1]
    if not interpret and not lowers_on_tpu(d, f):
        raise ValueError(f"megablox on TPU needs D and F multiples of {LANES} (or D == F); got "
                         f"D={d}, F={f}: use another expert_backend")
    tm = min(tiling[0], _round_up(s, 16))    # sublane multiple for fp32 and bf16
    rows = _round_up(s, tm)
    x = jnp.pad(x_SxD, ((0, rows - s), (0, 0)))
    wt = _weight_tile(min(tiling[1], tiling[2]), d, f)
    tiles = (tm, wt, wt)
    sizes = sizes_E.astype(jnp.int32)
    if interpret or lowers_on_tpu(d, 2 * f):
        wt2 = _weight_tile(min(tiling[1], tiling[2]), d, 2 * f)   # the fused [D, 2F] gate/up
        gu = _gmm(x, jnp.concatenate([gate_ExDxF, up_ExDxF], axis=-1), sizes, (tm, wt2, wt2),
                  interpret)
        h = jax.nn.silu(gu[:, :f]) * gu[:, f:]
    else:   # D == F off the 128 grid: a [D, 2F] tile would not lower
        h = jax.nn.silu(_gmm(x, gate_ExDxF, sizes, tiles, interpret)) * _gmm(
            x, up_ExDxF, sizes, tiles, interpret)
    y = _gmm(h, down_ExFxD, sizes, tiles, interpret)[:s]
    if not zero_unrouted:
        return y
    # Rows of no group are never written by the kernel: zero them (where, not multiply: NaN).
    routed = jnp.arange(s) < jnp.sum(sizes)
    return jnp.where(routed[:, None], y, jnp.zeros((), y.dtype))


def local_ffn(x_TxD: jax.Array, gate_ExDxF: jax.Array, up_ExDxF: jax.Array, down_ExFxD: jax.Array,
              idx_TxK: jax.Array, weights_TxK: jax.Array, *,
              tiling: tuple[int, int, int] = DEFAULT_TILING,
              interpret: Optional[bool] = None) -> jax.Array:
    """`megablox_ffn` on the tokens of one shard (no mesh handling; e.g. inside `shard_map`)."""
    plan = dispatch.padded_plan(idx_TxK, gate_ExDxF.shape[0], block=1)
    xs_NxD = dispatch.gather_tokens(x_TxD, plan, idx_TxK.shape[1])
    # combine reads only the routed rows: the rows the kernel leaves unwritten need no zeroing.
    ys_NxD = grouped_swiglu(xs_NxD, gate_ExDxF, up_ExDxF, down_ExFxD, plan.sizes_E,
                            tiling=tiling, interpret=interpret, zero_unrouted=False)
    return dispatch.combine(ys_NxD, plan, weights_TxK)


def megablox_ffn(x_TxD: jax.Array, gate_ExDxF: jax.Array, up_ExDxF: jax.Array,
                 down_ExFxD: jax.Array, idx_TxK: jax.Array, weights_TxK: jax.Array, *,
                 mesh: Optional[jax.sharding.Mesh | jax.sharding.AbstractMesh] = None,
                 tiling: tuple[int, int, int] = DEFAULT_TILING,
                 interpret: Optional[bool] = None) -> jax.Array:
    """Dropless routed SwiGLU with the megablox kernels (same math as `local.dense_ffn`).

    Args:
      x_TxD, gate_ExDxF, up_ExDxF, down_ExFxD, idx_TxK, weights_TxK: as `registry.expert_ffn`.
      mesh: the mesh (default the ambient one); token axes > 1 run the kernel per shard.
      tiling: (rows, contraction, output) tile sizes of the kernels.
      interpret: Pallas interpret mode (None: unless compiling for TPU).
    Returns:
      y_TxD in x's dtype.
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if interpret is None:
        interpret = sharding.device_platform(mesh) != "tpu"
    local = lambda *a: local_ffn(*a, tiling=tiling, interpret=interpret)
    if mesh is None or mesh.empty:
        return local(x_TxD, gate_ExDxF, up_ExDxF, down_ExFxD, idx_TxK, weights_TxK)
    tok_axes = tuple(a for a in sharding.mesh_axes("batch", mesh)
                     if mesh.shape[a] > 1 and x_TxD.shape[0] % mesh.shape[a] == 0)
    while tok_axes and x_TxD.shape[0] % math.prod(mesh.shape[a] for a in tok_axes):
        tok_axes = tok_axes[:-1]
    f = gate_ExDxF.shape[-1]
    tensor = tuple(a for a in sharding.mesh_axes("mlp", mesh)
                   if mesh.shape[a] > 1 and f % mesh.shape[a] == 0)
    if not tok_axes and not tensor:
        return local(x_TxD, gate_ExDxF, up_ExDxF, down_ExFxD, idx_TxK, weights_TxK)
    tok = tok_axes or None
    mlp = tensor or None

    def per_shard(x: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array, idx: jax.Array,
                  w: jax.Array):
        y = local(x, wg, wu, wd, idx, w)
        return jax.lax.psum(y, tensor) if tensor else y

    specs = (P(tok, None), P(None, None, mlp), P(None, None, mlp), P(None, mlp, None),
             P(tok, None), P(tok, None))
    # The kernels' outputs carry no varying-axes types (megablox's `gmm` builds its output
    # shape without them, and its index arithmetic mixes typed and untyped values): unchecked.
    # Without the check shard_map sums each input's cotangent over the axes its spec does not
    # name, at the boundary: dx over 'tensor' on the shard's rows, weight gradients over the
    # token axes, once each; tests/test_experts_megablox.py checks every gradient.
    fn = jax.shard_map(per_shard, mesh=mesh, in_specs=specs, out_specs=P(tok, None),
                       check_vma=False)
    return fn(x_TxD, gate_ExDxF, up_ExDxF, down_ExFxD, idx_TxK.astype(jnp.int32), weights_TxK)

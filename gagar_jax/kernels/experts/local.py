"""SwiGLU expert FFN backends behind one interface.

    y_t = sum_k w_tk * down_e(silu(x_t @ gate_e) * (x_t @ up_e)),   e = idx_tk

Stacked weights: `gate_ExDxF`, `up_ExDxF`, `down_ExFxD`. An expert id outside `[0, E)` (e.g. -1)
means "no expert": that assignment contributes zero (expert parallelism uses this for experts
that live on other devices; callers may use it to skip padding tokens).

Backends (`registry.py` picks one per config; all dropless except `capacity`):
  * `dense`    every expert on every token; the test oracle (E times the useful FLOPs).
  * `ragged`   sort by expert, `jax.lax.ragged_dot`, unsort by gather. Native on TPU/GPU; XLA:CPU
               runs ragged_dot as a masked loop over all groups, so it is slow there.
  * `grouped`  rows sorted by expert, each expert's run padded to a multiple of `block`; a
               scan over experts and, inside, loops with dynamic trip counts over that
               expert's rows (`big_block`-row matmuls, then `block`-row ones), with a
               hand-written backward (`custom_vjp`). The fast dropless path on XLA:CPU.
  * `capacity` fixed per-expert capacity, one batched einsum; DROPS overflow tokens
               (`capacity_ffn` reports how many). The speed reference for `grouped`.
  * `ep`       expert parallelism with `shard_map`: tokens all-gathered over the expert axis,
               local experts, outputs reduce-scattered back (see `ep.py`).
  * `ep_a2a`   expert parallelism with `ragged_all_to_all` dispatch (TPU/GPU only).

The token-to-expert plan (sort, gather, combine) is shared with the expert-parallel backends
in `ep.py` through the public module `dispatch.py`.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp

from gagar_jax.kernels.experts import dispatch


# --------------------------------------------------------------------------- dense (oracle)
def dense_ffn(x_TxD: jax.Array, gate_ExDxF: jax.Array, up_ExDxF: jax.Array, down_ExFxD: jax.Array,
              idx_TxK: jax.Array, weights_TxK: jax.Array) -> jax.Array:
    """Every expert on every token, combined with the gate weights (the test oracle)."""
    e = gate_ExDxF.shape[0]
    # one_hot of an out-of-range id is a zero row: "no expert".
    combine_TxE = jnp.einsum("tk,tke->te", weights_TxK.astype(x_TxD.dtype),
                             jax.nn.one_hot(idx_TxK, e, dtype=x_TxD.dtype))
    h_TxExF = jax.nn.silu(jnp.einsum("td,edf->tef", x_TxD, gate_ExDxF)) * jnp.einsum(
        "td,edf->tef", x_TxD, up_ExDxF)
    return jnp.einsum("tef,efd->td", h_TxExF * combine_TxE[:, :, None], down_ExFxD)


# --------------------------------------------------------------------------- ragged
def ragged_ffn(x_TxD: jax.Array, gate_ExDxF: jax.Array, up_ExDxF: jax.Array, down_ExFxD: jax.Array,
               idx_TxK: jax.Array, weights_TxK: jax.Array) -> jax.Array:
    """Sort by expert, three `jax.lax.ragged_dot`s, unsort by gather (TPU/GPU path)."""
    e = gate_ExDxF.shape[0]
    plan = dispatch.padded_plan(idx_TxK, e, block=1)
    xs_NxD = dispatch.gather_tokens(x_TxD, plan, idx_TxK.shape[1])
    h = jax.nn.silu(jax.lax.ragged_dot(xs_NxD, gate_ExDxF, plan.sizes_E)) * jax.lax.ragged_dot(
        xs_NxD, up_ExDxF, plan.sizes_E)
    ys_NxD = jax.lax.ragged_dot(h, down_ExFxD, plan.sizes_E)
    # Rows past sum(sizes) (invalid ids) are never read back: their slot is the sentinel.
    return dispatch.combine(ys_NxD, plan, weights_TxK)


# --------------------------------------------------------------------------- grouped (CPU)
def _varying_like(z: jax.Array, *refs: jax.Array) -> jax.Array:
    """Inside shard_map, loop carries must carry the union of their inputs' varying axes."""
    vary = lambda a: jax.typeof(a).manual_axis_type.varying
    vma = frozenset().union(*map(vary, refs)) - vary(z)
    return jax.lax.pcast(z, tuple(sorted(vma)), to="varying") if vma else z


def _sum_to_type_of(g: jax.Array, primal: jax.Array) -> jax.Array:
    """A cotangent varying over axes its primal does not vary over is summed over them."""
    vary = lambda a: jax.typeof(a).manual_axis_type.varying
    extra = vary(g) - vary(primal)
    return jax.lax.psum(g, tuple(sorted(extra))) if extra else g


def _over_expert_rows(first: jax.Array, size: jax.Array, block: int, big: int,
                      body: Callable[[jax.Array, int, tuple], tuple], carry: tuple):
    """Runs body(row0, rows, carry) over rows [first, first + size) of one expert.

    Chunks of `big` rows while they fit (large, efficient matmuls), then `block`-row chunks
    for the rest (the run is padded to a multiple of `block`, so the last chunk stays inside
    it). Trip counts are dynamic: only rows this expert actually has are computed.
    """
    n_big = size // big
    carry = jax.lax.fori_loop(0, n_big, lambda j, c: body(first + j * big, big, c), carry)
    rest0, rest = first + n_big * big, size - n_big * big
    return jax.lax.fori_loop(0, (rest + block - 1) // block,
                             lambda j, c: body(rest0 + j * block, block, c), carry)


def _dot_f32(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _expert_starts(sizes_E: jax.Array, block: int):
    padded_E = (sizes_E + block - 1) // block * block
    return jnp.cumsum(padded_E) - padded_E


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _grouped_swiglu(x_SxD: jax.Array, gate_ExDxF: jax.Array, up_ExDxF: jax.Array,
                    down_ExFxD: jax.Array, sizes_E: jax.Array, block: int, big: int):
    return _grouped_fwd(x_SxD, gate_ExDxF, up_ExDxF, down_ExFxD, sizes_E, block, big)[0]


def _grouped_fwd(x_SxD: jax.Array, gate_ExDxF: jax.Array, up_ExDxF: jax.Array,
                 down_ExFxD: jax.Array, sizes_E: jax.Array, block: int, big: int):
    s, d = x_SxD.shape
    f = gate_ExDxF.shape[-1]
    get = jax.lax.dynamic_slice_in_dim
    put = jax.lax.dynamic_update_slice_in_dim

    def per_expert(carry: tuple, xs: tuple):
        wg, wu, wd, first, size = xs

        def chunk(row0: jax.Array, rows: int, c: tuple):
            y_buf, hg_buf, hu_buf = c
            x_c = get(x_SxD, row0, rows)
            hg, hu = x_c @ wg, x_c @ wu
            y_c = (jax.nn.silu(hg) * hu) @ wd
            return put(y_buf, y_c, row0, 0), put(hg_buf, hg, row0, 0), put(hu_buf, hu, row0, 0)

        return _over_expert_rows(first, size, block, big, chunk, carry), None

    refs = (x_SxD, gate_ExDxF, up_ExDxF, down_ExFxD)
    zeros = lambda last: _varying_like(jnp.zeros((s, last), x_SxD.dtype), *refs)
    xs = (gate_ExDxF, up_ExDxF, down_ExFxD, _expert_starts(sizes_E, block), sizes_E)
    (y, hg, hu), _ = jax.lax.scan(per_expert, (zeros(d), zeros(f), zeros(f)), xs)
    # Saving the gate/up activations spares two of the three matmuls' recomputation.
    return y, (x_SxD, gate_ExDxF, up_ExDxF, down_ExFxD, sizes_E, hg, hu)


def _grouped_bwd(block: int, big: int, res: tuple, dy_SxD: jax.Array):
    x_SxD, gate_ExDxF, up_ExDxF, down_ExFxD, sizes_E, hg_buf, hu_buf = res
    get = jax.lax.dynamic_slice_in_dim

    def per_expert(dx_buf: jax.Array, xs: tuple):
        wg, wu, wd, first, size = xs

        def chunk(row0: jax.Array, rows: int, c: tuple):
            dx_buf, dwg, dwu, dwd = c
            x_c, dy_c = get(x_SxD, row0, rows), get(dy_SxD, row0, rows)
            hg, hu = get(hg_buf, row0, rows), get(hu_buf, row0, rows)
            sig = jax.nn.sigmoid(hg)
            silu = hg * sig
            da = dy_c @ wd.T
            dhu = da * silu
            dhg = da * hu * sig * (1 + hg * (1 - sig))
            dx_buf = jax.lax.dynamic_update_slice_in_dim(
                dx_buf, dhg @ wg.T + dhu @ wu.T, row0, 0)
            return (dx_buf, dwg + _dot_f32(x_c.T, dhg), dwu + _dot_f32(x_c.T, dhu),
                    dwd + _dot_f32((silu * hu).T, dy_c))

        # Weight gradients accumulate over the expert's chunks in fp32 (bf16 sums drift).
        refs = (x_SxD, dy_SxD, wg)
        init = (dx_buf,) + tuple(_varying_like(jnp.zeros(w.shape, jnp.float32), *refs)
                                 for w in (wg, wu, wd))
        dx_buf, dwg, dwu, dwd = _over_expert_rows(first, size, block, big, chunk, init)
        return dx_buf, (dwg.astype(wg.dtype), dwu.astype(wu.dtype), dwd.astype(wd.dtype))

    dx0 = _varying_like(jnp.zeros_like(x_SxD), dy_SxD, gate_ExDxF)
    xs = (gate_ExDxF, up_ExDxF, down_ExFxD, _expert_starts(sizes_E, block), sizes_E)
    # Per-expert weight gradients come out as scan outputs: no scatter into [E, D, F].
    dx, (dg, du, dd) = jax.lax.scan(per_expert, dx0, xs)
    return (_sum_to_type_of(dx, x_SxD), _sum_to_type_of(dg, gate_ExDxF),
            _sum_to_type_of(du, up_ExDxF), _sum_to_type_of(dd, down_ExFxD), None)


_grouped_swiglu.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_ffn(x_TxD: jax.Array, gate_ExDxF: jax.Array, up_ExDxF: jax.Array, down_ExFxD: jax.Array,
                idx_TxK: jax.Array, weights_TxK: jax.Array, *,
                block: int = 32, big_block: int = 256) -> jax.Array:
    """Dropless grouped matmul, fast on XLA:CPU.

    Rows are sorted by expert; each expert's run is padded to a multiple of `block` inside a
    buffer of static worst-case size `num_padded_blocks(T*K, E, block) * block` rows. Each
    expert runs `big_block`-row matmuls while they fit, then `block`-row ones, with dynamic
    trip counts, so padding costs memory but fewer than `block` wasted rows per expert.
    """
    t, k = idx_TxK.shape
    e = gate_ExDxF.shape[0]
    block = max(1, min(block, t * k))
    big_block = max(block, min(big_block, t * k))
    plan = dispatch.padded_plan(idx_TxK, e, block)
    x_SxD = dispatch.gather_tokens(x_TxD, plan, k)
    y_SxD = _grouped_swiglu(x_SxD, gate_ExDxF, up_ExDxF, down_ExFxD, plan.sizes_E,
                            block, big_block)
    return dispatch.combine(y_SxD, plan, weights_TxK)


# --------------------------------------------------------------------------- capacity
@flax.struct.dataclass
class CapacityOutput:
    y_TxD: jax.Array
    dropped: jax.Array   # int32 scalar: assignments over capacity (contribute nothing)


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Rows per expert in the capacity buffer: ceil(factor * T * K / E)."""
    return max(1, int(-(-factor * num_tokens * top_k // num_experts)))


def capacity_ffn(x_TxD: jax.Array, gate_ExDxF: jax.Array, up_ExDxF: jax.Array,
                 down_ExFxD: jax.Array, idx_TxK: jax.Array, weights_TxK: jax.Array, *,
                 capacity_factor: float = 1.25) -> CapacityOutput:
    """Fixed capacity per expert (first come, first served in token order); drops overflow."""
    t, k = idx_TxK.shape
    e, d, _ = gate_ExDxF.shape
    c = expert_capacity(t, k, e, capacity_factor)
    key_N, rank_N, sizes_E = dispatch.sort_by_expert(idx_TxK, e)
    keep_N = (key_N < e) & (rank_N < c)
    plan = dispatch.plan_from_slots(jnp.where(keep_N, key_N * c + rank_N, e * c), e * c, k, sizes_E)
    x_ExCxD = dispatch.gather_tokens(x_TxD, plan, k).reshape(e, c, d)
    h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", x_ExCxD, gate_ExDxF)) * jnp.einsum(
        "ecd,edf->ecf", x_ExCxD, up_ExDxF)
    y_ExCxD = jnp.einsum("ecf,efd->ecd", h, down_ExFxD)
    dropped = jnp.sum((key_N < e) & ~keep_N).astype(jnp.int32)
    return CapacityOutput(y_TxD=dispatch.combine(y_ExCxD.reshape(e * c, d), plan, weights_TxK),
                          dropped=dropped)


def _capacity_y(*args, **kw) -> jax.Array:
    return capacity_ffn(*args, **kw).y_TxD

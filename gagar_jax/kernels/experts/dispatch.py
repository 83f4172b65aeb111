"""The token-to-expert dispatch plan shared by every expert backend: sort, gather, combine.

A routing `idx_TxK` (expert ids; ids outside [0, E) mean "no expert") becomes a `Plan`: where each
(token, k) assignment lives in a buffer of rows grouped by expert. `gather_tokens` fills that
buffer from the tokens, a backend runs its experts on it, and `combine` sums each token's K rows
back with the gate weights. Row permutations use `take_rows`, whose backward is again a gather
through the inverse map, never a scatter-add (slow on XLA:CPU).
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


# --------------------------------------------------------------------------- row permutations
def _take_ext(src_RxD: jax.Array, idx_M: jax.Array) -> jax.Array:
    """src[idx] with idx == R (out of range) reading a zero row."""
    return jnp.take(src_RxD, idx_M, axis=0, mode="fill", fill_value=0)


@jax.custom_vjp
def take_rows(src_RxD: jax.Array, idx_M: jax.Array, inv_RxJ: jax.Array) -> jax.Array:
    """out[m] = src[idx[m]] (zero where idx[m] == R), differentiated by gathering.

    Args:
      src_RxD: rows to read.
      idx_M: source row of each output row; R = none.
      inv_RxJ: the inverse map, the (at most J) output rows that read source row r; M = none.
        Must be exact: out row m appears in inv[idx[m]] iff idx[m] < R.
    """
    return _take_ext(src_RxD, idx_M)


def _take_rows_fwd(src_RxD: jax.Array, idx_M: jax.Array, inv_RxJ: jax.Array):
    return _take_ext(src_RxD, idx_M), inv_RxJ


def _take_rows_bwd(inv_RxJ: jax.Array, g_MxD: jax.Array):
    r, j = inv_RxJ.shape
    d_src = _take_ext(g_MxD, inv_RxJ.reshape(r * j)).reshape(r, j, g_MxD.shape[-1]).sum(1)
    return d_src, None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


# --------------------------------------------------------------------------- routing plan
@flax.struct.dataclass
class Plan:
    """Where each (token, k) assignment lives in a buffer of S rows grouped by expert."""
    slot_N: jax.Array         # buffer row of assignment n = t*K + k; S = not computed
    row_assign_S: jax.Array   # assignment in buffer row s; N = empty row
    row_token_S: jax.Array    # token in buffer row s; T = empty row
    sizes_E: jax.Array        # rows per expert (valid assignments)


def sort_by_expert(idx_TxK: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (key_N, rank_N, sizes_E): expert (E = invalid), rank within the expert, sizes."""
    e_N = idx_TxK.reshape(-1).astype(jnp.int32)
    key_N = jnp.where((e_N >= 0) & (e_N < num_experts), e_N, num_experts)
    order_N = jnp.argsort(key_N, stable=True)            # sorted position -> assignment
    sizes_E1 = jnp.bincount(key_N, length=num_experts + 1)
    start_E1 = jnp.cumsum(sizes_E1) - sizes_E1
    key_sorted = key_N[order_N]
    rank_sorted = jnp.arange(key_N.shape[0], dtype=jnp.int32) - start_E1[key_sorted]
    rank_N = jnp.zeros_like(rank_sorted).at[order_N].set(rank_sorted, unique_indices=True)
    return key_N, rank_N, sizes_E1[:num_experts]


def plan_from_slots(slot_N: jax.Array, num_rows: int, top_k: int, sizes_E: jax.Array) -> Plan:
    n = slot_N.shape[0]
    row_assign_S = jnp.full((num_rows,), n, jnp.int32).at[slot_N].set(
        jnp.arange(n, dtype=jnp.int32), mode="drop", unique_indices=True)
    row_token_S = jnp.where(row_assign_S < n, row_assign_S // top_k, n // top_k)
    return Plan(slot_N=slot_N, row_assign_S=row_assign_S, row_token_S=row_token_S,
                 sizes_E=sizes_E)


def num_padded_blocks(num_assignments: int, num_experts: int, block: int) -> int:
    """Static worst case of sum_e ceil(size_e / block) over all routings."""
    return -(-(num_assignments + num_experts * (block - 1)) // block)


def padded_plan(idx_TxK: jax.Array, num_experts: int, block: int) -> Plan:
    """Rows sorted by expert, each expert's run padded to a multiple of `block` rows."""
    t, k = idx_TxK.shape
    key_N, rank_N, sizes_E = sort_by_expert(idx_TxK, num_experts)
    blocks_E = (sizes_E + block - 1) // block
    start_E = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(blocks_E) * block])
    s = num_padded_blocks(t * k, num_experts, block) * block
    slot_N = jnp.where(key_N < num_experts, start_E[key_N] + rank_N, s)
    return plan_from_slots(slot_N, s, k, sizes_E)


def gather_tokens(x_TxD: jax.Array, plan: Plan, top_k: int) -> jax.Array:
    """Buffer rows [S, D] from tokens; backward gathers the K slots of each token."""
    t = x_TxD.shape[0]
    return take_rows(x_TxD, plan.row_token_S, plan.slot_N.reshape(t, top_k))


def combine(y_SxD: jax.Array, plan: Plan, weights_TxK: jax.Array) -> jax.Array:
    """y_t = sum_k w_tk * buffer[slot(t, k)]."""
    t, k = weights_TxK.shape
    yk_TxKxD = take_rows(y_SxD, plan.slot_N, plan.row_assign_S[:, None]).reshape(t, k, -1)
    return jnp.einsum("tk,tkd->td", weights_TxK.astype(y_SxD.dtype), yk_TxKxD)


# --------------------------------------------------------------------------- varying-axes types
def varying_axes(*arrays: jax.Array) -> frozenset:
    """Mesh axes any of `arrays` varies over (inside `shard_map`; empty outside)."""
    return frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in arrays))


def to_varying(a: jax.Array, axes: tuple | frozenset) -> jax.Array:
    """`a` typed as varying over `axes` too (`pcast` of the axes it does not vary over yet).

    The cast is free in the forward pass; in the backward pass it is where the cotangent is
    summed over those axes, so expert backends cast at the cheapest place: tokens over
    'tensor' on the chip's own rows (not on a worst-case receive buffer), weights over the
    token axes once per layer (not once per chunk or expert).
    """
    missing = frozenset(axes) - varying_axes(a)
    return jax.lax.pcast(a, tuple(sorted(missing)), to="varying") if missing else a


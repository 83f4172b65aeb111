"""Expert parallelism: the `ep` expert backend, with `jax.shard_map` over the mesh.

Layout (from `sharding.LOGICAL_RULES`): tokens split over the batch axes
('data', 'fsdp', 'expert'), expert weights split on E over 'expert' and on F over 'tensor'.
Per device:

  1. all_gather the tokens (x, ids, gate weights) of its 'expert' group: every device of the
     group sees the group's T_local * n_expert tokens;
  2. run its E / n_expert LOCAL experts with the dropless grouped matmul on the tokens routed
     to them (ids of other devices' experts fall outside [0, E_local) and cost nothing);
     F split over 'tensor' gives partial sums, added with a psum over 'tensor';
  3. psum_scatter over 'expert' adds the partial outputs of the group's devices and hands each
     device back its own token rows.

Static shapes and no token dropping. The price of the gather design: each device holds the
whole group's tokens, T_local * n_expert rows of x (and a worst-case grouped buffer of
T_local * n_expert * K rows), so activation memory grows with the expert-axis size times the
tokens, and every token crosses the expert axis whether or not its experts live elsewhere. At
pod scale (an expert axis of 64+ devices, long packed rows) that may not fit. The alternative
is an all-to-all dispatch with `jax.lax.ragged_all_to_all`: sort each device's assignments by
destination device, exchange the per-device counts, send every row only to the device owning
its expert, run the local grouped matmul on the received rows, and send the results back with
a second ragged all-to-all. It moves K/n_expert of the gathered traffic; a dropless version
still needs a worst-case receive buffer, so in practice it is paired with a capacity bound or
chunking. `ragged_all_to_all` has no XLA:CPU lowering (it cannot run in these CPU tests) but
compiles ahead of time for TPU; it is not implemented here and would sit behind the same
`expert_ffn` interface as another entry of `experts.BACKENDS`.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gagar_jax import experts, sharding


def _mesh_axes(name: str, mesh) -> tuple:
    rule = sharding.LOGICAL_RULES[name]
    axes = () if rule is None else ((rule,) if isinstance(rule, str) else tuple(rule))
    return tuple(a for a in axes if a in mesh.axis_names)


def _spec(axes: tuple) -> Optional[object]:
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


def ep_ffn(x_TxD, gate_ExDxF, up_ExDxF, down_ExFxD, idx_TxK, weights_TxK, *,
           mesh=None, block: int = 32, big_block: int = 256) -> jax.Array:
    """Expert-parallel routed SwiGLU (same math as `experts.dense_ffn`).

    Args:
      x_TxD, gate_ExDxF, up_ExDxF, down_ExFxD, idx_TxK, weights_TxK: as `experts.expert_ffn`.
      mesh: a `Mesh`/`AbstractMesh`; default the ambient one (`jax.set_mesh(mesh)`).
      block, big_block: grouped-matmul chunk rows (see `experts.grouped_ffn`).
    Returns:
      y_TxD, sharded like the tokens.
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh is None or mesh.empty:
        raise ValueError("backend 'ep' needs a mesh: pass mesh= or set one with jax.set_mesh")
    (expert_axis,) = _mesh_axes("expert", mesh) or (None,)
    if expert_axis is None:
        raise ValueError(f"mesh axes {mesh.axis_names} lack the expert axis "
                         f"{sharding.LOGICAL_RULES['expert']!r}")
    t, e = x_TxD.shape[0], gate_ExDxF.shape[0]
    n_exp = mesh.shape[expert_axis]
    if e % n_exp:
        raise ValueError(f"num_experts={e} is not divisible by mesh axis {expert_axis!r}={n_exp}")
    tok_axes = _mesh_axes("batch", mesh)
    if expert_axis not in tok_axes:
        raise ValueError(f"token axes {tok_axes} must include the expert axis {expert_axis!r}")
    n_tok = 1
    for a in tok_axes:
        n_tok *= mesh.shape[a]
    if t % n_tok:
        raise ValueError(f"tokens T={t} not divisible by the batch mesh axes {tok_axes} ({n_tok})")
    # F over 'tensor' only where it divides (as sharding.logical_to_spec does).
    tensor_axes = tuple(a for a in _mesh_axes("mlp", mesh)
                        if mesh.shape[a] > 1 and gate_ExDxF.shape[-1] % mesh.shape[a] == 0)
    tok, mlp = _spec(tok_axes), _spec(tensor_axes)

    def local(x, wg, wu, wd, idx, w):
        gather = lambda a: jax.lax.all_gather(a, expert_axis, axis=0, tiled=True)  # noqa: E731
        e_local = wg.shape[0]
        first = jax.lax.axis_index(expert_axis) * e_local
        y = experts.grouped_ffn(gather(x), wg, wu, wd, gather(idx) - first, gather(w),
                                block=block, big_block=big_block)
        if tensor_axes:
            y = jax.lax.psum(y, tensor_axes)
        return jax.lax.psum_scatter(y, expert_axis, scatter_dimension=0, tiled=True)

    fn_specs = (P(tok, None), P(expert_axis, None, mlp), P(expert_axis, None, mlp),
                P(expert_axis, mlp, None), P(tok, None), P(tok, None))
    fn = jax.shard_map(local, mesh=mesh, in_specs=fn_specs, out_specs=P(tok, None))
    args = (x_TxD, gate_ExDxF, up_ExDxF, down_ExFxD, idx_TxK.astype(jnp.int32), weights_TxK)
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        # Explicit-sharding meshes make layout changes visible: move inputs to the specs.
        args = tuple(jax.reshard(a, jax.sharding.NamedSharding(mesh, s)) for a, s in zip(args, fn_specs))
    return fn(*args)

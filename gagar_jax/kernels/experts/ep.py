"""Expert parallelism: the `ep` (all-gather) and `ep_a2a` (ragged all-to-all) expert backends,
with `jax.shard_map` over the mesh.

Layout (from `sharding.LOGICAL_RULES`): tokens split over the batch axes
('data', 'fsdp', 'expert') and, for the flattened sequence, 'context'; expert weights split
on E over 'expert' and on F over 'tensor'.
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
is an all-to-all dispatch, `ep_a2a_ffn` (backend `ep_a2a`): sort each device's assignments by
destination device, exchange the per-device counts, send every row only to the device owning
its expert with `jax.lax.ragged_all_to_all`, run the local grouped matmul on the received rows,
and send the results back with a second ragged all-to-all. Its local FFN is the megablox
kernel when compiling for TPU (`megablox.py`), the grouped matmul elsewhere. \
It moves about K / n_expert of the
gathered traffic. Being dropless it sizes its receive buffer for the worst case (every row
sent to one device: n_expert * T_local * K rows), so it exchanges the local tokens in n_expert
chunks, one after another, each chunk's buffers rematerialized in the backward pass: the
buffer is then T_local * K rows, as without expert parallelism (at pod scale the unchunked
buffers alone, 16 GiB each for Flash at expert = 8, do not fit; docs/scaling.md).
`ragged_all_to_all` has no XLA:CPU lowering: `ep_a2a` runs on TPU/GPU and
compiles ahead of time for TPU (tested); the CPU tests check its bookkeeping with an
all_gather-based emulation of the collective (`emulated_ragged_all_to_all`).

Any token count T works: `_Layout.run` pads T to a multiple of the token shards with rows
routed to no expert (id -1, weight 0) and cuts them off the output, so a model on a mesh with an
`expert` axis runs a forward on any length.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gagar_jax import sharding
from gagar_jax.kernels.experts import dispatch
from gagar_jax.kernels.experts import local as experts
from gagar_jax.kernels.experts import megablox as experts_megablox


def _spec(axes: tuple) -> Optional[object]:
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


@dataclasses.dataclass(frozen=True)
class _Layout:
    mesh: object
    expert_axis: str
    tokens: object          # PartitionSpec entry of the token dimension
    token_axes: tuple       # mesh axes the tokens are split over
    mlp: object             # PartitionSpec entry of F
    tensor_axes: tuple      # mesh axes F is split over (partial sums to add)
    num_shards: int = 1     # devices the tokens are split over (T is padded to a multiple)

    def run(self, local: Callable[..., jax.Array], x_TxD: jax.Array, gate_ExDxF: jax.Array,
            up_ExDxF: jax.Array, down_ExFxD: jax.Array, idx_TxK: jax.Array, weights_TxK: jax.Array,
            *, check_vma: bool = True):
        tok, ex, mlp = self.tokens, self.expert_axis, self.mlp
        specs = (P(tok, None), P(ex, None, mlp), P(ex, None, mlp), P(ex, mlp, None),
                 P(tok, None), P(tok, None))
        fn = jax.shard_map(local, mesh=self.mesh, in_specs=specs, out_specs=P(tok, None),
                           check_vma=check_vma)
        # Any T: pad the tokens to a multiple of the token shards with rows routed to no
        # expert (id -1, weight 0: no compute, zero output and gradient), cut them off after.
        t = x_TxD.shape[0]
        pad = -t % self.num_shards
        if pad:
            rows = ((0, pad), (0, 0))
            x_TxD, weights_TxK = jnp.pad(x_TxD, rows), jnp.pad(weights_TxK, rows)
            idx_TxK = jnp.pad(idx_TxK.astype(jnp.int32), rows, constant_values=-1)
        args = (x_TxD, gate_ExDxF, up_ExDxF, down_ExFxD, idx_TxK.astype(jnp.int32), weights_TxK)
        if any(t == jax.sharding.AxisType.Explicit for t in self.mesh.axis_types):
            # Explicit-sharding meshes make layout changes visible: move inputs to the specs.
            args = tuple(
                jax.reshard(a, NamedSharding(self.mesh, s))
                for a, s in zip(args, specs, strict=False)
            )
        y_TxD = fn(*args)
        return y_TxD[:t] if pad else y_TxD


def _layout(mesh: Optional[jax.sharding.Mesh | jax.sharding.AbstractMesh], num_tokens: int,
            gate_ExDxF: jax.Array, backend: str) -> _Layout:
    """Validated mesh axes for expert parallelism (token, expert and F dimensions)."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh is None or mesh.empty:
        raise ValueError(f"backend {backend!r} needs a mesh: pass mesh= or set one with "
                         f"jax.set_mesh")
    (expert_axis,) = sharding.mesh_axes("expert", mesh) or (None,)
    if expert_axis is None:
        raise ValueError(f"mesh axes {mesh.axis_names} lack the expert axis "
                         f"{sharding.LOGICAL_RULES['expert']!r}")
    e, n_exp = gate_ExDxF.shape[0], mesh.shape[expert_axis]
    if e % n_exp:
        raise ValueError(f"num_experts={e} is not divisible by mesh axis {expert_axis!r}={n_exp}")
    # Tokens are the flattened [B, S]: B over the batch axes, then S over the context axis.
    tok_axes = sharding.mesh_axes("batch", mesh) + tuple(
        a for a in sharding.mesh_axes("seq", mesh) if mesh.shape[a] > 1)
    if expert_axis not in tok_axes:
        raise ValueError(f"token axes {tok_axes} must include the expert axis {expert_axis!r}")
    n_tok = int(np.prod([mesh.shape[a] for a in tok_axes]))   # `run` pads T to a multiple
    # F over 'tensor' only where it divides (as sharding.logical_to_spec does).
    tensor_axes = tuple(a for a in sharding.mesh_axes("mlp", mesh)
                        if mesh.shape[a] > 1 and gate_ExDxF.shape[-1] % mesh.shape[a] == 0)
    return _Layout(mesh, expert_axis, _spec(tok_axes), tok_axes, _spec(tensor_axes), tensor_axes,
                   n_tok)


def ep_ffn(x_TxD: jax.Array, gate_ExDxF: jax.Array, up_ExDxF: jax.Array, down_ExFxD: jax.Array,
           idx_TxK: jax.Array, weights_TxK: jax.Array, *,
           mesh: Optional[jax.sharding.Mesh | jax.sharding.AbstractMesh] = None, block: int = 32,
           big_block: int = 256) -> jax.Array:
    """Expert-parallel routed SwiGLU, gather design (same math as `local.dense_ffn`).

    Args:
      x_TxD, gate_ExDxF, up_ExDxF, down_ExFxD, idx_TxK, weights_TxK: as `registry.expert_ffn`.
      mesh: a `Mesh`/`AbstractMesh`; default the ambient one (`jax.set_mesh(mesh)`).
      block, big_block: grouped-matmul chunk rows (see `local.grouped_ffn`).
    Returns:
      y_TxD, sharded like the tokens.
    """
    lay = _layout(mesh, x_TxD.shape[0], gate_ExDxF, "ep")
    ax = lay.expert_axis

    def local(x: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array, idx: jax.Array,
              w: jax.Array):
        gather = lambda a: jax.lax.all_gather(a, ax, axis=0, tiled=True)
        first = jax.lax.axis_index(ax) * wg.shape[0]
        # Where the backward pass sums (see dispatch.to_varying): dx over 'tensor' on the
        # chip's rows before the gather, the weight gradients over the token axes once.
        x, w = (dispatch.to_varying(a, lay.tensor_axes) for a in (x, w))
        wg, wu, wd = (dispatch.to_varying(a, lay.token_axes) for a in (wg, wu, wd))
        y = experts.grouped_ffn(gather(x), wg, wu, wd, gather(idx) - first, gather(w),
                                block=block, big_block=big_block)
        y = jax.lax.psum_scatter(y, ax, scatter_dimension=0, tiled=True)
        # F's 'tensor' partial sums, added after the scatter: on T_local rows, not T_local * n.
        return jax.lax.psum(y, lay.tensor_axes) if lay.tensor_axes else y

    return lay.run(local, x_TxD, gate_ExDxF, up_ExDxF, down_ExFxD, idx_TxK, weights_TxK)


def emulated_ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                               send_sizes: jax.Array, output_offsets: jax.Array,
                               recv_sizes: jax.Array, *, axis_name: str) -> jax.Array:
    """`jax.lax.ragged_all_to_all` built from all_gather (runs on CPU; n times the traffic).

    Same semantics: sender i's rows [input_offsets[j], + send_sizes[j]) land on device j at
    rows [output_offsets[j], + send_sizes[j]) of `output`. For tests of `ep_a2a_ffn`.
    """
    del recv_sizes  # implied by the senders' send_sizes
    me = jax.lax.axis_index(axis_name)
    gather = lambda a: jax.lax.all_gather(a, axis_name)
    ops, io = gather(operand), gather(input_offsets)
    ss, oo = gather(send_sizes), gather(output_offsets)
    r = jnp.arange(output.shape[0])
    out = output
    for i in range(ops.shape[0]):
        start, size, src0 = oo[i, me], ss[i, me], io[i, me]
        hit = ((r >= start) & (r < start + size)).reshape((-1,) + (1,) * (output.ndim - 1))
        rows = jnp.take(ops[i], jnp.clip(src0 + r - start, 0, operand.shape[0] - 1), axis=0)
        out = jnp.where(hit, rows, out)
    return out


def _chunks(num_tokens: int, requested: Optional[int], n_dev: int) -> int:
    """Largest divisor of the local token count that is at most `requested` (default n_dev)."""
    want = n_dev if requested is None else requested
    if want < 1:
        raise ValueError(f"chunks={requested} must be >= 1")
    return max(c for c in range(1, min(want, num_tokens) + 1) if num_tokens % c == 0)


LOCAL_FFNS = ("grouped", "megablox")   # ep_a2a's per-device expert FFN


def _local_ffn(local: str, platform: str, block: int, big_block: int,
               interpret: Optional[bool], row_tile: Optional[int] = None):
    """The per-device FFN of `ep_a2a` (`registry.resolve_local` chooses for "auto")."""
    if local not in LOCAL_FFNS:
        raise ValueError(f"ep_a2a local={local!r}; expected one of {LOCAL_FFNS} (an 'auto' is "
                         f"resolved by kernels.experts.registry.resolve_local)")
    if local == "megablox":
        return functools.partial(
            experts_megablox.local_ffn,
            interpret=platform != "tpu" if interpret is None else interpret,
            tiling=(row_tile or experts_megablox.DEFAULT_TILING[0],
                    *experts_megablox.DEFAULT_TILING[1:]),
        )
    return functools.partial(experts.grouped_ffn, block=block, big_block=big_block)


def ep_a2a_ffn(
    x_TxD: jax.Array,
    gate_ExDxF: jax.Array,
    up_ExDxF: jax.Array,
    down_ExFxD: jax.Array,
    idx_TxK: jax.Array,
    weights_TxK: jax.Array,
    *,
    mesh: Optional[jax.sharding.Mesh | jax.sharding.AbstractMesh] = None,
    block: int = 32,
    big_block: int = 256,
    chunks: Optional[int] = None,
    exchange: Callable[..., jax.Array] = jax.lax.ragged_all_to_all,
    local: str = "grouped",
    interpret: Optional[bool] = None,
    row_tile: Optional[int] = None,
) -> jax.Array:
    """Expert-parallel routed SwiGLU, all-to-all design (TPU/GPU; see the module docstring).

    Each device's tokens go through the exchange in `chunks` slices, one after another (a
    `scan` whose body is rematerialized), so the dropless worst-case receive buffer is
    n_expert * (T_local / chunks) * K rows: with the default chunks = n_expert it is T_local * K
    rows, the size of the local grouped buffer, whatever the expert-axis size.

    Args:
      as `ep_ffn`, plus chunks: slices of the local tokens (default: the expert-axis size,
        lowered to a divisor of the local token count); exchange: the ragged all-to-all
        collective (tests pass `emulated_ragged_all_to_all` to run on CPU); local: the
        per-device expert FFN on the received rows, "grouped" (`local.grouped_ffn`),
        "megablox" (`megablox.local_ffn`); the model's `ep_local_ffn` "auto" is resolved by
        `registry.resolve_local` (megablox when compiling for TPU at widths it lowers for);
        interpret: Pallas interpret mode of megablox (None: unless compiling for TPU);
        row_tile: megablox's row tile (None: its default).
    Returns:
      y_TxD, sharded like the tokens.
    """
    lay = _layout(mesh, x_TxD.shape[0], gate_ExDxF, "ep_a2a")
    ax = lay.expert_axis
    expert_ffn = _local_ffn(local, sharding.device_platform(lay.mesh), block, big_block,
                            interpret, row_tile)
    # megablox's kernels carry no mesh-axis types (see megablox.megablox_ffn): unchecked there,
    # and shard_map then adds the cotangent sums at its boundary (the same places as the casts).
    typed = local != "megablox"
    cast = dispatch.to_varying if typed else (lambda a, axes: a)

    def one_chunk(x: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array, idx: jax.Array,
                  w: jax.Array):
        t, k = idx.shape
        n_rows, d, e_local = t * k, x.shape[1], wg.shape[0]
        n_dev, me = jax.lax.axis_size(ax), jax.lax.axis_index(ax)
        e_all = e_local * n_dev
        # Sort assignments by global expert id = by destination device, then local expert.
        e_N = idx.reshape(n_rows)
        key_N = jnp.where((e_N >= 0) & (e_N < e_all), e_N, e_all)
        order_N = jnp.argsort(key_N, stable=True)
        pos_N = jnp.zeros_like(order_N).at[order_N].set(
            jnp.arange(n_rows, dtype=order_N.dtype), unique_indices=True)
        key_s = key_N[order_N]
        dest_s = key_s // e_local                          # n_dev = not sent (invalid id)
        send = jnp.bincount(dest_s, length=n_dev + 1)[:n_dev].astype(jnp.int32)
        counts = jax.lax.all_gather(send, ax)              # [sender, receiver]
        recv = counts[:, me]
        excl = lambda c, axis: jnp.cumsum(c, axis) - c
        fwd = dict(input_offsets=excl(send, 0), send_sizes=send,
                   output_offsets=excl(counts, 0)[me], recv_sizes=recv)
        back = dict(input_offsets=excl(recv, 0), send_sizes=recv,
                    output_offsets=excl(counts, 1)[:, me], recv_sizes=send)
        plan = dispatch.Plan(slot_N=pos_N, row_assign_S=order_N, row_token_S=order_N // k,
                             sizes_E=send)
        rows_R = n_dev * n_rows                             # worst case: all rows to one device
        # Typed as varying over 'tensor' here, on the chunk's t rows, so that the backward pass
        # adds dx's 'tensor' partial sums on them (not on the n_dev * t * K received rows).
        x, w = (cast(a, lay.tensor_axes) for a in (x, w))

        def send(rows: jax.Array, into: jax.Array, plan_: dict) -> jax.Array:
            # ragged_all_to_all types its result like its `output` buffer: a fresh buffer is
            # invariant, and the backward pass would then sum the received rows' cotangents
            # over the token axes (a wrong gradient: every chip holds different rows). Type
            # the buffer like the rows it receives.
            into = cast(into, dispatch.varying_axes(rows) | {ax})
            return exchange(rows, into, axis_name=ax, **plan_)

        x_recv = send(dispatch.gather_tokens(x, plan, k), jnp.zeros((rows_R, d), x.dtype), fwd)
        e_recv = send((key_s - dest_s * e_local)[:, None].astype(jnp.int32),
                      jnp.full((rows_R, 1), -1, jnp.int32), fwd)
        y_recv = expert_ffn(x_recv, wg, wu, wd, e_recv,
                            cast(jnp.ones((rows_R, 1), x.dtype), dispatch.varying_axes(x_recv)))
        y_sorted = send(y_recv, jnp.zeros((n_rows, d), y_recv.dtype), back)
        y = dispatch.combine(y_sorted, plan, w)
        # Partial sums over F's 'tensor' shards: add them on the t tokens, not on the
        # n_dev * t * K worst-case rows (return exchange and combine are linear, and every
        # 'tensor' shard routes the same tokens the same way).
        return jax.lax.psum(y, lay.tensor_axes) if lay.tensor_axes else y

    def per_device(x: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array, idx: jax.Array,
                   w: jax.Array):
        # Weights typed as varying over the token axes before the chunk loop: their gradients
        # are summed over those axes once per layer, not once per chunk.
        wg, wu, wd = (cast(a, lay.token_axes) for a in (wg, wu, wd))
        c = _chunks(x.shape[0], chunks, jax.lax.axis_size(ax))
        if c == 1:
            return one_chunk(x, wg, wu, wd, idx, w)
        # Keep only each chunk's inputs for the backward pass, not its worst-case buffers.
        body = jax.checkpoint(lambda _, xs: (None, one_chunk(xs[0], wg, wu, wd, xs[1], xs[2])))
        split = lambda a: a.reshape((c, a.shape[0] // c) + a.shape[1:])
        _, y = jax.lax.scan(body, None, (split(x), split(idx), split(w)))
        return y.reshape(x.shape[0], -1)

    return lay.run(per_device, x_TxD, gate_ExDxF, up_ExDxF, down_ExFxD, idx_TxK, weights_TxK,
                   check_vma=typed)

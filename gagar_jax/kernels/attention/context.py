"""Attention over rows split along the sequence across the `context` mesh axis.

With context parallelism (`sharding.LOGICAL_RULES["seq"] = "context"`, n = the axis size) chip r
holds rows [r * S / n, (r + 1) * S / n) of every sequence: its queries, keys, values and segment
ids. Everything else in the model is per token; attention alone reads other chips' keys. Inside a
`jax.shard_map` over the mesh, each chip gathers the keys its queries can see and runs an
ordinary per-shard attention kernel on them (`registry.py`), told where its first query sits
among the keys (`q_offset`); segment ids travel with the keys, so packing masks, causality and
sinks hold across chip boundaries exactly as on one chip.

* Full-attention layers: all-gather K, V and segment ids over `context` (`all_gather`; its
  transpose, a reduce-scatter, returns dK / dV in the backward pass). GQA keeps this small: for
  MiMo-V2-Flash at 256k tokens, K + V of a row are 256k x 4 x (192 + 128) x 2 B = 640 MiB per
  full layer (160 MiB per chip at tensor = 4), gathered one layer at a time. Causal work is
  balanced zig-zag style on the query side (`_balanced_full`): the row stays in order, and each
  chip computes query half-chunks r and 2n - 1 - r, sent to it and back with `ppermute`. The ring
  alternative (pass K/V blocks around the axis) is not built; docs/scaling.md has the figures
  that chose all-gather.
* Sliding-window layers (window W): a query needs only the W - 1 keys before its chip's chunk,
  so each chip receives just those rows, from the chip(s) before it (`ppermute`, as many hops
  as W - 1 spans chunks). The first chip receives segment id -1 (no key) there.

The per-shard kernel is any record of `registry.KERNELS` (its `local` function, with the
contract of `blockwise.blockwise_attention`: keys of their own length via `kv_segment_ids_BxK`,
the key index of the first query as `q_offset`). A kernel that declares `static_offset` (splash:
its masks are static) is also given, where a chip's offset depends on its `axis_index` (full
layers), the offsets the chips can have (`q_offsets`), and builds one masked kernel per value,
chosen by `lax.switch`; sliding layers' offset (the halo length) is the same on every chip.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gagar_jax import sharding
from gagar_jax.kernels.attention import registry


def _specs(q: jax.Array, k: jax.Array, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh):
    """PartitionSpecs of q / k (B, S, heads, None) inside the context shard_map, or None when the
    sequence is not split over the context axis (S does not divide)."""
    q_spec = sharding.logical_to_spec(("batch", "seq", "heads", None), q.shape, mesh)
    k_spec = sharding.logical_to_spec(("batch", "seq", "kv_heads", None), k.shape, mesh)
    ctx = sharding.mesh_axes("seq", mesh)
    if len(ctx) != 1 or q_spec[1] != ctx[0] or k_spec[1] != ctx[0]:
        return None
    if q_spec[2] != k_spec[2]:  # heads split but KV heads not (or vice versa): keep GQA groups
                                # whole
        q_spec = P(q_spec[0], q_spec[1], None, None)
        k_spec = P(k_spec[0], k_spec[1], None, None)
    return q_spec, k_spec


def _preceding_keys(x: jax.Array, halo: int, axis: str, n: int, fill: int = 0):
    """The `halo` rows before this chip's chunk along axis 1, from the chips before it.

    Chip r gets chunk r - h from `ppermute` shift h, for h = 1 .. ceil(halo / chunk); chips
    with no such predecessor receive `fill`. Returns [chunks received..., own chunk] cut to the
    last halo + chunk rows (fewer where the axis has too few chips).
    """
    chunk = x.shape[1]
    hops = min(-(-halo // chunk), n - 1) if halo else 0
    parts = []
    for h in range(hops, 0, -1):
        perm = [(i, i + h) for i in range(n - h)]
        if fill:  # ppermute leaves non-receivers at 0: shift so that 0 arrives as `fill`
            parts.append(jax.lax.ppermute(x - fill, axis, perm) + fill)
        else:
            parts.append(jax.lax.ppermute(x, axis, perm))
    full = jnp.concatenate(parts + [x], axis=1) if parts else x
    return full[:, max(0, full.shape[1] - halo - chunk):]


def _balanced_full(kernel: Callable[..., jax.Array], q: jax.Array, k_all: jax.Array,
                   v_all: jax.Array, seg: jax.Array, seg_all: jax.Array, axis: str, n: int,
                   sinks: jax.Array | None, kw: dict[str, Any]):
    """Causal full attention with the query work balanced over the context axis (zig-zag).

    With the row in order, chip r's queries see r + 1/2 chunks of keys on average: the last
    chip does (2n - 1) / n times the mean work. Cut the row into 2n half-chunks; chip r
    computes half-chunks r and 2n - 1 - r, whose key counts add up to the same on every chip:
    each chip sends
    its two query halves (and their segment ids) to the chips that compute them, runs the
    kernel on what it received against the gathered keys, and sends the outputs back. Keys
    stay in row order; only queries and outputs move (two `ppermute`s each way), and the
    backward pass runs the inverse permutations.
    """
    half = q.shape[1] // 2
    r = jax.lax.axis_index(axis)
    dest = lambda h: h if h < n else 2 * n - 1 - h  # half-chunk -> computing chip
    outs = []
    for j in (0, 1):  # chip s's half j is half-chunk 2s + j
        perm = [(s, dest(2 * s + j)) for s in range(n)]
        back = [(b, a) for a, b in perm]
        part = slice(j * half, (j + 1) * half)
        q_j = jax.lax.ppermute(q[:, part], axis, perm)
        seg_j = jax.lax.ppermute(seg[:, part], axis, perm)
        # Chip r receives half-chunk r from the even-or-odd set of r's parity, else 2n - 1 - r.
        h = jnp.where(r % 2 == j, r, 2 * n - 1 - r)
        if kernel.static_offset:  # h is a half-chunk 2s + j: one of n values
            kw = {**kw, "q_offsets": tuple(c * half for c in range(j, 2 * n, 2))}
        o_j = kernel.local(q_j, k_all, v_all, seg_j, kv_segment_ids_BxK=seg_all, q_offset=h * half,
                     window=0, sinks_H=sinks, **kw)
        outs.append(jax.lax.ppermute(o_j, axis, back))
    return jnp.concatenate(outs, axis=1)


def attention(q_BxSxHxD: jax.Array, k_BxSxKxD: jax.Array, v_BxSxKxD: jax.Array,
              segment_ids_BxS: jax.Array, *, impl: str, block: int = 512, window: int = 0,
              sinks_H: jax.Array | None = None, balance: bool = True) -> jax.Array:
    """`registry.attention` with rows split along S over the ambient mesh's context axis.

    Without a context axis larger than 1 (or when S does not split over it) this is exactly
    `registry.attention`. Arguments as there; `impl` names a resolved kernel of
    `registry.KERNELS` ("auto" is an error: `registry.resolve` it when the model is built).
    `balance`: full layers compute zig-zag placed query halves (`_balanced_full`), so every chip
    does the same causal work; False keeps each chip on its own queries.
    """
    mesh = jax.sharding.get_abstract_mesh()
    kernel = registry.get(impl)
    n = sharding.axis_size("seq", mesh)
    specs = _specs(q_BxSxHxD, k_BxSxKxD, mesh) if n > 1 else None
    if specs is None:
        return registry.attention(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS,
                                  impl=impl, block=block, window=window, sinks_H=sinks_H)
    q_spec, k_spec = specs
    (axis,) = sharding.mesh_axes("seq", mesh)
    seg_spec, has_sink = P(q_spec[0], q_spec[1]), sinks_H is not None
    kw = kernel.kwargs(block, sharding.device_platform(mesh))

    def local(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array, sinks: jax.Array):
        chunk, kw_offsets = q.shape[1], {}
        if window:
            halo = window - 1
            k_all = _preceding_keys(k, halo, axis, n)
            v_all = _preceding_keys(v, halo, axis, n)
            seg_all = _preceding_keys(seg, halo, axis, n, fill=-1)
            offset = k_all.shape[1] - chunk
        else:
            gather = functools.partial(jax.lax.all_gather, axis_name=axis, axis=1, tiled=True)
            k_all, v_all, seg_all = gather(k), gather(v), gather(seg)
            if balance and chunk % 2 == 0:
                return _balanced_full(kernel, q, k_all, v_all, seg, seg_all, axis, n,
                                      sinks if has_sink else None, kw)
            offset = jax.lax.axis_index(axis) * chunk
            if kernel.static_offset:
                kw_offsets = {"q_offsets": tuple(c * chunk for c in range(n))}
        return kernel.local(q, k_all, v_all, seg, kv_segment_ids_BxK=seg_all, q_offset=offset,
                      window=window, sinks_H=sinks if has_sink else None, **kw, **kw_offsets)

    sinks = sinks_H if has_sink else jnp.zeros((q_BxSxHxD.shape[2],), jnp.float32)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, k_spec, k_spec, seg_spec,
                                                   P(q_spec[2])),
                       out_specs=q_spec, check_vma=False)
    return fn(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, sinks)

"""Canonical units of the parameters, and a device-side reshard that puts each unit on one host.

A *unit* is the slice of a parameter leaf that one Hugging Face tensor holds: one layer of a
stacked leaf (`[L, ...]` -> L units), one (layer, expert) of a stacked expert leaf
(`[L, E, ...]` -> L*E units), or the whole of a top-level leaf (embedding, lm_head, final norm).
The units of a leaf are numbered in C order of those leading axes. They do not depend on the
mesh, so anything defined per unit (the published files, `metrics.params_sha256`) is the same on
1 and N processes.

`to_owners` reshards a leaf on device (one jitted reshape + pad + roll, an all-to-all, never an
all-gather) into `[P * k, *unit]` sharded over processes, so process p holds k whole units;
`host_units` then copies only this process's units to host memory. Which process owns which unit
comes from `plan`: contiguous blocks of k = ceil(U / P) units, each leaf rotated by an offset chosen
greedily (largest leaves first) to balance bytes across processes.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gagar_jax import sharding

UNIT_AXES = ("layers", "expert")   # leading logical axes that split a leaf into units


@dataclasses.dataclass(frozen=True)
class LeafUnits:
    name: str
    shape: tuple
    lead: int           # number of leading axes that index units (0, 1 or 2)
    dtype: str          # dtype of the resharded units
    procs: int
    offset: int = 0     # rotation, in blocks of k units

    @property
    def units(self) -> int:
        return int(np.prod(self.shape[:self.lead], dtype=np.int64))

    @property
    def unit_shape(self) -> tuple:
        return tuple(self.shape[self.lead:])

    @property
    def k(self) -> int:
        return -(-self.units // self.procs)

    @property
    def unit_bytes(self) -> int:
        return int(np.prod(self.unit_shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def slot(self, u: int) -> int:
        return (u + self.offset * self.k) % (self.procs * self.k)

    def owner(self, u: int) -> int:
        return self.slot(u) // self.k

    def unit_index(self, u: int) -> tuple:
        """The leading-axis indices of unit u (e.g. (layer, expert))."""
        return (
            tuple(int(i) for i in np.unravel_index(u, self.shape[: self.lead])) if self.lead else ()
        )


def unit_lead(name: str, ndim: int) -> int:
    """How many leading axes of parameter `name` index its units."""
    axes = sharding.param_logical_axes(name.split("/"), ndim)
    n = 0
    while n < min(len(axes), len(UNIT_AXES)) and axes[n] == UNIT_AXES[n]:
        n += 1
    return n


def plan(leaves: dict, procs: int, dtype_of: Callable[[str, object], str]) -> dict:
    """name -> LeafUnits for `leaves` (name -> array or ShapeDtypeStruct), bytes balanced.

    Args:
      leaves: parameter leaves by path name.
      procs: number of processes.
      dtype_of: (name, leaf) -> the dtype name the units are resharded to.
    """
    out = {n: LeafUnits(n, tuple(x.shape), unit_lead(n, len(x.shape)), dtype_of(n, x), procs)
           for n, x in leaves.items()}
    load = np.zeros(procs, np.int64)
    for n in sorted(out, key=lambda n: (-out[n].units * out[n].unit_bytes, n)):
        lu = out[n]
        best = None
        for o in range(procs if lu.units % procs else 1):
            owners = (np.arange(lu.units) + o * lu.k) % (procs * lu.k) // lu.k
            trial = load + np.bincount(owners, minlength=procs) * lu.unit_bytes
            if best is None or trial.max() < best[0].max():
                best = (trial, o)
        load, out[n] = best[0], dataclasses.replace(lu, offset=best[1])
    return out


def process_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """All devices (default `jax.devices()`; compile-only TPU devices for AOT) as a
    (process, local device) mesh, processes in index order."""
    devs = sorted(jax.devices() if devices is None else devices,
                  key=lambda d: (d.process_index, d.id))
    procs = len({d.process_index for d in devs})
    return Mesh(np.array(devs).reshape(procs, -1), ("proc", "local"))


def _out_sharding(lu: LeafUnits, mesh: Mesh) -> NamedSharding:
    local = mesh.shape["local"]
    spec = [None] * len(lu.unit_shape)
    for d, n in enumerate(lu.unit_shape):   # spread a host's units over its devices
        if n % local == 0 and n >= local:
            spec[d] = "local"
            break
    return NamedSharding(mesh, P("proc", *spec))


def rearrange(x: jax.Array, lu: LeafUnits) -> jax.Array:
    """`[*lead, *unit]` -> `[P * k, *unit]`: unit u at slot `lu.slot(u)`, empty slots zero.

    Written as static-offset updates of a zero array (at most two contiguous pieces: the
    rotation wraps once), which the SPMD partitioner turns into sends of each unit to its
    owner's devices; a pad + roll would be all-gathered first."""
    u = x.reshape((lu.units,) + lu.unit_shape).astype(lu.dtype)
    out = jnp.zeros((lu.procs * lu.k,) + lu.unit_shape, lu.dtype)
    start = lu.offset * lu.k
    first = min(lu.units, lu.procs * lu.k - start)
    out = jax.lax.dynamic_update_slice_in_dim(out, u[:first], start, axis=0)
    if first < lu.units:
        out = jax.lax.dynamic_update_slice_in_dim(out, u[first:], 0, axis=0)
    return out


@functools.lru_cache(maxsize=256)
def resharder(lu: LeafUnits, mesh: Mesh) -> Callable[[jax.Array], jax.Array]:
    """The jitted `rearrange` with its output sharded over processes (cached per leaf)."""
    return jax.jit(functools.partial(rearrange, lu=lu), out_shardings=_out_sharding(lu, mesh))


def to_owners(x: jax.Array, lu: LeafUnits, mesh: Mesh) -> jax.Array:
    """Leaf `x` as `[P * k, *unit]` in `lu.dtype`, process p holding slots [p*k, (p+1)*k)."""
    return resharder(lu, mesh)(x)


def host_units(arr: jax.Array, lu: LeafUnits) -> dict:
    """unit index -> numpy unit, for the units this process owns (device-to-host copies only)."""
    p = jax.process_index()
    block = np.empty((lu.k,) + lu.unit_shape, np.dtype(lu.dtype))
    seen = set()
    for shard in arr.addressable_shards:
        box = tuple(sl.indices(n)[:2] for sl, n in zip(shard.index, arr.shape, strict=False))
        if box in seen:
            continue
        seen.add(box)
        rows = slice(box[0][0] - p * lu.k, box[0][1] - p * lu.k)
        block[(rows,) + tuple(slice(a, b) for a, b in box[1:])] = np.asarray(shard.data)
    out = {}
    for s in range(p * lu.k, (p + 1) * lu.k):
        u = (s - lu.offset * lu.k) % (lu.procs * lu.k)
        if u < lu.units:
            out[u] = block[s - p * lu.k]
    return out

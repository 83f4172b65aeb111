"""Where a mesh's axes land on the machine: a TPU slice's torus, slices over DCN, GPU hosts.

`sharding.make_mesh` decides the axis sizes; this module decides which device sits at each mesh
position. Three machines:

  * **A TPU slice** (devices with `coords`): the chips form a 3D torus (wrap-around links in
    every dimension once the slice is made of whole 4x4x4 cubes; smaller slices are open
    meshes). Ring neighbours along a mesh axis should be torus neighbours, above all along the
    axes that move the most bytes (`PRIORITY`: `expert` carries the ragged all-to-all).
    `tpu_grid` starts from JAX's own `mesh_utils.create_device_mesh` for every order of the
    axes (with and without splitting physical axes), re-orders each axis's positions into the
    cycle with the fewest hops (`cyclic_order`), keeps only layouts whose hops are no worse
    than JAX's on every axis, and picks the best by `PRIORITY`.
  * **Several TPU slices** (devices with `slice_index`) or **GPU hosts** (NVLink inside a host,
    the slower network across hosts): a hybrid mesh. Each axis of size n is split into
    `dcn` outer parts (which slice / host) times n / dcn inner ones; the inner mesh is laid out
    per slice or host as above (a GPU host's devices in id order), and the blocks are stacked
    like `mesh_utils.create_hybrid_device_mesh`. Without explicit DCN sizes the slow network
    takes the axes that move the fewest bytes (`PRIORITY` read backwards: data first).
  * **Anything else** (CPU devices): the devices in the given order, reshaped (as always).

`ring_hops` is the figure the choice minimizes and `docs/scaling.md` reports: per mesh axis,
the mean torus distance between ring neighbours (position i and i + 1, and the last back to
the first when the axis has more than two positions), over every ring along that axis.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np

# Mesh axes by the bytes their collectives move, heaviest first (docs/scaling.md, "FLOPs, bytes
# and the roofline"): the expert all-to-all, the tensor gathers and partial sums, the context
# K/V exchange, the FSDP weight gathers, the data-parallel gradient reduction.
PRIORITY = ("expert", "tensor", "context", "fsdp", "data")
Grid = np.ndarray   # an object array of devices, one axis per mesh axis


@dataclasses.dataclass(frozen=True)
class Torus:
    """A TPU slice's chips as a 3D torus: `dims` chips per dimension, `wrap` where the
    dimension's last chip links back to its first."""

    dims: tuple[int, ...]
    wrap: tuple[bool, ...]

    def hops(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Shortest-path link count between coordinates `a` and `b` ([..., 3] arrays)."""
        d = np.abs(np.asarray(a) - np.asarray(b))
        dims = np.asarray(self.dims)
        d = np.where(np.asarray(self.wrap), np.minimum(d, dims - d), d)
        return d.sum(axis=-1)


def torus_of(devices: Sequence[Any]) -> Optional[Torus]:
    """The torus of one slice's devices; None when a device has no `coords` (CPU, GPU).

    Wrap-around: "all 4x4x4 and larger slices (one cube) have full 3D torus" (Google Cloud's
    v5p page); a slice of whole cubes has every dimension a multiple of 4.
    """
    coords = device_coords(devices)
    if coords is None:
        return None
    dims = tuple(int(c) + 1 for c in coords.max(axis=0))
    whole_cubes = all(n % 4 == 0 for n in dims)
    return Torus(dims=dims, wrap=tuple(whole_cubes and n > 2 for n in dims))


def device_coords(devices: Sequence[Any]) -> Optional[np.ndarray]:
    """[N, 3] chip coordinates, or None when any device lacks them."""
    out = []
    for d in devices:
        c = getattr(d, "coords", None)
        if c is None:
            return None
        out.append(list(c)[:3])
    return np.asarray(out, np.int64)


def _slices(devices: Sequence[Any]) -> list[list]:
    """Devices grouped by `slice_index` (one group when they have none), in slice order."""
    groups: dict[int, list] = {}
    for d in devices:
        groups.setdefault(int(getattr(d, "slice_index", 0) or 0), []).append(d)
    return [groups[k] for k in sorted(groups)]


def ring_hops(grid: Grid, names: Sequence[str]) -> dict[str, float]:
    """Mean torus hops between ring neighbours along each mesh axis larger than 1.

    Args:
      grid: devices arranged as the mesh (all on one torus: one slice).
      names: the mesh axis names, one per grid axis.
    Returns:
      {axis name: mean hops}; pairs are (i, i + 1) and, for rings of more than two, (n - 1, 0).
    """
    flat = list(grid.flat)
    torus = torus_of(flat)
    if torus is None or len(_slices(flat)) > 1:
        raise ValueError("ring_hops needs the devices of one TPU slice (devices with coords)")
    coords = device_coords(flat).reshape(grid.shape + (3,))
    out = {}
    for ax, name in enumerate(names):
        n = grid.shape[ax]
        if n > 1:
            out[name] = float(_pair_hops(coords, ax, torus, list(range(n))).mean())
    return out


def _pair_hops(coords: np.ndarray, ax: int, torus: Torus, order: list) -> np.ndarray:
    """Hops of every ring-neighbour pair along axis `ax` with its positions in `order`."""
    c = np.moveaxis(coords, ax, 0)[order]
    nxt = np.roll(c, -1, axis=0) if len(order) > 2 else c[1:]
    return torus.hops(c[: len(nxt)], nxt)


@functools.cache
def _tours(n: int) -> np.ndarray:
    """Every order of n positions with 0 first, closed into a cycle: [(n-1)!, n + 1]."""
    rest = np.array(list(itertools.permutations(range(1, n))), np.int64).reshape(-1, n - 1)
    zeros = np.zeros((len(rest), 1), np.int64)
    return np.concatenate([zeros, rest, zeros], axis=1)


def cyclic_order(dist: np.ndarray) -> list[int]:
    """A cyclic order of n positions with a short closed tour under `dist` (n x n).

    Exact for n <= 9 (every order with 0 first), else 2-opt from the identity; never longer
    than the identity. Position 0 stays first.
    """
    dist = np.asarray(dist, np.float64)
    n = len(dist)
    if n <= 3:
        return list(range(n))
    if n <= 9:
        tours = _tours(n)
        cost = dist[tours[:, :-1], tours[:, 1:]].sum(axis=1)
        ident = cost[0]                    # the first order is the identity
        k = int(np.argmin(cost))
        return tours[k, :-1].tolist() if cost[k] < ident - 1e-12 else list(range(n))
    best = list(range(n))
    improved = True
    while improved:     # 2-opt: reverse best[i:j+1] when that shortens the tour
        improved = False
        for i in range(1, n - 1):
            for j in range(i + 1, n):
                a, b, c, d = best[i - 1], best[i], best[j], best[(j + 1) % n]
                if dist[a, c] + dist[b, d] < dist[a, b] + dist[c, d] - 1e-12:
                    best[i:j + 1] = best[i:j + 1][::-1]
                    improved = True
    return best


def reorder_axes(grid: Grid, torus: Torus) -> Grid:
    """Each axis's positions re-ordered into its shortest cycle (`cyclic_order`).

    A permutation of one axis's positions leaves every other axis's rings as they were, so
    each axis is improved alone and none gets worse.
    """
    coords = device_coords(list(grid.flat)).reshape(grid.shape + (3,))
    for ax, n in enumerate(grid.shape):
        if n <= 2:
            continue
        c = np.moveaxis(coords, ax, 0).reshape(n, -1, 3)
        dist = torus.hops(c[:, None], c[None, :]).mean(axis=-1)
        order = cyclic_order(dist)
        grid = np.take(grid, order, axis=ax)
        coords = np.take(coords, order, axis=ax)
    return grid


def host_tour(devices: Sequence[Any], torus: Torus) -> Optional[list]:
    """One ring through every chip that visits each host's chips one after another.

    For a mesh with a single axis over many hosts (Qwen's fsdp 64): JAX's snake through the
    torus splits hosts between distant ring positions, and a host must hold one contiguous block
    of the batch. Each host's chips are walked in a path of 1-hop steps (every such path is an
    orientation); the hosts are ordered by `cyclic_order` of their mean distances, and the
    orientations chosen (dynamic programming round the ring) for the fewest hops between one
    host's last chip and the next one's first. None if a host's chips have no 1-hop path.
    """
    hosts: dict[int, list] = {}
    for d in devices:
        hosts.setdefault(int(getattr(d, "process_index", 0)), []).append(d)
    keys = sorted(hosts)
    paths = []
    for k in keys:
        chips = hosts[k]
        xyz = device_coords(chips)
        ok = [list(p) for p in itertools.permutations(range(len(chips)))
              if all(torus.hops(xyz[p[i]], xyz[p[i + 1]]) == 1 for i in range(len(p) - 1))]
        if not ok:
            return None
        paths.append([[chips[i] for i in p] for p in ok])
    centre = np.array([device_coords(hosts[k]).mean(axis=0) for k in keys])
    dist = np.array([[torus.hops(a, b) for b in np.rint(centre)] for a in np.rint(centre)])
    order = cyclic_order(dist)
    cost = lambda a, b: int(torus.hops(device_coords([a])[0], device_coords([b])[0]))
    best_total, best = None, None
    for first in range(len(paths[order[0]])):    # the ring closes back onto the first host
        # states: orientation of the current host -> (hops so far, chosen orientations)
        states = {first: (0, [first])}
        for h_prev, h in zip(order, order[1:], strict=False):
            states = {o: min(((c + cost(paths[h_prev][p][-1], paths[h][o][0]), ch + [o])
                              for p, (c, ch) in states.items()), key=lambda t: t[0])
                      for o in range(len(paths[h]))}
        for o, (c, ch) in states.items():
            total = c + cost(paths[order[-1]][o][-1], paths[order[0]][first][0])
            if best_total is None or total < best_total:
                best_total, best = total, ch
    return [d for h, o in zip(order, best, strict=True) for d in paths[h][o]]


def _dominates(a: dict, b: dict) -> bool:
    return all(a[k] <= b[k] + 1e-9 for k in b)


def _rank(hops: dict, names: Sequence[str]) -> tuple:
    """Sort key: hops of the axes in `PRIORITY` order (unknown names last)."""
    order = sorted(hops, key=lambda k: (PRIORITY.index(k) if k in PRIORITY else len(PRIORITY)))
    return tuple(hops[k] for k in order)


def jax_grids(sizes: Sequence[int], devices: Sequence[Any]) -> list[Grid]:
    """`mesh_utils.create_device_mesh` for `sizes` as JAX lays it out: without splitting
    physical axes where it can, and with (where it must or can)."""
    from jax.experimental import mesh_utils
    out = []
    for split in (False, True):
        try:
            out.append(mesh_utils.create_device_mesh(list(sizes), list(devices),
                                                     allow_split_physical_axes=split))
        except (ValueError, NotImplementedError, AssertionError):
            continue
    return out


def tpu_grid(sizes: Sequence[int], names: Sequence[str], devices: Sequence[Any],
             valid: Callable[[Grid], bool] = lambda g: True) -> Grid:
    """The mesh of one TPU slice laid onto its torus (see the module docstring).

    Args:
      sizes: mesh axis sizes (product = len(devices)).
      names: mesh axis names.
      devices: the slice's devices (with coords).
      valid: a layout the caller can use (`sharding.make_mesh`: every host holds one
        contiguous block of the batch); layouts it refuses are not chosen.
    Returns:
      An object array of `sizes` devices.
    """
    torus = torus_of(devices)
    live = [i for i, n in enumerate(sizes) if n > 1]
    refs = jax_grids(sizes, devices)
    candidates = list(refs)
    for perm in itertools.permutations(live):
        if list(perm) == live:
            continue
        # create_device_mesh gives its last axes the best placement: try every order.
        order = [i for i in range(len(sizes)) if i not in live] + list(perm)
        for g in jax_grids([sizes[i] for i in order], devices):
            candidates.append(np.transpose(g, np.argsort(order)))
    fallback = np.asarray(list(devices), dtype=object).reshape(sizes)
    candidates.append(fallback)
    if len(live) == 1:
        tour = host_tour(devices, torus)
        if tour is not None:
            candidates.append(np.asarray(tour, dtype=object).reshape(sizes))
    unique = {tuple(d.id for d in g.flat): g for g in candidates}   # orders often coincide
    candidates = list(unique.values())
    candidates += [reorder_axes(g, torus) for g in candidates]
    scored = [(ring_hops(g, names), g) for g in candidates if valid(g)]
    if not scored:
        return fallback
    ref_hops = [ring_hops(g, names) for g in refs if valid(g)]
    good = [(h, g) for h, g in scored if all(_dominates(h, r) for r in ref_hops)] or scored
    return min(good, key=lambda hg: _rank(hg[0], names))[1]


def split_dcn(sizes: Sequence[int], names: Sequence[str], granules: int,
              dcn: Optional[Sequence[int]] = None) -> list[int]:
    """DCN (outer) size per axis: `dcn` if given (each dividing its axis, product = granules),
    else the granules given to the lightest axes first (`PRIORITY` backwards)."""
    if dcn is not None and any(d != 1 for d in dcn):
        dcn = [int(d) for d in dcn]
        bad = [n for n, s, d in zip(names, sizes, dcn, strict=True) if d < 1 or s % d]
        if bad or int(np.prod(dcn)) != granules:
            raise ValueError(f"mesh dcn sizes {dict(zip(names, dcn, strict=True))} must divide "
                             f"their axes {dict(zip(names, sizes, strict=True))} and multiply "
                             f"to the {granules} slices / hosts")
        return dcn
    out, left = [1] * len(sizes), granules
    for name in reversed(PRIORITY):
        if name in names and left > 1:
            i = list(names).index(name)
            out[i] = int(np.gcd(sizes[i], left))
            left //= out[i]
    if left != 1:
        raise ValueError(f"mesh {dict(zip(names, sizes, strict=True))} cannot be split over "
                         f"{granules} slices / hosts; set the mesh's dcn_* sizes")
    return out


def hybrid_grid(sizes: Sequence[int], names: Sequence[str], granules: list[list],
                dcn: Sequence[int], inner: Callable[[list, list[int]], Grid]) -> Grid:
    """Granule (slice or host) meshes of sizes / dcn stacked dcn-outer, as
    `mesh_utils.create_hybrid_device_mesh` does, each laid out by `inner`."""
    ici = [s // d for s, d in zip(sizes, dcn, strict=True)]
    if any(len(g) != int(np.prod(ici)) for g in granules):
        raise ValueError(f"every slice / host must hold {int(np.prod(ici))} devices for the "
                         f"inner mesh {dict(zip(names, ici, strict=True))}")
    blocks = np.empty(len(granules), dtype=object)
    for k, g in enumerate(granules):
        blocks[k] = inner(g, ici)
    blocks = blocks.reshape(list(dcn))
    return np.block(blocks.tolist()) if blocks.ndim else blocks.item()


def device_grid(sizes: Sequence[int], names: Sequence[str], devices: Sequence[Any],
                dcn: Optional[Sequence[int]] = None,
                valid: Callable[[Grid], bool] = lambda g: True) -> Grid:
    """The devices arranged as the mesh, for the machine they belong to (module docstring).

    Args:
      sizes: mesh axis sizes (product = len(devices)).
      names: mesh axis names.
      devices: the devices.
      dcn: per axis, how many slices (TPU) or hosts (GPU) it spans; None or all 1 = automatic.
      valid: see `tpu_grid`.
    Returns:
      An object array of `sizes` devices.
    """
    devices = list(devices)
    platform = getattr(devices[0], "platform", "cpu")
    if platform == "tpu" and device_coords(devices) is not None:
        slices = _slices(devices)
        if len(slices) == 1:
            return tpu_grid(sizes, names, devices, valid)
        dcn = split_dcn(sizes, names, len(slices), dcn)
        return hybrid_grid(sizes, names, slices, dcn,
                           lambda g, ici: tpu_grid(ici, names, g))
    if platform in ("gpu", "cuda", "rocm"):
        hosts: dict[int, list] = {}
        for d in devices:
            hosts.setdefault(int(d.process_index), []).append(d)
        granules = [sorted(hosts[k], key=lambda d: d.id) for k in sorted(hosts)]
        dcn = split_dcn(sizes, names, len(granules), dcn)
        return hybrid_grid(sizes, names, granules, dcn,
                           lambda g, ici: np.asarray(g, dtype=object).reshape(ici))
    return np.asarray(devices, dtype=object).reshape(sizes)

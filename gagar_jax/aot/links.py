"""Collective time from the bytes each torus link carries, on the mesh's actual device placement.

The roofline used to price every collective as a ring moving (n-1)/n of its buffer over the
chip's whole ICI bandwidth (or one torus dimension's). On a torus that flatters: in an
all-to-all over a ring of 8 chips every link carries the whole send buffer, not 7/8 of it
spread over six links. This module routes the traffic instead:

  * **Links.** Each chip has two links per torus dimension (to the next and the previous chip;
    the last chip of a wrapped dimension links back to the first), each carrying `link_bw`
    bytes/s in each direction. A collective's time is its busiest directed link's bytes over
    `link_bw`; collectives run one after another.
  * **Routing.** Dimension-ordered (x, then y, then z), shortest way round each wrapped
    dimension; at exactly half way round the bytes split evenly between the two directions.
  * **All-to-all** (and `ep_a2a`'s ragged ones, at balanced routing): every member sends
    1/n of its buffer to every other member of its group, all groups at once.
  * **All-gather, reduce-scatter, all-reduce:** bidirectional rings, one phase per mesh axis
    the group spans (innermost mesh axis first), each ring in the mesh's order along that axis
    (the order `mesh_layout` chose): a ring of n moves (n-1)/2 chunks each way over every ring
    edge, routed over the torus (an edge between chips h hops apart loads h links). All-reduce
    = reduce-scatter then all-gather.
  * **Collective-permute:** each (source, target) pair sends its buffer.
  * **Across slices (DCN):** a phase whose ring crosses slices sends its chunks over the chip's
    data-center network share (`dcn_bw` per chip) instead; those bytes are reported apart.
    The TPU compiler compiles a multi-slice program per slice: its collectives stay inside the
    slice and the traffic between slices is Megascale `send`s (`schedule.dcn_records`), priced
    as ring algorithms over the slices (`DCN_FACTOR`) at `dcn_bw`.

Partition ids in the compiled HLO index the mesh's devices in `mesh.devices.flat` order.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from gagar_jax.mesh_layout import Torus, device_coords, torus_of


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each partition id of a compiled program sits: torus coordinates, slice, mesh index.

    Attributes:
      torus: one slice's torus (every slice has the same).
      coords: [N, 3] chip coordinates per partition id.
      slice_of: [N] slice index per partition id.
      index: [N, ndim] mesh index per partition id.
      shape: the mesh shape.
    """

    torus: Torus
    coords: np.ndarray
    slice_of: np.ndarray
    index: np.ndarray
    shape: tuple

    @classmethod
    def of_grid(cls, grid: np.ndarray, partitions: int = 0) -> Placement:
        """From a mesh's device grid (`mesh.devices`) for a program of `partitions` partition
        ids (0 = all the grid's devices). A multi-slice TPU program is compiled per slice
        (fewer partitions than devices): its ids number the first slice's devices in mesh order."""
        if partitions and partitions < grid.size:
            grid = _first_slice_block(grid)
            if grid.size != partitions:
                raise ValueError(f"a program of {partitions} partitions on slices of "
                                 f"{grid.size} devices")
        flat = list(grid.flat)
        slices = np.array([int(getattr(d, "slice_index", 0) or 0) for d in flat])
        first = [d for d, s in zip(flat, slices, strict=True) if s == slices.min()]
        torus = torus_of(first)
        if torus is None:
            raise ValueError("a placement needs TPU devices with coords")
        index = np.stack(np.unravel_index(np.arange(len(flat)), grid.shape), axis=1)
        return cls(torus=torus, coords=device_coords(flat), slice_of=slices, index=index,
                   shape=tuple(grid.shape))

    @classmethod
    def ring(cls, n: int, wrap: bool = True) -> Placement:
        """n chips on one ring (x), in ring order: the hand-worked cases of the tests."""
        return cls.of_coords([(i, 0, 0) for i in range(n)],
                             Torus((n, 1, 1), (wrap and n > 2, False, False)))

    @classmethod
    def of_coords(cls, coords: Sequence, torus: Torus, shape: Optional[tuple] = None
                  ) -> Placement:
        """Partition i at `coords[i]`, a one-axis mesh unless `shape` is given."""
        coords = np.asarray(coords, np.int64)
        shape = shape or (len(coords),)
        index = np.stack(np.unravel_index(np.arange(len(coords)), shape), axis=1)
        return cls(torus=torus, coords=coords, slice_of=np.zeros(len(coords), np.int64),
                   index=index, shape=tuple(shape))


def _first_slice_block(grid: np.ndarray) -> np.ndarray:
    """The first slice's devices as the block of the mesh they form (the `dcn_*` axes split the
    mesh into one block per slice: `mesh_layout.device_grid`)."""
    slice_of = np.vectorize(lambda d: int(getattr(d, "slice_index", 0) or 0), otypes=[int])(grid)
    where = np.nonzero(slice_of == slice_of.min())
    block = grid[tuple(slice(int(w.min()), int(w.max()) + 1) for w in where)]
    if block.size != len(where[0]):
        raise ValueError("the first slice's devices do not form a block of the mesh")
    return block


# Bytes a chip sends over DCN per byte of a Megascale send's buffer, ring algorithms over S
# slices: an all-reduce reduce-scatters and all-gathers the buffer (2 (S-1)/S), an all-gather
# forwards its shard to the S-1 other slices, an all-to-all keeps 1/S of its buffer at home.
DCN_FACTOR = {"ALL_REDUCE": lambda s: 2.0 * (s - 1) / s, "ALL_GATHER": lambda s: float(s - 1),
              "ALL_TO_ALL": lambda s: (s - 1) / s, "ONE_TO_ONE": lambda s: 1.0}


def link_loads(torus: Torus, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Bytes on every directed link when each flow f sends `nbytes[f]` from `src[f]` to `dst[f]`.

    Returns:
      [3, 2, X, Y, Z]: [dim, 0] the links from a chip to its next chip along dim, [dim, 1] to
      its previous one, indexed by the sending chip.
    """
    load = np.zeros((3, 2) + tuple(torus.dims))
    pos = np.array(src, np.int64, copy=True).reshape(-1, 3)
    dst = np.asarray(dst, np.int64).reshape(-1, 3)
    nbytes = np.broadcast_to(np.asarray(nbytes, np.float64), (len(pos),)).copy()
    for dim in range(3):
        n = torus.dims[dim]
        if n == 1:
            continue
        fwd = (dst[:, dim] - pos[:, dim]) % n if torus.wrap[dim] else np.maximum(
            dst[:, dim] - pos[:, dim], 0)
        back = (n - fwd) % n if torus.wrap[dim] else np.maximum(pos[:, dim] - dst[:, dim], 0)
        if torus.wrap[dim]:
            tie = (fwd == back) & (fwd > 0)
            go_fwd = np.where(tie, 0.5, (fwd < back) & (fwd > 0))
            go_back = np.where(tie, 0.5, (back < fwd) & (back > 0))
        else:
            go_fwd, go_back = (fwd > 0).astype(float), (back > 0).astype(float)
        for direction, steps, share in ((0, fwd, go_fwd), (1, back, go_back)):
            sign = 1 if direction == 0 else -1
            for k in range(int(steps.max(initial=0))):
                live = (steps > k) & (share > 0)
                if not live.any():
                    break
                at = pos[live].copy()
                at[:, dim] = (at[:, dim] + sign * k) % n
                np.add.at(load[dim, direction], tuple(at.T), nbytes[live] * share[live])
        pos[:, dim] = dst[:, dim]
    return load


def _groups_by_axes(place: Placement, groups: list[list[int]]) -> Optional[list[int]]:
    """The mesh axes every group spans whole (the same for all groups), or None."""
    axes = None
    for g in groups:
        idx = place.index[g]
        varying = [a for a in range(idx.shape[1]) if len(np.unique(idx[:, a])) > 1]
        whole = int(np.prod([place.shape[a] for a in varying] or [1])) == len(g)
        if not whole or (axes is not None and varying != axes):
            return None
        axes = varying
    return axes


def _ring_pairs(rings: list[list[int]], per_edge: float) -> list[tuple[int, int, float]]:
    """Flows of bidirectional rings: over every edge of each ring (the last member back to the
    first included) `per_edge` bytes go each way. A ring of two sends both halves to its one
    neighbour."""
    out = []
    for ring in rings:
        for a, b in zip(ring, ring[1:] + ring[:1], strict=True):
            out += [(a, b, per_edge), (b, a, per_edge)]
    return out


def _axis_rings(place: Placement, groups: list[list[int]], axis: int) -> list[list[int]]:
    """Within each group, the rings along mesh `axis` (other indices fixed), in mesh order."""
    rings = []
    for g in groups:
        idx = place.index[g]
        others = np.delete(idx, axis, axis=1)
        keys = {}
        for pid, key, pos in zip(g, map(tuple, others), idx[:, axis], strict=True):
            keys.setdefault(key, []).append((pos, pid))
        rings += [[pid for _, pid in sorted(v)] for v in keys.values()]
    return rings


@dataclasses.dataclass(frozen=True)
class Cost:
    """One collective's time on the links: `ici_s` over the torus, `dcn_s` over the data-center
    network, `dcn_bytes` sent per chip over it."""

    ici_s: float
    dcn_s: float = 0.0
    dcn_bytes: float = 0.0

    @property
    def seconds(self) -> float:
        return self.ici_s + self.dcn_s

    def __mul__(self, k: float) -> Cost:
        return Cost(self.ici_s * k, self.dcn_s * k, self.dcn_bytes * k)


def _pairs_cost(place: Placement, pairs: list[tuple[int, int, float]], link_bw: float,
                dcn_bw: float) -> Cost:
    """Flows (source, target, bytes) sent at once: the busiest ICI link's time, and the busiest
    chip's bytes over DCN for the flows between slices."""
    ici = [(a, b, w) for a, b, w in pairs if place.slice_of[a] == place.slice_of[b] and a != b]
    out_dcn: dict[int, float] = {}
    for a, b, w in pairs:
        if place.slice_of[a] != place.slice_of[b]:
            out_dcn[a] = out_dcn.get(a, 0.0) + w
    ici_s = 0.0
    if ici:
        a, b, w = (np.array(x) for x in zip(*ici, strict=True))
        ici_s = float(link_loads(place.torus, place.coords[a], place.coords[b], w).max()) / link_bw
    dcn_bytes = max(out_dcn.values(), default=0.0)
    return Cost(ici_s, dcn_bytes / dcn_bw if dcn_bytes else 0.0, dcn_bytes)


def collective_cost(place: Placement, op: str, groups: list[list[int]], nbytes: float, *,
                    link_bw: float, dcn_bw: float,
                    pairs: Optional[list[tuple[int, int]]] = None) -> Cost:
    """Time of one collective of `op` on `place` (module docstring).

    Args:
      place: partition ids -> torus coordinates and mesh indices.
      op: an HLO collective ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
        "ragged-all-to-all", "collective-permute").
      groups: the replica groups (partition ids); all run at once.
      nbytes: per device: an all-gather's gathered result, a reduce-scatter's full input, an
        all-reduce's buffer, an all-to-all's (ragged: the rows held to send) buffer, a
        permute's buffer.
      link_bw: bytes/s per link and direction; dcn_bw: bytes/s per chip over DCN.
      pairs: a collective-permute's (source, target) pairs.
    """
    if op == "collective-permute":
        return _pairs_cost(place, [(a, b, nbytes) for a, b in pairs or ()], link_bw, dcn_bw)
    groups = [list(g) for g in groups if len(g) > 1]
    if not groups:
        return Cost(0.0)
    if op in ("all-to-all", "ragged-all-to-all"):
        flows = [(a, b, nbytes / len(g)) for g in groups for a in g for b in g if a != b]
        return _pairs_cost(place, flows, link_bw, dcn_bw)
    n_all = len(groups[0])
    axes = _groups_by_axes(place, groups)
    phases = [None] if axes is None else sorted(axes, reverse=True)   # innermost first

    def phase_cost(axis: Optional[int], chunk: float) -> tuple[Cost, int]:
        rings = groups if axis is None else _axis_rings(place, groups, axis)
        n = len(rings[0])
        return _pairs_cost(place, _ring_pairs(rings, (n - 1) * chunk / 2), link_bw, dcn_bw), n

    def gather(total: float) -> Cost:          # all-gather of `total` bytes per device
        cost, have = Cost(0.0), total / n_all
        for axis in phases:
            c, n = phase_cost(axis, have)
            cost, have = _add(cost, c), have * n
        return cost

    def scatter(total: float) -> Cost:         # reduce-scatter of a `total`-byte input
        cost, have = Cost(0.0), total
        for axis in reversed(phases):
            n = len(groups[0]) if axis is None else place.shape[axis]
            c, _ = phase_cost(axis, have / n)
            cost, have = _add(cost, c), have / n
        return cost

    if op == "all-gather":
        return gather(nbytes)
    if op == "reduce-scatter":
        return scatter(nbytes)
    if op == "all-reduce":
        return _add(scatter(nbytes), gather(nbytes))
    raise ValueError(f"unknown collective {op!r}")


def _add(a: Cost, b: Cost) -> Cost:
    return Cost(a.ici_s + b.ici_s, a.dcn_s + b.dcn_s, a.dcn_bytes + b.dcn_bytes)


def step_costs(place: Placement, records: list[dict[str, Any]], *, link_bw: float,
               dcn_bw: float, dcn_records: Sequence[dict[str, Any]] = (), slices: int = 1
               ) -> dict:
    """Per step: seconds on the links of every collective of `schedule.collective_records`,
    split by op and by whether the HLO schedule overlaps it with compute; with
    `schedule.dcn_records` of a program compiled per slice (`slices` of them), its Megascale
    transfers too, as "dcn <kind>" ops (an unknown kind counts its buffer once).

    Returns:
      {"by_op": {op: seconds}, "exposed_by_op", "exposed_s", "overlapped_s", "dcn_bytes"
       (per chip), "dcn_s"}.
    """
    cache: dict = {}
    by_op: dict[str, float] = {}
    exposed_by_op: dict[str, float] = {}
    exposed = overlapped = dcn_bytes = dcn_s = 0.0
    for r in records:
        key = (r["op"], r["groups_key"])
        if key not in cache:    # cost is linear in bytes: price one byte per (op, groups)
            cache[key] = collective_cost(place, r["op"], r["groups"], 1.0, link_bw=link_bw,
                                         dcn_bw=dcn_bw, pairs=r.get("pairs"))
        c = cache[key] * (r["bytes"] * r["runs"])
        by_op[r["op"]] = by_op.get(r["op"], 0.0) + c.seconds
        if r["overlapped"]:
            overlapped += c.seconds
        else:
            exposed += c.seconds
            exposed_by_op[r["op"]] = exposed_by_op.get(r["op"], 0.0) + c.seconds
        dcn_bytes += c.dcn_bytes
        dcn_s += c.dcn_s
    for r in dcn_records:
        nbytes = DCN_FACTOR.get(r["kind"], lambda s: 1.0)(slices) * r["bytes"] * r["runs"]
        op, seconds = f"dcn {r['kind'].lower()}", nbytes / dcn_bw
        by_op[op] = by_op.get(op, 0.0) + seconds
        if r["overlapped"]:
            overlapped += seconds
        else:
            exposed += seconds
            exposed_by_op[op] = exposed_by_op.get(op, 0.0) + seconds
        dcn_bytes += nbytes
        dcn_s += seconds
    return {"by_op": by_op, "exposed_by_op": exposed_by_op, "exposed_s": exposed,
            "overlapped_s": overlapped, "dcn_bytes": dcn_bytes, "dcn_s": dcn_s}

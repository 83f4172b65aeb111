"""What a compiled program's schedule runs: every collective with its replica groups, whether the
schedule hides it behind compute, the grouped-matmul kernel calls, the transfers between slices
of a multi-slice program, and the length buckets' micro-batch loops of a bucketed step.

Read from the TPU compiler's `*.after_optimizations.txt` dump, whose instruction order is the
schedule. `links.step_costs` prices the collectives on the mesh's placement; `expert_passes`
counts how often the megablox kernels run per step.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from gagar_jax.aot.hlo_stats import (
    ARRAY_TYPE,
    COLLECTIVE_LINE,
    array_bytes,
    group_size,
    instruction_shapes,
    parse_computations,
    tuple_elements,
)


def replica_groups(line: str, num_devices: int = 0) -> list[list[int]]:
    """The replica groups of a collective's HLO line as lists of partition ids.

    Reads the explicit form `{{0,2},{1,3}}`, the iota form `[G,n]<=[dims]T(perm)` and the mesh
    form `mesh['axis_0'=2,'axis_1'=2] {'axis_0'}` (axes row-major, the listed axes varying
    within a group, in the order listed); `{}` is one group of all `num_devices`.
    """
    m = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line)
    if m:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}",
                                                                          m.group(1))]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",")])
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        inner = re.findall(r"'(\w+)'", m.group(2))
        outer = [names.index(a) for a in names if a not in inner]
        ids = np.arange(int(np.prod(sizes))).reshape(sizes)
        ids = ids.transpose(outer + [names.index(a) for a in inner])
        return ids.reshape(-1, int(np.prod([sizes[names.index(a)] for a in inner] or [1]))
                           ).tolist()
    if "replica_groups={}" in line and num_devices:
        return [list(range(num_devices))]
    return []


def source_target_pairs(line: str) -> list[tuple[int, int]]:
    """A collective-permute's (source, target) partition pairs."""
    m = re.search(r"source_target_pairs=\{(\{[\d,{}]*\})\}", line)
    if not m:
        return []
    return [tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{(\d+,\d+)\}", m.group(1))]


_MATMUL = re.compile(r"=\s*(\S+)\s+(?:convolution|dot)\(")
HEAVY_ELEMENTS = 2**22    # a matmul whose result has fewer elements is bookkeeping (a cumsum)


def _is_heavy_line(line: str) -> bool:
    """A Mosaic kernel call, or a matmul with a large result."""
    if "tpu_custom_call" in line:
        return True
    m = _MATMUL.search(line)
    return bool(m) and max((int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                            for _, dims in ARRAY_TYPE.findall(m.group(1))),
                           default=0) >= HEAVY_ELEMENTS


def _compute_computations(comps: dict) -> set:
    """Computations that run large matmuls or Mosaic kernels, directly or through what they
    call (fusions, loop bodies)."""
    calls = {n: set(re.findall(r"(?:calls|to_apply|body)=%([\w.\-]+)", "\n".join(ls)))
             for n, ls in comps.items() if n != "__entry__"}
    heavy = {n for n, ls in comps.items() if n != "__entry__" and any(map(_is_heavy_line, ls))}
    grew = True
    while grew:
        new = {n for n, callees in calls.items() if callees & heavy} - heavy
        heavy |= new
        grew = bool(new)
    return heavy


def _overlap_checker(comps: dict):
    """`overlap_in(lines, start)`: whether the schedule puts compute (a matmul, a kernel, or a
    call of a computation that has one) between instruction `start` of `lines` and the done
    that consumes it."""
    heavy = _compute_computations(comps)

    def is_compute(line: str) -> bool:
        if _is_heavy_line(line):
            return True
        callees = re.findall(r"(?:calls|to_apply|body)=%([\w.\-]+)", line)
        for branches in re.findall(r"branch_computations=\{([^}]*)\}", line):
            callees += [b.strip().lstrip("%") for b in branches.split(",")]
        return any(c in heavy for c in callees)

    def overlap_in(lines: list[str], start: str) -> bool:
        inside = False
        for line in lines:
            name = re.match(r"^\s+(?:ROOT )?%([\w.\-]+) =", line)
            if name and name.group(1) == start:
                inside = True
                continue
            if inside:
                if re.search(rf"-done\(%{re.escape(start)}\b|async-done\(%{re.escape(start)}\b",
                             line):
                    return False
                if is_compute(line):
                    return True
        return False

    return overlap_in


def collective_records(hlo_text: str, num_devices: int = 0) -> list[dict]:
    """Every collective of a compiled module with what `links.step_costs` needs.

    Returns:
      [{"op", "bytes" (per device, as `collective_traffic` counts them), "groups" (partition
      ids), "groups_key", "pairs" (collective-permute), "runs" (times per step, loops followed),
      "overlapped" (the schedule puts a matmul, kernel or loop between its start and its done:
      it can hide behind compute; a synchronous collective cannot)}].
    """
    num_devices = num_devices or num_partitions(hlo_text)
    comps, runs = parse_computations(hlo_text)
    overlap_in = _overlap_checker(comps)
    shapes = instruction_shapes(comps)

    # async computations (a collective wrapped by `async-start(..., calls=%c)`): who starts them
    starter = {}
    for name, lines in comps.items():
        if name == "__entry__":
            continue
        for line in lines:
            m = re.match(r"^\s+%([\w.\-]+) = .* async-start\(.*calls=%([\w.\-]+)", line)
            if m:
                starter[m.group(2)] = (name, m.group(1))
    out = []
    for name, mult in runs.items():
        if name == "__unknown__":
            continue
        for line in comps[name]:
            m = COLLECTIVE_LINE.search(line)
            if not m:
                continue
            op, result = m.group(2), m.group(1)
            parts = tuple_elements(result)
            if "-start(" in line and len(parts) > 1:
                result = parts[0] if op == "collective-permute" else parts[1]
            nbytes = sum(array_bytes(result))
            groups = replica_groups(line, num_devices)
            n = len(groups[0]) if groups else group_size(line)
            if op == "ragged-all-to-all":
                operand = re.search(r"ragged-all-to-all\(%([\w.\-]+)", line)
                sent = sum(array_bytes(shapes.get(operand.group(1), ""))) if operand else 0
                nbytes = min(sent, nbytes) if sent else nbytes
            elif op == "reduce-scatter":
                nbytes *= n
            this = re.match(r"^\s+(?:ROOT )?%([\w.\-]+) =", line).group(1)
            if "-start(" in line:
                overlapped = overlap_in(comps[name], this)
            elif name in starter:
                caller, start = starter[name]
                overlapped = overlap_in(comps[caller], start)
            else:
                overlapped = False
            pairs = source_target_pairs(line) if op == "collective-permute" else None
            key = tuple(pairs) if pairs is not None else tuple(map(tuple, groups))
            out.append({"op": op, "bytes": nbytes, "groups": groups, "groups_key": key,
                        "pairs": pairs, "runs": mult, "overlapped": overlapped,
                        "computation": name})
        for line in comps[name]:          # reduce-scatters emitted as fusions
            if "calls=%all-reduce-scatter" not in line:
                continue
            res = re.search(r"=\s*(.+?)\s+fusion\(", line)
            callee = re.search(r"calls=%([\w.\-]+)", line).group(1)
            inner = next((x for x in comps.get(callee, []) if " all-reduce(" in x), "")
            groups = replica_groups(inner, num_devices)
            n = len(groups[0]) if groups else group_size(inner)
            out.append({"op": "reduce-scatter",
                        "bytes": n * sum(array_bytes(res.group(1) if res else "")),
                        "groups": groups, "groups_key": tuple(map(tuple, groups)), "pairs": None,
                        "runs": mult, "overlapped": False, "computation": name})
    return out


_MEGASCALE_SEND = re.compile(r'^\s+%([\w.\-]+) = \((.*?)\) send\(.*'
                             r'_xla_megascale_transfer_type="([A-Z_]+)"')


def num_partitions(hlo_text: str) -> int:
    """The module's `num_partitions` (0 if it does not say)."""
    m = re.search(r"num_partitions=(\d+)", hlo_text.split("\n", 1)[0])
    return int(m.group(1)) if m else 0


def dcn_records(hlo_text: str) -> list[dict]:
    """A multi-slice TPU program's transfers between slices.

    The TPU compiler compiles one program per slice (its `num_partitions` is the slice's chip
    count) and turns each collective whose groups cross slices into host-transfer `send` /
    `recv` pairs for the Megascale runtime over DCN, tagged `_xla_megascale_transfer_type`
    (ALL_REDUCE, ALL_GATHER, ALL_TO_ALL, ONE_TO_ONE). A single-slice program has none.

    Returns:
      [{"kind" (the transfer type), "bytes" (the send's buffer per chip: the whole buffer of
      an all-reduce or all-to-all, the chip's shard of an all-gather), "runs" (times per step,
      loops followed), "overlapped" (compute between the send and its send-done)}].
    """
    comps, runs = parse_computations(hlo_text)
    overlap_in = _overlap_checker(comps)
    out = []
    for name, mult in runs.items():
        for line in comps.get(name, ()) if name != "__unknown__" else ():
            m = _MEGASCALE_SEND.match(line)
            if m:
                out.append({"kind": m.group(3), "bytes": max(array_bytes(m.group(2)), default=0),
                            "runs": mult, "overlapped": overlap_in(comps[name], m.group(1)),
                            "computation": name})
    return out


_CALLEES = re.compile(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)")


def bucket_loops(hlo_text: str) -> list[dict]:
    """The length buckets' micro-batch loops of a bucketed train step (`run/bucket_step.py`):
    the outermost while loops whose body holds a `conditional` (the `lax.cond` that skips a
    micro-batch with no live rows), in program order.

    Returns:
      [{"trip" (the loop's static micro-batches), "computations" (every computation its body
      reaches)}].
    """
    comps, runs = parse_computations(hlo_text)
    calls = {}
    for name, lines in comps.items():
        if name == "__entry__":
            continue
        out = calls.setdefault(name, [])
        for line in lines:
            out += _CALLEES.findall(line)
            for branches in re.findall(r"branch_computations=\{([^}]*)\}", line):
                out += [b.strip().lstrip("%") for b in branches.split(",")]

    def reach(root: str) -> set:
        seen, todo = set(), [root]
        while todo:
            c = todo.pop()
            if c not in seen and c in comps:
                seen.add(c)
                todo += calls.get(c, [])
        return seen

    found = []
    for name, lines in comps.items():
        if name == "__entry__":
            continue
        for line in lines:
            w = re.search(r"condition=%([\w.\-]+), body=%([\w.\-]+)", line)
            if w and any(" conditional(" in x for x in comps.get(w.group(2), ())):
                trip = runs.get(w.group(2), 0) // max(1, runs.get(name, 1))
                found.append((w.group(2), {"trip": trip, "computations": reach(w.group(2))}))
    # Only the outermost: a loop inside a micro-batch (a layer scan with a cond) is not a bucket.
    return [loop for body, loop in found
            if not any(body in other["computations"] for b, other in found if b != body)]


def bucket_scaled(records: list[dict], loops: list[dict], static: Sequence[int],
                  live: Sequence[float]) -> list[dict]:
    """`records` (collectives, transfers or kernels, each with its "computation") with the runs
    of those inside bucket b's micro-batch loop scaled from its `static[b]` micro-batches to
    `live[b]`: a step runs only its live micro-batches, the loop's conditional skips the rest.
    Bucket b's loop is the first one of `bucket_loops` not yet taken with `static[b]` trips.
    Each record gets "bucket" (b, or None outside every bucket's loop)."""
    where, taken = {}, set()
    for b, n in enumerate(static):
        i = next((i for i, loop in enumerate(loops) if i not in taken and loop["trip"] == n),
                 None)
        if i is None:
            raise ValueError(f"bucket {b}: no micro-batch loop of {n} trips in the program "
                             f"(loops: {[loop['trip'] for loop in loops]})")
        taken.add(i)
        where.update(dict.fromkeys(loops[i]["computations"], b))
    out = []
    for r in records:
        b = where.get(r["computation"])
        out.append({**r, "bucket": None} if b is None else
                   {**r, "bucket": b, "runs": r["runs"] * live[b] / static[b]})
    return out


_KERNEL = re.compile(r"^\s+(?:ROOT )?%(t?gmm)[.\d]* = (\S+) custom-call\(.*"
                     r"operand_layout_constraints=\{(.*?)\}\s*,\s*[a-z_]+=")


def grouped_matmuls(hlo_text: str) -> list[dict]:
    """The megablox kernels of a compiled module: per call site, the kernel ("gmm": rows x
    [E, k, n] weights -> [rows, n]; "tgmm": the weight gradient, rows x rows -> [E, k, n]),
    its row-buffer length m, contraction k, output width n, and how often it runs per step.

    Returns:
      [{"kernel", "m", "k", "n", "groups", "tm" (row tile), "runs"}].
    """
    comps, runs = parse_computations(hlo_text)
    out = []
    for name, mult in runs.items():
        if name == "__unknown__":
            continue
        for line in comps[name]:
            m = _KERNEL.match(line)
            if not m:
                continue
            dims = [[int(d) for d in s.split(",") if d]
                    for _, s in ARRAY_TYPE.findall(m.group(3))]
            big = [d for d in dims if len(d) >= 2]
            res = [int(d) for _, s in ARRAY_TYPE.findall(m.group(2)) for d in s.split(",") if d]
            if m.group(1) == "gmm":       # lhs [m, k], rhs [E, k, n] (or [E, n, k]) -> [m, n]
                lhs, rhs = big[-2], big[-1]
                n = rhs[2] if rhs[1] == lhs[1] else rhs[1]     # the backward's transposed rhs
                rec = {"m": lhs[0], "k": lhs[1], "n": n, "groups": rhs[0]}
            else:                         # lhs [m, k], grad [m, n] -> [E, k, n]
                rec = {"m": big[-2][0], "k": res[1], "n": res[2], "groups": res[0]}
            # The group metadata holds tiles_m + groups - 1 entries: the row tile is m / tiles_m.
            ids = max(d[0] for d in dims if len(d) == 1)
            rec["tm"] = rec["m"] // max(1, ids - rec["groups"] + 1)
            out.append({"kernel": m.group(1), **rec, "runs": mult, "computation": name})
    return out


def visited_rows(rows: int, groups: int, tm: int, *, samples: int = 256, seed: int = 0,
                 visit_empty: bool = False) -> float:
    """Rows megablox computes for `rows` routed rows in `groups` experts with row tiles of `tm`:
    every tile a group's run of rows touches is computed whole (a run that starts or ends
    inside a tile costs the tile), averaged over balanced random routing (multinomial counts,
    fixed seed).

    Args:
      rows: routed rows in the buffer (the rest of the worst-case buffer is not visited).
      groups: experts on the chip.
      tm: the kernel's row tile.
      visit_empty: `tgmm` visits one tile for an empty group.
    Returns:
      The mean number of rows the kernel computes (tiles x tm).
    """
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(rows, [1.0 / groups] * groups, size=samples)
    ends = np.cumsum(sizes, axis=1)
    starts = ends - sizes
    tiles = -(-ends // tm) - starts // tm
    tiles = np.where(sizes == 0, 1 if visit_empty else 0, tiles)
    return float(tiles.sum(axis=1).mean() * tm)

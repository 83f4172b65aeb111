"""Collectives in compiled HLO text: how many ops of each kind, and the bytes they move per step.

Read from the TPU compiler's `*.after_optimizations.txt` dump (`aot.compile_lowered`).
"""
from __future__ import annotations

import re

import numpy as np

COLLECTIVES = ("all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "all-reduce",
               "collective-permute")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Static count of each collective op in compiled HLO text (async `-start` forms included).

    The TPU compiler emits most reduce-scatters as fusions calling an `%all-reduce-scatter`
    computation; those calls count as reduce-scatters. A collective inside a loop body (the scan
    over layers, the micro-batch loop) counts once.
    """
    counts = {}
    for op in COLLECTIVES:
        counts[op] = len(re.findall(rf"\s{op}(?:-start)?\(", hlo_text))
    counts["reduce-scatter"] += len(re.findall(r"calls=%all-reduce-scatter", hlo_text))
    return counts


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
                "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
ARRAY_TYPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
COLLECTIVE_LINE = re.compile(r"=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def _largest_array_bytes(shapes: str) -> int:
    """Bytes of the largest array in an HLO result type (an async start's tuple holds the
    operand and the result: the larger is what crosses the wire for a gather)."""
    sizes = [int(np.prod([int(d) for d in dims.split(",") if d] or [1])) * _DTYPE_BYTES[dt]
             for dt, dims in ARRAY_TYPE.findall(shapes)]
    return max(sizes, default=0)


def parse_computations(hlo_text: str) -> tuple[dict, dict]:
    """(computation -> its instruction lines, computation -> times it runs per execution),
    following while loops (trip count from the condition's `compare(i, constant(N))`; a
    run-time bound counts once and is counted in `runs["__unknown__"]`), calls and branches."""
    comps, current = {}, None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                comps["__entry__"] = current
            continue
        if current is None or not line.startswith("  "):
            continue
        comps[current].append(line)
    trip = {}
    for name, lines in comps.items():
        if name == "__entry__":
            continue
        text = "\n".join(lines)
        if "direction=LT" in text and "ROOT" in text:
            consts = re.findall(r"s32\[\]\S* constant\((\d+)\)", text)
            trip[name] = int(consts[-1]) if len(consts) == 1 else None
    unknown = 0
    edges = {}
    for name, lines in comps.items():
        if name == "__entry__":
            continue
        for line in lines:
            w = re.search(r"condition=%([\w.\-]+), body=%([\w.\-]+)", line)
            if w:
                n = trip.get(w.group(1))
                unknown += n is None
                edges.setdefault(name, []).append((w.group(2), n or 1))
                continue
            for callee in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", line):
                if not callee.startswith("all-reduce-scatter"):
                    edges.setdefault(name, []).append((callee, 1))
            for branches in re.findall(r"branch_computations=\{([^}]*)\}", line):
                edges.setdefault(name, []).extend((b.strip().lstrip("%"), 1)
                                                  for b in branches.split(","))
    runs = {}

    def visit(name: str, mult: int):
        runs[name] = runs.get(name, 0) + mult
        for callee, n in edges.get(name, ()):
            if callee in comps:
                visit(callee, mult * n)

    if "__entry__" in comps:
        visit(comps["__entry__"], 1)
    runs["__unknown__"] = unknown
    return comps, runs


def instruction_shapes(comps: dict) -> dict[str, str]:
    """Every instruction's result type by name, over the computations of `parse_computations`."""
    shapes = {}
    for name, lines in comps.items():
        if name == "__entry__":
            continue
        for line in lines:
            m = re.match(r"^\s+(?:ROOT )?%([\w.\-]+) = (\(.*?\)(?= [a-z])|[a-z0-9]+\[[\d,]*\])",
                         line)
            if m:
                shapes[m.group(1)] = m.group(2)
    return shapes


def collective_bytes_per_step(hlo_text: str) -> dict:
    """Bytes each kind of collective produces per executed step, loops counted by trip count.

    Walks one compiled HLO module: each collective's result bytes (per device) times the
    number of times its computation runs, following while loops (trip count read from the
    loop condition's `compare(i, constant(N)), direction=LT`; loops with a run-time bound, like
    the attention block loops, count once and are reported in `unknown_trip_loops`), fusions and
    calls. The reduce-scatters XLA:TPU emits as fusions calling `%all-reduce-scatter` count as
    reduce-scatters. A figure of the program, per device: it is what `ppermute`, gathers and
    reductions produce, not link traffic (`collective_traffic` has that). A ragged all-to-all
    counts its whole (worst-case) receive buffer, an upper bound far above what it sends.
    """
    comps, runs = parse_computations(hlo_text)
    out = {op: 0 for op in COLLECTIVES}
    for name, mult in runs.items():
        if name == "__unknown__":
            continue
        for line in comps[name]:
            m = COLLECTIVE_LINE.search(line)
            if m:
                out[m.group(2)] += mult * _largest_array_bytes(m.group(1))
            elif "calls=%all-reduce-scatter" in line:
                res = re.search(r"=\s*(.+?)\s+fusion\(", line)
                out["reduce-scatter"] += mult * _largest_array_bytes(res.group(1) if res else "")
    out["unknown_trip_loops"] = runs["__unknown__"]
    return out


# --------------------------------------------------------------------------- ring traffic
def ring_factor(op: str, n: int) -> float:
    """Bytes a device sends per byte of the collective's per-device buffer, on a ring of n.

    all-gather: the gathered result R, of which the device receives (and forwards) (n-1)/n;
    reduce-scatter: the full input (n x the shard), (n-1)/n of it; all-reduce: a reduce-scatter
    plus an all-gather, 2(n-1)/n; all-to-all: (n-1)/n of the buffer leaves the device;
    collective-permute: the whole buffer, once. n = 1 moves nothing.
    """
    if n <= 1:
        return 0.0
    return {"all-gather": (n - 1) / n, "reduce-scatter": (n - 1) / n,
            "all-reduce": 2 * (n - 1) / n, "all-to-all": (n - 1) / n,
            "ragged-all-to-all": (n - 1) / n, "collective-permute": 1.0}[op]


def group_size(line: str) -> int:
    """Devices per replica group of a collective's HLO line (1 if it names none)."""
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return int(np.prod([int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2))] or [1]))
    if "source_target_pairs" in line:
        return 2
    return 1


def array_bytes(shapes: str) -> list[int]:
    return [int(np.prod([int(d) for d in dims.split(",") if d] or [1])) * _DTYPE_BYTES[dt]
            for dt, dims in ARRAY_TYPE.findall(shapes)]


def tuple_elements(shape: str) -> list[str]:
    """Elements of a tuple type `(a, (b, c), d)` (the type itself if it is not a tuple)."""
    shape = re.sub(r"/\*index=\d+\*/|\{[^{}]*\}", "", shape).strip()
    if not shape.startswith("("):
        return [shape]
    parts, depth, cur = [], 0, ""
    for ch in shape[1:-1]:
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
            continue
        depth += ch in "(["
        depth -= ch in ")]"
        cur += ch
    return parts + [cur.strip()]


def collective_traffic(hlo_text: str) -> dict:
    """Per device and step: each collective kind's buffer bytes and ring traffic, by group size.

    Returns {op: {"bytes": per-device buffer bytes, "ring_bytes": bytes sent on a ring,
    "by_group": {n: buffer bytes}}} for the ops of `COLLECTIVES`, loops counted by trip count
    as in `collective_bytes_per_step`. Buffers: an all-gather's gathered result, a
    reduce-scatter's full input (n x its shard), an all-reduce's or all-to-all's buffer, a
    permute's buffer; every array of a multi-operand collective counts. For
    "ragged-all-to-all" the bytes are the SEND buffers (what one device could send; at
    balanced routing (n-1)/n of it leaves the device): its worst-case receive buffer is no
    traffic. Also "ragged_send_rows_bytes": the same, for `roofline` to scale by imbalance.
    """
    comps, runs = parse_computations(hlo_text)
    shapes = instruction_shapes(comps)
    out = {op: {"bytes": 0, "ring_bytes": 0.0, "by_group": {}} for op in COLLECTIVES}

    def add(op: str, n: int, nbytes: int, mult: int):
        rec = out[op]
        rec["bytes"] += mult * nbytes
        rec["ring_bytes"] += mult * nbytes * ring_factor(op, n)
        rec["by_group"][n] = rec["by_group"].get(n, 0) + mult * nbytes

    for name, mult in runs.items():
        if name == "__unknown__":
            continue
        for line in comps[name]:
            m = COLLECTIVE_LINE.search(line)
            if m:
                op, result = m.group(2), m.group(1)
                n = group_size(line)
                parts = tuple_elements(result)
                if "-start(" in line and len(parts) > 1:
                    result = parts[0] if op == "collective-permute" else parts[1]
                nbytes = sum(array_bytes(result))
                if op == "ragged-all-to-all":
                    # The rows a device holds to send: the smaller of the operand and the output
                    # (the dispatch sends its T*K rows into a worst-case buffer; the return
                    # sends the received rows out of that buffer into a T*K one).
                    operand = re.search(r"ragged-all-to-all\(%([\w.\-]+)", line)
                    sent = sum(array_bytes(shapes.get(operand.group(1), ""))) if operand else 0
                    nbytes = min(sent, nbytes) if sent else nbytes
                elif op == "reduce-scatter":
                    nbytes *= n
                add(op, n, nbytes, mult)
            elif "calls=%all-reduce-scatter" in line:
                res = re.search(r"=\s*(.+?)\s+fusion\(", line)
                callee = re.search(r"calls=%([\w.\-]+)", line).group(1)
                inner = next((x for x in comps.get(callee, []) if " all-reduce(" in x), "")
                n = group_size(inner)
                add("reduce-scatter", n, n * sum(array_bytes(res.group(1) if res else "")), mult)
    return out


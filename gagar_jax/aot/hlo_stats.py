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
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_COLLECTIVE = re.compile(r"=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def _largest_array_bytes(shapes: str) -> int:
    """Bytes of the largest array in an HLO result type (an async start's tuple holds the
    operand and the result: the larger is what crosses the wire for a gather)."""
    sizes = [int(np.prod([int(d) for d in dims.split(",") if d] or [1])) * _DTYPE_BYTES[dt]
             for dt, dims in _ARRAY.findall(shapes)]
    return max(sizes, default=0)


def collective_bytes_per_step(hlo_text: str) -> dict:
    """Bytes each kind of collective produces per executed step, loops counted by trip count.

    Walks one compiled HLO module: each collective's result bytes (per device) times the
    number of times its computation runs, following while loops (trip count read from the
    loop condition's `compare(i, constant(N)), direction=LT`; loops with a run-time bound, like
    the attention block loops, count once and are reported in `unknown_trip_loops`), fusions and
    calls. The reduce-scatters XLA:TPU emits as fusions calling `%all-reduce-scatter` count as
    reduce-scatters. A figure of the program, per device: it is what `ppermute`, gathers and
    reductions move, not link traffic. A ragged all-to-all counts its whole (worst-case)
    receive buffer, an upper bound far above what it sends.
    """
    comps, calls, current = {}, {}, None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            comps[current] = []
            calls[current] = []
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
    out = {op: 0 for op in COLLECTIVES}
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
    for name, mult in runs.items():
        for line in comps[name]:
            m = _COLLECTIVE.search(line)
            if m:
                out[m.group(2)] += mult * _largest_array_bytes(m.group(1))
            elif "calls=%all-reduce-scatter" in line:
                res = re.search(r"=\s*(.+?)\s+fusion\(", line)
                out["reduce-scatter"] += mult * _largest_array_bytes(res.group(1) if res else "")
    out["unknown_trip_loops"] = unknown
    return out

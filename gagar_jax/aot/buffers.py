"""Which buffers are live at a compiled program's memory peak (read from XLA's own dump).

`memory_analysis()` gives one number for the temporaries. The compiler's dump (`xla_dump_to`,
`aot.compile_lowered(..., dump_dir=)`) says how it got there: its live-range file
(`*after_optimizations-live-range.txt`) ends with "Live ranges at N (peak)", every buffer live
at the schedule step where the heap simulator's usage peaks, with its bytes (parameters
included). `peak_buffers` reads that list and names each buffer by the JAX operation and source
line that made it (the `op_name` and stack frame of its instruction in
`*after_optimizations.txt`), largest first.
"""
from __future__ import annotations

import glob
import os
import re

import numpy as np

from gagar_jax.aot import hlo_stats

_PEAK = re.compile(r"^\s+Live ranges at (\d+) \(peak\):")
_LIVE = re.compile(r"^\s+(.+?)(\{[\d,]*\})?: (\d+) bytes \(cumulative")
_SHAPE = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = (\(.*?\)(?= [a-z])|[a-z0-9]+\[[\d,]*\])")


def _element(shape: str, index: str) -> str:
    """The array type at a shape index of an HLO result type: `(a, (b, c))`, `{1,0}` -> `b`."""
    shape = re.sub(r"/\*index=\d+\*/|\{[^{}]*\}", "", shape)   # index comments, layouts
    for i in (int(k) for k in index.strip("{}").split(",") if k):
        if not shape.startswith("("):
            break
        parts = hlo_stats.tuple_elements(shape)
        shape = parts[i] if i < len(parts) else ""
    return shape


def _metadata(hlo: str) -> dict[str, dict]:
    """Instruction name -> {shape, op_name, source} from the HLO text (innermost frame)."""
    head = hlo.split("FunctionNames")[0]
    files = dict(re.findall(r'^(\d+) "(.*)"$', head, re.M))
    locs = {k: (f, ln) for k, f, ln in re.findall(
        r"^(\d+) \{file_name_id=(\d+) function_name_id=\d+ line=(\d+)", hlo, re.M)}
    frames = dict(re.findall(r"^(\d+) \{file_location_id=(\d+)", hlo, re.M))
    out = {}
    for line in hlo.splitlines():
        s = _SHAPE.match(line)
        if not s:
            continue
        entry = {"shape": s.group(2), "op_name": "", "source": ""}
        meta = re.search(r"metadata=\{([^}]*)\}", line)
        if meta:
            op = re.search(r'op_name="([^"]*)"', meta.group(1))
            frame = re.search(r"stack_frame_id=(\d+)", meta.group(1))
            entry["op_name"] = op.group(1) if op else ""
            if frame and frame.group(1) in frames and frames[frame.group(1)] in locs:
                f, ln = locs[frames[frame.group(1)]]
                entry["source"] = re.sub(r"^.*?/(gagar_jax|scripts|tests)/", r"\1/",
                                         f"{files.get(f, f)}:{ln}")
        out[s.group(1)] = entry
    return out


def parse_peak(live_range_text: str) -> tuple[int, list[tuple[str, str, int]]]:
    """(schedule step, [(instruction, shape index, bytes)]) of the "(peak)" section."""
    step, live, inside = -1, [], False
    for line in live_range_text.splitlines():
        m = _PEAK.match(line)
        if m:
            step, inside = int(m.group(1)), True
            continue
        if inside:
            v = _LIVE.match(line)
            if not v:
                break
            live.append((v.group(1), v.group(2) or "{}", int(v.group(3))))
    return step, live


def peak_buffers(dump_dir: str, *, top: int = 25, min_bytes: int = 0) -> dict:
    """The buffers live at the memory peak of the dump's largest module, largest first.

    Args:
      dump_dir: an `xla_dump_to` directory with the after-optimizations text dumps.
      top: at most this many buffers listed.
      min_bytes: leave out smaller buffers.
    Returns:
      {"module", "peak_step", "peak_bytes" (parameters included), "buffers": [{bytes, shape,
      instruction, op_name, source}]}; an empty dict when the dump lacks the files.
    """
    ranges = sorted(glob.glob(os.path.join(dump_dir, "*after_optimizations-live-range.txt")),
                    key=os.path.getsize)
    if not ranges:
        return {}
    stem = ranges[-1][: -len("-live-range.txt")]
    with open(ranges[-1]) as f:
        step, live = parse_peak(f.read())
    meta = {}
    if os.path.exists(stem + ".txt"):
        with open(stem + ".txt") as f:
            meta = _metadata(f.read())
    listed = sorted(live, key=lambda v: -v[2])
    buffers = []
    for name, idx, n in listed[:top]:
        if n < min_bytes:
            break
        m = meta.get(name, {"shape": "", "op_name": "", "source": ""})
        buffers.append({"bytes": n, "instruction": name + (idx if idx != "{}" else ""),
                        **m, "shape": _element(m["shape"], idx)})
    return {"module": os.path.basename(stem), "peak_step": step,
            "peak_bytes": sum(n for _, _, n in live), "buffers": buffers}


# --------------------------------------------------------------------------- every byte, named
_ALLOC = re.compile(r"^allocation (\d+): size (\d+)(.*):$")
_VALUE = re.compile(r"^ value: <\d+ ([\w.\-]+)(\{[\d,]*\})?(?: \(phi\))? @\d+> "
                    r"\(size=(\d+),offset=(\d+)\): (.*)$")
_RANGE = re.compile(r"^\s+([\w.\-]+)(\{[\d,]*\}):(\d+)-(\d+)$")


def parse_allocations(text: str) -> list[dict]:
    """Allocations of a `*buffer-assignment.txt`: {"size", "kind" (parameter, output,
    constant, temp, thread-local, other-color), "values": [(name, index, size, offset, shape)]}."""
    out = []
    for line in text.splitlines():
        m = _ALLOC.match(line)
        if m:
            attrs = m.group(3)
            kind = ("other-color" if re.search(r", color \d+", attrs) else
                    "thread-local" if "thread-local" in attrs else
                    "parameter" if ", parameter " in attrs else
                    "constant" if "constant" in attrs else
                    "temp" if "preallocated-temp" in attrs else
                    "output" if "live-out" in attrs else "other")
            out.append({"size": int(m.group(2)), "kind": kind, "values": []})
            continue
        v = _VALUE.match(line)
        if v and out:
            out[-1]["values"].append((v.group(1), v.group(2) or "{}", int(v.group(3)),
                                      int(v.group(4)), v.group(5)))
    return out


def _live_ranges(text: str) -> dict:
    ranges, inside = {}, False
    for line in text.splitlines():
        if line.strip() == "BufferLiveRange:":
            inside = True
            continue
        if inside:
            m = _RANGE.match(line)
            if not m:
                if line.strip().startswith("Live ranges at"):
                    break
                continue
            ranges[m.group(1) + m.group(2)] = (int(m.group(3)), int(m.group(4)))
    return ranges


def heap_at_peak(temp: dict, ranges: dict, candidates: int = 64
                 ) -> tuple[int, list[tuple[str, int, str]]]:
    """The temporaries at the heap's fullest moment: the schedule step where the most distinct
    heap bytes are live (values sharing an address range, like a loop's phi values, count once).

    Live bytes are first summed per step with each address range's overlapping intervals merged;
    the exact union of live address ranges is then taken at the `candidates` fullest steps.

    Returns:
      (step, [(instruction, bytes, shape)]): each live address range once, first value named.
    """
    vals = [(n + i, s, o, sh) for n, i, s, o, sh in temp["values"] if n + i in ranges and s]
    steps = max((e for _, e in ranges.values()), default=0) + 2
    live = np.zeros(steps + 1)
    by_slot: dict[tuple, list] = {}
    for name, s, o, _ in vals:
        by_slot.setdefault((o, s), []).append(ranges[name])
    for (_, s), spans in by_slot.items():
        spans.sort()
        a, b = spans[0]
        for x, y in spans[1:] + [(steps + 1, steps + 1)]:
            if x <= b + 1:
                b = max(b, y)
                continue
            live[a] += s
            live[min(b + 1, steps)] -= s
            a, b = x, y
    live = np.cumsum(live)

    def union_at(step: int) -> list[tuple[str, int, str]]:
        here = sorted(((o, s, name, sh) for name, s, o, sh in vals
                       if ranges[name][0] <= step <= ranges[name][1]),
                      key=lambda t: (t[0], -t[1]))
        out, end = [], 0
        for o, s, name, sh in here:
            if o + s <= end:
                continue
            out.append((name, o + s - max(o, end), sh))
            end = o + s
        return out

    best = (-1, [])
    for step in np.argsort(-live)[:candidates]:
        got = union_at(int(step))
        if sum(n for _, n, _ in got) > sum(n for _, n, _ in best[1]):
            best = (int(step), got)
    return best


_NO_SOURCE = {"wide.param": "loop-carried values of the scans (accumulators, carries)",
              "wide.wide.param": "loop-carried values of the scans (accumulators, carries)",
              "copy": "layout copies", "custom-call": "custom-call results"}


def _row_name(instruction: str, meta: dict) -> str:
    """A temporary's row: its source line, else what its instruction name says it is."""
    if meta.get("source"):
        return meta["source"]
    if meta.get("op_name"):
        return "/".join(meta["op_name"].split("/")[-2:])
    stem = re.sub(r"(\.\d+)*(\{[\d,]*\})?$", "", instruction)
    return f"{_NO_SOURCE.get(stem, stem)} (no source line)"


def buffer_table(dump_dir: str, *, min_row_bytes: int = 2**26) -> dict:
    """Every HBM byte of the compiled module named (issue 41 item 4), from the dump's buffer
    assignment, live ranges and HLO text.

    Rows: the entry parameters (the train state and the batch), outputs that are not donated
    inputs, constants, and the temporary heap: the values live where it is fullest,
    grouped by the source line that made them (rows under `min_row_bytes` gathered in one),
    plus the heap's unused gaps at that moment (fragmentation). The rows sum to the buffer
    assignment's HBM total exactly; `memory_analysis` adds the code.

    Returns:
      {"rows": [{"what", "bytes", "buffers", "shapes"}], "total_bytes", "heap_bytes",
       "heap_step", "thread_local": `thread_local_breakdown`}; {} without a dump.
    """
    files = glob.glob(os.path.join(dump_dir, "*after_optimizations-buffer-assignment.txt"))
    if not files:
        return {}
    path = max(files, key=os.path.getsize)
    stem = path[: -len("-buffer-assignment.txt")]
    allocs = parse_allocations(open(path).read())
    ranges = _live_ranges(open(stem + "-live-range.txt").read())
    meta = _metadata(open(stem + ".txt").read()) if os.path.exists(stem + ".txt") else {}
    rows = []
    for kind, what in (("parameter", "arguments: the train state and the batch (entry "
                                     "parameters)"),
                       ("output", "outputs that are not donated inputs"),
                       ("constant", "constants"), ("other", "other HBM allocations")):
        picked = [a for a in allocs if a["kind"] == kind]
        if picked:
            rows.append({"what": what, "bytes": sum(a["size"] for a in picked),
                         "buffers": len(picked), "shapes": ""})
    heap = next((a for a in allocs if a["kind"] == "temp"), None)
    step = -1
    if heap is not None:
        step, live = heap_at_peak(heap, ranges)
        groups: dict[str, dict] = {}
        for name, n, shape in live:
            key = _row_name(name, meta.get(name.split("{")[0], {}))
            g = groups.setdefault(key, {"bytes": 0, "buffers": 0, "shapes": {}})
            g["bytes"] += n
            g["buffers"] += 1
            short = re.sub(r"\{[^}]*\}", "", shape)
            g["shapes"][short] = g["shapes"].get(short, 0) + 1
        small = {"bytes": 0, "buffers": 0, "sources": 0}
        for key, g in sorted(groups.items(), key=lambda kv: -kv[1]["bytes"]):
            if g["bytes"] < min_row_bytes:
                small["bytes"] += g["bytes"]
                small["buffers"] += g["buffers"]
                small["sources"] += 1
                continue
            shapes = ", ".join(f"{c} x {s}" if c > 1 else s
                               for s, c in sorted(g["shapes"].items(), key=lambda t: -t[1])[:3])
            rows.append({"what": f"temporary: {key}", "bytes": g["bytes"],
                         "buffers": g["buffers"], "shapes": shapes})
        if small["buffers"]:
            rows.append({"what": f"temporaries of {small['sources']} other source lines "
                                 f"(each under {min_row_bytes / 2**20:.0f} MiB)",
                         "bytes": small["bytes"], "buffers": small["buffers"], "shapes": ""})
        used = sum(n for _, n, _ in live)
        rows.append({"what": "heap gaps at that moment (fragmentation)",
                     "bytes": heap["size"] - used, "buffers": 0, "shapes": ""})
    hbm = [a for a in allocs if a["kind"] not in ("thread-local", "other-color")]
    return {"rows": rows, "total_bytes": sum(a["size"] for a in hbm),
            "heap_bytes": heap["size"] if heap else 0, "heap_step": step,
            "thread_local": thread_local_breakdown(allocs, open(stem + ".txt").read()
                                                   if os.path.exists(stem + ".txt") else "")}


def thread_local_breakdown(allocs: list[dict], hlo: str) -> dict:
    """What the thread-local allocations hold, by the computation their values live in.

    A thread-local allocation belongs to a computation that runs inside one instruction of its
    caller (a fusion's fused computation, an async or offloaded computation, a reduction's
    combiner): its parameters are the caller's operands and its root is the caller's result,
    which the caller's own allocations already hold; its other values live in the kernel's
    registers and scratch (VMEM), never in HBM. `memory_analysis` leaves them out.

    Returns:
      {"bytes", "allocations", "by_role": {role: bytes}, "by_computation_kind": {kind: bytes}}
      with role parameter / root / internal and kind the computation's name stem.
    """
    comp_of, roots, params = {}, set(), set()
    current = None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$", line)
        if m:
            current = m.group(1)
            continue
        v = re.match(r"^\s+(ROOT )?%([\w.\-]+) = .*?\b(parameter)?\(", line)
        if v and current:
            comp_of[v.group(2)] = current
            if v.group(1):
                roots.add(v.group(2))
            if re.search(r"\sparameter\(\d+\)", line):
                params.add(v.group(2))
    by_role: dict[str, int] = {}
    by_kind: dict[str, int] = {}
    total = n = 0
    for a in allocs:
        if a["kind"] != "thread-local":
            continue
        n += 1
        total += a["size"]
        name = a["values"][0][0] if a["values"] else ""
        role = "parameter" if name in params else "root" if name in roots else "internal"
        kind = re.sub(r"[.\d]+$", "", comp_of.get(name, "unknown"))
        by_role[role] = by_role.get(role, 0) + a["size"]
        by_kind[kind] = by_kind.get(kind, 0) + a["size"]
    top = dict(sorted(by_kind.items(), key=lambda kv: -kv[1])[:8])
    return {"bytes": total, "allocations": n, "by_role": by_role, "by_computation_kind": top}

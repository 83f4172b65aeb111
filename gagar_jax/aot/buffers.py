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

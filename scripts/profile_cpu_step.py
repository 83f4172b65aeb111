"""Where gagar_jax's CPU step spends its time: one traced call, XLA:CPU thunks grouped by loop.

Run:  JAX_PLATFORMS=cpu .venv/bin/python scripts/profile_cpu_step.py [--part trunk|head|step]
      [--top 12] [--rows 4 --seq 1024] [--config configs/small.py]

Builds the same model and batch as `bench_vs_transformers.py` (its `jax_cases`), compiles the
part, runs it twice untimed, then once under `jax.profiler`, and reads the trace back: every
XLA:CPU thunk event (a fusion, dot, copy; loops are containers and left out) with its summed duration and call count. The count
says where a thunk sits: 1 is the program's top level (e.g. zero-filling the scan's stacked
buffers), a multiple of the layer count is per layer, larger counts are inside the attention
and expert loops. Durations are thread time (two threads may run thunks at once), so the shares
matter more than the sum. Run it in a process of its own: jax's profiler crashes in a process
that has loaded libtpu (an ahead-of-time TPU compile does). Each thunk is listed with its
output shape and JAX op from the compiled HLO.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Left out of the table: runtime wrappers, waits and Python-level events, completion markers,
# and control-flow thunks, whose events span the thunks of their bodies (counted once already).
_NOT_WORK = ("ThunkExecutor", "$", "SlinkyThreadPool", "PjitFunction", "ThreadpoolListener",
             "end: ", "while", "conditional", "call")


def thunk_times(trace_dir: str) -> dict[str, tuple[float, int]]:
    """name -> (summed microseconds, calls) of the complete events in the newest trace."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    dur, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(_NOT_WORK):
            dur[e["name"]] += e["dur"]
            calls[e["name"]] += 1
    return {n: (dur[n], calls[n]) for n in dur}


def describe(hlo: str) -> dict[str, str]:
    """thunk name -> 'output shape  jax op' from the compiled HLO's instruction lines."""
    out = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = (\([^ ]*|\S+) ", line)
        if m:
            op = re.search(r'op_name="([^"]*)"', line)
            shape = "(loop)" if m.group(2).startswith("(") else m.group(2).split("{")[0]
            out[m.group(1)] = f"{shape:22s} {op.group(1)[-60:] if op else ''}"
    return out


def report(times: dict[str, tuple[float, int]], top: int, names: dict[str, str]) -> str:
    by_count = collections.defaultdict(list)
    for name, (us, n) in times.items():
        by_count[n].append((us, name))
    total = sum(us for us, _ in times.values())
    lines = [f"thunk thread time {total / 1e3:.0f} ms; by call count (where a thunk sits):"]
    groups = sorted(by_count.items(), key=lambda kv: -sum(us for us, _ in kv[1]))
    for n, items in groups:
        s = sum(us for us, _ in items)
        if s < 0.01 * total:
            continue
        lines.append(f"  x{n:<6d} {s / 1e3:8.0f} ms ({100 * s / total:4.1f}%)")
        for us, name in sorted(items, reverse=True)[:top]:
            lines.append(f"      {us / 1e3:8.1f} ms  {name:30s} {names.get(name, '')}")
    return "\n".join(lines)


def main(argv=None) -> str:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu's profiler plugin must stay out
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from bench_vs_transformers import add_model_args, build, jax_cases

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("step", "trunk", "head"), default="trunk")
    p.add_argument("--top", type=int, default=6, help="thunks listed per group")
    add_model_args(p)
    args = p.parse_args(argv)
    import jax

    cases = jax_cases(*build(args))
    run, names = cases[args.part], describe(cases["hlo"][args.part]())
    run(), run()                                    # compile, then one step of its own
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        t = time.perf_counter()
        run()
        wall = time.perf_counter() - t
        jax.profiler.stop_trace()
        text = (f"{args.part} [{args.rows}, {args.seq}] attention={args.attention} "
                f"experts={args.experts}: traced call {wall:.2f} s wall\n"
                + report(thunk_times(d), args.top, names))
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()

"""Where gagar_jax's CPU step spends its time: one traced call, XLA:CPU thunks grouped by loop.

Run:  JAX_PLATFORMS=cpu .venv/bin/python scripts/profile_cpu_step.py [--part trunk|head|step]
      [--top 12] [--rows 4 --seq 1024] [--config configs/small.py]

Builds the same model and batch as `bench_vs_transformers.py` (its `jax_parts`), compiles the
part, runs it once untimed, then once under `jax.profiler`, and reads the trace back: every
XLA:CPU thunk event (a fusion, dot, copy; loops are containers and left out) with its summed
duration and call count. The count says where a thunk sits: 1 is the program's top level
(e.g. zero-filling the scan's stacked buffers), a multiple of the layer count is per layer,
larger counts are inside the attention and expert loops. Durations are thread time \
(two threads may run thunks at once), so the shares
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
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Control-flow thunks: their events span the thunks of their bodies, which count on their own.
_CONTAINERS = ("while", "conditional", "call")


def instructions(hlo: str) -> dict[str, tuple[str, str, str]]:
    """name -> (output shape, opcode, jax op name) of every instruction in the HLO text."""
    out = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = ", line)
        if not m:
            continue
        rest = line[m.end():]
        if rest.startswith("("):                  # a tuple shape: up to its closing paren
            depth = 0
            for k, c in enumerate(rest):  # noqa: B007 -- k is read after the break
                depth += {"(": 1, ")": -1}.get(c, 0)
                if depth == 0:
                    break
            shape, rest = "(tuple)", rest[k + 1:]
        else:
            shape, _, rest = rest.partition(" ")
            shape = shape.split("{")[0]
        opcode = re.match(r"\s*([\w-]+)\(", rest)
        op = re.search(r'op_name="([^"]*)"', line)
        out[m.group(1)] = (shape, opcode.group(1) if opcode else "", op.group(1) if op else "")
    return out


def leaves(hlo: str) -> set[str]:
    """The instructions that run as thunks of their own (control flow left out)."""
    return {n for n, (_, opcode, _) in instructions(hlo).items() if opcode not in _CONTAINERS}


def thunk_times(trace_dir: str, thunks: set[str]) -> dict[str, tuple[float, int]]:
    """name -> (summed microseconds, calls) of the newest trace's complete events named after
    one of `thunks` (runtime wrappers, waits and Python-level events are not instructions)."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    dur, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e["name"] in thunks:
            dur[e["name"]] += e["dur"]
            calls[e["name"]] += 1
    return {n: (dur[n], calls[n]) for n in dur}


def describe(hlo: str) -> dict[str, str]:
    """thunk name -> 'output shape  jax op' for the table."""
    return {n: f"{shape:22s} {op[-60:]}" if opcode != "while" else f"{'(loop)':22s} {op[-60:]}"
            for n, (shape, opcode, op) in instructions(hlo).items()}


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
    from bench_vs_transformers import add_model_args, build, jax_parts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("step", "trunk", "head"), default="trunk")
    p.add_argument("--top", type=int, default=6, help="thunks listed per group")
    add_model_args(p)
    args = p.parse_args(argv)
    import jax

    fn, fn_args = jax_parts(*build(args))[args.part]
    compiled = fn.lower(*fn_args).compile()
    hlo = compiled.as_text()
    names = describe(hlo)
    run = lambda: jax.block_until_ready(compiled(*fn_args))
    run()                                           # a step of its own first
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        t = time.perf_counter()
        run()
        wall = time.perf_counter() - t
        jax.profiler.stop_trace()
        text = (f"{args.part} [{args.rows}, {args.seq}] attention={args.attention} "
                f"experts={args.experts}: traced call {wall:.2f} s wall\n"
                + report(thunk_times(d, leaves(hlo)), args.top, names))
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()

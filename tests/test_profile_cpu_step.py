"""scripts/profile_cpu_step.py: the trace is read back into thunk times grouped by call count."""
import os
import subprocess
import sys

import profile_cpu_step
from support.paths import REPO, TINY_CONFIG
from support.xla_flags import FAST_COMPILE, cpu_flags


def test_report_groups_by_call_count_and_names_shapes():
    times = {"dot.1": (3000.0, 8), "fusion.2": (1000.0, 8), "loop.3": (6000.0, 80),
             "tiny.4": (1.0, 1)}
    names = profile_cpu_step.describe(
        "  %dot.1 = f32[4,8]{1,0} dot(%a, %b), metadata={op_name=\"jit(f)/bsd,dhk->bshk/dot\"}\n"
        "  ROOT %loop.3 = (s32[], f32[2]{0}) while(%t), condition=%c, body=%b\n")
    assert names["dot.1"].split()[0] == "f32[4,8]" and names["dot.1"].endswith("bsd,dhk->bshk/dot")
    assert names["loop.3"].startswith("(loop)")
    text = profile_cpu_step.report(times, top=5, names=names)
    lines = text.splitlines()
    assert lines[0].startswith("thunk thread time 10 ms")
    # groups by total time, largest first; a group under 1% of the total is left out
    heads = [ln.split()[0] for ln in lines if ln.startswith("  x")]
    assert heads == ["x80", "x8"]
    assert "60.0%" in text and "40.0%" in text and "tiny.4" not in text
    i = lines.index(next(ln for ln in lines if ln.startswith("  x8 ")))
    assert "dot.1" in lines[i + 1] and "fusion.2" in lines[i + 2]      # largest first


def test_tiny_trunk_is_traced():
    # A process of its own: the profiler crashes in a process that has loaded libtpu (the AOT
    # tests do, and pytest workers share processes between test files).
    # One CPU device with the subprocesses' flags, at -O0 (the step is compiled for one call):
    # not the suite's 8 fake devices without the CPU-only flags, which it would inherit.
    # PYTHONPATH: this checkout's package (an editable install may point at another checkout).
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_flags(1, FAST_COMPILE),
               PYTHONPATH=REPO)
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "profile_cpu_step.py"), "--config",
         TINY_CONFIG, "--rows", "2", "--seq", "32", "--top", "2"],
        env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "traced call" in out.stdout and "thunk thread time" in out.stdout
    assert any(ln.startswith("  x") for ln in out.stdout.splitlines())


def test_thunk_times_counts_leaves_once(tmp_path):
    import gzip
    import json
    events = [{"ph": "X", "name": "while.7", "dur": 50.0},          # spans the two below
              {"ph": "X", "name": "dot.1", "dur": 20.0}, {"ph": "X", "name": "dot.1", "dur": 25.0},
              {"ph": "X", "name": "end: dot.1", "dur": 1.0},
              {"ph": "X", "name": "ThunkExecutor::Execute", "dur": 60.0},
              {"ph": "i", "name": "fusion.3"}]
    (tmp_path / "host").mkdir()
    with gzip.open(tmp_path / "host" / "x.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    hlo = ("  %while.7 = (s32[], f32[2,3]{1,0}) while(%t), condition=%c, body=%b\n"
           "  %dot.1 = f32[4,8]{1,0} dot(%a, %b)\n  %fusion.3 = f32[4]{0} fusion(%dot.1)\n")
    assert profile_cpu_step.leaves(hlo) == {"dot.1", "fusion.3"}
    assert profile_cpu_step.thunk_times(str(tmp_path), profile_cpu_step.leaves(hlo)) == {
        "dot.1": (45.0, 2)}

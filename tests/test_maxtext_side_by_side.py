"""scripts/maxtext_side_by_side.py: its parsers and table on fixed inputs (no MaxText needed),
and the buffer-assignment measure against memory_analysis on a CPU compile."""
import json
import os

import jax
import jax.numpy as jnp
import maxtext_side_by_side as sbs

# A hand-written excerpt in XLA's buffer-assignment format (TPU-style colors and pages).
EXCERPT = """BufferAssignment:
allocation 0: size 1024, page 0, parameter 0, shape |f32[256]| at ShapeIndex {}, maybe-live-out:
 value: <1 p0 @0> (size=1024,offset=0): f32[256]{0}
allocation 1: size 512, page 0, parameter 1, shape |f32[128]| at ShapeIndex {}:
 value: <2 p1 @0> (size=512,offset=0): f32[128]{0}
allocation 2: size 4096, page 0, preallocated-temp:
 value: <3 dot @0> (size=4096,offset=0): f32[32,32]{1,0}
allocation 3: size 64, page 0, constant:
 value: <4 c @0> (size=64,offset=0): f32[16]{0}
allocation 4: size 16, page 0, output shape is |(f32[256], f32[])|, maybe-live-out:
 value: <5 tuple @0> (size=16,offset=0): (f32[256]{0}, f32[])
allocation 5: size 8, page 0, thread-local:
 value: <6 r @0> (size=8,offset=0): f32[2]{0}
allocation 6: size 2048, color 1, page 0, preallocated-temp:
 value: <7 v @1> (size=2048,offset=0): f32[512]{0:S(1)}
allocation 7: size 32, color 6, page 0, thread-local:
 value: <8 s @6> (size=32,offset=0): f32[8]{0:S(6)}
"""

LOG = ("Jitting and compilation complete!\nMemory analysis: CompiledMemoryStats("
       "generated_code_size_in_bytes=100, argument_size_in_bytes=1536, output_size_in_bytes=1040,"
       " alias_size_in_bytes=1024, temp_size_in_bytes=4160, host_generated_code_size_in_bytes=0,"
       " host_argument_size_in_bytes=0, host_output_size_in_bytes=0, host_alias_size_in_bytes=0,"
       " host_temp_size_in_bytes=0)\n")


def test_buffer_assignment_totals_excerpt():
    t = sbs.buffer_assignment_totals(EXCERPT)
    # HBM: 1024 + 512 + 4096 + 64 + 16, of it parameters 1024 + 512; thread-local 8 apart;
    # colors 1 and 6 apart.
    assert t == {"hbm": 5712, "parameters": 1536, "thread_local": 8,
                 "other_colors": {"1": 2048, "6": 32}, "allocations": 8}


def test_parse_memory_analysis_log():
    m = sbs.parse_memory_analysis("no stats here\n")
    assert m is None
    m = sbs.parse_memory_analysis(LOG)
    # 1536 + 1040 - 1024 + 4160 + 100
    assert m == {"arguments": 1536, "outputs": 1040, "aliases": 1024, "temporaries": 4160,
                 "code": 100, "total": 5812}


def test_side_by_side_table_cells():
    gib = 2**30
    gagar = {"name": "gagar", "status": "compiled", "compile_seconds": 551.2,
             "memory_analysis": {"arguments": 8 * gib, "temporaries": 45 * gib,
                                 "code": gib // 2, "total": int(53.5 * gib)},
             "buffer_assignment": {"hbm": 52 * gib}, "peak_live_bytes": int(49.25 * gib),
             "max_rss_bytes": None}
    oom = {"name": "default", "status": "compile-time HBM OOM", "compile_seconds": 1200.4,
           "memory_analysis": None, "hbm_oom": {"required_bytes": int(96.5 * gib)},
           "buffer_assignment": {"hbm": int(96.5 * gib), "parameters": 7 * gib},
           "peak_live_bytes": int(80.25 * gib), "max_rss_bytes": 11 * gib}
    lines = sbs.side_by_side_table([gagar, oom]).splitlines()
    assert lines[0] == "| | gagar_jax | MaxText default |"
    assert lines[1] == "|---|---|---|"
    rows = {ln.split(" | ")[0][2:]: ln.split(" | ")[1:] for ln in lines[2:]}
    # Without memory_analysis, the arguments are the buffer assignment's parameters.
    assert rows["arguments GiB (memory_analysis)"] == ["8.00", "7.00 (b) |"]
    assert rows["temporaries GiB (memory_analysis)"] == ["45.00", "- |"]
    assert rows["code GiB (memory_analysis)"] == ["0.50", "- |"]
    assert rows["(a) total GiB, memory_analysis"] == ["53.50", "HBM OOM at 96.50 |"]
    assert rows["(b) total GiB, buffer assignment (HBM)"] == ["52.00", "96.50 |"]
    assert rows["(c) XLA peak live set GiB"] == ["49.25", "80.25 |"]
    assert rows["compile s"] == ["551", "1200 |"]
    assert rows["host peak RSS GiB"] == ["-", "11.00 |"]


def test_buffer_assignment_equals_memory_analysis_on_cpu(tmp_path):
    # Donated weights, a temporary and two outputs: the HBM allocations of the dump add up to
    # memory_analysis' total (arguments + outputs - aliases + temporaries; no code on CPU).
    def step(w, x):
        h = jnp.tanh(x @ w)
        return w - 0.1 * (h.T @ x).T, h.sum()

    lowered = jax.jit(step, donate_argnums=0).lower(jnp.zeros((256, 256)), jnp.zeros((64, 256)))
    compiled = lowered.compile({"xla_dump_to": str(tmp_path), "xla_dump_hlo_as_text": True})
    s = compiled.memory_analysis()
    total = (s.argument_size_in_bytes + s.output_size_in_bytes - s.alias_size_in_bytes
             + s.temp_size_in_bytes + s.generated_code_size_in_bytes)
    ba = sbs.dump_buffer_assignment(str(tmp_path))
    assert ba["file"].endswith("buffer-assignment.txt")
    assert ba["hbm"] == total
    assert total >= 256 * 256 * 4 + 64 * 256 * 4   # the weights and the batch at least


def test_stop_after_buffer_assignment(tmp_path):
    # The train step's buffer assignment alone is not enough: (c) needs its live ranges too.
    dump = tmp_path / "dump"
    dump.mkdir()
    stem = "module_0042.jit_train_step.cl_1.after_optimizations"
    (dump / "module_0001.jit_init.after_optimizations-buffer-assignment.txt").write_text("x")
    (dump / "module_0001.jit_init.after_optimizations-live-range.txt").write_text("x")
    assert not sbs.past_buffer_assignment(str(dump))
    (dump / f"{stem}-buffer-assignment.txt").write_text("x")
    assert not sbs.past_buffer_assignment(str(dump))
    (dump / f"{stem}-live-range.txt").write_text("x")
    assert sbs.past_buffer_assignment(str(dump))
    # run_capped ends a compile early once told to, and says so.
    run = sbs.run_capped(["sleep", "60"], str(tmp_path / "log.txt"), dict(os.environ), 0, 60,
                         stop_when=lambda: sbs.past_buffer_assignment(str(dump)), stop_grace_s=0)
    assert run["rc"] == "stopped" and run["wall_seconds"] < 30


def test_committed_side_by_side_is_one_compiler_and_gagar_below_maxtext():
    # Issue 41's check over the committed report: every column built by one libtpu, MaxText at
    # 16 token chunks among them, and gagar_jax's per-chip HBM (buffer assignment, the measure
    # every column has) below each MaxText variant's.
    path = os.path.join(sbs.REPO, "docs", "aot", "maxtext_side_by_side.json")
    with open(path) as f:
        report = json.load(f)
    cols = {c["name"]: c for c in report["columns"]}
    assert {"gagar", "ring_chunks16"} <= set(cols)
    assert len({c["libtpu"] for c in cols.values()}) == 1
    assert cols["gagar"]["libtpu"] not in (None, "unknown")
    gagar = cols["gagar"]["buffer_assignment"]["hbm"]
    maxtext = [c["buffer_assignment"]["hbm"] for n, c in cols.items() if n != "gagar"]
    assert len(maxtext) == 4 and gagar < min(maxtext)

"""XLA:CPU flags for the test suite and the subprocesses it starts.

The suite is compile-bound (tiny shapes, hundreds of programs), so it trades XLA:CPU's code
quality for compile speed. None of these changes float semantics (XLA:CPU never enables
fast-math by default); they only pick cheaper code generation:
  - LLVM without its expensive passes, at -O0 in the pytest processes, which compile hundreds
    of programs and run each a few times (FAST_COMPILE), and at -O1 in the subprocesses, which
    run trainers and the miniature for many steps from a warm cache: -O0 code runs them about
    4x slower, and -O1 compiles about as fast (measured: a cold 6-step tiny trainer 18.6 s at
    -O0 and 17.0 s at -O1, warm 12.8 s and 8.6 s; the miniature --quick 82 s and 64 s);
  - the classic elemental fusion emitter instead of the MLIR fusion emitters, whose per-fusion
    MLIR pipelines were about half of every compile (measured with perf on a train step)
    (CPU_ONLY). libtpu, which the TPU AOT tests load in-process, dies on this flag ("Unknown
    flag in XLA_FLAGS"), so conftest drops it from the environment once XLA:CPU has read its
    flags (each XLA library parses XLA_FLAGS once, when it starts);
  - one LLVM module per program instead of XLA:CPU's split into parallel codegen parts (CPU_ONLY):
    the parts are compiled on a thread pool, which buys nothing on 2 busy cores and costs the
    split itself (test_train_step.py 201.9 -> 181.4 CPU-seconds, fresh cache, Zen 1, 2026-12-05).
    A step's result can differ from the default split's in its last bits, as between two CPUs:
    what a test compares runs under the same flags, or within a tolerance.
Tried and left out (compile CPU-seconds of a tiny train step, Zen 1, 2026-12-05): the
FAST_COMPILE opt preset, no XNNPACK, the memory-optimized or non-concurrency scheduler, no
region analysis in copy insertion (none faster); -O1 for the pytest processes (compiles 2-2.5x
slower). Subprocesses that compile a program for one short run use FAST_COMPILE too
(trainer_runs.env(level)): a cold 4-step 4-device trainer 38-40 -> 30-32 CPU-seconds.
"""
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
SUBPROCESS = "--xla_backend_optimization_level=1 --xla_llvm_disable_expensive_passes=true"
CPU_ONLY = "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"


def cpu_flags(devices: int, level: str = SUBPROCESS) -> str:
    """XLA_FLAGS for a CPU-only process with `devices` fake CPU devices (subprocesses by
    default; conftest passes FAST_COMPILE for the pytest processes)."""
    return f"--xla_force_host_platform_device_count={devices} {level} {CPU_ONLY}"


def without(flags: str, drop: str) -> str:
    """`flags` less every flag in `drop` (whole flags only)."""
    dropped = set(drop.split())
    return " ".join(f for f in flags.split() if f not in dropped)

"""XLA:CPU flags for the test suite and the subprocesses it starts.

The suite is compile-bound (tiny shapes, hundreds of programs), so it trades XLA:CPU's code
quality for compile speed. None of these changes float semantics (XLA:CPU never enables
fast-math by default); they only pick cheaper code generation:
  - LLVM at -O0 and without its expensive passes (FAST_COMPILE);
  - the classic elemental fusion emitter instead of the MLIR fusion emitters, whose per-fusion
    MLIR pipelines were about half of every compile (measured with perf on a train step)
    (CPU_ONLY). libtpu, which the TPU AOT tests load in-process, dies on this flag ("Unknown
    flag in XLA_FLAGS"), so conftest drops it from the environment once XLA:CPU has read its
    flags (each XLA library parses XLA_FLAGS once, when it starts).
"""
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
CPU_ONLY = "--xla_cpu_use_fusion_emitters=false"


def cpu_flags(devices: int) -> str:
    """XLA_FLAGS for a CPU-only subprocess with `devices` fake CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE} {CPU_ONLY}"


def without(flags: str, drop: str) -> str:
    """`flags` less every flag in `drop`."""
    for flag in drop.split():
        flags = flags.replace(flag, "")
    return " ".join(flags.split())

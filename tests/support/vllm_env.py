"""The vLLM environment for tests: .venv-vllm beside .venv (`make vllm`; `make test` builds it).

vLLM cannot share the learner's venv (its torch / transformers pins), so the tests that need it
run vLLM in a subprocess of .venv-vllm. A missing .venv-vllm fails those tests (CI builds it),
it never skips them.
"""
import os
import subprocess

from support.paths import REPO

VLLM_PY = os.path.join(REPO, ".venv-vllm", "bin", "python")


def vllm_python() -> str:
    """The vLLM venv's interpreter; fails the test (not a skip) when it is missing."""
    if not os.access(VLLM_PY, os.X_OK):
        raise AssertionError(f"{VLLM_PY} is missing: run `make vllm` (`make test` does it)")
    return VLLM_PY


def vllm_env(in_process: bool = True) -> dict:
    """Environment for a vLLM subprocess: this tree first on the path, a 1 GiB KV cache, and
    (in_process) the engine core inside the calling process: 3 s to start instead of 15-30 s."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env["PYTHONPATH"] = REPO
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def run_vllm(args: list, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Runs `.venv-vllm/bin/python ARGS`; raises with the output's tail if it fails."""
    proc = subprocess.run([vllm_python(), *args], cwd=REPO, env=kwargs.pop("env", vllm_env()),
                          capture_output=True, text=True, timeout=timeout, **kwargs)
    if proc.returncode != 0:
        raise AssertionError(f"{args[0]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc

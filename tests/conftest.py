"""Test set-up: 8 fake CPU devices, fast XLA:CPU compiles and a shared persistent compilation cache.

Both must be configured before JAX is imported anywhere, so this runs first.
"""
import os

from support.paths import REPO, load_tiny_config
from support.xla_flags import (  # fast compiles: xla_flags.py
    CPU_ONLY,
    FAST_COMPILE,
    cpu_flags,
    without,
)

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {cpu_flags(8, FAST_COMPILE)}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_CACHE = os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(REPO, ".cache", "jax"),
)

import jax  # noqa: E402
import pytest  # noqa: E402

# XLA:CPU reads XLA_FLAGS once, when its backend starts and compiles; then the CPU-only flag
# leaves the environment so that libtpu (the TPU AOT tests) and the subprocesses that inherit it
# start cleanly.
jax.jit(lambda: jax.numpy.zeros(()))()
os.environ["XLA_FLAGS"] = without(os.environ["XLA_FLAGS"], CPU_ONLY)

jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_numpy_rank_promotion", "raise")

from hypothesis import settings  # noqa: E402

# The gcs_emulator fixture (a local fake-gcs-server for tests/test_gcs.py); vllm_served (one
# vLLM engine per family for the test run: tests/test_vllm.py, tests/test_engine_conformance.py).
pytest_plugins = ("support.gcs_emulator", "support.vllm_served")

# Few, deterministic examples: each new shape is a compile on 2 CPU cores.
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.load_profile("ci")


@pytest.fixture(scope="session")
def repo_root() -> str:
    """The repository root (configs/, data/, scripts/ live there)."""
    return REPO


@pytest.fixture(scope="session")
def tiny_config():
    """The loader of configs/tiny_cpu.py: `tiny_config(train__steps=3)` is a fresh ConfigDict
    with the sample feed's absolute path and the given `section__name` overrides."""
    return load_tiny_config


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, "tests expect 8 fake CPU devices"
    return devs


# The longest files first: `make test` runs two xdist workers with a file per worker
# (--dist loadfile), handed out in collection order, so a long file collected last would run
# alone at the end.
_LONG_FIRST = ("test_vllm.py", "test_train_mesh.py", "test_loop.py", "test_weights_io.py",
               "test_train.py", "test_train_signals.py", "test_train_step.py", "test_startup.py",
               "test_gcs.py", "test_miniature.py", "test_reliability.py", "test_policy_loss.py",
               "test_aot.py", "test_configs.py", "test_hf_mimo.py", "test_published_versions.py",
               "test_bench_device.py", "test_sim.py", "test_miniature_tabular.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))

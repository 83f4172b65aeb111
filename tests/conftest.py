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
# One OpenMP / BLAS thread per process (torch in the parity tests, vLLM's CPU build, NumPy's
# OpenBLAS), inherited by the subprocesses: `make test` runs three workers on two cores, and a pool
# of two threads beside a busy core spins while it waits (measured: the vLLM driver of
# vllm_served 50 -> 36 CPU-seconds beside a busy core, alone 38 -> 33). XLA:CPU keeps its
# own thread pool.
os.environ.setdefault("OMP_NUM_THREADS", "1")
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
# vLLM engine per family for the test run: tests/test_vllm.py, tests/test_engine_conformance.py,
# tests/test_sampler_vllm.py, tests/test_agent_vllm.py); jax_served (the JAX sampler's engines on
# the same weights); tasks_env (the repository tasks' interpreter, `make tasks_env`: the files
# that run task tests fail with that fix in the message when it is missing).
pytest_plugins = ("support.gcs_emulator", "support.vllm_served", "support.jax_served",
                  "support.tasks_env")

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


# The longest files first (longest-processing-time-first scheduling): `make test` runs three
# xdist workers with a file per worker (--dist loadfile; the vLLM files below together), handed
# out in collection order, so a long file collected last would run alone at the end. The order
# is the files' pytest seconds in a fresh-clone `make test` (Zen 1, 2 cores, 2026-12-05), the
# vLLM group first (its four files together, ~120 s). xdist itself would sort files by their
# number of tests, which put the long files of one to three tests (the loops, the miniature, the
# two-process trainers) last: pytest_xdist_make_scheduler turns that off.
_LONG_FIRST = ("test_vllm.py", "test_engine_conformance.py", "test_sampler_vllm.py",
               "test_agent_vllm.py", "test_grader_server.py", "test_train_step.py",
               "test_miniature.py", "test_train.py",
               "test_loop.py", "test_context.py", "test_train_mesh.py", "test_aot.py",
               "test_grader_loop.py", "test_reliability.py", "test_advantage.py", "test_sim.py",
               "test_policy_loss.py", "test_gcs.py", "test_hf_mimo.py", "test_configs.py",
               "test_attention_splash.py", "test_colocated.py", "test_sampler.py",
               "test_experts.py", "test_model.py", "test_miniature_tabular.py",
               "test_published_versions.py", "test_ep_a2a.py", "test_weights_io.py",
               "test_repo_env.py", "test_sampler_handover.py", "test_sharding.py",
               "test_train_signals.py", "test_startup.py", "test_bench_vs_transformers.py",
               "test_layout.py", "test_experts_megablox.py", "test_logprobs.py",
               "test_profile_cpu_step.py", "test_attention.py", "test_bench_device.py",
               "test_loss.py", "test_paged_sampler.py", "test_checkpoint.py",
               "test_bucket_step.py", "test_feed_batcher.py", "test_agent_loop.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# The files that read the test run's vLLM engines (support/vllm_served.py, a session fixture: one
# engine per family) are one xdist work unit, so `--dist loadfile` runs them on one worker and
# starts the engines once; every other file stays a unit of its own. (A scheduler, not
# `--dist loadgroup`: xdist 3.8 marks groups by rewriting `item._nodeid`, which pytest 9 no
# longer reads, so loadgroup falls back to scheduling test by test.)
VLLM_FILES = ("test_vllm.py", "test_engine_conformance.py", "test_sampler_vllm.py",
              "test_agent_vllm.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    config.option.loadscopereorder = False     # keep _LONG_FIRST's order (see above)
    from xdist.scheduler import LoadFileScheduling

    class VLLMFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)           # the test's file
            return "vllm" if os.path.basename(scope) in VLLM_FILES else scope
    return VLLMFilesTogether(config, log)

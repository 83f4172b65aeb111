"""Small helpers the `scripts/bench_*.py` benchmarks share: timing, matmul peak, docs sections."""
from __future__ import annotations

import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np


def timed(fn) -> float:
    """Seconds for one call of `fn`, its result waited for."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def matmul_peak(n: int = 2048, reps: int = 3) -> float:
    """FLOP/s of a large float32 matmul on the default device (best of `reps`, after warm-up)."""
    a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    return 2 * n ** 3 / min(timed(lambda: f(a)) for _ in range(reps))


def write_docs_section(path: str, heading: str, section: str) -> None:
    """Replaces the `heading` section of a Markdown file (or appends it), leaving the rest."""
    text = open(path).read() if os.path.exists(path) else "# Performance\n"
    pattern = re.compile(re.escape(heading) + r".*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with open(path, "w") as fh:
        fh.write(text)

"""Small helpers the `scripts/bench_*.py` benchmarks share: timing, matmul peak, docs sections,
a synthetic feed batch, a wall/CPU clock. Imports only numpy at the top (the torch side of
`bench_vs_transformers.py` uses the clock without JAX in its process) and jax and gagar_jax.batch
where needed (`bench_device.py` runs where nothing else is installed)."""
from __future__ import annotations

import os
import re
import resource
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gagar_jax.batch import Batch


class Clock:
    """Wall (or, single-threaded, CPU) seconds of one call, with its CPU time and page faults."""

    def __init__(self, cpu: bool):
        self.cpu = cpu

    def __call__(self, fn) -> dict:
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.process_time() if self.cpu else time.perf_counter()
        out = fn()
        t = (time.process_time() if self.cpu else time.perf_counter()) - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        return {"s": t, "user": r1.ru_utime - r0.ru_utime, "sys": r1.ru_stime - r0.ru_stime,
                "faults": r1.ru_minflt - r0.ru_minflt, "out": out}


def timed(fn) -> float:
    """Seconds for one call of `fn`, its result waited for."""
    import jax
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def timed_call(fn) -> tuple:
    """(result, seconds) of one call of `fn`, its result waited for."""
    import jax
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t0


def best_of(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `fn` (seconds; results waited for)."""
    return min(timed(fn) for _ in range(repeats))


def mean_of(fn, repeats: int) -> float:
    """Mean seconds per call over `repeats` calls of `fn`, each waited for."""
    import jax
    t0 = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn())
    return (time.perf_counter() - t0) / repeats


def matmul_peak(n: int = 2048, reps: int = 3) -> float:
    """FLOP/s of a large float32 matmul on the default device (best of `reps`, after warm-up)."""
    import jax
    import jax.numpy as jnp
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


def synthetic_batch(B: int, S: int, vocab: int, group_size: int = 4, seed: int = 0) -> Batch:
    """Rows packed with trajectories of 3/4 row length or less (prompt 1/4), groups of 4, every
    group mixed with graded passes: the shape of a real feed batch, with random tokens."""
    import jax.numpy as jnp

    from gagar_jax.batch import Batch
    rng = np.random.default_rng(seed)
    per_row = 2
    T = B * per_row
    G = T // group_size
    span = S // per_row
    tokens = rng.integers(1, vocab, (B, S)).astype(np.int32)
    seg, pos, traj = (np.zeros((B, S), np.int32) for _ in range(3))
    mask = np.zeros((B, S), np.float32)
    for t in range(T):
        b, h = divmod(t, per_row)
        n = int(rng.integers(span * 3 // 4, span + 1))
        lo = h * span
        seg[b, lo:lo + n], pos[b, lo:lo + n], traj[b, lo:lo + n] = h + 1, np.arange(n), t
        mask[b, lo + span // 4:lo + n] = 1.0
    rewards = np.tile([1, 1, 0, 0], G).astype(np.float32)
    factors = rng.choice([1.0, 0.9, 0.85, 0.4, 0.2], T).astype(np.float32)
    return Batch(
        tokens_BxS=jnp.asarray(tokens), segment_ids_BxS=jnp.asarray(seg),
        positions_BxS=jnp.asarray(pos), traj_index_BxS=jnp.asarray(traj),
        loss_mask_BxS=jnp.asarray(mask),
        old_logprobs_BxS=jnp.asarray(-np.log(vocab) * mask, jnp.float32),
        group_ids_T=jnp.asarray(np.arange(T) // group_size, jnp.int32),
        rewards_T=jnp.asarray(rewards), valid_T=jnp.ones(T, bool), hacked_T=jnp.zeros(T, bool),
        factors_T=jnp.asarray(factors), adjustments_T=jnp.zeros(T, jnp.float32),
        grading_ok_G=jnp.ones(G, bool))


def time_train_step(step_cfg, mesh, B: int, S: int, steps: int) -> tuple:
    """Builds the train state and step on `mesh`, runs one step on a synthetic [B, S] batch
    (compile included), then `steps` timed steps.

    Returns:
      (compile_s, median step_s, the last step's metrics).
    """
    import jax

    from gagar_jax import sharding as shd
    from gagar_jax.run import step as TS

    state, graphdef, shardings = TS.init_train_state(step_cfg, mesh, jax.random.key(0))
    batch = synthetic_batch(B, S, step_cfg.model.vocab_size)
    bsh = shd.batch_shardings(batch, mesh)
    batch = jax.device_put(batch, bsh)
    step = TS.make_train_step(step_cfg, mesh, shardings, bsh, graphdef)
    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    return compile_s, float(np.median(times)), m

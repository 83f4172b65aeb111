"""Benchmark: jitted, segment-op Gagar advantages vs a per-group Python loop.

The loop is written the way reference GRPO code in PyTorch frameworks computes group advantages:
bucket trajectory indices by group id in a dict, then loop over groups with small array ops per
group (here NumPy, on CPU). Both compute the same thing (sum_preserving with the cap, hacks,
invalid members and the grading fallback); the script checks they agree before timing.

Run:  .venv/bin/python scripts/bench_advantage.py [--sizes 4096,65536,1048576] [--group-size 8]
"""
import argparse
import collections
import functools
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # libtpu is installed; this benchmark is CPU

import jax
import numpy as np
from benchutil import best_of

from gagar_jax.algo.advantage import gagar_advantages

LOOP_BUDGET_S = 60.0    # time the loop fully when the estimate is under this


def make_batch(num_traj: int, group_size: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    num_groups = num_traj // group_size
    levels = np.array([1.0, 0.9, 0.85, 0.7, 0.55, 0.4, 0.2, np.nan], np.float32)
    return dict(
        rewards=(rng.random(num_traj) < 0.5).astype(np.float32),
        group_ids=np.repeat(np.arange(num_groups, dtype=np.int32), group_size),
        factors=levels[rng.choice(len(levels), num_traj, p=[.2, .2, .2, .1, .1, .1, .09, .01])],
        valid=rng.random(num_traj) < 0.97,
        hacked=rng.random(num_traj) < 0.01,
        grading_ok=rng.random(num_groups) < 0.98,
    ), num_groups


def loop_advantages(rewards, group_ids, factors, valid, hacked, grading_ok, lam_cap=1.5):
    """Per-group Python loop, reference-GRPO style."""
    buckets = collections.defaultdict(list)
    for i, g in enumerate(group_ids.tolist()):
        if valid[i]:
            buckets[g].append(i)
    adv = np.zeros(len(rewards), np.float32)
    for g, members in buckets.items():
        idx = np.asarray(members)
        r = np.where(hacked[idx], 0.0, rewards[idx])
        n, k = len(idx), r.sum()
        if k == 0 or k == n:
            continue
        a = r - k / n
        passed = r > 0.5
        f = factors[idx][passed]
        if not grading_ok[g] or not np.all(np.isfinite(f) & (f > 0) & (f <= 1)):
            f = np.ones_like(f)
        lam = a[passed].sum() / (f * a[passed]).sum()
        capped = lam > lam_cap
        new = a.copy()
        new[passed] = min(lam, lam_cap) * f * a[passed]
        if capped:
            new -= new.mean()
        adv[idx] = new
    return adv


def bench(num_traj: int, group_size: int, loop_est_s: float | None):
    batch, num_groups = make_batch(num_traj, group_size)
    fn = jax.jit(functools.partial(gagar_advantages, num_groups=num_groups))
    dev = {k: jax.device_put(v) for k, v in batch.items()}
    run = lambda: jax.block_until_ready(fn(**dev).advantages)
    run()   # compile
    t_vec = best_of(run, repeats=20 if num_traj <= 65536 else 5)

    vec = np.asarray(run())
    if loop_est_s is None or loop_est_s <= LOOP_BUDGET_S:
        t0 = time.perf_counter()
        ref = loop_advantages(**batch)
        t_loop, note = time.perf_counter() - t0, "timed in full"
        np.testing.assert_allclose(vec, ref, atol=1e-5)
    else:
        sub = 65536
        part = {
            k: (v[: sub // group_size] if k == "grading_ok" else v[:sub]) for k, v in batch.items()
        }
        t0 = time.perf_counter()
        ref = loop_advantages(**part)
        t_loop = (time.perf_counter() - t0) * num_traj / sub
        note = f"EXTRAPOLATED linearly from the first {sub} trajectories"
        np.testing.assert_allclose(vec[:sub], ref, atol=1e-5)
    print(f"T={num_traj:>9,d} G={num_groups:>7,d}  jitted {t_vec * 1e3:9.3f} ms   "
          f"loop {t_loop * 1e3:11.1f} ms ({note})   speed-up {t_loop / t_vec:9.1f}x", flush=True)
    return t_loop


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,65536,1048576")
    parser.add_argument("--group-size", type=int, default=8)
    a = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPU cores; "
          f"groups of {a.group_size}; best of several runs for the jitted path; "
          "outputs of both paths checked equal", flush=True)
    prev = None
    for n in (int(s) for s in a.sizes.split(",")):
        est = None if prev is None else prev[1] * n / prev[0]
        prev = (n, bench(n, a.group_size, est))


if __name__ == "__main__":
    main()

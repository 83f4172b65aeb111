"""Attention fwd+bwd time and compiled temporary memory, two comparisons.

  plain       blockwise (flash-style) vs plain attention (default).
  sliding     a sliding-window layer (MiMo: W = 129) vs a full causal layer, both blockwise:
              the sliding layer's time grows linearly with S (blocks outside the window are
              skipped), the full layer's quadratically.

Run:  JAX_PLATFORMS=cpu python scripts/bench_attention.py [--seqs 1024,2048,4096]
      JAX_PLATFORMS=cpu python scripts/bench_attention.py --mode sliding --seqs 4096,8192,16384
Prints one row per sequence length; ratios are measured in the same run.
"""
import argparse
import time

import jax
import jax.numpy as jnp

from gagar_jax.attention import blockwise_attention, plain_attention


def _grad_fn(fn):
    return jax.jit(jax.grad(lambda q, k, v, s: jnp.sum(fn(q, k, v, s) ** 2), (0, 1, 2)))


def measure(fn, s, heads, kv_heads, head_dim, repeats):
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (1, s, heads, head_dim))
    k = jax.random.normal(ks[1], (1, s, kv_heads, head_dim))
    v = jax.random.normal(ks[2], (1, s, kv_heads, head_dim))
    seg = jnp.ones((1, s), jnp.int32)
    g = _grad_fn(fn)
    temp = g.lower(q, k, v, seg).compile().memory_analysis().temp_size_in_bytes
    jax.block_until_ready(g(q, k, v, seg))
    t0 = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(g(q, k, v, seg))
    return (time.perf_counter() - t0) / repeats, temp


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", default="1024,2048,4096")
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--mode", choices=("plain", "sliding"), default="plain")
    p.add_argument("--window", type=int, default=129)
    p.add_argument("--heads", default="8,2,64", help="H,Kv,Dh")
    a = p.parse_args()
    H, Kv, Dh = map(int, a.heads.split(","))
    blk = lambda q, k, v, s: blockwise_attention(q, k, v, s, block=a.block)  # noqa: E731
    if a.mode == "sliding":
        win = lambda q, k, v, s: blockwise_attention(q, k, v, s, block=a.block,  # noqa: E731
                                                     window=a.window)
        print(f"S      full ms  sliding(W={a.window}) ms  full / sliding  sliding ms per 1k tokens")
        for s in map(int, a.seqs.split(",")):
            tf, _ = measure(blk, s, H, Kv, Dh, a.repeats)
            tw, _ = measure(win, s, H, Kv, Dh, a.repeats)
            print(f"{s:<6} {tf * 1e3:8.1f} {tw * 1e3:20.1f} {tf / tw:15.2f} {tw * 1e3 / (s / 1024):25.2f}")
        return
    print("S      plain ms  blockwise ms  time ratio  plain temp MiB  blockwise temp MiB")
    for s in map(int, a.seqs.split(",")):
        tp, mp = measure(plain_attention, s, H, Kv, Dh, a.repeats)
        tb, mb = measure(blk, s, H, Kv, Dh, a.repeats)
        print(f"{s:<6} {tp * 1e3:9.1f} {tb * 1e3:13.1f} {tb / tp:11.2f} {mp / 2**20:15.1f} "
              f"{mb / 2**20:19.1f}")


if __name__ == "__main__":
    main()

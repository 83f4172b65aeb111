"""Blockwise (flash-style) vs plain attention: fwd+bwd time and compiled temporary memory.

Run:  JAX_PLATFORMS=cpu python scripts/bench_attention.py [--seqs 1024,2048,4096]
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
    a = p.parse_args()
    blk = lambda q, k, v, s: blockwise_attention(q, k, v, s, block=a.block)  # noqa: E731
    print("S      plain ms  blockwise ms  time ratio  plain temp MiB  blockwise temp MiB")
    for s in map(int, a.seqs.split(",")):
        tp, mp = measure(plain_attention, s, 8, 2, 64, a.repeats)
        tb, mb = measure(blk, s, 8, 2, 64, a.repeats)
        print(f"{s:<6} {tp * 1e3:9.1f} {tb * 1e3:13.1f} {tb / tp:11.2f} {mp / 2**20:15.1f} "
              f"{mb / 2**20:19.1f}")


if __name__ == "__main__":
    main()

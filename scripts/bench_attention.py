"""Attention fwd+bwd time and compiled temporary memory, two comparisons.

  plain       blockwise (flash-style) vs plain attention (default).
  sliding     a sliding-window layer (MiMo: W = 129) vs a full causal layer, both blockwise:
              the sliding layer's time grows linearly with S (blocks outside the window are
              skipped), the full layer's quadratically.

  context_aot one full and one sliding layer (sinks) of rows split along S over a context axis,
              fwd+bwd, compiled ahead of time for a TPU topology on this host with each
              per-shard kernel (blockwise, splash): per-chip memory and Mosaic kernel count.
              --heads are one chip's (query heads, full-layer KV heads, Dh, Dv, sliding KV).

Run:  JAX_PLATFORMS=cpu python scripts/bench_attention.py [--seqs 1024,2048,4096]
      JAX_PLATFORMS=cpu python scripts/bench_attention.py --mode sliding --seqs 4096,8192,16384
      JAX_PLATFORMS=cpu python scripts/bench_attention.py --mode context_aot --seqs 262144 \
          --topology v5p:2x2x2 --heads 16,1,192,128,2
Prints one row per sequence length (per kernel for context_aot); ratios are measured in the
same run.
"""
import argparse
import time
import types

import jax
import jax.numpy as jnp
from benchutil import mean_of

from gagar_jax.kernels.attention.blockwise import blockwise_attention, plain_attention


def context_aot(seqs, topology, heads, block, window):
    """Per-chip compiled memory of attention under context = all chips of `topology`."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from gagar_jax import sharding
    from gagar_jax.aot import compile as aot
    from gagar_jax.kernels.attention import context as attention_context

    H, Kv, Dh, Dv, Kv_slide = heads
    devices = aot.topology_devices(topology)
    mesh = sharding.make_mesh(types.SimpleNamespace(data=1, fsdp=1, expert=1, context=-1,
                                                    tensor=1), devices)
    rows = NamedSharding(mesh, P(None, "context"))
    print(f"context {len(devices)} on {topology}; per chip: {H} query heads, KV {Kv} (full) / "
          f"{Kv_slide} (sliding, W={window}), Dh {Dh}, Dv {Dv}, bf16, block {block}")
    print("S        kernel     temporaries MiB  arguments MiB  Mosaic kernels  compile s")
    for s in seqs:
        sds = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=rows)
        args = (sds(1, s, H, Dh), sds(1, s, Kv, Dh), sds(1, s, Kv, Dv), sds(1, s, Kv_slide, Dh),
                sds(1, s, Kv_slide, Dv), sds(1, s, dt=jnp.int32),
                jax.ShapeDtypeStruct((H,), jnp.float32, sharding=NamedSharding(mesh, P())))
        for impl in ("blockwise", "splash"):
            def loss(q, k, v, k2, v2, seg, sinks, impl=impl):  # lowered in this iteration
                att = lambda k, v, **kw: attention_context.attention(
                    q, k, v, seg, impl=impl, block=block, **kw)
                o = att(k, v) + att(k2, v2, window=window, sinks_H=sinks)
                return jnp.sum(o.astype(jnp.float32))
            t0 = time.perf_counter()
            with jax.set_mesh(mesh):
                lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 6))).lower(*args)
            kernels = lowered.as_text().count("tpu_custom_call")
            r = aot.compile_lowered(lowered)
            if r.error:
                print(f"{s:<8} {impl:<10} {r.error[:200]}")
                continue
            m = r.memory
            print(f"{s:<8} {impl:<10} {m.temporaries / 2**20:15.1f} {m.arguments / 2**20:14.1f} "
                  f"{kernels:15d} {time.perf_counter() - t0:10.1f}")


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
    return mean_of(lambda: g(q, k, v, seg), repeats), temp


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", default="1024,2048,4096")
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--mode", choices=("plain", "sliding", "context_aot"), default="plain")
    p.add_argument("--window", type=int, default=129)
    p.add_argument("--heads", default="8,2,64", help="H,Kv,Dh (context_aot: H,Kv,Dh,Dv,Kv_slide)")
    p.add_argument("--topology", default="v5p:2x2x2", help="context_aot: the TPU topology")
    a = p.parse_args()
    if a.mode == "context_aot":
        context_aot(list(map(int, a.seqs.split(","))), a.topology,
                    tuple(map(int, a.heads.split(","))), a.block, a.window)
        return
    H, Kv, Dh = map(int, a.heads.split(","))
    blk = lambda q, k, v, s: blockwise_attention(q, k, v, s, block=a.block)
    if a.mode == "sliding":
        win = lambda q, k, v, s: blockwise_attention(q, k, v, s, block=a.block,
                                                     window=a.window)
        print(f"S      full ms  sliding(W={a.window}) ms  full / sliding  sliding ms per 1k tokens")
        for s in map(int, a.seqs.split(",")):
            tf, _ = measure(blk, s, H, Kv, Dh, a.repeats)
            tw, _ = measure(win, s, H, Kv, Dh, a.repeats)
            print(
                f"{s:<6} {tf * 1e3:8.1f} {tw * 1e3:20.1f} "
                f"{tf / tw:15.2f} {tw * 1e3 / (s / 1024):25.2f}"
            )
        return
    print("S      plain ms  blockwise ms  time ratio  plain temp MiB  blockwise temp MiB")
    for s in map(int, a.seqs.split(",")):
        tp, mp = measure(plain_attention, s, H, Kv, Dh, a.repeats)
        tb, mb = measure(blk, s, H, Kv, Dh, a.repeats)
        print(f"{s:<6} {tp * 1e3:9.1f} {tb * 1e3:13.1f} {tb / tp:11.2f} {mp / 2**20:15.1f} "
              f"{mb / 2**20:19.1f}")


if __name__ == "__main__":
    main()

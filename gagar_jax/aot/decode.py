"""Ahead-of-time compile of the JAX sampler's decode step for a TPU slice, on a CPU host.

    report = decode_report(cfg, "v5p:4x4x4", mesh={"expert": 16, "tensor": 4}, slots=32,
                           context=200_000)

The same jitted `sample.programs.decode` the sampler runs (one decode step of every slot,
sampling included), lowered with the serving weights (the config's model in bfloat16, the
learner's logical-axis rules on the sampler's mesh), a paged KV cache sized for `slots`
sequences of `context` tokens (`cache.CacheSpec`: pages of `page` positions; window rings for
the sliding layers) and the slots' inputs as `jax.ShapeDtypeStruct`s carrying their shardings:
nothing is allocated. The compiler's memory analysis gives the bytes per chip; a layout out of
HBM is reported `fits: false` with the compiler's figure (`compile.parse_hbm_oom`).
`scripts/aot_compile.py --what=decode` writes the report (docs/aot/, docs/scaling.md).
"""
from __future__ import annotations

import dataclasses
import math
import time
from types import SimpleNamespace
from typing import Any

import ml_collections

from gagar_jax.aot import compile as aot

MESH_DEFAULT = {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}


def decode_inputs(cfg: ml_collections.ConfigDict, devices: list, mesh_sizes: dict, *,
                  slots: int, context: int, page: int, dtype: str = "bfloat16") -> dict:
    """The decode step's abstract inputs on `devices`: {"graphdef", "state", "cache",
    "slots", "kernels", "cache_sharding", "mesh", "model_config", "spec"}."""
    import jax
    from flax import nnx

    from gagar_jax import sharding as shd
    from gagar_jax.kernels.attention import registry as attention_registry
    from gagar_jax.model.transformer import ModelConfig, Transformer, resolve_kernels
    from gagar_jax.sample import cache as cache_lib
    from gagar_jax.sample import programs
    from gagar_jax.sample.forward import Kernels

    mesh = shd.make_mesh(SimpleNamespace(**{**MESH_DEFAULT, **mesh_sizes}), devices)
    mc = ModelConfig.from_config(cfg.model)
    mc = resolve_kernels(dataclasses.replace(mc, param_dtype=dtype, compute_dtype=dtype), mesh)
    with jax.set_mesh(mesh):
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(0))))
    sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    state = jax.tree.map(sds, abstract, shd.state_shardings(abstract, mesh))
    M = -(-context // page)
    rp = cache_lib.ring_pages(mc, page)
    full = not mc.layer_types or "full" in mc.layer_types
    spec = cache_lib.CacheSpec(page=page, max_len=context, num_pages=slots * M if full else 0,
                               num_ring_pages=slots * rp, ring_pages=rp, dtype=dtype)
    cache_sh = cache_lib.cache_shardings(mc, spec, mesh)
    shapes = cache_lib.pool_shapes(mc, spec)
    tree = {name: [(k, v) for k, v, _ in pos] for name, pos in shapes.items()}
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x)
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_shape)
    cache = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, spec.dtype, sharding=sh)
                                         for s, sh in zip(leaves, cache_sh, strict=True)])

    def row(*tail: int, dt: Any = "int32") -> jax.ShapeDtypeStruct:
        shape = (slots, *tail)
        axes = ("batch",) + (None,) * len(tail)
        return jax.ShapeDtypeStruct(shape, dt, sharding=shd.named_sharding(mesh, axes, shape))
    slot_in = programs.Slots(
        token_S=row(), pos_S=row(), active_S=row(dt="bool"), budget_S=row(),
        pages_SxM=row(M), ring_SxR=row(max(rp, 1)), temperature_S=row(dt="float32"),
        top_k_S=row(), top_p_S=row(dt="float32"), seed_S=row(dt="uint32"), count_S=row(),
        stops_SxX=row(4))
    same = mc.head_dim == mc.value_head_dim
    pick = lambda window, sinks: attention_registry.resolve_paged(
        "auto", mesh, decode=True, window=window, sinks=sinks, same_dims=same,
        head_dim=mc.head_dim)
    kernels = Kernels(pick(0, False), pick(mc.sliding_window if mc.has_sliding else 0,
                                           mc.attention_sinks))
    return {"graphdef": graphdef, "state": state, "cache": cache, "slots": slot_in,
            "kernels": kernels, "cache_sharding": cache_sh, "mesh": mesh, "model_config": mc,
            "spec": spec}


def decode_report(cfg: ml_collections.ConfigDict, topology: str, *, mesh: dict, slots: int,
                  context: int, page: int = 256, steps: int = 1, name: str = "",
                  dump_dir: str = "") -> dict:
    """Lowers and compiles the decode step for `topology`; never raises on HBM OOM.

    Args:
      cfg: the full config (its model section is served, in bfloat16).
      topology: `"v5p:AxBxC"`.
      mesh: the sampler's mesh sizes ({"expert": 16, "tensor": 4}; others 1).
      slots: concurrent sequences. context: tokens each may hold (prompt and every turn).
      page: positions per KV page. steps: decode steps per call (1: one token each).
    Returns:
      The report (a dict): per-chip bytes by kind, the cache's and the weights' own bytes per
      chip worked out on paper, fits, compile seconds.
    """
    import jax

    from gagar_jax.aot import flops
    from gagar_jax.sample import cache as cache_lib
    from gagar_jax.sample import programs

    generation, _ = aot.parse_topology(topology)
    devices = aot.topology_devices(topology)
    inp = decode_inputs(cfg, devices, mesh, slots=slots, context=context, page=page)
    t0 = time.perf_counter()
    with jax.set_mesh(inp["mesh"]):
        lowered = programs.decode.lower(inp["graphdef"], inp["state"], inp["cache"], inp["slots"],
                                        kernels=inp["kernels"], steps=steps,
                                        cache_sharding=inp["cache_sharding"])
    r = aot.compile_lowered(lowered, dump_dir)
    hbm = aot.HBM_BYTES.get(generation, aot.HBM_BYTES["v5p"])
    mc, spec = inp["model_config"], inp["spec"]

    def per_chip(tree: Any) -> int:
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                   for x in jax.tree.leaves(tree))
    counts = flops.param_counts(mc)
    return {
        "what": "decode", "config": name, "topology": topology, "num_devices": len(devices),
        "mesh": {k: int(v) for k, v in inp["mesh"].shape.items()},
        "slots": slots, "context": context, "page": page, "steps": steps,
        "kernels": inp["kernels"]._asdict(), "expert_backend": mc.expert_backend,
        "dtype": spec.dtype, "ring_pages": spec.ring_pages,
        "cache_bytes_total": cache_lib.cache_bytes(mc, spec),
        "cache_bytes_per_chip": per_chip(inp["cache"]),
        "params_bytes_per_chip": per_chip(inp["state"]),
        "params_total": counts.total, "params_active": counts.active,
        "per_device_bytes": r.per_device_bytes, "hbm_bytes": hbm,
        "fits": bool(not r.error and r.per_device_bytes is not None
                     and r.per_device_bytes <= hbm),
        "memory": None if r.memory is None else dataclasses.asdict(r.memory),
        "collectives": r.collectives, "collective_bytes": r.collective_bytes,
        "compile_seconds": r.seconds, "lower_seconds": time.perf_counter() - t0 - r.seconds,
        "peak_buffers": r.peak_buffers.get("buffers", [])[:12] if r.peak_buffers else [],
        "error": r.error,
    }

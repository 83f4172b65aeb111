"""Weights I/O of a pod config on paper, and the publish reshard compiled for its TPU topology.

For each parameter leaf of the config's train state (shardings of `step.state_shardings`
over the topology's compile-only devices):
- load: which index boxes each host's chips hold (`devices_indices_map`), hence the elements each
  host reads (`hf_load` reads exactly those) and the largest per-leaf host buffer;
- publish: the `hf_save` plan (tensor -> writing host) gives the bytes each host holds and writes;
  the on-device reshard (`units.resharder`) of every leaf is lowered and compiled for the
  topology, so the compiler states the extra HBM per chip it needs beside the resident state.

`scripts/aot_compile.py --what=weights_io` runs it; docs/scaling.md has the figures.
"""
from __future__ import annotations

import collections
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from gagar_jax import sharding
from gagar_jax.aot import compile as aot
from gagar_jax.hf import save as hf_save
from gagar_jax.hf import units as param_units
from gagar_jax.run import step as ts

PyTree = Any


def _local_elements(shape: tuple, where: jax.sharding.Sharding) -> dict:
    """process index -> elements of the distinct boxes its devices hold."""
    boxes = collections.defaultdict(set)
    for dev, index in where.devices_indices_map(tuple(shape)).items():
        boxes[dev.process_index].add(
            tuple(sl.indices(n)[:2] for sl, n in zip(index, shape, strict=False))
        )
    return {p: sum(int(np.prod([b - a for a, b in box])) for box in bs) for p, bs in boxes.items()}


def _per_device_bytes(abstract: PyTree, shardings: PyTree) -> int:
    total = 0
    for x, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings), strict=False):
        shard = s.shard_shape(tuple(x.shape))
        total += int(np.prod(shard)) * np.dtype(x.dtype).itemsize
    return total


def weights_io_report(cfg: ml_collections.ConfigDict, topology: str, *,
                      publish_dtype: str = "bfloat16", compile_reshard: bool = True) -> dict:
    """Per-host load / publish figures and the compiled publish reshard for `topology`."""
    devices = aot.topology_devices(topology)
    generation, _ = aot.parse_topology(topology)
    step_cfg = ts.StepConfig.from_config(cfg)
    mesh = sharding.make_mesh(cfg.mesh, devices=devices)
    abstract, _ = ts.abstract_train_state(step_cfg, mesh)
    shs = ts.state_shardings(abstract, mesh, step_cfg)
    leaves, where_of = {}, {}
    for tree, where in ((abstract.params, shs.params), (abstract.router_bias, shs.router_bias)):
        for (kp, x), w in zip(
            jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(where), strict=False
        ):
            leaves[sharding.leaf_path(kp)], where_of[sharding.leaf_path(kp)] = x, w
    procs = len({d.process_index for d in devices})
    read = collections.Counter()
    largest_leaf_local = 0
    for name, x in leaves.items():
        for p, n in _local_elements(x.shape, where_of[name]).items():
            read[p] += n
            largest_leaf_local = max(largest_leaf_local, n)
    plan = hf_save.plan_save(leaves, step_cfg.model, procs, publish_dtype)
    written = [plan.bytes_of(p) for p in range(procs)]
    total_params = sum(int(np.prod(x.shape)) for x in leaves.values())
    resident = _per_device_bytes(abstract, shs)
    out = {
        "topology": topology, "chips": len(devices), "hosts": procs,
        "params": total_params,
        "load": {"elements_read_per_host_max": max(read.values()),
                 "elements_read_per_host_min": min(read.values()),
                 "bf16_bytes_read_per_host_max": 2 * max(read.values()),
                 "fp8_bytes_read_per_host_max": max(read.values()),
                 "largest_leaf_local_elements": largest_leaf_local,
                 "host_buffer_bytes_bound": 2 * 4 * largest_leaf_local},
        "publish": {"dtype": publish_dtype, "bytes_total": sum(written),
                    "bytes_per_host_max": max(written), "bytes_per_host_min": min(written),
                    "host_ram_bytes_max": max(written), "files": len(plan.files)},
        "hbm": {"resident_state_bytes_per_chip": resident, "hbm_bytes": aot.HBM_BYTES[generation]},
    }
    if compile_reshard:
        pmesh = param_units.process_mesh(devices)
        worst, seconds = None, 0.0
        for name, lu in plan.units.items():
            x = jax.ShapeDtypeStruct(
                leaves[name].shape, leaves[name].dtype, sharding=where_of[name]
            )
            t0 = time.perf_counter()
            res = aot.compile_lowered(param_units.resharder(lu, pmesh).lower(x))
            seconds += time.perf_counter() - t0
            extra = res.per_device_bytes - (res.memory.arguments if res.memory else 0)
            if worst is None or extra > worst[1]:
                worst = (name, extra, res.collectives)
        out["hbm"].update({
            "reshard_worst_leaf": worst[0], "reshard_extra_bytes_per_chip": worst[1],
            "reshard_collectives": {k: v for k, v in worst[2].items() if v},
            "peak_bytes_per_chip": resident + worst[1],
            "fits": resident + worst[1] <= aot.HBM_BYTES[generation],
            "compile_seconds": round(seconds, 1)})
    return out

"""Ahead-of-time compile of the real train step for a TPU topology, on a CPU host.

With `libtpu` installed, `jax.experimental.topologies.get_topology_desc` describes a TPU slice
(e.g. `v5p:8x8x8`, 512 chips) as compile-only devices. We build the config's mesh over them,
describe the train state and the batch as `jax.ShapeDtypeStruct`s carrying their shardings (no
array is ever allocated), and lower + compile the same jitted `train_step` the trainer runs,
micro-batching included. The compiled executable reports per-device memory
(`memory_analysis`) and FLOPs (`cost_analysis`); its HLO text shows the collectives.

A layout that does not fit makes the TPU compiler raise `CompileTimeHbmOom` instead of returning
figures; `compile_report` turns that into `fits=False` with the bytes from the message.

Run with `JAX_PLATFORMS=cpu` (libtpu must not try to claim a real TPU); `configure_libtpu_env`
sets the variables that keep libtpu from probing cloud metadata on a CPU machine.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from typing import TYPE_CHECKING, Any, Optional

import ml_collections
import numpy as np

from gagar_jax import mesh_layout, sharding
from gagar_jax.aot import bucket_cost, buffers, flops, links, roofline, schedule
from gagar_jax.aot.hlo_stats import (
    COLLECTIVES,
    collective_bytes_per_step,
    collective_traffic,
    count_collectives,
)
from gagar_jax.aot.report import AotReport, MemoryFigures, write_report  # noqa: F401

if TYPE_CHECKING:
    import jax

    from gagar_jax.model.config import ModelConfig

# HBM per chip as the TPU compiler counts it (the CompileTimeHbmOom message says 95.73G on v5p).
HBM_BYTES = {"v5p": int(95.74 * 2**30), "v5e": 16 * 2**30, "v4": 32 * 2**30, "v6e": 32 * 2**30}
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def configure_libtpu_env() -> None:
    """Environment that lets libtpu build compile-only topologies on a host without TPUs."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")        # no GCE metadata server here
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")  # silences the "could not determine"
                                                            # probe
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_WORKER_ID", "0")
    # Compile-only use needs no exclusive TPU: let several processes (tests, scripts) load libtpu.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def parse_topology(topology: str) -> tuple[str, tuple[int, ...]]:
    """`"v5p:8x8x8"` -> (`"v5p"`, (8, 8, 8)); a clear error on anything else."""
    m = re.fullmatch(r"(v\d+[a-z]*):(\d+(?:x\d+)*)", topology)
    if not m:
        raise ValueError(f"topology must look like 'v5p:2x2x1', got {topology!r}")
    return m.group(1), tuple(int(d) for d in m.group(2).split("x"))


def topology_devices(topology: str, num_slices: int = 1) -> list:
    """Compile-only devices of a TPU topology (`v5p:AxBxC`), of `num_slices` such slices
    joined over DCN (each device then has a `slice_index`)."""
    parse_topology(topology)
    configure_libtpu_env()
    from jax.experimental import topologies
    extra = {"num_slices": num_slices} if num_slices > 1 else {}
    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                             **extra).devices)


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit.upper()[:1] if unit else ""])


_SIZE = r"(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?"


def parse_hbm_oom(message: str) -> Optional[dict]:
    """Bytes required / available from a TPU `CompileTimeHbmOom` message; None if not one.

    Known forms: "... required for HLO temporaries (128.00G) exceeds available HBM (95.73G)" and
    "Used 120.5G of 95.74G hbm. Exceeded hbm capacity by 24.8G."
    """
    if "CompileTimeHbmOom" not in message and "Ran out of memory" not in message \
            and "hbm capacity" not in message.lower():
        return None
    m = re.search(rf"required[^(]*\({_SIZE}\)\s*exceeds available HBM\s*\({_SIZE}\)", message)
    if m:
        return {"required_bytes": _bytes(m.group(1), m.group(2)),
                "available_bytes": _bytes(m.group(3), m.group(4))}
    m = re.search(rf"Used\s+{_SIZE}\s+of\s+{_SIZE}\s+hbm", message, re.IGNORECASE)
    if m:
        return {"required_bytes": _bytes(m.group(1), m.group(2)),
                "available_bytes": _bytes(m.group(3), m.group(4))}
    sizes = [_bytes(a, b) for a, b in re.findall(rf"\b{_SIZE}", message) if b]
    return {"required_bytes": max(sizes) if sizes else None, "available_bytes": None}


def _paper_estimate(model_cfg: ModelConfig, mesh: dict, rows_per_shard: int, seq_len: int) -> dict:
    """State and remat activation bytes per device, worked out on paper (see docs/scaling.md)."""
    width = mesh["fsdp"] * mesh.get("context", 1)  # experts' model width D is stored over both
    expert_shards = mesh["expert"] * width * mesh["tensor"]
    # Dense weights' width is stored over expert too (sharding.LOGICAL_RULES["embed"]).
    state = flops.state_bytes_per_device(model_cfg, expert_shards, expert_shards)
    # A row is split along S over context: a chip holds seq_len / context of each of its rows,
    # and the saved residual stream's width is split over tensor ("resid").
    act = flops.remat_activation_bytes_per_device(
        model_cfg, rows_per_shard * seq_len // mesh.get("context", 1)) / mesh["tensor"]
    return {"params_bytes": state.params, "grads_bytes": state.grads,
            "optimizer_bytes": state.optimizer, "state_bytes": state.state,
            "activation_bytes": act}


def lower_train_step(cfg: ml_collections.ConfigDict,
                     devices: list) -> tuple[jax.stages.Lowered, dict]:
    """Lowers the trainer's jitted `train_step` over `devices` with abstract state and batch.

    Same code path as training: `StepConfig.from_config`, the state and batch shardings of
    `run/step.py`, and `make_train_step`'s jit (donation, micro-batch scan). Every input is a
    `ShapeDtypeStruct` carrying its `NamedSharding`; nothing is allocated.

    Returns:
      (lowered, meta) with meta the model config, mesh sizes and batch geometry.
    """
    import jax

    from gagar_jax import batch as batch_lib
    from gagar_jax import sharding
    from gagar_jax.feed.config import FeedConfig
    from gagar_jax.kernels.attention import registry as attention_registry
    from gagar_jax.run import step as ts

    step_cfg = ts.StepConfig.from_config(cfg)
    mesh = sharding.make_mesh(cfg.mesh, devices=devices)
    f = FeedConfig.from_config(cfg.feed)     # rows_per_batch resolved from tokens_per_batch
    abstract_state, graphdef = ts.abstract_train_state(step_cfg, mesh)
    mc = step_cfg.model
    routing = dict(num_moe_layers=mc.num_moe_layers if f.routing_replay else 0,
                   top_k=mc.top_k if f.routing_replay else 0)
    if f.buckets:   # length buckets: the trainer's `BucketedBatch`, every bucket's static rows
        abstract_batch = jax.eval_shape(lambda: batch_lib.dummy_bucketed_batch(
            f.bucket_shapes, f.max_trajectories, f.groups_per_batch, **routing))
    else:
        abstract_batch = jax.eval_shape(lambda: batch_lib.dummy_batch(
            f.rows_per_batch, f.seq_len, f.max_trajectories, f.groups_per_batch, **routing))
    state_sh = ts.state_shardings(abstract_state, mesh, step_cfg)
    batch_sh = sharding.batch_shardings(abstract_batch, mesh)
    with_sharding = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    state_in = jax.tree.map(with_sharding, abstract_state, state_sh)
    batch_in = jax.tree.map(with_sharding, abstract_batch, batch_sh)
    step_fn = ts.make_train_step(step_cfg, mesh, state_sh, batch_sh, graphdef)
    with jax.set_mesh(mesh):
        lowered = step_fn.jitted.lower(state_in, batch_in)
    sizes = dict(mesh.shape)
    batch_shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    # With buckets a micro-batch is `feed.bucket_rows` rows of one bucket's length, and a step
    # trains at most the token budget of them (the static rows hold every bucket's maximum).
    micro_rows = (f.bucket_rows if f.buckets else
                  f.rows_per_batch // (step_cfg.mini_batches * step_cfg.micro_batches))
    meta = {
        "model_config": mc,
        "grid": mesh.devices,
        "occupancy": bucket_cost.bucket_occupancy(f),
        "mesh": {k: int(v) for k, v in sizes.items()},
        "batch": {
            "rows": f.rows_per_batch,
            "seq_len": f.seq_len,
            # the step's token slots: rows x seq_len, or with buckets the token budget
            "tokens": f.batch_tokens,
            "buckets": [list(shape) for shape in f.bucket_shapes] if f.buckets else [],
            "mini_batches": step_cfg.mini_batches,
            "micro_batches": (sum(f.bucket_micro_batches) if f.buckets
                              else step_cfg.micro_batches),
            "rows_per_shard": max(1, micro_rows // batch_shards),
            "expert_backend": mc.expert_backend,
            "ep_local_ffn": mc.ep_local_ffn if mc.expert_backend == "ep_a2a" else "",
            "remat": mc.remat,
            # as compiled: "auto" resolved for the mesh's devices
            "attention": f"{attention_registry.resolve(mc.attention, mesh)}/{mc.attn_block}",
        },
    }
    return lowered, meta


@dataclasses.dataclass(frozen=True)
class CompileResult:
    """Figures of one compile; `error` (the compiler's message) is set when HBM ran out."""

    per_device_bytes: Optional[int]
    memory: Optional[MemoryFigures]
    flops_per_device: Optional[float]
    collectives: dict
    seconds: float
    error: str = ""
    collective_bytes: dict = dataclasses.field(default_factory=dict)
    traffic: dict = dataclasses.field(default_factory=dict)
    peak_buffers: dict = dataclasses.field(default_factory=dict)
    dump: dict = dataclasses.field(default_factory=dict)     # `dump_figures`


def dump_figures(dump: str) -> dict:
    """What the compiler's dump says of one compiled program (no compile needed: a kept dump can
    be read again with newer code): collectives by op, ring traffic (issue 29's measure), every
    collective with its groups and overlap (`schedule.collective_records`), the transfers between
    slices of a multi-slice program (`schedule.dcn_records`), the megablox calls,
    the peak live set and the table of every HBM byte."""
    import glob
    texts = [open(t).read() for t in
             sorted(glob.glob(os.path.join(dump, "*.after_optimizations.txt")))]
    per_step = [collective_bytes_per_step(t) for t in texts]
    moved = {k: sum(b[k] for b in per_step) for k in per_step[0]} if per_step else {}
    traffic = {}
    for t in texts:
        for op, rec in collective_traffic(t).items():
            acc = traffic.setdefault(op, {"bytes": 0, "ring_bytes": 0.0, "by_group": {}})
            acc["bytes"] += rec["bytes"]
            acc["ring_bytes"] += rec["ring_bytes"]
            for n, b in rec["by_group"].items():
                acc["by_group"][n] = acc["by_group"].get(n, 0) + b
    return {"collectives": count_collectives("".join(texts)), "collective_bytes": moved,
            "traffic": traffic,
            "records": [r for t in texts for r in schedule.collective_records(t)],
            "dcn_records": [r for t in texts for r in schedule.dcn_records(t)],
            "bucket_loops": [loop for t in texts for loop in schedule.bucket_loops(t)],
            "num_partitions": max((schedule.num_partitions(t) for t in texts), default=0),
            "kernels": [k for t in texts for k in schedule.grouped_matmuls(t)],
            "peak": buffers.peak_buffers(dump, top=40, min_bytes=2**27),
            "buffer_table": buffers.buffer_table(dump)}


def compile_lowered(lowered: jax.stages.Lowered, dump_dir: str = "") -> CompileResult:
    """Compiles a `jax.stages.Lowered`; an HBM OOM becomes a result with `error` set.

    Args:
      lowered: `jax.jit(f).lower(*abstract_args)` for TPU devices.
      dump_dir: keep the compiler's HLO dump (and memory-usage report) here ("" = discard).
    Returns:
      `CompileResult`; on `CompileTimeHbmOom`, `per_device_bytes` is the compiler's figure.
    """
    import tempfile

    import jax

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gagar_aot_") as tmp:
        dump = dump_dir or tmp
        # `compiled.as_text()` cannot re-read some TPU async ops; the compiler's own dump can.
        try:
            compiled = lowered.compile({"xla_dump_to": dump, "xla_dump_hlo_as_text": True})
        except jax.errors.JaxRuntimeError as e:
            oom = parse_hbm_oom(str(e))
            if oom is None:
                raise
            return CompileResult(per_device_bytes=oom["required_bytes"], memory=None,
                                 flops_per_device=None, collectives={op: 0 for op in COLLECTIVES},
                                 seconds=time.perf_counter() - t0, error=str(e))
        seconds = time.perf_counter() - t0
        d = dump_figures(dump)
    memory = MemoryFigures.from_compiled(compiled.memory_analysis())
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return CompileResult(per_device_bytes=memory.total, memory=memory,
                         flops_per_device=float(cost.get("flops", 0.0)),
                         collectives=d["collectives"], seconds=seconds,
                         collective_bytes=d["collective_bytes"], traffic=d["traffic"],
                         peak_buffers=d["peak"], dump=d)


def step_figures(meta: dict, d: dict, grid: Any, chip: roofline.Chip, devices: list) -> dict:
    """FLOPs, traffic, the torus roofline and the layout's hops of one compiled step.

    Args:
      meta: `lower_train_step`'s (model config, mesh sizes, batch geometry).
      d: `dump_figures` of its compile ({} when the compile ran out of HBM).
      grid: the mesh's device grid (`mesh.devices`).
      chip: the hardware figures.
      devices: the devices in the order `make_mesh` got them (the former layout reshaped them).
    Returns:
      The `AotReport` fields they fill.
    """
    model_cfg, b = meta["model_config"], meta["batch"]
    # Per-token FLOPs at seq_len: with buckets the largest bucket's length, an upper bound (a
    # step's budget of live tokens all in its longest rows).
    tokens = b.get("tokens", b["rows"] * b["seq_len"])
    model_flops = flops.train_flops_per_token(model_cfg, b["seq_len"]) * tokens
    ep = model_cfg.expert_backend == "ep_a2a"
    chunks = (model_cfg.ep_chunks or meta["mesh"].get("expert", 1)) if ep else 1
    hw = roofline.hardware_flops_per_token(model_cfg, b["seq_len"], expert_chunks=chunks)
    out = {"model_flops_per_step": model_flops, "flops_breakdown": hw,
           "hardware_flops_per_step": hw["total"] * tokens,
           "hardware_flops_per_step_analytic": hw["total"] * tokens}
    chips, names = len(devices), sharding.MESH_AXES
    one_slice = len({getattr(x, "slice_index", 0) for x in devices}) == 1
    if mesh_layout.device_coords(devices) is not None and one_slice:
        out["mesh_hops"] = mesh_layout.ring_hops(grid, names)
        out["mesh_hops_id_order"] = mesh_layout.ring_hops(
            np.asarray(devices, dtype=object).reshape(grid.shape), names)
    if not d:
        return out
    per_chip = b["rows_per_shard"] * b["seq_len"] // meta["mesh"].get("context", 1)
    active = 2.0 * flops.param_counts(model_cfg).active_experts * tokens
    ek = roofline.expert_kernel_flops(d["kernels"], rows_per_chunk=per_chip // chunks
                                      * model_cfg.top_k, chips=chips,
                                      active_expert_flops_per_step=active)
    if ek:
        out["expert_kernels"] = ek
        out["hardware_flops_per_step"] = (hw["total"] - hw["experts"]) * tokens + ek[
            "flops_per_step"]
        out["flops_breakdown"] = {**hw, "experts_as_compiled": ek["flops_per_step"] / tokens}
    traffic = {op: {**rec, "by_group": {str(n): v for n, v in rec["by_group"].items()}}
               for op, rec in d["traffic"].items()}
    sends = traffic.get("ragged-all-to-all", {}).get("bytes", 0)
    ragged = roofline.ragged_traffic(sends, meta["mesh"].get("expert", 1))
    ring = sum(rec["ring_bytes"] for rec in traffic.values())
    out.update(traffic=traffic, ragged=ragged, roofline_ring_model=roofline.roofline(
        model_flops=model_flops, hardware_flops=out["hardware_flops_per_step_analytic"],
        chips=chips, ring_bytes=ring,
        ring_bytes_imbalanced=ring - ragged["balanced"] + ragged["imbalanced"], chip=chip))
    if mesh_layout.device_coords(devices) is not None:
        slices = len({getattr(x, "slice_index", 0) for x in devices})
        place = links.Placement.of_grid(grid, d.get("num_partitions", 0))
        costs = links.step_costs(place, d["records"], link_bw=chip.link_bytes_per_s,
                                 dcn_bw=chip.dcn_bytes_per_s,
                                 dcn_records=d.get("dcn_records", ()), slices=slices)
        out["links"] = costs
        out["roofline"] = roofline.torus_roofline(
            model_flops=model_flops, hardware_flops=out["hardware_flops_per_step"],
            chips=chips, chip=chip, costs=costs)
        if meta.get("occupancy") and d.get("bucket_loops"):
            out["bucket_step"] = bucket_cost.bucket_step(meta, d, place, chip, chips, slices,
                                                          chunks)
    return out


def compile_report(cfg: ml_collections.ConfigDict, topology: str, *, name: str = "",
                   dump_dir: str = "", overrides: tuple = (), num_slices: int = 1) -> AotReport:
    """Lower and compile the config's train step for `topology`; never raises on HBM OOM.

    Args:
      cfg: the full config (all sections of `configs/tiny_cpu.py`).
      topology: `"v5p:AxBxC"` (one slice's shape).
      name: config name for the report.
      dump_dir: keep the compiler's HLO dump here ("" = discard).
      overrides: the `--config.KEY=VALUE` flags applied (recorded in the report).
      num_slices: slices of `topology` joined over DCN (the mesh's `dcn_*` sizes split them).
    Returns:
      `AotReport` (fits False with the compiler's bytes when the layout is out of HBM).
    """
    generation, _ = parse_topology(topology)
    devices = topology_devices(topology, num_slices)
    lowered, meta = lower_train_step(cfg, devices)
    r = compile_lowered(lowered, dump_dir)
    hbm = HBM_BYTES.get(generation, HBM_BYTES["v5p"])
    model_cfg, b = meta["model_config"], meta["batch"]
    counts = flops.param_counts(model_cfg)
    flags = ["while-loop bodies counted once (layer scans, micro-batches, chunks)"]
    if model_cfg.expert_backend == "megablox" or (model_cfg.expert_backend == "ep_a2a"
                                                  and model_cfg.ep_local_ffn == "megablox"):
        flags.append("megablox gmm declares 2*rows*K*N over its whole worst-case row buffer")
    if b["attention"].startswith("splash"):
        flags.append("splash declares its own cost (Mosaic kernel)")
    if b.get("buckets"):
        flags.append("length buckets: the memory is the compiled program's; FLOPs and the "
                     "roofline count every token at the largest bucket's length and the "
                     "kernels' and collectives' runs over every bucket's static micro-batches "
                     "(upper bounds: a step trains its token budget)")
    chip = roofline.CHIPS.get(generation, roofline.CHIPS["v5p"])
    d = r.dump
    return AotReport(
        config=name, topology=topology if num_slices == 1 else f"{num_slices} x {topology}",
        num_devices=len(devices), mesh=meta["mesh"], batch=b,
        fits=bool(not r.error and r.per_device_bytes is not None and r.per_device_bytes <= hbm),
        per_device_bytes=r.per_device_bytes, hbm_bytes=hbm, memory=r.memory,
        flops_per_device=r.flops_per_device,
        collectives=r.collectives, compile_seconds=r.seconds,
        params_total=counts.total, params_active=counts.active,
        paper=_paper_estimate(model_cfg, meta["mesh"], b["rows_per_shard"], b["seq_len"]),
        error=r.error, overrides=tuple(overrides), collective_bytes=r.collective_bytes,
        cost_analysis_flags=tuple(flags), chip=dataclasses.asdict(chip),
        peak_buffers=r.peak_buffers.get("buffers", []),
        peak_live_bytes_xla=r.peak_buffers.get("peak_bytes", 0),
        buffer_table=d.get("buffer_table", {}),
        **step_figures(meta, d, meta["grid"], chip, devices))


def reanalyze(report: dict, cfg: ml_collections.ConfigDict, dump_dir: str,
              num_slices: int = 1) -> dict:
    """A committed report with its dump-derived figures recomputed by this code from the kept
    dump of its compile (memory, FLOPs of the compiler and compile time are the compile's).

    Args:
      report: the report's JSON.
      cfg: the config it compiled (with its overrides applied).
      dump_dir: that compile's `--dump_dir`.
      num_slices: as compiled.
    Returns:
      The updated JSON.
    """
    from gagar_jax.model.transformer import ModelConfig, resolve_kernels

    topology = report["topology"].split(" x ")[-1]
    devices = topology_devices(topology, num_slices)
    mesh = sharding.make_mesh(cfg.mesh, devices)
    mc = resolve_kernels(ModelConfig.from_config(cfg.model), mesh)
    from gagar_jax.feed.config import FeedConfig
    meta = {"model_config": mc, "mesh": report["mesh"], "batch": report["batch"],
            "occupancy": bucket_cost.bucket_occupancy(FeedConfig.from_config(cfg.feed))}
    chip = roofline.CHIPS.get(parse_topology(topology)[0], roofline.CHIPS["v5p"])
    d = dump_figures(dump_dir)
    fresh = step_figures(meta, d, mesh.devices, chip, devices)
    return {**report, **json.loads(json.dumps(fresh)), "buffer_table": d["buffer_table"],
            "collectives": d["collectives"], "collective_bytes": d["collective_bytes"],
            "peak_buffers": d["peak"].get("buffers", []),
            "peak_live_bytes_xla": d["peak"].get("peak_bytes", 0)}

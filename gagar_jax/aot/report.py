"""The report of one ahead-of-time compile: what it found, as JSON and as a table.

`compile.compile_report` fills it; `scripts/aot_compile.py` prints `table()` and writes
`to_json()` to `docs/aot/` (docs/scaling.md says what every figure means).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

from gagar_jax.aot.hlo_stats import COLLECTIVES


def fmt_bytes(b: float | None) -> str:
    if b is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b:.0f} B"


@dataclasses.dataclass(frozen=True)
class MemoryFigures:
    """Per-device bytes of one compiled executable (`memory_analysis()`)."""

    arguments: int
    outputs: int
    aliases: int        # outputs that reuse (donated) argument buffers
    temporaries: int
    code: int

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliases + self.temporaries + self.code

    @classmethod
    def from_compiled(cls, stats: Any) -> MemoryFigures:
        return cls(arguments=stats.argument_size_in_bytes, outputs=stats.output_size_in_bytes,
                   aliases=stats.alias_size_in_bytes, temporaries=stats.temp_size_in_bytes,
                   code=stats.generated_code_size_in_bytes)


@dataclasses.dataclass(frozen=True)
class AotReport:
    """What one ahead-of-time compile found; `summary()` is the script's last stdout line."""

    config: str
    topology: str
    num_devices: int
    mesh: dict
    batch: dict                  # global rows, seq_len, micro_batches
    fits: bool
    per_device_bytes: Optional[int]
    hbm_bytes: int
    memory: Optional[MemoryFigures]
    flops_per_device: Optional[float]     # compiler's cost_analysis, one device, one step
    model_flops_per_step: float           # analytic 6N + attention, whole batch (flops.py)
    collectives: dict
    compile_seconds: float
    params_total: int
    params_active: int
    paper: dict                  # state / activation bytes per device worked out on paper
    error: str = ""
    overrides: tuple = ()        # command-line config overrides applied to the config file
    collective_bytes: dict = dataclasses.field(default_factory=dict)  # per device and step
    # Item-2/3 figures (docs/scaling.md "FLOPs, bytes and the roofline"):
    hardware_flops_per_step: float = 0.0   # with remat recomputation (roofline.py)
    flops_breakdown: dict = dataclasses.field(default_factory=dict)   # per token, by part
    cost_analysis_flags: tuple = ()         # why the compiler's figure is neither of the above
    traffic: dict = dataclasses.field(default_factory=dict)   # ring bytes per chip, by op
    ragged: dict = dataclasses.field(default_factory=dict)    # ep_a2a exchange, per chip
    roofline: dict = dataclasses.field(default_factory=dict)  # on the torus (links.py)
    chip: dict = dataclasses.field(default_factory=dict)      # hardware figures and source
    # Issue 41 (docs/scaling.md "Pod truth, round two"):
    roofline_ring_model: dict = dataclasses.field(default_factory=dict)   # the issue-29 model
    hardware_flops_per_step_analytic: float = 0.0   # 5 expert passes, no tile padding (issue 29)
    expert_kernels: dict = dataclasses.field(default_factory=dict)  # megablox calls as compiled
    links: dict = dataclasses.field(default_factory=dict)     # collective seconds on the torus
    mesh_hops: dict = dataclasses.field(default_factory=dict)   # ring-neighbour hops per axis
    mesh_hops_id_order: dict = dataclasses.field(default_factory=dict)  # the former layout's
    buffer_table: dict = dataclasses.field(default_factory=dict)    # every HBM byte, by row
    peak_buffers: list = dataclasses.field(default_factory=list)   # live at the memory peak
    peak_live_bytes_xla: int = 0   # all buffers live at XLA's heap peak (parameters included)
    bucket_step: dict = dataclasses.field(default_factory=dict)  # a mean step of the buckets
    commit: str = ""             # the source tree compiled (`git describe --always --dirty`)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> dict:
        return {"config": self.config, "topology": self.topology,
                "per_device_bytes": self.per_device_bytes, "hbm_bytes": self.hbm_bytes,
                "fits": self.fits}

    def table(self) -> str:
        """Human-readable table of the figures (GiB per device)."""
        g = fmt_bytes
        rows = [
            ("config", " ".join((self.config,) + tuple(self.overrides))),
            ("topology", f"{self.topology} ({self.num_devices} chips)"),
            ("mesh", " ".join(f"{k}={v}" for k, v in self.mesh.items())),
            ("batch", " ".join(f"{k}={v}" for k, v in self.batch.items())),
            (
                "params total / active",
                f"{self.params_total / 1e9:.2f}B / {self.params_active / 1e9:.2f}B",
            ),
        ]
        if self.memory is not None:
            m = self.memory
            rows += [("arguments", g(m.arguments)), ("outputs", g(m.outputs)),
                     ("aliases", g(m.aliases)), ("temporaries", g(m.temporaries)),
                     ("code", g(m.code))]
        rows += [
            ("per device (total)", g(self.per_device_bytes)),
            ("HBM per chip", g(self.hbm_bytes)),
            ("fits", str(self.fits)),
            (
                "paper: state / activations",
                f"{g(self.paper['state_bytes'])} / {g(self.paper['activation_bytes'])}",
            ),
        ]
        if self.flops_per_device is not None:
            rows += [
                (
                    "FLOPs per step (compiler, all chips)",
                    f"{self.flops_per_device * self.num_devices:.3e}",
                )
            ]
        rows += [("model FLOPs per step (6N + attn)", f"{self.model_flops_per_step:.3e}")]
        if self.hardware_flops_per_step:
            rows += [("hardware FLOPs per step (remat)", f"{self.hardware_flops_per_step:.3e}")]
        if self.cost_analysis_flags:
            rows += [("cost_analysis caveats", "; ".join(self.cost_analysis_flags))]
        for op, rec in self.traffic.items():
            if rec["ring_bytes"]:
                rows += [(f"{op} ring bytes per chip", g(rec["ring_bytes"]))]
        if self.ragged:
            rows += [(f"ragged a2a ring, balanced / x{self.ragged['imbalance']:.1f}",
                      f"{g(self.ragged['balanced'])} / {g(self.ragged['imbalanced'])}")]
        if self.mesh_hops:
            rows += [("ring hops per axis (id order)", " ".join(
                f"{k}={v:.2f} ({self.mesh_hops_id_order.get(k, 0):.2f})"
                for k, v in self.mesh_hops.items()))]
        e = self.expert_kernels
        if e:
            rows += [("expert kernels: passes / tile padding",
                      f"{e['passes']:.2f} / x{e['padding']:.3f} (row tile {e['row_tile']}, "
                      f"{e['rows_per_chunk']} rows per call)")]
        r = self.roofline
        if r:
            s, pct = (lambda k: f"{r[k]:.2f} s"), (lambda k: f"{r[k]:.1%}")
            rows += [
                ("step at peak: model / hardware FLOPs",
                 f"{s('compute_s_model_flops')} / {s('compute_s_hardware_flops')}"),
                ("comm on the torus: exposed / overlapped",
                 f"{s('comm_exposed_s')} / {s('comm_overlapped_s')} (ragged a2a "
                 f"{s('ragged_a2a_s')})"),
                (f"step bound / MFU bound (x{r['imbalance']:.1f} a2a)",
                 f"{s('step_s')} / {pct('mfu_bound')} ({s('step_s_imbalanced')} / "
                 f"{pct('mfu_bound_imbalanced')})"),
            ]
        bs = self.bucket_step
        if bs:
            rows += [("buckets: live / static micro-batches", " ".join(
                f"{x:.1f}/{n}" for x, n in zip(bs["live_micro_batches"],
                                               bs["static_micro_batches"], strict=True))),
                     ("buckets: mean step, MFU bound", f"{bs['roofline']['step_s']:.2f} s, "
                      f"{bs['roofline']['mfu_bound']:.1%}")]
        if self.links.get("dcn_bytes"):
            rows += [("DCN bytes per chip per step", g(self.links["dcn_bytes"]))]
        for b in self.peak_buffers[:8]:
            rows += [(f"peak buffer {g(b['bytes'])}",
                      f"{b['shape']} {b['source'] or b['instruction']}")]
        rows += [(f"{op} ops", str(n)) for op, n in self.collectives.items()]
        rows += [(f"{op} bytes per step", g(n)) for op, n in self.collective_bytes.items()
                 if op in COLLECTIVES]
        rows += [("compile time", f"{self.compile_seconds:.1f} s")]
        if self.error:
            rows += [("compiler error", self.error.splitlines()[0][:160])]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def write_report(report: AotReport, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report.to_json(), f, indent=2, sort_keys=True)
        f.write("\n")



"""Model and hardware FLOPs, ring traffic and the roofline of one train step, on paper.

Three FLOP counts, per token and per step:
  * model FLOPs (the MFU numerator, `flops.train_flops_per_token`): 6 x active matmul
    parameters + 3 x the causal attention of each layer's own keys;
  * hardware FLOPs: what the chips execute. With `remat="full"` every layer's forward runs
    again in the backward pass (4 forward-equivalents of its matmuls: forward, recompute, two
    for the backward); `ep_a2a` in chunks recomputes each chunk's expert FFN once more (5);
    the vocab head recomputes its logits in the backward unless it keeps them (4, else 3).
    Attention computes whole key blocks (`computed_keys_per_query`: a 129-token window costs
    two 512-token blocks), and its backward five block matmuls (S, dP, dV, dK, dQ) against the
    forward's two (S, PV);
  * the compiler's `cost_analysis` figure, reported beside them only: it counts each loop body
    once and takes Pallas kernels' declared costs (megablox declares the whole worst-case row
    buffer), so it is neither.

Roofline: compute-bound step time at peak for model and hardware FLOPs; communication-bound
time of the ring traffic (`hlo_stats.collective_traffic`) at the chip's full ICI bandwidth and
on one torus dimension (a ring on one axis uses 2 of a v5p chip's 6 links); the MFU upper
bound is model time / max(hardware time, communication time), i.e. perfect overlap.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from gagar_jax.aot import flops, schedule

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """Per-chip hardware figures of one TPU generation, with where they come from."""

    name: str
    peak_bf16_flops: float    # FLOP/s, dense bf16
    hbm_bytes: float          # per chip, as the TPU compiler counts it
    ici_bytes_per_s: float    # all links of one chip together, one direction
    ici_links: int            # links per chip (a 3D torus: 6, two per dimension)
    source: str
    dcn_bytes_per_s: float = 0.0   # the chip's share of the data-center network

    @property
    def ici_one_dim_bytes_per_s(self) -> float:
        """A ring confined to one torus dimension: the 2 links of that dimension."""
        return self.ici_bytes_per_s * 2 / self.ici_links

    @property
    def link_bytes_per_s(self) -> float:
        """One link, one direction (`links.py` prices every link at this)."""
        return self.ici_bytes_per_s / self.ici_links


CHIPS = {
    "v5p": Chip("v5p", 459e12, 95.74 * GiB, 4800e9 / 8, 6,
                "https://cloud.google.com/tpu/docs/v5p (459 bf16 TFLOP/s, 95 GB HBM2e, "
                "4800 Gbps = 1200 GB/s bidirectional ICI per chip over 6 links of a 3D torus "
                "(100 GB/s per link and direction), 50 Gbps DCN per chip); HBM as the "
                "compiler's CompileTimeHbmOom counts it: 95.74 GiB",
                dcn_bytes_per_s=50e9 / 8),
}

# Imbalance stated for the ragged all-to-all: the busiest chip receives this many times the
# mean routed rows (top-8 of 256 experts, 32 per chip: a bias-balanced router keeps chip loads
# close; 1.5 is a pessimistic planning figure, not a measurement).
IMBALANCE = 1.5


def computed_keys_per_query(seq_len: int, window: int, block: int) -> float:
    """Mean keys per query the blockwise kernels compute: whole `block`-key tiles, causal,
    from the first tile a query block's window reaches to its diagonal tile."""
    blk = min(block, seq_len)
    nq = math.ceil(seq_len / blk)
    total = 0
    for i in range(nq):
        lo = 0 if not window else max((i * blk - (window - 1)) // blk, 0)
        total += (i - lo + 1) * blk
    return total / nq


def _get(cfg: Any, name: str, default: Any):
    try:
        return getattr(cfg, name)
    except (AttributeError, KeyError):
        return default


def hardware_flops_per_token(cfg: Any, seq_len: int, *, expert_chunks: int = 1) -> dict:
    """FLOPs the chips execute per trained token, by part (see the module docstring).

    Args:
      cfg: model config.
      seq_len: tokens per row (attention).
      expert_chunks: `ep_a2a`'s chunk count (> 1: each chunk's FFN is recomputed once more).
    Returns:
      {"layer_matmuls", "experts", "head", "attention", "total"}.
    """
    p = flops.param_counts(cfg)
    remat = _get(cfg, "remat", "none") == "full"
    passes = 4 if remat else 3
    head_passes = 3 if _get(cfg, "logprob_keep_logits_mib", 0) else 4
    head = p.lm_head or p.embedding   # tied: the embedding is the head matrix
    layer = 2.0 * (p.attention + p.dense_mlp + p.router) * passes
    experts = 2.0 * p.active_experts * (passes + (1 if expert_chunks > 1 else 0))
    window = _get(cfg, "sliding_window", 0)
    block = _get(cfg, "attn_block", 512)
    attention = 0.0
    for sliding, _, dv in flops.attention_layout(cfg):
        keys = computed_keys_per_query(seq_len, window if sliding else 0, block)
        hd = cfg.head_dim
        fwd = 2.0 * cfg.num_heads * (hd + dv) * keys
        bwd = 2.0 * cfg.num_heads * (3 * hd + 2 * dv) * keys
        attention += fwd * (2 if remat else 1) + bwd
    out = {"layer_matmuls": layer, "experts": experts, "head": 2.0 * head * head_passes,
           "attention": attention}
    out["total"] = sum(out.values())
    return out


def ragged_traffic(send_bytes: float, n: int, imbalance: float = IMBALANCE) -> dict:
    """Ring bytes of `ep_a2a`'s ragged all-to-alls per chip: (n-1)/n of the rows a chip holds
    leave it at balanced routing; the busiest receiver takes `imbalance` x the mean."""
    balanced = send_bytes * (n - 1) / n if n > 1 else 0.0
    return {"balanced": balanced, "imbalanced": balanced * imbalance, "imbalance": imbalance}


def roofline(*, model_flops: float, hardware_flops: float, chips: int, ring_bytes: float,
             ring_bytes_imbalanced: float, chip: Chip) -> dict:
    """Step-time bounds (seconds) and the MFU upper bound of one step.

    Args:
      model_flops, hardware_flops: per step, all chips.
      chips: chips in the slice.
      ring_bytes: ring traffic per chip and step at balanced routing;
        ring_bytes_imbalanced: the same with the ragged all-to-all at the stated imbalance.
      chip: the hardware figures.
    """
    peak = chips * chip.peak_bf16_flops
    t_model, t_hw = model_flops / peak, hardware_flops / peak
    out = {"compute_s_model_flops": t_model, "compute_s_hardware_flops": t_hw}
    for name, bw in (("full_ici", chip.ici_bytes_per_s),
                     ("one_torus_dim", chip.ici_one_dim_bytes_per_s)):
        for routing, b in (("balanced", ring_bytes), ("imbalanced", ring_bytes_imbalanced)):
            t_comm = b / bw
            out[f"comm_s_{name}_{routing}"] = t_comm
            out[f"mfu_bound_{name}_{routing}"] = t_model / max(t_hw, t_comm)
    return out


def expert_kernel_flops(kernels: list[dict], *, rows_per_chunk: int, chips: int,
                        active_expert_flops_per_step: float) -> dict:
    """Expert FLOPs as compiled: every megablox call of the HLO (`schedule.grouped_matmuls`) x
    its runs per step x 2 x k x n x the rows the kernel computes, which are whole row tiles
    (`schedule.visited_rows`) of the rows routed to the chip (balanced routing).

    Args:
      kernels: `schedule.grouped_matmuls` of the compiled module (one chip's program).
      rows_per_chunk: routed rows a chip's kernels see per call (chunk tokens x top-k).
      chips: chips in the slice.
      active_expert_flops_per_step: one forward pass of the experts, all chips
        (2 x active expert parameters x tokens).
    Returns:
      {"flops_per_step" (with tile padding), "unpadded_flops_per_step", "passes" (forward-
      equivalents the program runs), "padding" (computed / routed rows), "row_tile",
      "rows_per_chunk", "calls_per_step"}; {} without kernels.
    """
    if not kernels:
        return {}
    visited: dict = {}
    total = unpadded = 0.0
    for c in kernels:
        key = (c["groups"], c["tm"], c["kernel"] == "tgmm")
        if key not in visited:
            visited[key] = schedule.visited_rows(rows_per_chunk, c["groups"], c["tm"],
                                                 visit_empty=key[2])
        total += c["runs"] * 2.0 * visited[key] * c["k"] * c["n"]
        unpadded += c["runs"] * 2.0 * rows_per_chunk * c["k"] * c["n"]
    return {"flops_per_step": total * chips, "unpadded_flops_per_step": unpadded * chips,
            "passes": unpadded * chips / active_expert_flops_per_step,
            "padding": total / unpadded, "row_tile": sorted({c["tm"] for c in kernels}),
            "rows_per_chunk": rows_per_chunk,
            "calls_per_step": int(sum(c["runs"] for c in kernels))}


def torus_roofline(*, model_flops: float, hardware_flops: float, chips: int, chip: Chip,
                   costs: dict, imbalance: float = IMBALANCE) -> dict:
    """Step-time bound and MFU bound from `links.step_costs` on the mesh's placement.

    The overlap is what the compiled schedule says (`schedule.collective_records`): a
    collective with a matmul, a kernel or a loop between its start and its done can hide behind
    compute, every other one (synchronous ones, and `ep_a2a`'s exchanges, whose chunk runs
    dispatch -> FFN -> return in order) adds to the step:
      step = exposed communication + max(hardware compute, overlapped communication).
    The imbalanced figure scales the exposed ragged all-to-alls by `imbalance`.
    """
    peak = chips * chip.peak_bf16_flops
    t_model, t_hw = model_flops / peak, hardware_flops / peak
    ragged = costs.get("exposed_by_op", {}).get("ragged-all-to-all", 0.0)
    step = costs["exposed_s"] + max(t_hw, costs["overlapped_s"])
    step_imb = step + (imbalance - 1.0) * ragged
    return {"compute_s_model_flops": t_model, "compute_s_hardware_flops": t_hw,
            "comm_exposed_s": costs["exposed_s"], "comm_overlapped_s": costs["overlapped_s"],
            "ragged_a2a_s": ragged, "step_s": step, "step_s_imbalanced": step_imb,
            "mfu_bound": t_model / step, "mfu_bound_imbalanced": t_model / step_imb,
            "imbalance": imbalance}

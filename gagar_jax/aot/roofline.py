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

from gagar_jax.aot import flops

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """Per-chip hardware figures of one TPU generation, with where they come from."""

    name: str
    peak_bf16_flops: float    # FLOP/s, dense bf16
    hbm_bytes: float          # per chip, as the TPU compiler counts it
    ici_bytes_per_s: float    # all links of one chip together
    ici_links: int            # links per chip (a 3D torus: 6, two per dimension)
    source: str

    @property
    def ici_one_dim_bytes_per_s(self) -> float:
        """A ring confined to one torus dimension: the 2 links of that dimension."""
        return self.ici_bytes_per_s * 2 / self.ici_links


CHIPS = {
    "v5p": Chip("v5p", 459e12, 95.74 * GiB, 4800e9 / 8, 6,
                "https://cloud.google.com/tpu/docs/v5p (459 bf16 TFLOP/s, 95 GB HBM2e, "
                "4800 Gbps ICI per chip, 3D torus); HBM as the compiler's CompileTimeHbmOom "
                "counts it: 95.74 GiB"),
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

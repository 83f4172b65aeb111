"""What a bucketed train step costs in a mean step, not in its compiled upper bound.

A bucketed program (`run/bucket_step.py`) holds every length bucket's static micro-batches, and
a step runs only its live ones (a `lax.cond` skips the rest), so the compiled program's FLOPs and
collectives are an upper bound. Here the feed's own steps over a stated length distribution
(`BUCKET_WORKLOAD`) give each bucket's live micro-batches, and the program's collectives,
transfers and kernels in each bucket's loop are scaled to them (`schedule.bucket_scaled`);
docs/scaling.md "The 256k configs' reports, with a mean step".
"""
from __future__ import annotations

from typing import Any

import numpy as np

from gagar_jax.aot import flops, links, roofline, schedule

# The lengths a bucketed report's mean step is priced at (issue 41 item 6, scripts/bench_feed.py):
# 640 groups of 8 trajectories, log-normal lengths of mean 180k tokens and 20% spread, seed 0.
BUCKET_WORKLOAD = {"mean": 180_000, "spread": 0.2, "groups": 640, "group_size": 8, "seed": 0}


def bucket_occupancy(fc: Any) -> dict:
    """A mean step of a bucketed feed (`feed.config.FeedConfig`) under `BUCKET_WORKLOAD`: live
    micro-batches per bucket, real tokens and padding ({} without buckets, or when the
    workload's trajectories fill no step of them, as in the tiny test configs)."""
    from gagar_jax.feed import bucket_figures
    if not fc.buckets:
        return {}
    w = BUCKET_WORKLOAD
    lengths = bucket_figures.lognormal_lengths(np.random.default_rng(w["seed"]), w["groups"],
                                               w["group_size"], w["mean"], w["spread"])
    f = bucket_figures.simulate(fc, lengths)
    if not f.steps:
        return {}
    steps = f.steps
    return {"workload": dict(w), "steps": f.steps, "bucket_rows": fc.bucket_rows,
            "buckets": list(fc.buckets),
            "static_micro_batches": list(fc.bucket_micro_batches),
            "live_micro_batches": [k / steps for k in f.micro_K],
            "tokens_per_step": f.tokens / steps, "padding": f.padding}


def bucket_step(meta: dict, d: dict, place: links.Placement, chip: roofline.Chip, chips: int,
                slices: int, chunks: int) -> dict:
    """The mean step of a bucketed program (`meta["occupancy"]`), not its upper bound: each
    bucket's collectives, transfers and kernels at its live micro-batches instead of its static
    ones (`schedule.bucket_scaled`), FLOPs per bucket at the bucket's row length (model FLOPs
    for the real tokens, hardware FLOPs for every token slot the live micro-batches hold)."""
    occ, model_cfg, b = meta["occupancy"], meta["model_config"], meta["batch"]
    static, live = occ["static_micro_batches"], occ["live_micro_batches"]
    loops = d["bucket_loops"]
    recs = schedule.bucket_scaled(d["records"], loops, static, live)
    dcn = schedule.bucket_scaled(d.get("dcn_records", []), loops, static, live)
    kernels = schedule.bucket_scaled(d["kernels"], loops, static, live)
    costs = links.step_costs(place, recs, link_bw=chip.link_bytes_per_s,
                             dcn_bw=chip.dcn_bytes_per_s, dcn_records=dcn, slices=slices)
    slots = [n * occ["bucket_rows"] * length for n, length in zip(live, occ["buckets"],
                                                                   strict=True)]
    fill = occ["tokens_per_step"] / max(1.0, sum(slots))      # real tokens per token slot
    model = hardware = 0.0
    context = meta["mesh"].get("context", 1)
    for i, (length, tokens) in enumerate(zip(occ["buckets"], slots, strict=True)):
        if not tokens:          # no live micro-batch of this bucket in the mean step
            continue
        model += fill * tokens * flops.train_flops_per_token(model_cfg, length)
        hw = roofline.hardware_flops_per_token(model_cfg, length, expert_chunks=chunks)
        mine = [k for k in kernels if k["bucket"] == i]
        ek = roofline.expert_kernel_flops(
            mine, rows_per_chunk=b["rows_per_shard"] * length // context // chunks
            * model_cfg.top_k, chips=chips,
            active_expert_flops_per_step=2.0 * flops.param_counts(model_cfg).active_experts
            * tokens)
        hardware += ((hw["total"] - hw["experts"]) * tokens + ek["flops_per_step"] if ek
                     else hw["total"] * tokens)
    return {**occ, "model_flops_per_step": model, "hardware_flops_per_step": hardware,
            "links": costs,
            "roofline": roofline.torus_roofline(model_flops=model, hardware_flops=hardware,
                                                chips=chips, chip=chip, costs=costs)}

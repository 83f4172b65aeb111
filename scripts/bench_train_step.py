"""Throughput and MFU of the whole jitted train step, and the share of it spent on advantages.

Run:  JAX_PLATFORMS=cpu .venv/bin/python scripts/bench_train_step.py     (CPU; writes the section
      "## Train step (scripts/bench_train_step.py)" of docs/performance.md; --no-docs to skip)
      On a GPU/TPU host: JAX_PLATFORMS= .venv/bin/python scripts/bench_train_step.py --no-docs

For each config (tiny_cpu, and small = the ~100M-parameter configs/small.py) it builds a synthetic
packed batch, compiles `train_step` once, and times steps. MFU = model FLOPs per second
(`flops.train_flops_per_token` x row tokens x epochs, remat not counted) / the matmul peak
measured in the same run with a large `jnp.dot`. The advantage share times the jitted
`gagar_advantages` + `broadcast_to_tokens` at the batch's T and G against the step (goal < 1%).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from benchutil import matmul_peak, synthetic_batch, time_train_step, timed, write_docs_section

from gagar_jax.algo.advantage import broadcast_to_tokens, gagar_advantages
from gagar_jax.aot import flops
from gagar_jax.batch import Batch
from gagar_jax.config import load_config_file
from gagar_jax.run import step as TS
from gagar_jax.sharding import make_mesh

HEADING = "## Train step (scripts/bench_train_step.py)"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTE = ("CPU numbers come from a 2-core machine shared with other jobs: read the ratios (MFU "
        "against the peak measured beside it, the advantage share), not the absolute times. "
        "The advantage computation is a few segment sums over T and G, independent of the "
        "model, so its share only shrinks as models and batches grow.")


def advantage_seconds(batch: Batch, reps: int = 50) -> float:
    """Median time of the jitted advantage computation + token broadcast for this batch."""
    @jax.jit
    def adv(b):
        out = gagar_advantages(b.rewards_T, b.group_ids_T, b.factors_T, b.valid_T, b.hacked_T,
                               b.grading_ok_G, num_groups=b.num_groups,
                               adjustments=b.adjustments_T)
        return broadcast_to_tokens(out.advantages, b.traj_index_BxS, b.loss_mask_BxS)
    adv(batch).block_until_ready()
    return float(np.median([timed(lambda: adv(batch)) for _ in range(reps)]))


def bench(name: str, B: int, S: int, steps: int) -> dict:
    cfg = load_config_file(os.path.join(ROOT, "configs", f"{name}.py"))
    step_cfg = TS.StepConfig.from_config(cfg)
    step_cfg = dataclasses.replace(step_cfg, micro_batches=min(step_cfg.micro_batches, B),
                                   mini_batches=1, epochs=1)
    mesh = make_mesh(type("M", (), dict(data=-1, fsdp=1, expert=1, tensor=1)))
    compile_s, step_s, m = time_train_step(step_cfg, mesh, B, S, steps)
    batch = synthetic_batch(B, S, step_cfg.model.vocab_size)   # its T and G, for the advantage
                                                               # share
    # The machine may be shared: measure the peak right after the timed steps.
    peak = matmul_peak(reps=5)
    tokens = B * S * step_cfg.epochs
    model_flops = flops.train_flops_per_token(step_cfg.model, S) * tokens
    adv_s = advantage_seconds(batch)
    return dict(name=name, B=B, S=S, T=batch.num_trajectories, G=batch.num_groups,
                params=flops.param_counts(step_cfg.model).total,
                active=flops.param_counts(step_cfg.model).active,
                micro=step_cfg.micro_batches, compile_s=compile_s, step_s=step_s,
                tok_s=tokens / step_s, mfu=model_flops / step_s / peak, adv_s=adv_s,
                adv_share=adv_s / step_s, peak=peak, loss=float(m.loss))


def render(rows) -> str:
    dev = jax.devices()[0]
    out = [
        HEADING,
        "",
        f"`{' '.join(sys.argv)}` on {len(jax.devices())} x {dev.platform} "
        f"({dev.device_kind}); peak = a float32 2048^3 `jnp.dot` measured right after each "
        "config's timed steps (the machine may be shared). One train step = one feed batch, "
        "1 epoch x 1 mini-batch, "
        "gradient accumulation over `micro` micro-batches; tokens/s counts all B x S row "
        "tokens; MFU = model FLOPs (6 x active matmul params + causal attention, per token) / "
        "step time / peak. Advantage share = jitted `gagar_advantages` + `broadcast_to_tokens` "
        "at the batch's T and G, over the step time (goal < 1%).",
        "",
        NOTE,
        "",
        "| config | params (active) | batch [B, S] | T / G | micro | compile s | step s "
        "| tokens/s | peak GFLOP/s | MFU | advantage ms | advantage share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['name']} | {r['params'] / 1e6:.1f}M ({r['active'] / 1e6:.1f}M) "
            f"| [{r['B']}, {r['S']}] | {r['T']} / {r['G']} | {r['micro']} "
            f"| {r['compile_s']:.0f} | {r['step_s']:.3f} | {r['tok_s']:,.0f} "
            f"| {r['peak'] / 1e9:.1f} "
            f"| {100 * r['mfu']:.1f}% | {1e3 * r['adv_s']:.3f} | {100 * r['adv_share']:.2g}% |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="timed steps per config (after compile)")
    p.add_argument("--tiny", default="16x128", help="tiny_cpu batch BxS")
    p.add_argument("--small", default="4x256", help="small (~100M) batch BxS; '' to skip")
    p.add_argument("--no-docs", action="store_true", help="do not write docs/performance.md")
    args = p.parse_args()
    rows = []
    for name, shape in (("tiny_cpu", args.tiny), ("small", args.small)):
        if not shape:
            continue
        B, S = (int(x) for x in shape.split("x"))
        r = bench(name, B, S, args.steps)
        print(f"{name}: {r['tok_s']:,.0f} tokens/s, MFU {100 * r['mfu']:.2f}%, step "
              f"{r['step_s']:.3f}s, advantages {1e3 * r['adv_s']:.3f} ms = "
              f"{100 * r['adv_share']:.2g}% of the step", flush=True)
        rows.append(r)
    section = render(rows)
    print(section)
    if not args.no_docs:
        write_docs_section(os.path.join(ROOT, "docs", "performance.md"), HEADING, section)


if __name__ == "__main__":
    main()

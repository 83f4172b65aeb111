"""One-command accelerator benchmark: train-step MFU and tokens/s, attention x expert backends.

Run (one TPU or GPU, at most ~8 minutes):
    python scripts/bench_device.py                  # the 1.7B-parameter bench model, bf16 compute
    python scripts/bench_device.py --json out.json  # also write the figures as JSON
    JAX_PLATFORMS=cpu python scripts/bench_device.py --tiny    # seconds on CPU (the test)

It needs only jax, flax, optax, chex, orbax, numpy, etils and safetensors (what an accelerator
image may offer): no config files (ml_collections), no feed (grain, msgspec). The model config
is built here, the batch is synthetic (`benchutil.synthetic_batch`: packed rows of mixed
groups), and the step is the trainer's own jitted `train_step` on a one-axis data mesh over the
local devices.

The bench model (`BENCH`) is MoE in the shapes of the MiMo-V2-Flash family scaled down (GQA,
64 experts top-8, one leading dense layer): 1.7B parameters, so float32 master weights, their
gradients and the two Adam moments take about 27 GB and fit well inside 60 GB with room for
activations (full remat per layer). Compute is bfloat16.

For each pair (attention path, expert backend) available on the platform (TPU: blockwise and
splash x ragged and megablox; GPU: blockwise x ragged and grouped; CPU: blockwise x grouped),
it compiles the step once, runs `--steps` timed steps, and prints one line each, then a table.
MFU = model FLOPs (6 x active matmul parameters + causal attention, per token;
`flops.train_flops_per_token`) x tokens / step time / the chip's peak bf16 FLOP/s (the
vendor's figure for the device kind when known, otherwise a bf16 matmul measured here).
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from benchutil import time_train_step, timed

from gagar_jax import sharding as shd
from gagar_jax.algo.loss import LossConfig
from gagar_jax.aot import flops
from gagar_jax.model.config import ModelConfig
from gagar_jax.run import step as TS
from gagar_jax.run.optim import OptimConfig

# The bench model: 1.67B parameters (0.43B active), 8 layers (1 dense + 7 MoE).
BENCH = ModelConfig(
    vocab_size=32768, hidden_size=2048, num_layers=8, num_heads=16, num_kv_heads=4,
    head_dim=128, moe_intermediate_size=512, intermediate_size=6144, num_experts=64, top_k=8,
    num_dense_layers=1, param_dtype="float32", compute_dtype="bfloat16", remat="full",
    attn_block=512)
BENCH_BATCH = (8, 4096)                     # rows x tokens: 32k tokens per step
TINY = dataclasses.replace(
    BENCH, vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, moe_intermediate_size=16, intermediate_size=48, num_experts=4, top_k=2,
    compute_dtype="float32", remat="none", attn_block=32)
TINY_BATCH = (4, 64)

# platform -> (attention paths, expert backends) compared.
CANDIDATES = {
    "tpu": (("blockwise", "splash"), ("ragged", "megablox")),
    "gpu": (("blockwise",), ("ragged", "grouped")),
    "cpu": (("blockwise",), ("grouped",)),
}
# Dense bf16 peak FLOP/s per chip by device kind (vendor figures).
PEAK_BF16 = {
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5": 459e12,
    "TPU v5p": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12,
    "NVIDIA H100": 989e12, "NVIDIA H200": 989e12, "NVIDIA A100": 312e12,
}


def peak_flops(device) -> tuple[float, str]:
    """(peak bf16 FLOP/s of one chip, where the figure comes from)."""
    kind = device.device_kind
    for name in sorted(PEAK_BF16, key=len, reverse=True):   # longest match: "TPU v5 lite" first
        if kind.startswith(name):
            return PEAK_BF16[name], f"vendor figure for {name}"
    n = 1024 if device.platform == "cpu" else 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    return 2 * n ** 3 / min(timed(lambda: f(a)) for _ in range(3)), f"measured {n}^3 bf16 matmul"


def run_case(model: ModelConfig, batch_shape, attention: str, experts: str, steps: int) -> dict:
    """Compile the train step for one (attention, experts) pair and time `steps` steps."""
    cfg = TS.StepConfig(model=dataclasses.replace(model, attention=attention,
                                                  expert_backend=experts),
                        loss=LossConfig(), optim=OptimConfig(learning_rate=1e-6))
    mesh = shd.make_mesh(type("M", (), dict(data=-1, fsdp=1, expert=1, tensor=1)))
    B, S = batch_shape
    compile_s, step_s, m = time_train_step(cfg, mesh, B, S, steps)
    n_dev = len(jax.devices())
    tokens = B * S
    model_flops = flops.train_flops_per_token(model, S) * tokens
    return dict(attention=attention, experts=experts, compile_s=compile_s, step_s=step_s,
                tokens_per_s=tokens / step_s, model_flops=model_flops,
                loss=float(m.loss), finite=bool(np.isfinite(float(m.loss))), devices=n_dev)


def render(rows, model: ModelConfig, batch_shape, peak: float, peak_src: str) -> str:
    dev = jax.devices()[0]
    counts = flops.param_counts(model)
    lines = [f"device: {len(jax.devices())} x {dev.device_kind} ({dev.platform}); jax "
             f"{jax.__version__}; peak {peak / 1e12:.3g} TFLOP/s per chip ({peak_src})",
             f"model: {counts.total / 1e6:,.1f}M params ({counts.active / 1e6:,.1f}M active), "
             f"compute {model.compute_dtype}, remat {model.remat}; batch {batch_shape[0]} x "
             f"{batch_shape[1]} tokens", "",
             "| attention | experts | compile s | step s | tokens/s | MFU |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['attention']} | {r['experts']} | {r['compile_s']:.0f} "
                     f"| {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (always on CPU)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per pair (after compile)")
    p.add_argument("--attention", default="", help="comma list (default: per platform)")
    p.add_argument("--experts", default="", help="comma list (default: per platform)")
    p.add_argument("--json", default="", help="also write the figures here")
    args = p.parse_args(argv)
    dev = jax.devices()[0]
    if dev.platform == "cpu" and not args.tiny:
        print("CPU only: tiny shapes (the bench model is for an accelerator)", flush=True)
    tiny = args.tiny or dev.platform == "cpu"
    model, batch_shape = (TINY, TINY_BATCH) if tiny else (BENCH, BENCH_BATCH)
    attn_default, expert_default = CANDIDATES.get(dev.platform, CANDIDATES["cpu"])
    attns = tuple(a for a in args.attention.split(",") if a) or attn_default
    experts = tuple(e for e in args.experts.split(",") if e) or expert_default
    peak, peak_src = peak_flops(dev)
    rows = []
    for a in attns:
        for e in experts:
            r = run_case(model, batch_shape, a, e, args.steps)
            r["mfu"] = r["model_flops"] / r["step_s"] / (peak * r["devices"])
            print(f"attention={a} experts={e}: {r['tokens_per_s']:,.0f} tokens/s, MFU "
                  f"{100 * r['mfu']:.1f}%, step {r['step_s']:.3f} s, compile "
                  f"{r['compile_s']:.0f} s", flush=True)
            rows.append(r)
    print(render(rows, model, batch_shape, peak, peak_src))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device_kind": dev.device_kind, "platform": dev.platform,
                       "jax": jax.__version__, "peak_flops": peak, "peak_source": peak_src,
                       "batch": list(batch_shape), "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()

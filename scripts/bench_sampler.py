"""The JAX sampler on `small`: tokens/s against vLLM's CPU build (same float32 weights, prompts,
batch and lengths, temperature 1, one timed run each after a warm-up), and the resharded
hand-over against a publish plus a vLLM reload of the same weights.

Run:  /work/bin/quiet .venv/bin/python scripts/bench_sampler.py   (writes the section
      "## Sampler (scripts/bench_sampler.py)" of docs/performance.md; --no-docs to skip)

`configs/small.py` (102M parameters, Qwen3-MoE layout) at its initial weights, published once
in float32. The JAX side runs on 8 fake CPU devices: throughput on device 0 alone (`JaxEngine`
from the published directory: `SamplerConfig(slots=B, layer_copies=True)`, one decode program
of `--decode-steps` steps per call); the hand-over from a learner mesh of devices 0-3 (fsdp 4)
to a sampler mesh of devices 4-7 (tensor 4: `handover.timed_hand_over(mode="reshard")`, the
mean of 3), whose greedy tokens must equal the published sampler's. vLLM (`--vllm-python`, its
workers import this checkout) loads the same directory (float32, eager, batch of B in one
`generate`, no routing capture), then reloads it in place (`gagar_reload_from`, the worker's
reload, the mean of 3).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import numpy as np
from benchutil import write_docs_section

HEADING = "## Sampler (scripts/bench_sampler.py)"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXT = "gagar_jax.rollout.vllm_extension.GagarWorkerExtension"


def prompts(b: int, n: int, vocab: int) -> list:
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, n).tolist() for _ in range(b)]


# -- the vLLM side (.venv-vllm: no JAX) ----------------------------------------------------------

def engine(spec_file: str) -> None:
    """vLLM's tokens/s on the batch and its in-place reload time; writes the answers beside."""
    from vllm import LLM, SamplingParams

    spec = json.load(open(spec_file))
    t0 = time.perf_counter()
    llm = LLM(model=spec["path"], skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=spec["max_len"], seed=0, worker_extension_cls=EXT)
    out = {"start_s": time.perf_counter() - t0}
    ps = [{"prompt_token_ids": p} for p in spec["prompts"]]

    def run(seed: int) -> tuple:
        sp = [SamplingParams(temperature=1.0, max_tokens=spec["gen"], ignore_eos=True,
                             detokenize=False, seed=seed + i) for i in range(len(ps))]
        t0 = time.perf_counter()
        got = llm.generate(ps, sp, use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in got)
    run(1000)                                                 # warm-up
    out["gen_s"], out["tokens"] = run(0)
    greedy = SamplingParams(temperature=0.0, max_tokens=min(8, spec["gen"]), ignore_eos=True,
                            detokenize=False)
    out["greedy"] = list(llm.generate(ps[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids)
    reloads = []
    for _ in range(3):
        t0 = time.perf_counter()
        llm.collective_rpc("gagar_reload_from", args=(spec["path"],))
        assert llm.reset_prefix_cache()
        reloads.append(time.perf_counter() - t0)
    out["reload_s"] = reloads
    json.dump(out, open(spec_file + ".out", "w"))


# -- the JAX side ----------------------------------------------------------------------------

def jax_side(args: argparse.Namespace, work: str) -> dict:
    import jax
    from flax import nnx

    from gagar_jax import sharding as shd
    from gagar_jax.config import load_config_file
    from gagar_jax.hf import api as hf
    from gagar_jax.model.transformer import ModelConfig, Transformer
    from gagar_jax.rollout.engine import EngineOptions, Request, SamplingSpec
    from gagar_jax.run import publish
    from gagar_jax.sample import handover
    from gagar_jax.sample.engine import JaxEngine, make_engine
    from gagar_jax.sample.sampler import Sampler, SamplerConfig

    cfg = ModelConfig.from_config(load_config_file(os.path.join(ROOT, "configs",
                                                                "small.py")).model)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    t0 = time.perf_counter()
    path = publish.publish_weights(model, 1, work, lambda m, d: hf.save_pretrained(
        m, d, dtype="float32"))
    out = {"publish_s": time.perf_counter() - t0, "path": str(path),
           "bytes": handover.state_bytes(nnx.state(model))}
    B, L = args.batch, args.prompt + args.gen + 1
    ps = prompts(B, args.prompt, cfg.vocab_size)
    sampler_cfg = SamplerConfig(slots=B, page=16, max_len=L, decode_steps=args.decode_steps,
                                max_chunk=64, layer_copies=True)
    options = EngineOptions(seed=0, max_model_len=L)
    eng = make_engine(str(path), options, sampler_cfg)

    def run(seed: int, max_tokens: int = args.gen) -> tuple:
        s = SamplingSpec(temperature=1.0, max_tokens=max_tokens)
        t0 = time.perf_counter()
        got = eng.generate([Request(p, s, seed=seed + i) for i, p in enumerate(ps)])
        eng.cancel([c.sequence for [c] in got])
        return time.perf_counter() - t0, sum(len(c.tokens) for [c] in got)
    run(1000)                                                     # warm-up: every program
    run(1000, 1)
    out["gen_s"], out["tokens"] = run(0)
    out["first_s"], _ = run(0, 1)         # prefill + one decode call: the rest is decode
    out["decode_calls"] = eng.sampler.stats["decode_calls"]
    greedy = SamplingSpec(top_k=1, max_tokens=min(8, args.gen))
    [[g]] = eng.generate([Request(ps[0], greedy)])
    out["greedy"] = g.tokens

    devices = jax.devices()
    mesh_of = lambda ds, **a: shd.make_mesh(type("M", (), {**dict(
        data=1, fsdp=1, expert=1, context=1, tensor=1), **a}), ds)
    learner_mesh, sampler_mesh = mesh_of(devices[:4], fsdp=4), mesh_of(devices[4:], tensor=4)
    state = jax.device_put(nnx.state(model), shd.state_shardings(nnx.state(model),
                                                                 learner_mesh))
    shardings = handover.sampler_shardings(state, sampler_mesh)
    other = JaxEngine(Sampler(nnx.merge(nnx.graphdef(model), handover.reshard(state, shardings)),
                              SamplerConfig(slots=1, page=16, max_len=L, max_chunk=64),
                              sampler_mesh), "", options, 0)
    out["reshard_s"] = [handover.timed_hand_over(other, state, 1, "reshard", shardings)["seconds"]
                        for _ in range(3)]
    out["copy_s"] = [handover.timed_hand_over(other, state, 1, "copy")["seconds"]
                     for _ in range(3)]
    handover.timed_hand_over(other, state, 1, "reshard", shardings)
    [[g2]] = other.generate([Request(ps[0], greedy)])
    out["greedy_resharded"] = g2.tokens
    return out, ps


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def render(j: dict, v: dict | None, args: argparse.Namespace) -> str:
    jt = j["tokens"] / j["gen_s"]
    date = datetime.date.today().isoformat()
    out = [HEADING, "",
           f"{date}, {cpu_name()}, {os.cpu_count()} cores (shared; run under /work/bin/quiet, "
           f"one timed run after a warm-up). `configs/small.py` (102M parameters) at its initial "
           f"weights, float32; {args.batch} prompts of {args.prompt} tokens, {args.gen} tokens "
           f"each at temperature 1 (no stop), the whole batch in one call.", "",
           "| engine | tokens | seconds | tokens/s | prefill + first token s |",
           "|---|---|---|---|---|",
           f"| JAX sampler (slots {args.batch}, {args.decode_steps} decode steps per call, "
           f"per-layer weight copies) | "
           f"{j['tokens']} | {j['gen_s']:.2f} | {jt:.0f} | {j['first_s']:.2f} |"]
    if v is not None:
        vt = v["tokens"] / v["gen_s"]
        out.append(f"| vLLM 0.32 CPU (float32, eager) | {v['tokens']} | {v['gen_s']:.2f} | "
                   f"{vt:.0f} | - |")
        out += ["", f"**JAX sampler / vLLM: {jt / vt:.2f}x** tokens/s (goal >= 0.5x)."]
    mb = j["bytes"] / 2**20
    rs, cs = float(np.mean(j["reshard_s"])), float(np.mean(j["copy_s"]))
    out += ["", "| weights to the engine | MB | seconds |", "|---|---|---|",
            "| hand-over, same mesh (the learner's arrays) | 0 moved | 0 |",
            f"| hand-over, copy on the learner's 4 devices | {mb:.0f} | {cs:.3f} |",
            f"| hand-over, reshard fsdp 4 -> tensor 4 (other 4 devices, `jax.device_put`) | "
            f"{mb:.0f} | {rs:.3f} |",
            f"| publish float32 (`publish_weights`, safetensors + manifest) | {mb:.0f} | "
            f"{j['publish_s']:.2f} |"]
    if v is not None:
        rl = float(np.mean(v["reload_s"]))
        out += [f"| vLLM in-place reload of it (`gagar_reload_from`) | {mb:.0f} | {rl:.2f} |",
                "", f"**Resharded hand-over / (publish + vLLM reload): "
                f"{rs / (j['publish_s'] + rl):.1%}** (goal <= 10%)."]
    same = "equal" if v is not None and v["greedy"] == j["greedy"] else "not compared"
    out += ["", f"Greedy tokens of prompt 0: vLLM's and the JAX sampler's {same}; the resharded "
            f"sampler's and the published one's "
            f"{'equal' if j['greedy_resharded'] == j['greedy'] else 'DIFFERENT'}."]
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/gagar_bench_sampler", help="scratch directory")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--vllm-python", default=os.path.join(ROOT, ".venv-vllm", "bin", "python"),
                   help="the vLLM environment's python ('' to skip the vLLM part)")
    p.add_argument("--engine", default="", help=argparse.SUPPRESS)   # the vLLM side's entry
    p.add_argument("--no-docs", action="store_true", help="do not write docs/performance.md")
    args = p.parse_args()
    if args.engine:
        return engine(args.engine)
    import shutil
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    j, ps = jax_side(args, args.out)
    print(json.dumps(j), flush=True)
    v = None
    if args.vllm_python and os.path.exists(args.vllm_python):
        spec = os.path.join(args.out, "engine.json")
        json.dump({"path": j["path"], "prompts": ps, "gen": args.gen,
                   "max_len": args.prompt + args.gen + 1}, open(spec, "w"))
        env = {**os.environ, "PYTHONPATH": ROOT, "VLLM_CPU_KVCACHE_SPACE": "1"}
        env.pop("XLA_FLAGS", None)
        subprocess.run([args.vllm_python, os.path.abspath(__file__), "--engine", spec],
                       env=env, check=True)
        v = json.load(open(spec + ".out"))
        print(json.dumps(v), flush=True)
    section = render(j, v, args)
    print(section)
    if not args.no_docs:
        write_docs_section(os.path.join(ROOT, "docs", "performance.md"), HEADING, section)


if __name__ == "__main__":
    sys.exit(main())

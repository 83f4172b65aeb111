"""Weight sync: bytes and seconds of delta publishes against full ones, and vLLM's apply of a
delta against a full reload.

Run:  JAX_PLATFORMS=cpu .venv/bin/python scripts/bench_weight_sync.py     (writes the section
      "## Weight sync (scripts/bench_weight_sync.py)" of docs/performance.md; --no-docs to skip)

The `small` config (configs/small.py, 102M parameters) trains with its Adam (AdamW, clip 1.0) at
a constant learning rate (1e-6 and 1e-5, RL rates) on synthetic batches (`benchutil`); after
10 warm-up steps it publishes bf16 after every step twice: a full publisher (every version
full) and a delta publisher (one full base, then deltas: `train.publish_full_every`). The
figures are means over the deltas; a chain of K publishes writes one full base and K - 1 deltas,
so the bytes per publish at K are (full + (K - 1) x mean delta) / K. Every delta's chain is
materialized and compared with the full publish of the same step, byte for byte.

Then, in vLLM's environment (`--vllm-python`, default .venv-vllm/bin/python; its workers import
this checkout through PYTHONPATH), one engine serves each learning rate's publishes, from the delta
chain's base; per delta, one after the other (so under the same machine load): the apply by vLLM's
reload of the touched layers (`gagar_apply_version(fast=False)`, the old path), the fast apply
(`gagar_apply_version`), a full reload of the same step's full version (`gagar_reload_from`),
with untimed re-syncs between them. After the fast apply and after the full reload: greedy tokens
and log-probs of a fixed prompt, and `gagar_weights_digest` (every parameter and buffer, every
packed linear's output on a fixed input), which must be equal.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np
from benchutil import synthetic_batch, write_docs_section

HEADING = "## Weight sync (scripts/bench_weight_sync.py)"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXT = "gagar_jax.rollout.vllm_extension.GagarWorkerExtension"
PROMPT = [11, 507, 93, 2048, 7, 31000, 415, 3, 999, 12, 640, 88, 1500, 21, 8, 300]


# -- the learner side (.venv, JAX) ---------------------------------------------------------------

def learner(out: str, lr: float, warmup: int, publishes: int, B: int, S: int) -> dict:
    """Trains `small` at `lr`, publishes full and delta versions after every step past warm-up."""
    import jax
    from flax import nnx

    from gagar_jax import sharding as shd
    from gagar_jax.config import load_config_file
    from gagar_jax.rollout import delta
    from gagar_jax.run import publish
    from gagar_jax.run import step as TS

    cfg = load_config_file(os.path.join(ROOT, "configs", "small.py"))
    with cfg.unlocked():
        cfg.optim.learning_rate, cfg.optim.warmup_steps = lr, 0
        cfg.optim.schedule = "constant"
    step_cfg = dataclasses.replace(TS.StepConfig.from_config(cfg), micro_batches=1,
                                   mini_batches=1, epochs=1)
    mesh = shd.make_mesh(type("M", (), dict(data=-1, fsdp=1, expert=1, tensor=1)))
    state, graphdef, shardings = TS.init_train_state(step_cfg, mesh, jax.random.key(0))
    bsh = shd.batch_shardings(synthetic_batch(B, S, step_cfg.model.vocab_size), mesh)
    train_step = TS.make_train_step(step_cfg, mesh, shardings, bsh, graphdef)
    work = {k: os.path.join(out, f"lr{lr:g}", k) for k in ("full", "delta")}
    full = publish.Publisher(work["full"], keep=publishes + 1, dtype="bfloat16")
    deltas = publish.Publisher(work["delta"], keep=2, dtype="bfloat16",
                               full_every=publishes + 1)
    rows = []
    for i in range(1, warmup + publishes + 1):
        batch = jax.device_put(synthetic_batch(B, S, step_cfg.model.vocab_size, seed=i), bsh)
        state, m = train_step(state, batch)
        jax.block_until_ready(m)
        if i <= warmup:
            continue
        model = nnx.merge(graphdef, state.params, state.router_bias)
        row = {"step": i}
        for kind, pub in (("full", full), ("delta", deltas)):
            t0 = time.perf_counter()
            pub.publish(model, i)
            row[f"{kind}_blocking_s"] = time.perf_counter() - t0
            pub.wait()
            row[f"{kind}_s"] = time.perf_counter() - t0
            row[f"{kind}_bytes"] = pub.last_bytes
        s = deltas.last_delta
        if s is not None:
            row.update(changed=s.changed, elements=s.elements, sparse=s.sparse, dense=s.dense,
                       unchanged=s.unchanged)
            got = delta.materialize(publish.read_latest(work["delta"])["path"])
            ref = delta.load_full(publish.read_latest(work["full"])["path"])
            row["exact"] = sorted(got) == sorted(ref) and all(
                got[n].array.tobytes() == ref[n].array.tobytes() for n in ref)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"lr": lr, "rows": rows, "work": work}


def summarize(run: dict, ks: tuple) -> dict:
    d = [r for r in run["rows"] if "changed" in r]
    full_bytes = float(np.mean([r["full_bytes"] for r in run["rows"]]))
    delta_bytes = float(np.mean([r["delta_bytes"] for r in d]))
    return {
        "lr": run["lr"], "deltas": len(d), "exact": all(r["exact"] for r in d),
        "changed": float(np.mean([r["changed"] / r["elements"] for r in d])),
        "full_mb": full_bytes / 2**20, "delta_mb": delta_bytes / 2**20,
        "delta_frac": delta_bytes / full_bytes,
        "amortised": {k: (full_bytes + (k - 1) * delta_bytes) / (k * full_bytes) for k in ks},
        "full_s": float(np.mean([r["full_s"] for r in run["rows"]])),
        "delta_s": float(np.mean([r["delta_s"] for r in d])),
        "full_blocking_s": float(np.mean([r["full_blocking_s"] for r in run["rows"]])),
        "delta_blocking_s": float(np.mean([r["delta_blocking_s"] for r in d])),
        "sparse": float(np.mean([r["sparse"] for r in d])),
        "dense": float(np.mean([r["dense"] for r in d])),
        "unchanged": float(np.mean([r["unchanged"] for r in d])),
    }


# -- the engine side (.venv-vllm: no JAX) --------------------------------------------------------

def engine(spec_file: str) -> None:
    """Times full reloads and delta applies in one vLLM engine; writes the answers beside."""
    from vllm import LLM, SamplingParams

    from gagar_jax.rollout.pointer import read_manifest

    spec = json.load(open(spec_file))
    sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, prompt_logprobs=1,
                        detokenize=False, ignore_eos=True)

    def answer(llm):
        o = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0]
        c = o.outputs[0]
        return {"tokens": list(c.token_ids),
                "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)],
                "prompt_logprobs": [{str(k): v.logprob for k, v in p.items()} if p else None
                                    for p in o.prompt_logprobs]}

    def timed_rpc(llm, name, path, **kwargs):
        t0 = time.perf_counter()
        info = llm.collective_rpc(name, args=(path,), kwargs=kwargs)[0]
        assert llm.reset_prefix_cache()
        return time.perf_counter() - t0, info

    first = spec["runs"][0]["full"][0]
    t0 = time.perf_counter()
    llm = LLM(model=first, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              max_model_len=256, seed=0, worker_extension_cls=EXT, gpu_memory_utilization=0.5)
    result = {"start_s": time.perf_counter() - t0, "runs": []}
    rpc = lambda name, *a, **k: llm.collective_rpc(name, args=a, kwargs=k)[0]
    for run in spec["runs"]:
        rows, deltas = [], run["delta"]
        t0 = time.perf_counter()
        base = rpc("gagar_apply_version", deltas[0])      # the chain's base: a full load
        base_s = time.perf_counter() - t0
        for prev, path, full in zip(deltas[:-1], deltas[1:], run["full"][1:], strict=True):
            assert read_manifest(path)["step"] == read_manifest(full)["step"]
            # paired under the same load: vLLM's reload of the touched layers (the old apply),
            # the fast apply, a full reload of the same step; untimed re-syncs between them
            old_s, old = timed_rpc(llm, "gagar_apply_version", path, fast=False)
            rpc("gagar_apply_version", prev)
            s, info = timed_rpc(llm, "gagar_apply_version", path)
            got, got_w = answer(llm), rpc("gagar_weights_digest")
            full_s, _ = timed_rpc(llm, "gagar_reload_from", full)
            ref, ref_w = answer(llm), rpc("gagar_weights_digest")
            rpc("gagar_apply_version", path)
            row = {"step": read_manifest(path)["step"], "reload_s": full_s, "apply_s": s,
                   "apply_read_s": info["read_s"], "apply_reload_s": info["reload_s"],
                   "old_apply_s": old_s, "old_reloaded": old["reloaded"],
                   "rebuilt": len(info["rebuilt"]), "fed": info["reloaded"],
                   "tiled": info.get("tiled"), "patched": len(info.get("patched", [])),
                   "patched_elements": info.get("patched_elements", 0),
                   "reprocessed": len(info.get("reprocessed", [])),
                   "slow_groups": len(info["slow_groups"]), "deltas": info["deltas"],
                   "equal": got == ref, "tensors_equal": got_w == ref_w, "tensors": len(ref_w)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        result["runs"].append({"lr": run["lr"], "rows": rows, "base_s": base_s,
                               "probe_s": base.get("probe_s")})
    json.dump(result, open(spec_file + ".out", "w"))


def versions(work: str) -> list:
    root = os.path.join(work, "published")
    names = sorted(n for n in os.listdir(root) if n.startswith("step_"))
    return [os.path.join(root, n) for n in names]


def render(summaries: list, eng: dict | None, args: argparse.Namespace) -> str:
    ks = sorted(summaries[0]["amortised"])
    out = [HEADING, "",
           f"`{' '.join(sys.argv)}`: configs/small.py (102M parameters, Qwen3-MoE layout, "
           f"head_dim 64) trained at batch [{args.batch}] with AdamW (clip 1.0, constant rate), "
           f"{args.warmup} warm-up steps, then a bf16 publish after each of {args.publishes} "
           "steps: one full base and "
           f"{args.publishes - 1} deltas (each on the version before it). 2 shared CPU cores; "
           "times are means and read as ratios (the machine runs other jobs).", "",
           "| lr | elements changed per step | delta MB (full MB) | delta / full bytes | "
           + " | ".join(f"bytes / publish, K={k}" for k in ks)
           + " | publish s: full / delta (training blocked) | base + deltas == full |",
           "|---|---|---|---|" + "---|" * len(ks) + "---|---|"]
    for s in summaries:
        out.append(
            f"| {s['lr']:g} | {100 * s['changed']:.2f}% | {s['delta_mb']:.1f} ({s['full_mb']:.0f})"
            f" | {100 * s['delta_frac']:.1f}% | "
            + " | ".join(f"{100 * s['amortised'][k]:.1f}%" for k in ks)
            + f" | {s['full_s']:.2f} / {s['delta_s']:.2f} ({s['full_blocking_s']:.2f} / "
            f"{s['delta_blocking_s']:.2f}) | {'yes' if s['exact'] else 'NO'} "
            f"({s['deltas']} deltas) |")
    if eng is not None:
        out += ["", f"vLLM 0.32 CPU build, one engine (start {eng['start_s']:.0f} s), bf16, "
                "`enforce_eager`; per step, under the same load, vLLM's reload of the touched "
                "layers (the old apply), the fast apply and a full reload of the same step, "
                "each the `collective_rpc` and prefix-cache reset; means over the steps, and "
                "the median of the per-step ratios:", "",
                "| lr | full reload s | fast apply s (read + bit copies / patch + rebuild) | "
                "fast / full: mean (median) | old apply s | old / full: mean (median) | "
                "modules patched (elements written; re-processed) | modules rebuilt (tensors "
                "fed) | engine equal to the full reload's: tokens and log-probs / every tensor "
                "and packed linear |", "|---|---|---|---|---|---|---|---|---|"]
        for r in eng["runs"]:
            rows = r["rows"]
            full = np.mean([x["reload_s"] for x in rows])
            app = np.mean([x["apply_s"] for x in rows])
            old = np.mean([x["old_apply_s"] for x in rows])
            med = {k: np.median([x[k] / x["reload_s"] for x in rows])
                   for k in ("apply_s", "old_apply_s")}
            out.append(
                f"| {r['lr']:g} | {full:.2f} | {app:.3f} "
                f"({np.mean([x['apply_read_s'] for x in rows]):.3f} / "
                f"{np.mean([x['apply_reload_s'] for x in rows]):.3f}) | {100 * app / full:.0f}% "
                f"({100 * med['apply_s']:.0f}%) | {old:.2f} | {100 * old / full:.0f}% "
                f"({100 * med['old_apply_s']:.0f}%) | "
                f"{np.mean([x.get('patched', 0) for x in rows]):.0f} "
                f"({np.mean([x.get('patched_elements', 0) for x in rows]):.0f}; "
                f"{np.mean([x.get('reprocessed', 0) for x in rows]):.0f}) | "
                f"{np.mean([x['rebuilt'] for x in rows]):.0f}"
                f" ({np.mean([x['fed'] for x in rows]):.0f}) | "
                f"{sum(x['equal'] for x in rows)}/{len(rows)} / "
                f"{sum(x['tensors_equal'] for x in rows)}/{len(rows)} |")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/gagar_bench_weight_sync", help="scratch directory")
    p.add_argument("--lrs", default="1e-6,1e-5")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--publishes", type=int, default=20,
                   help="publishes per learning rate: one full base, then deltas")
    p.add_argument("--batch", default="4x128", help="BxS of the synthetic batches")
    p.add_argument("--ks", default="8,16,32", help="chain lengths K to amortise the base over")
    p.add_argument("--vllm-python", default=os.path.join(ROOT, ".venv-vllm", "bin", "python"),
                   help="the vLLM environment's python ('' to skip the engine part)")
    p.add_argument("--engine", default="", help=argparse.SUPPRESS)   # the vLLM side's entry
    p.add_argument("--no-docs", action="store_true", help="do not write docs/performance.md")
    args = p.parse_args()
    if args.engine:
        return engine(args.engine)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    B, S = (int(x) for x in args.batch.split("x"))
    ks = tuple(int(k) for k in args.ks.split(","))
    runs = [learner(args.out, float(lr), args.warmup, args.publishes, B, S)
            for lr in args.lrs.split(",")]
    summaries = [summarize(r, ks) for r in runs]
    eng = None
    if args.vllm_python and not os.path.exists(args.vllm_python):
        print(f"{args.vllm_python} not found (make vllm): the engine part is skipped")
    elif args.vllm_python:
        spec = os.path.join(args.out, "engine.json")
        json.dump({"runs": [{"lr": r["lr"], "full": versions(r["work"]["full"]),
                             "delta": versions(r["work"]["delta"])} for r in runs]},
                  open(spec, "w"))
        env = {**os.environ, "PYTHONPATH": ROOT, "VLLM_CPU_KVCACHE_SPACE": "1"}
        subprocess.run([args.vllm_python, os.path.abspath(__file__), "--engine", spec],
                       env=env, check=True)
        eng = json.load(open(spec + ".out"))
    section = render(summaries, eng, args)
    print(section)
    print(json.dumps({"summaries": summaries}, indent=1))
    if not args.no_docs:
        write_docs_section(os.path.join(ROOT, "docs", "performance.md"), HEADING, section)


if __name__ == "__main__":
    main()

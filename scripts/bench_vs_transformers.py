"""The CPU train-step core against Hugging Face transformers: same weights, same tokens, same loss.

Run:  JAX_PLATFORMS=cpu .venv/bin/python scripts/bench_vs_transformers.py
      (--attention / --experts pick gagar_jax's paths; --rows/--seq the batch; --reps timings;
      --breakdown also times the trunk and the head alone; --single-thread: one thread each,
      timed in CPU seconds; --same-process: both libraries in this one process, the old design)

Builds the `configs/small.py` model (D 512, 8 layers, 16 experts top-2, vocab 32k, fp32) with
random weights, publishes it with `hf.save_pretrained`, and loads that directory into
transformers' `Qwen3MoeForCausalLM` (its default attention and expert implementations). Both
compute loss = mean next-token negative log-prob over every row of one random [rows, seq] batch
(one segment per row) and its gradient with respect to all weights: forward + backward.

Each library runs in a process of its own, as it would for a user: gagar_jax in this one (torch
is never imported here), transformers in a worker subprocess (torch threads = cores; XLA:CPU
uses its own pool). After checking the losses agree, the two take turns (jax, torch, jax, ...;
medians over `--reps` turns). In each turn a library first runs `--warm` untimed steps (default
1), so its timed step follows a step of its own, as in a training loop. Why: a step frees its
buffers at the end (XLA:CPU's 2 GB temp allocation, torch's tensors), and on a VM that hands
freed pages back to the host, memory left free for the seconds the other library's step takes
costs several times more to fault in again; `--warm 0` (strict alternation) measures exactly
that cost, `--same-process` runs both libraries in one process (docs/performance.md has all
three). Every timed step also reports its process's user and system CPU time and page faults.
Prints the times and the ratio transformers / gagar_jax (> 1: gagar_jax is faster): the median
of the per-pair ratios, each pair being one timed step of each library taken back to back, with
the machine (CPU model, cores, load average, the CPU time the hypervisor took: steal) beside it.

On a machine shared with other jobs the wall times measure the other jobs. `--realtime` puts both
processes under round-robin real-time scheduling (SCHED_RR, priority 1: root or CAP_SYS_NICE),
so ordinary processes get only the CPU the kernel's real-time throttle leaves them (5%): the
comparison then runs as on a quiet machine. It must be asked for; the run says whether it held.

gagar_jax's loss goes through `logprobs.token_logprobs`, the trainer's own path, which also
computes the per-token entropy the policy loss reports; transformers computes the cross-entropy
only.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from benchutil import Clock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SINGLE_THREAD_XLA = " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


# --------------------------------------------------------------------------- the machine
def cpu_model() -> str:
    """The CPU's model name and the vector extensions that matter for these kernels."""
    name, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name == "unknown CPU":
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    isa = [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if x in flags]
    return f"{name} ({os.cpu_count()} cores; {', '.join(isa) or 'no AVX2'})"


def steal_ticks() -> int:
    """The CPU time the hypervisor gave to others, in ticks since boot (/proc/stat's steal)."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8])
    except (OSError, IndexError, ValueError):
        return 0


def go_realtime() -> bool:
    """SCHED_RR at priority 1 for this process and what it starts (True if it held)."""
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
    except (AttributeError, PermissionError, OSError):
        return False
    return os.sched_getscheduler(0) == os.SCHED_RR


# --------------------------------------------------------------------------- transformers
def torch_cases(path: str, threads: int, tokens: np.ndarray, trunk_r, head_h0) -> dict:
    """name -> zero-argument step of transformers' model (full step, trunk, head)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    ids = torch.from_numpy(tokens.astype(np.int64))

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return float(out.loss.detach())

    def trunk():
        model.zero_grad(set_to_none=True)
        (model.model(input_ids=ids).last_hidden_state * torch.from_numpy(trunk_r)).sum().backward()

    def head():
        model.zero_grad(set_to_none=True)
        ht = torch.from_numpy(head_h0).requires_grad_(True)
        logits = model.lm_head(ht[:, :-1]).float()
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                          ids[:, 1:].reshape(-1)).backward()

    return {"step": step, "trunk": trunk, "head": head}


class TorchProcess:
    """The transformers side in a subprocess (`torch_worker`)."""

    def __init__(self, workdir: str, threads: int, cpu_clock: bool):
        cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker", workdir,
               "--threads", str(threads)] + (["--single-thread"] if cpu_clock else [])
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True)
        self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"transformers worker died (exit {self.proc.wait()})")
        return json.loads(line)

    def __call__(self, case: str) -> dict:
        self.proc.stdin.write(case + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


class TorchInProcess:
    """The transformers side in this process (`--same-process`)."""

    def __init__(self, workdir: str, threads: int, cpu_clock: bool):
        data = np.load(os.path.join(workdir, "inputs.npz"))
        self.cases = torch_cases(os.path.join(workdir, "hf"), threads, data["tokens"],
                                 data["trunk_r"], data["head_h0"])
        self.clock = Clock(cpu_clock)

    def __call__(self, case: str) -> dict:
        return self.clock(self.cases[case])

    def close(self) -> None:
        pass


def torch_worker(workdir: str, threads: int, cpu_clock: bool) -> None:
    """Serves timed steps over stdin/stdout: reads a case name per line, answers a JSON line."""
    side = TorchInProcess(workdir, threads, cpu_clock)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(side(line.strip())), flush=True)


# --------------------------------------------------------------------------- gagar_jax
def jax_parts(model, tokens: np.ndarray, trunk_r, head_h0) -> dict:
    """name -> (jit(value_and_grad) of gagar_jax's full step, trunk or head, its arguments)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from gagar_jax.model.logprobs import chunked_logprobs_entropy, logits_bytes, token_logprobs

    cfg = model.cfg
    B, S = tokens.shape
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tok = jnp.asarray(tokens)

    def loss(p, tokens):
        m = nnx.merge(graphdef, p, rest)
        seg = jnp.ones((B, S), jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        lp, _, _ = token_logprobs(m, tokens, seg, pos)
        return -jnp.sum(lp) / (B * (S - 1))   # position 0 predicts nothing (lp = 0 there)

    def trunk(p, tokens):
        h, _ = nnx.merge(graphdef, p, rest).hidden_states(tokens)
        return jnp.sum(h * trunk_r)

    def head(w, h):
        keep = (logits_bytes(B * (S - 1), cfg.vocab_size, cfg.logprob_vocab_chunk)
                <= cfg.logprob_keep_logits_mib * 2**20)     # as token_logprobs decides
        lp, _ = chunked_logprobs_entropy(h[:, :-1], w, tok[:, 1:], cfg.logprob_vocab_chunk, keep)
        return -jnp.mean(lp)

    step = jax.jit(jax.value_and_grad(loss))
    jt = jax.jit(jax.value_and_grad(trunk))
    jh = jax.jit(jax.value_and_grad(head, argnums=(0, 1)))
    w, h = model.output_kernel_DxV(), jnp.asarray(head_h0)
    return {"step": (step, (params, tok)), "trunk": (jt, (params, tok)), "head": (jh, (w, h))}


def jax_cases(*inputs) -> dict:
    """name -> zero-argument call of `jax_parts`' function (the step returns its loss)."""
    import jax

    parts = jax_parts(*inputs)

    def call(name):
        f, args = parts[name]
        return lambda: jax.block_until_ready(f(*args))

    cases = {name: call(name) for name in parts}
    step = cases["step"]
    cases["step"] = lambda: float(step()[0])
    return cases


def interleaved(name: str, jax_fn, torch_fn, reps: int, warm: int, log: bool = True):
    """Medians of `reps` pairs of turns (jax first, then torch); in each turn a library runs
    `warm` untimed calls, then the timed one. warm = 0 alternates timed calls one by one.
    Returns (jax median s, torch median s, the pairs' ratios torch / jax)."""
    jax_fn(name)
    torch_fn(name)
    js, ts = [], []
    for _ in range(reps):
        for fn, out in ((jax_fn, js), (torch_fn, ts)):
            for _ in range(warm):
                fn(name)
            out.append(fn(name))
        if log:
            print(f"  {name}: gagar_jax {_fmt(js[-1])}   transformers {_fmt(ts[-1])}   "
                  f"pair ratio {ts[-1]['s'] / js[-1]['s']:.2f}x", flush=True)
    ratios = [t["s"] / j["s"] for j, t in zip(js, ts, strict=True)]
    return float(np.median([r["s"] for r in js])), float(np.median([r["s"] for r in ts])), ratios


def _fmt(r: dict) -> str:
    return (f"{r['s']:.2f} s (user {r['user']:.1f}, sys {r['sys']:.1f}, "
            f"{r['faults'] // 1000}k faults)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model and batch options (shared with scripts/profile_cpu_step.py)."""
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--attention", default="blockwise")
    p.add_argument("--experts", default="grouped")
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "small.py"))


def build(args):
    """(gagar_jax model with random weights, tokens, trunk probe r, head input h0) from the args."""
    from flax import nnx

    from gagar_jax.config import load_config_file
    from gagar_jax.model.transformer import ModelConfig, Transformer

    cfg = ModelConfig.from_config(load_config_file(args.config).model)
    cfg = dataclasses.replace(cfg, attention=args.attention, expert_backend=args.experts)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (args.rows, args.seq)).astype(np.int32)
    trunk_r = rng.normal(size=(args.rows, args.seq, cfg.hidden_size)).astype(np.float32)
    head_h0 = rng.normal(size=(args.rows, args.seq, cfg.hidden_size)).astype(np.float32)
    return model, tokens, trunk_r, head_h0


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--reps", type=int, default=5,
                   help="alternating pairs: timed steps of each library, taken in turns")
    p.add_argument("--realtime", action="store_true",
                   help="both processes under SCHED_RR priority 1 (root): the machine's other "
                        "jobs cannot take the CPU from the comparison")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--single-thread", action="store_true",
                   help="both libraries on one thread, timed in CPU seconds of their process: "
                        "the comparison a shared, loaded machine cannot disturb much")
    p.add_argument("--same-process", action="store_true",
                   help="run transformers in this process too (the libraries then share, and "
                        "disturb, one memory allocator)")
    p.add_argument("--warm", type=int, default=1,
                   help="untimed calls before each timed one, in every turn of a library (the "
                        "timed call then runs right after its own kind, as in a training loop; "
                        "0: strict alternation, every call right after the other library's)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the trunk (layers) and the head (log-softmax) alone")
    p.add_argument("--torch-worker", metavar="DIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.single_thread:
        args.threads = 1
    if args.torch_worker:
        torch_worker(args.torch_worker, args.threads, args.single_thread)
        return {}

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    realtime = go_realtime() if args.realtime else False
    if args.realtime and not realtime:
        print("--realtime: SCHED_RR refused (needs root or CAP_SYS_NICE); timing as is",
              flush=True)
    machine = cpu_model()
    if args.single_thread:   # must reach XLA before jax is imported
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + SINGLE_THREAD_XLA
    model, tokens, trunk_r, head_h0 = build(args)
    from gagar_jax.hf import api as hf

    clock = Clock(args.single_thread)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(model, os.path.join(d, "hf"))
        np.savez(os.path.join(d, "inputs.npz"), tokens=tokens, trunk_r=trunk_r, head_h0=head_h0)
        torch_side = (TorchInProcess if args.same_process else TorchProcess)(
            d, args.threads, args.single_thread)
        cases = jax_cases(model, tokens, trunk_r, head_h0)
        jax_fn = lambda name: clock(cases[name])
        try:
            first = jax_fn("step")                        # compiles
            t_loss = torch_side("step")["out"]
            j_loss = first["out"]
            rel = abs(j_loss - t_loss) / abs(t_loss)
            print(f"loss gagar_jax {j_loss:.6f}  transformers {t_loss:.6f}  (rel diff {rel:.1e}); "
                  f"gagar_jax compile {first['s']:.1f} s", flush=True)
            if rel > 1e-4:
                raise SystemExit(f"losses disagree: {j_loss} vs {t_loss}")
            steal0, load0 = steal_ticks(), os.getloadavg()[0]
            j_med, t_med, ratios = interleaved("step", jax_fn, torch_side, args.reps, args.warm)
            steal = (steal_ticks() - steal0) / os.sysconf("SC_CLK_TCK")
            where = "one process" if args.same_process else "separate processes"
            ratio = float(np.median(ratios))
            print(f"fwd+bwd [{args.rows}, {args.seq}] attention={args.attention} "
                  f"experts={args.experts}, {args.threads} thread(s), {where}, warm "
                  f"{args.warm}: gagar_jax "
                  f"{j_med:.2f} s, transformers {t_med:.2f} s; ratio transformers / gagar_jax = "
                  f"{ratio:.2f}x (median of {len(ratios)} pairs, {min(ratios):.2f}-"
                  f"{max(ratios):.2f})", flush=True)
            print(f"machine: {machine}; load average {load0:.1f} -> {os.getloadavg()[0]:.1f}; "
                  f"steal {steal:.1f} s; {'real-time' if realtime else 'normal'} scheduling",
                  flush=True)
            out = dict(gagar_s=j_med, transformers_s=t_med, ratio=ratio, pair_ratios=ratios,
                       loss=j_loss, cpu=machine, realtime=realtime, steal_s=steal)
            if args.breakdown:
                for name in ("trunk", "head"):
                    jm, tm, _ = interleaved(name, jax_fn, torch_side, args.reps, args.warm,
                                            log=False)
                    print(f"  {name}: gagar_jax {jm:.2f} s, transformers {tm:.2f} s "
                          f"({tm / jm:.2f}x)", flush=True)
                    out[name] = (jm, tm)
        finally:
            torch_side.close()
    return out


if __name__ == "__main__":
    main()

"""The CPU train-step core against Hugging Face transformers: same weights, same tokens, same loss.

Run:  JAX_PLATFORMS=cpu .venv/bin/python scripts/bench_vs_transformers.py
      (--attention / --experts pick gagar_jax's paths; --rows/--seq the batch; --reps timings;
      --single-thread: one thread each, timed in CPU seconds, for a loaded machine)

Builds the `configs/small.py` model (D 512, 8 layers, 16 experts top-2, vocab 32k, fp32) with
random weights, publishes it with `hf.save_pretrained`, and loads that directory into
transformers' `Qwen3MoeForCausalLM` (its default attention and expert implementations). Both
compute loss = mean next-token negative log-prob over every row of one random [rows, seq] batch
(one segment per row) and its gradient with respect to all weights: forward + backward. The two
are timed interleaved in one process (jax, torch, jax, torch, ...; medians), each library on
all cores (torch threads = cores; XLA:CPU uses its own pool), after checking the losses agree.
Prints the times and the ratio transformers / gagar_jax (> 1: gagar_jax is faster).

gagar_jax's loss goes through `logprobs.token_logprobs`, the trainer's own path, which also
computes the per-token entropy the policy loss reports; transformers computes the cross-entropy
only.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--single-thread" in sys.argv:   # must reach XLA before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_cpu_multi_thread_eigen=false"
                               " intra_op_parallelism_threads=1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from gagar_jax import hf  # noqa: E402
from gagar_jax.config import load_config_file  # noqa: E402
from gagar_jax.logprobs import chunked_logprobs_entropy, logits_bytes, token_logprobs  # noqa: E402
from gagar_jax.model import ModelConfig, Transformer  # noqa: E402


CLOCK = time.perf_counter   # --single-thread: time.process_time (CPU seconds of this process)


def gagar_step(model: Transformer):
    """jit(value_and_grad) of the mean next-token negative log-prob over the params."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, tokens):
        m = nnx.merge(graphdef, p, rest)
        B, S = tokens.shape
        seg = jnp.ones((B, S), jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        lp, _, _ = token_logprobs(m, tokens, seg, pos)
        return -jnp.sum(lp) / (B * (S - 1))   # position 0 predicts nothing (lp = 0 there)

    step = jax.jit(jax.value_and_grad(loss))
    return lambda tokens: step(params, tokens)


def torch_step(path: str, threads: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()

    def step(tokens: np.ndarray):
        model.zero_grad(set_to_none=True)
        ids = torch.from_numpy(tokens.astype(np.int64))
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return float(out.loss.detach())
    return step, model


def breakdown(model: Transformer, torch_model, tokens: np.ndarray, reps: int) -> None:
    """Times the two halves of the step in both libraries, interleaved: the trunk (embedding and
    layers: loss = <final hidden states, a fixed random tensor>) and the head (output
    projection and log-softmax from fixed hidden states), forward + backward each."""
    import torch

    cfg = model.cfg
    B, S = tokens.shape
    rng = np.random.default_rng(1)
    r = rng.normal(size=(B, S, cfg.hidden_size)).astype(np.float32)
    h0 = rng.normal(size=(B, S, cfg.hidden_size)).astype(np.float32)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def j_trunk(p, tok):
        h, _ = nnx.merge(graphdef, p, rest).hidden_states(tok)
        return jnp.sum(h * r)

    def j_head(w, h):
        keep = (logits_bytes(B * (S - 1), cfg.vocab_size, cfg.logprob_vocab_chunk)
                <= cfg.logprob_keep_logits_mib * 2**20)     # as token_logprobs decides
        lp, _ = chunked_logprobs_entropy(h[:, :-1], w, jnp.asarray(tokens)[:, 1:],
                                         cfg.logprob_vocab_chunk, keep)
        return -jnp.mean(lp)

    jt = jax.jit(jax.value_and_grad(j_trunk))
    jh = jax.jit(jax.value_and_grad(j_head, argnums=(0, 1)))
    tok, w, h = jnp.asarray(tokens), model.output_kernel_DxV(), jnp.asarray(h0)
    ids = torch.from_numpy(tokens.astype(np.int64))
    rt = torch.from_numpy(r)

    def t_trunk():
        torch_model.zero_grad(set_to_none=True)
        (torch_model.model(input_ids=ids).last_hidden_state * rt).sum().backward()

    def t_head():
        torch_model.zero_grad(set_to_none=True)
        ht = torch.from_numpy(h0).requires_grad_(True)
        logits = torch_model.lm_head(ht[:, :-1]).float()
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                          ids[:, 1:].reshape(-1)).backward()

    cases = {"trunk": (lambda: jt(params, tok), t_trunk), "head": (lambda: jh(w, h), t_head)}
    for name, (jf, tf) in cases.items():
        jax.block_until_ready(jf())
        tf()
        js, ts = [], []
        for _ in range(reps):
            t0 = CLOCK()
            jax.block_until_ready(jf())
            js.append(CLOCK() - t0)
            t0 = CLOCK()
            tf()
            ts.append(CLOCK() - t0)
        print(f"  {name}: gagar_jax {np.median(js):.2f} s, transformers {np.median(ts):.2f} s",
              flush=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3, help="timed steps of each library")
    p.add_argument("--attention", default="blockwise")
    p.add_argument("--experts", default="grouped")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--single-thread", action="store_true",
                   help="both libraries on one thread, timed in CPU seconds of this process: "
                        "the comparison a shared, loaded machine cannot disturb much")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the trunk (layers) and the head (log-softmax) alone")
    args = p.parse_args(argv)
    global CLOCK
    if args.single_thread:
        args.threads, CLOCK = 1, time.process_time

    cfg = ModelConfig.from_config(load_config_file(os.path.join(ROOT, "configs", "small.py")).model)
    cfg = dataclasses.replace(cfg, attention=args.attention, expert_backend=args.experts)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.rows, args.seq),
                                               dtype=np.int64).astype(np.int32)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(model, d)
        t_step, t_model = torch_step(d, args.threads)
    j_step = gagar_step(model)

    t0 = CLOCK()
    j_loss = float(jax.block_until_ready(j_step(jnp.asarray(tokens)))[0])
    compile_s = CLOCK() - t0
    t_loss = t_step(tokens)                       # warm-up
    rel = abs(j_loss - t_loss) / abs(t_loss)
    print(f"loss gagar_jax {j_loss:.6f}  transformers {t_loss:.6f}  (rel diff {rel:.1e}); "
          f"gagar_jax compile {compile_s:.1f} s", flush=True)
    if rel > 1e-4:
        raise SystemExit(f"losses disagree: {j_loss} vs {t_loss}")
    jt, tt = [], []
    for _ in range(args.reps):
        t0 = CLOCK()
        jax.block_until_ready(j_step(jnp.asarray(tokens)))
        jt.append(CLOCK() - t0)
        t0 = CLOCK()
        t_step(tokens)
        tt.append(CLOCK() - t0)
        print(f"  gagar_jax {jt[-1]:.2f} s   transformers {tt[-1]:.2f} s", flush=True)
    j_med, t_med = float(np.median(jt)), float(np.median(tt))
    print(f"fwd+bwd [{args.rows}, {args.seq}] attention={args.attention} experts={args.experts}: "
          f"gagar_jax {j_med:.2f} s, transformers {t_med:.2f} s; "
          f"ratio transformers / gagar_jax = {t_med / j_med:.2f}x")
    if args.breakdown:
        breakdown(model, t_model, tokens, args.reps)
    return dict(gagar_s=j_med, transformers_s=t_med, ratio=t_med / j_med, loss=j_loss)


if __name__ == "__main__":
    main()

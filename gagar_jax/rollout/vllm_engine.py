"""vLLM behind the engine interface (`gagar_jax.rollout.engine.Engine`): the worker's default
engine, `--engine gagar_jax.rollout.vllm_engine:make` (docs/rollout.md, "Engines").

    engine = make(read_latest(workdir)["path"], EngineOptions(seed=0))
    [comps] = engine.generate([Request(prompt_ids, SamplingSpec(max_tokens=8), seed=7, n=4)])

Runs in .venv-vllm; vLLM is imported inside functions only, so this module imports without it
(and without JAX). Token ids in, token ids out (no tokenizer), eager, float32 compute.

Routing: the extension's router hook (`gagar_capture_routes`) sees the whole scheduled batch of a
forward step, and the CPU build has no per-request routing output (vLLM's `routed_experts` needs
its V2 model runner, Triton). So while routing capture is on, requests are **serialised**: one
sample per `LLM.generate` call, whose captured rows then belong to it, in order (the last g rows
are the passes that produced its g tokens; a prefix-cache hit only removes rows of the prompt).
With routing off, every sample of a `generate` call goes to vLLM in one batch. On a GPU build,
`enable_return_routed_experts=True` gives per-request routing with batching.

Live sequences: vLLM keeps no sequence between calls; a continuation resubmits the whole
sequence (its prompt, every turn since, the appended tokens) and the prefix cache (on by
default) finds the part already computed, so only the new tokens are prefilled.
"""
from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from typing import Any

from gagar_jax.rollout import delta
from gagar_jax.rollout.engine import Completion, EngineOptions, Request
from gagar_jax.rollout.pointer import read_latest, read_manifest

EXTENSION = "gagar_jax.rollout.vllm_extension.GagarWorkerExtension"
# vLLM's finish reasons -> the interface's (an aborted request was cancelled)
_FINISH = {"stop": "stop", "length": "length", "abort": "cancelled"}
# Structured outputs (`SamplingSpec.json_schema`) with a tokenizer: xgrammar, no whitespace
# between JSON tokens. vLLM reads this from the engine's config only (a request's
# `disable_any_whitespace` is ignored by xgrammar); with free whitespace a weak judge (the tiny
# test models) fills max_tokens with "\r" between the braces (measured).
NO_FREE_WHITESPACE = {"backend": "xgrammar", "disable_any_whitespace": True}


def make_llm(path: str, *, seed: int = 0, max_model_len: int = 256,
             logprobs_mode: str = "raw_logprobs", dtype: str = "float32",
             **kwargs: Any) -> Any:
    """A vLLM `LLM` on a published (full) directory, with the gagar worker extension.

    No tokenizer (token ids in, token ids out; `skip_tokenizer_init=False` loads the one beside
    the weights, which structured outputs need, with `NO_FREE_WHITESPACE`), eager mode, float32
    compute (a bf16 directory is upcast: the engine then differs from the learner by the weight
    rounding only). Call it under `if __name__ == "__main__":` (the CPU platform spawns its
    workers). On CPU set
    `VLLM_CPU_KVCACHE_SPACE` (GiB) before calling; it defaults to 1 here.

    Args:
      path: a full published version directory (HF safetensors + config.json).
      seed, max_model_len, logprobs_mode, dtype, kwargs: passed to `vllm.LLM`.
    Returns:
      The `vllm.LLM`.
    """
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    kwargs.setdefault("skip_tokenizer_init", True)
    if not kwargs["skip_tokenizer_init"]:
        kwargs.setdefault("structured_outputs_config", NO_FREE_WHITESPACE)
    return LLM(model=path, enforce_eager=True, dtype=dtype,
               max_model_len=max_model_len, seed=seed, logprobs_mode=logprobs_mode,
               worker_extension_cls=EXTENSION, **kwargs)


def routes_array(calls: list) -> list:
    """The extension's popped routes [(layer name, [[id] * K] * rows), ...] (call order) as
    [rows][L][K], layers in the order of their first call (= the model's layer order)."""
    per_layer: dict = {}
    for name, rows in calls:
        per_layer.setdefault(name, []).extend(rows)
    if not per_layer:
        return []
    cols = list(per_layer.values())
    n = {len(c) for c in cols}
    if len(n) != 1:
        raise RuntimeError(f"MoE layers captured different token counts: {sorted(n)}")
    return [[c[r] for c in cols] for r in range(n.pop())]


def version_of(path: str) -> int:
    """The `policy_version` in a published directory's manifest (0 for a plain checkpoint)."""
    return int((read_manifest(path) or {}).get("policy_version", 0))


class VLLMEngine:
    """`Engine` on a `vllm.LLM` with the gagar worker extension (see the module docstring).

    Attributes:
      llm: the `vllm.LLM` (for tests and tools that call the extension directly).
      path: the version directory it serves.
    """

    name = "vllm"

    def __init__(self, llm: Any, path: str, options: EngineOptions):
        self.llm, self.options, self.path = llm, options, path
        self.version = version_of(path)
        self.chained = False      # it has applied a delta: later versions go through chains
        self._live: dict = {}     # sequence id -> every token id of it
        self._ids = itertools.count()

    def generate(self, requests: Sequence[Request]) -> list:
        """Per request its `n` completions (see `Engine.generate`); one vLLM request per
        sample, sample j seeded `seed + j`, serialised while routing is recorded."""
        jobs = []          # (request index, full prompt, SamplingParams, parent sequence)
        for i, r in enumerate(requests):
            if r.sampling.logprobs_mode != self.options.logprobs_mode:
                raise ValueError(f"request {i}: logprobs_mode {r.sampling.logprobs_mode!r}, but "
                                 f"this engine serves {self.options.logprobs_mode!r}")
            if r.sequence is not None and r.sequence not in self._live:
                raise KeyError(f"request {i}: no live sequence {r.sequence!r} (cancelled?)")
            if r.sequence is not None and r.sequence in {j[3] for j in jobs}:
                raise ValueError(f"request {i}: sequence {r.sequence!r} is continued twice")
            prompt = (self._live[r.sequence] if r.sequence else []) + [int(t) for t in r.tokens]
            if len(prompt) >= self.options.max_model_len:
                raise ValueError(f"request {i}: {len(prompt)} tokens fill the context "
                                 f"(max_model_len {self.options.max_model_len})")
            for j in range(r.n):
                seed = None if r.seed is None else r.seed + j
                jobs.append((i, prompt, _params(r.sampling, seed), r.sequence))
        outs = []
        if self.options.routing:
            for _, prompt, sp, _ in jobs:
                self.llm.collective_rpc("gagar_capture_routes", args=(True,))
                out = self.llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
                calls = self.llm.collective_rpc("gagar_pop_routes")[0]
                outs.append((out.outputs[0], routes_array(calls)))
        else:
            got = self.llm.generate([{"prompt_token_ids": p} for _, p, _, _ in jobs],
                                    [sp for _, _, sp, _ in jobs], use_tqdm=False)
            outs = [(o.outputs[0], None) for o in got]
        result = [[] for _ in requests]
        for (i, prompt, _, parent), (out, rows) in zip(jobs, outs, strict=True):
            result[i].append(self._completion(prompt, out, rows, parent))
        return result

    def _completion(self, prompt: list, out: Any, rows: list | None,
                    parent: str | None) -> Completion:
        tokens = list(out.token_ids)
        logprobs = [float(out.logprobs[j][t].logprob) for j, t in enumerate(tokens)]
        routed = None
        if rows:
            if len(rows) < len(tokens):
                raise RuntimeError(f"captured {len(rows)} routing rows for {len(tokens)} tokens")
            routed = rows[len(rows) - len(tokens):]
        seq = parent if parent is not None else f"s{next(self._ids)}"
        self._live[seq] = prompt + tokens
        return Completion(tokens=tokens, logprobs=logprobs, routed_experts=routed,
                          finish_reason=_FINISH.get(out.finish_reason, "length"), sequence=seq,
                          policy_version=self.version)

    def cancel(self, sequences: Sequence[str]) -> None:
        """Forgets live sequences (`generate` returns only once they are done, so none is in
        flight; their cached blocks are evicted by vLLM as it needs them)."""
        for s in sequences:
            self._live.pop(s, None)

    def move_to(self, path: str) -> dict:
        """Serves `path`: a delta (or any version once a delta was applied) through the
        extension's `gagar_apply_version` (only the deltas after the version held), a full
        version by an in-place reload; then the prefix cache is reset (its KV was computed under
        the old weights). Returns the first worker's answer with "policy_version" and "path"."""
        self.chained = self.chained or (read_manifest(path) or {}).get("kind") == "delta"
        method = "gagar_apply_version" if self.chained else "gagar_reload_from"
        info = self.llm.collective_rpc(method, args=(path,))[0]
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset the prefix cache after a weight update")
        self.path, self.version = path, version_of(path)
        return {**info, "policy_version": self.version, "path": path}

    def sync(self, workdir: str) -> dict | None:
        """`move_to` the version `latest` names, when it is another directory (None if not)."""
        ptr = read_latest(workdir)
        if ptr is None:
            raise FileNotFoundError(f"nothing published under {workdir}")
        if ptr["path"] == self.path:
            return None
        return self.move_to(ptr["path"])

    def close(self) -> None:
        """Shuts vLLM down in this process (another engine may start afterwards)."""
        import gc

        from gagar_jax.rollout.vllm_internals import shutdown_vllm

        self.llm, self._live = None, {}
        gc.collect()
        shutdown_vllm()


def _params(spec: Any, seed: int | None) -> Any:
    """vLLM's SamplingParams for one sample of `spec` (a `SamplingSpec`); its `json_schema`
    goes to vLLM's structured outputs (the engine then needs a tokenizer: `make_llm(...,
    skip_tokenizer_init=False)` on a directory holding one)."""
    from vllm import SamplingParams
    structured = None
    if getattr(spec, "json_schema", None) is not None:
        from gagar_jax.rollout.vllm_internals import structured_outputs
        structured = structured_outputs(json.loads(spec.json_schema))
    return SamplingParams(n=1, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
                          max_tokens=spec.max_tokens, logprobs=0, detokenize=False,
                          ignore_eos=not spec.stop_token_ids,
                          stop_token_ids=list(spec.stop_token_ids) or None, seed=seed,
                          structured_outputs=structured)


def make(path: str, options: EngineOptions) -> VLLMEngine:
    """The engine factory (`--engine gagar_jax.rollout.vllm_engine:make`): a vLLM engine on the
    published version `path`. A delta directory is no checkpoint: the engine starts on its
    chain's full base and applies the chain.

    Args:
      path: a published version directory (full or delta).
      options: seed, context length, log-probs mode, routing.
    Returns:
      The `VLLMEngine`, serving `path`.
    """
    chain = delta.chain(path) if (read_manifest(path) or {}).get("kind") == "delta" else [path]
    llm = make_llm(chain[0], seed=options.seed, max_model_len=options.max_model_len,
                   logprobs_mode=options.logprobs_mode)
    engine = VLLMEngine(llm, chain[0], options)
    if len(chain) > 1:
        engine.move_to(path)
    return engine

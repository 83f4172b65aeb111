"""vLLM as the rollout engine: start it on a published directory, sample one completion with its
behaviour log-probs and its routing (docs/rollout.md). Runs in .venv-vllm; vLLM is imported
inside the functions only, so this module imports without it (and without JAX).

    llm = make_llm(read_latest(workdir)["path"], seed=0)
    c = sample(llm, prompt_ids, SamplingSpec(temperature=1.0, top_p=1.0, max_tokens=8), seed=7)
    c.tokens, c.logprobs, c.routed_experts          # [g], [g], [g][L][K]

Routing comes from the extension's router hook (`gagar_capture_routes`): vLLM's own
`routed_experts` output needs its V2 model runner (Triton), which the CPU build lacks. The hook
sees the whole scheduled batch of a forward step, so `sample` runs one request at a time: the
rows then belong to that request, in order. On a GPU build, `enable_return_routed_experts=True`
gives per-request routing with batching (docs/rollout.md, "GPUs").
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

EXTENSION = "gagar_jax.rollout.vllm_extension.GagarWorkerExtension"
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
    """How the worker samples; written into every feed record (`sampling`).

    Attributes:
      temperature, top_p, top_k: vLLM's sampling parameters (top_k -1 = off).
      max_tokens: completion length bound (the example task's completions run to it).
      logprobs_mode: which log-probs the record carries as the behaviour policy's:
        "raw_logprobs" (vLLM's default) = log softmax of the model's logits, before temperature
        and top-p: what the learner computes, so the ratio compares like with like;
        "processed_logprobs" = of the distribution actually sampled from (after temperature,
        top-p), the exact behaviour probability.
      stop_token_ids: tokens that end a completion (kept in it).
    """
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 8
    logprobs_mode: str = "raw_logprobs"
    stop_token_ids: tuple = ()

    def __post_init__(self):
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, "
                             f"got {self.logprobs_mode!r}")
        if not (self.temperature > 0 and 0 < self.top_p <= 1 and self.max_tokens >= 1):
            raise ValueError(f"bad sampling parameters: {self}")

    def record(self) -> dict:
        """The record's `sampling` field (docs/feed.md)."""
        return {"engine": "vllm", "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "max_tokens": self.max_tokens,
                "logprobs_mode": self.logprobs_mode}


@dataclasses.dataclass
class Completion:
    """One sampled completion: its tokens, their behaviour log-probs and the engine's routing."""
    tokens: list            # [g] generated token ids
    logprobs: list          # [g] log-prob of each (SamplingSpec.logprobs_mode)
    routed_experts: list | None   # [g][L][K]: the forward that produced token j (None: no MoE)


def make_llm(path: str, *, seed: int = 0, max_model_len: int = 256,
             logprobs_mode: str = "raw_logprobs", dtype: str = "float32",
             **kwargs: Any) -> Any:
    """A vLLM engine on a published directory, with the gagar worker extension.

    No tokenizer (token ids in, token ids out), eager mode, float32 compute (a bf16 directory
    is upcast: the engine then differs from the learner by the weight rounding only). Call it
    under `if __name__ == "__main__":` (the CPU platform spawns its workers). On CPU set
    `VLLM_CPU_KVCACHE_SPACE` (GiB) before calling; it defaults to 1 here.
    """
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    return LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype=dtype,
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


def sample(llm: Any, prompt: list, spec: SamplingSpec, *, seed: int | None = None,
           routing: bool = True) -> Completion:
    """One completion of `prompt` (token ids) with its log-probs and, with `routing`, its experts.

    One request per call (the routing hook cannot tell requests of one batch apart). The
    captured rows are the forward passes' input tokens; the last g rows are the passes that
    produced the g generated tokens (a prefix-cache hit only removes rows of the prompt).
    """
    from vllm import SamplingParams
    sp = SamplingParams(n=1, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
                        max_tokens=spec.max_tokens, logprobs=0, detokenize=False,
                        ignore_eos=not spec.stop_token_ids,
                        stop_token_ids=list(spec.stop_token_ids) or None, seed=seed)
    if routing:
        # (Re)hooks every router and clears the record: a reload may rebuild modules.
        llm.collective_rpc("gagar_capture_routes", args=(True,))
    out = llm.generate([{"prompt_token_ids": list(prompt)}], sp, use_tqdm=False)[0].outputs[0]
    tokens = list(out.token_ids)
    logprobs = [float(out.logprobs[j][t].logprob) for j, t in enumerate(tokens)]
    routed = None
    if routing:
        rows = routes_array(llm.collective_rpc("gagar_pop_routes")[0])
        if rows:
            if len(rows) < len(tokens):
                raise RuntimeError(f"captured {len(rows)} routing rows for {len(tokens)} tokens")
            routed = rows[len(rows) - len(tokens):]
    return Completion(tokens=tokens, logprobs=logprobs, routed_experts=routed)

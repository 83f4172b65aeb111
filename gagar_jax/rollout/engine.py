"""The rollout engine interface: what the worker (and every loop built on it) asks of an engine.

The worker talks to this interface only; an engine is chosen by `--engine module:factory`
(default `gagar_jax.rollout.vllm_engine:make`) and built as `factory(path, EngineOptions(...))`
on a published version directory (docs/rollout.md, "Engines"):

    engine = make(read_latest(workdir)["path"], EngineOptions(seed=0))
    [samples] = engine.generate([Request(prompt, SamplingSpec(max_tokens=8), seed=7, n=4)])
    s = samples[0]; s.tokens, s.logprobs, s.routed_experts, s.finish_reason   # [g] [g] [g][L][K]
    [[turn2]] = engine.generate([Request(observation_ids, spec, seed=8, sequence=s.sequence)])
    engine.cancel([s.sequence]); engine.sync(workdir); engine.close()

Live sequences: every sample is a live sequence (its prompt, then every token generated or
appended to it) until it is cancelled; a request naming `sequence` appends its `tokens` to that
sequence and generates the next turn from the whole of it, so an engine may keep its cache
(vLLM resubmits the prefix and its prefix cache finds it; a paged sampler keeps the pages).
Importing this module imports neither JAX nor any engine.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
FINISH_REASONS = ("stop", "length", "cancelled")


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
    """How one request samples; written into every feed record (`sampling`).

    Attributes:
      temperature, top_p, top_k: the sampling parameters (top_k -1 or 0 = off).
      max_tokens: completion length bound (the example task's completions run to it).
      logprobs_mode: which log-probs the record carries as the behaviour policy's:
        "raw_logprobs" = log softmax of the model's logits, before temperature and top-p: what
        the learner computes, so the ratio compares like with like; "processed_logprobs" = of
        the distribution actually sampled from (after temperature, top-p), the exact behaviour
        probability. An engine may serve one mode only (`EngineOptions.logprobs_mode`).
      stop_token_ids: tokens that end a completion (kept in it; finish reason "stop").
      json_schema: None, or a JSON schema (as JSON text, so the spec stays hashable) the
        completion must follow: the vLLM engine hands it to vLLM's structured outputs (which
        need a tokenizer); an engine without constrained decoding (the JAX sampler, scripted
        ones) samples freely, and its reader validates (the LLM grader: docs/grader.md). Not
        part of the record's `sampling`.
    """
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 8
    logprobs_mode: str = "raw_logprobs"
    stop_token_ids: tuple = ()
    json_schema: str | None = None

    def __post_init__(self):
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, "
                             f"got {self.logprobs_mode!r}")
        if not (self.temperature > 0 and 0 < self.top_p <= 1 and self.max_tokens >= 1):
            raise ValueError(f"bad sampling parameters: {self}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        if self.json_schema is not None:
            try:
                ok = isinstance(json.loads(self.json_schema), dict)
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"json_schema must be a JSON object's text, got "
                                 f"{self.json_schema!r:.80}")

    def record(self, engine: str = "vllm") -> dict:
        """The record's `sampling` field (docs/feed.md); `engine`: the engine's `name`."""
        return {"engine": engine, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "max_tokens": self.max_tokens,
                "logprobs_mode": self.logprobs_mode}


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request: `n` samples of one prompt, or the next turn of a live sequence.

    Attributes:
      tokens: token ids: the prompt, or (with `sequence`) the ids appended to that sequence
        before it generates (a tool's output, the next user turn; may be empty).
      sampling: temperature, top-p, top-k, max tokens, log-probs mode, stop tokens.
      seed: sample j draws with seed `seed + j` (None: the engine's own stream, not
        reproducible).
      n: samples sharing the prompt (1 for a continuation).
      sequence: the live sequence to continue (a `Completion.sequence`), or None.
    """
    tokens: Sequence[int]
    sampling: SamplingSpec
    seed: int | None = None
    n: int = 1
    sequence: str | None = None

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.sequence is not None and self.n != 1:
            raise ValueError(f"a continuation of {self.sequence!r} takes n=1, got n={self.n}")
        if self.sequence is None and not self.tokens:
            raise ValueError("a new request needs a non-empty prompt")


@dataclasses.dataclass
class Completion:
    """One sample: its generated tokens, their behaviour log-probs, the engine's routing.

    Attributes:
      tokens: [g] generated token ids (a stop token, when one ended it, is the last).
      logprobs: [g] log-prob of each (the request's `logprobs_mode`).
      routed_experts: [g][L][K] the experts of the forward that produced token j, per MoE
        layer (None: no MoE, or routing not recorded).
      finish_reason: "stop" (a stop token), "length" (max_tokens or the context) or
        "cancelled".
      sequence: the live sequence id (continue it with `Request(..., sequence=...)`).
      policy_version: the version whose weights generated it (a trajectory whose turns span a
        `move_to` carries one per turn).
    """
    tokens: list
    logprobs: list
    routed_experts: list | None
    finish_reason: str = "length"
    sequence: str | None = None
    policy_version: int | None = None


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """What the worker tells an engine's factory besides the version to start on.

    Attributes:
      seed: the engine's own seed (requests without one draw from it).
      max_model_len: the longest sequence (prompt plus every turn) the engine serves.
      logprobs_mode: the log-probs it reports (`SamplingSpec.logprobs_mode`).
      routing: record the routed experts of every generated token.
    """
    seed: int = 0
    max_model_len: int = 256
    logprobs_mode: str = "raw_logprobs"
    routing: bool = True


@runtime_checkable
class Engine(Protocol):
    """What every rollout engine implements (`tests/test_engine_conformance.py` checks it).

    Attributes:
      name: the engine's name in the records' `sampling.engine` ("vllm", ...).
      version: the `policy_version` of the weights it serves.
    """
    name: str
    version: int

    def generate(self, requests: Sequence[Request]) -> list:
        """Runs `requests` together (returns when all are done); returns per request its `n`
        `Completion`s, in order. Each completion is then a live sequence until cancelled. A
        sequence that would not fit the context (`EngineOptions.max_model_len`) is a
        ValueError naming the request; a continuation of an unknown sequence a KeyError."""
        ...

    def cancel(self, sequences: Sequence[str]) -> None:
        """Ends live sequences: the engine frees what it holds for them; continuing one is
        then an error. Unknown ids are ignored (a sequence may already be gone)."""
        ...

    def move_to(self, path: str) -> dict:
        """Serves the published version directory `path` (full, or a delta whose chain it
        applies from the version it holds); returns what the move did, with
        "policy_version". Live sequences stay (their next turn runs on the new weights)."""
        ...

    def sync(self, workdir: str) -> dict | None:
        """Moves to the version `<workdir>/published/latest` names when it is another one;
        returns `move_to`'s answer, or None when it already serves it."""
        ...

    def close(self) -> None:
        """Shuts the engine down (it takes no request afterwards)."""
        ...


def check_engine(engine: object, factory: str) -> Engine:
    """`engine` when it implements `Engine`; a one-line error naming `factory` otherwise."""
    missing = [m for m in ("name", "version", "generate", "cancel", "move_to", "sync", "close")
               if not hasattr(engine, m)]
    if missing:
        raise TypeError(f"{factory!r} returned a {type(engine).__name__}, which lacks "
                        f"{', '.join(missing)} (gagar_jax.rollout.engine.Engine)")
    return engine  # type: ignore[return-value]

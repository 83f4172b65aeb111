"""What the sampler is built with, asked and answers: `SamplerConfig` (its static sizes),
`SampleParams` (one sample's draw), `Work` (a prompt's samples, or a live sequence's next turn),
`Turn` (one sample's generated turn). Plain dataclasses (`sample/sampler.py` runs them).
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """Static sizes of one sampler (each bucket compiles once).

    Attributes:
      slots: decode slots (S): sequences decoded together.
      page: positions per KV page (T).
      max_len: the longest sequence, prompt and every turn included.
      num_pages: full-attention pages (0: `4 * slots` sequences of `max_len`).
      decode_steps: decode steps per call (sequences join and leave between calls).
      max_chunk: the longest prefill chunk; chunks are padded to powers of two from 16.
      max_prefill_rows: sequences prefilled together (rows padded to a power of two).
      max_stops: stop tokens per request (a bucket; more compile a wider one).
      paged_attention: "auto" or a paged kernel of `kernels/attention/registry.py`.
      cache_dtype: dtype of keys and values ("" = the model's compute dtype).
      layer_copies: run on per-layer copies of the stacked layer parameters, made once per
        hand-over (`forward.unstack`: the model's size again in memory): XLA:CPU otherwise
        copies each layer's weights out of the stacked arrays at every decode step. Off for a
        same-mesh hand-over (it would copy what that hand-over shares).
    """
    slots: int = 8
    page: int = 16
    max_len: int = 256
    num_pages: int = 0
    decode_steps: int = 8
    max_chunk: int = 256
    max_prefill_rows: int = 8
    max_stops: int = 4
    paged_attention: str = "auto"
    cache_dtype: str = ""
    layer_copies: bool = False

    def __post_init__(self):
        for name in ("slots", "page", "max_len", "decode_steps", "max_chunk", "max_prefill_rows",
                     "max_stops"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"SamplerConfig.{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class SampleParams:
    """How one sample draws: temperature (<= 0: greedy), top-k (<= 0: off), top-p, the most
    tokens this turn, stop tokens (kept in the output), and its seed."""
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 16
    stop: tuple = ()
    seed: int = 0


@dataclasses.dataclass
class Work:
    """A prompt with one `SampleParams` per sample, or (`sequence`) the tokens appended to a live
    sequence before its next turn (then exactly one `SampleParams`)."""
    tokens: list
    params: list
    sequence: str | None = None


@dataclasses.dataclass
class Turn:
    """One sample's generated turn: tokens, raw and processed log-probs, the experts of the
    forward that produced each token [g, L, K], why it ended, its live sequence."""
    tokens: list
    raw: list
    processed: list
    routed: np.ndarray
    finish: str
    sequence: str

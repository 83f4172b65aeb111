"""The JAX sampler behind the rollout engine interface (`gagar_jax.rollout.engine.Engine`):

    python -m gagar_jax.rollout.worker --engine gagar_jax.sample.engine:make ...   (.venv)
    engine = make(read_latest(workdir)["path"], EngineOptions(seed=0, max_model_len=256))

It serves a published version directory (full, or a delta whose chain it materialises) with
the learner's own model code (`hf.from_pretrained`, float32 unless asked otherwise), or weights
handed over in memory (`JaxEngine.hand_over`, `sample/handover.py`). Requests map one to one
onto the sampler's works: a request's N samples share its prompt's pages, sample j draws with
seed + j, a continuation appends to the live sequence the sampler holds (nothing it holds is
prefilled again). Both log-prob modes are served, per request (`SamplingSpec.logprobs_mode`).
"""
from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import jax
import ml_dtypes
from flax import nnx

from gagar_jax.hf import api as hf
from gagar_jax.hf.safetensors import write_safetensors
from gagar_jax.rollout import delta
from gagar_jax.rollout.engine import Completion, EngineOptions, Request
from gagar_jax.rollout.pointer import read_latest, read_manifest
from gagar_jax.sample.sampler import SampleParams, Sampler, SamplerConfig, Work


def version_of(path: str) -> int:
    """The `policy_version` in a published directory's manifest (0 for a plain checkpoint)."""
    return int((read_manifest(path) or {}).get("policy_version", 0))


def load(path: str, dtype: str = "float32", mesh: jax.sharding.Mesh | None = None) -> Any:
    """The model of a published version: a full directory through `hf.from_pretrained`; a delta
    materialised on the host (`rollout.delta`: its chain's full base and every delta, verified)
    and loaded the same way."""
    if (read_manifest(path) or {}).get("kind") != "delta":
        return hf.from_pretrained(path, dtype, mesh=mesh)[0]
    chain = delta.chain(path)
    tensors = {name: (t.array.view(ml_dtypes.bfloat16) if t.dtype == "BF16" else t.array)
               for name, t in delta.materialize(path).items()}
    tmp = tempfile.mkdtemp(prefix="gagar_delta_")
    try:
        shutil.copy(os.path.join(chain[0], "config.json"), tmp)
        write_safetensors(os.path.join(tmp, "model.safetensors"), tensors)
        return hf.from_pretrained(tmp, dtype, mesh=mesh)[0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class JaxEngine:
    """`Engine` on a `Sampler` (see the module docstring).

    Attributes:
      sampler: the `Sampler` (tests and the colocated loop reach it directly).
      path: the version directory it serves ("" after a hand-over).
    """

    name = "jax"

    def __init__(self, sampler: Sampler, path: str, options: EngineOptions, version: int,
                 dtype: str = "float32"):
        self.sampler, self.path, self.options, self.version = sampler, path, options, version
        self.dtype = dtype
        self._seeds = itertools.count()

    def _params(self, r: Request, j: int) -> SampleParams:
        s = r.sampling
        seed = (r.seed + j if r.seed is not None else
                hash((self.options.seed, next(self._seeds))) % 2**32)
        return SampleParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                            max_tokens=s.max_tokens, stop=tuple(int(t) for t in
                                                                s.stop_token_ids), seed=seed)

    def generate(self, requests: Sequence[Request]) -> list:
        """Per request its `n` `Completion`s (see `Engine.generate`)."""
        works = [Work(list(r.tokens), [self._params(r, j) for j in range(r.n)], r.sequence)
                 for r in requests]
        try:
            turns = self.sampler.generate(works)
        except (KeyError, ValueError) as e:      # "work i" is request i
            raise type(e)(str(e).strip("'\"").replace("work ", "request ", 1)) from e
        out = []
        for r, ts in zip(requests, turns, strict=True):
            raw = r.sampling.logprobs_mode == "raw_logprobs"
            routing = self.options.routing and self.sampler.model_cfg.num_moe_layers > 0
            out.append([Completion(tokens=t.tokens, logprobs=t.raw if raw else t.processed,
                                   routed_experts=t.routed.tolist() if routing else None,
                                   finish_reason=t.finish, sequence=t.sequence,
                                   policy_version=self.version) for t in ts])
        return out

    def cancel(self, sequences: Sequence[str]) -> None:
        """Frees the sequences' pages; unknown ids are ignored."""
        self.sampler.cancel(sequences)

    def move_to(self, path: str) -> dict:
        """Serves the published version `path` (full or delta): its weights replace the
        sampler's (live sequences re-prefill on their next turn)."""
        model = load(path, self.dtype, self.sampler.mesh)
        self.sampler.set_params(nnx.state(model))
        self.path, self.version = path, version_of(path)
        return {"policy_version": self.version, "path": path}

    def hand_over(self, state: nnx.State, version: int) -> None:
        """Serves parameters given in memory (same tree as the model's; see
        `sample/handover.py` for the same-mesh and resharded hand-overs)."""
        self.sampler.set_params(state)
        self.path, self.version = "", int(version)

    def sync(self, workdir: str) -> dict | None:
        """`move_to` what `<workdir>/published/latest` names, when it is another directory."""
        ptr = read_latest(workdir)
        if ptr is None:
            raise FileNotFoundError(f"nothing published under {workdir}")
        if ptr["path"] == self.path:
            return None
        return self.move_to(ptr["path"])

    def close(self) -> None:
        """Drops the sampler (its cache and parameters)."""
        self.sampler = None


def make_engine(path: str, options: EngineOptions, config: SamplerConfig | None = None,
                dtype: str = "float32", mesh: jax.sharding.Mesh | None = None) -> JaxEngine:
    """A `JaxEngine` on the published version `path` with a sampler of `config` (default:
    `SamplerConfig(max_len=options.max_model_len)`) on `mesh` (default: one device)."""
    config = config or SamplerConfig(max_len=options.max_model_len)
    if config.max_len != options.max_model_len:
        raise ValueError(f"SamplerConfig.max_len {config.max_len} != EngineOptions."
                         f"max_model_len {options.max_model_len}")
    model = load(path, dtype, mesh)
    return JaxEngine(Sampler(model, config, mesh), path, options, version_of(path), dtype)


def make(path: str, options: EngineOptions) -> JaxEngine:
    """The engine factory (`--engine gagar_jax.sample.engine:make`)."""
    return make_engine(path, options)


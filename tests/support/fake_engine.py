"""A scripted engine behind the engine interface, for the worker's tests without vLLM (JAX-free,
pure Python): `--engine support.fake_engine:make`. Sample j of a request draws its tokens from
`random.Random(seed + j)` over the byte vocabulary; log-probs are -1; no routing. It refuses to
start if any vLLM module is loaded (the worker must import none)."""
from __future__ import annotations

import random
import sys

from gagar_jax.rollout.engine import Completion, EngineOptions, Request
from gagar_jax.rollout.pointer import read_latest, read_manifest


class FakeEngine:
    name = "fake"

    def __init__(self, path: str, options: EngineOptions):
        self.path, self.options, self.moves = path, options, []
        self.version = int((read_manifest(path) or {}).get("policy_version", 0))
        self.live, self.closed = {}, False

    def generate(self, requests: list[Request]) -> list:
        out = []
        for r in requests:
            comps = []
            for j in range(r.n):
                rng = random.Random((r.seed or 0) + j)
                toks = [rng.randrange(256) for _ in range(r.sampling.max_tokens)]
                seq = r.sequence or f"s{len(self.live)}"
                self.live[seq] = toks
                comps.append(Completion(tokens=toks, logprobs=[-1.0] * len(toks),
                                        routed_experts=None, sequence=seq))
            out.append(comps)
        return out

    def cancel(self, sequences: list[str]) -> None:
        for s in sequences:
            self.live.pop(s, None)

    def move_to(self, path: str) -> dict:
        self.path, self.version = path, int(read_manifest(path)["policy_version"])
        self.moves.append(path)
        return {"policy_version": self.version, "path": path, "deltas": None}

    def sync(self, workdir: str) -> dict | None:
        ptr = read_latest(workdir)
        return None if ptr["path"] == self.path else self.move_to(ptr["path"])

    def close(self) -> None:
        self.closed = True


def make(path: str, options: EngineOptions) -> FakeEngine:
    """The factory the worker calls (`--engine support.fake_engine:make`)."""
    loaded = sorted(m for m in sys.modules if "vllm" in m)
    if loaded:
        raise RuntimeError(f"the worker imported vLLM modules: {loaded}")
    return FakeEngine(path, options)


def not_an_engine(path: str, options: EngineOptions) -> object:
    """A factory whose answer lacks the interface (the worker must refuse it in one line)."""
    return object()

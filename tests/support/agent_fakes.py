"""A scripted engine and environment for the agent loop's tests (JAX-free, pure Python).

`ScriptedEngine` implements the engine interface: sample draws from `random.Random(seed)` over
ids 3..99 (stopping at the first stop token it draws, which it draws at turn position `stop_at`
when set), log-prob of generated token j = -(1 + j) / 100, routing [g][2][2] = [[t % 4, (t + 1)
% 4], [(t + 2) % 4, (t + 3) % 4]] for token t; it keeps every call's requests and every live
sequence's ids, and refuses (like vLLM) a prompt that fills `max_model_len`.

`ScriptedEnv`: a task {"task_id", "turns": k, "obs": m, "pass": [bool per trajectory j] or
bool} submits after k model turns (each a tool call), every observation is m tokens
`[200 + turn] * m`; `"hang_at"` / `"raise_at"`: turn whose step hangs (sleeps 30 s) or raises;
`"verdict_raises"`: the verdict raises; `"move_latest_at"`: after that turn trajectory 0's step
points `<workdir>/published/latest` at the version directory `move_path`, or at a made-up
version `move_to` (a partial rollout); `"prompt"`: the first observation (default `PROMPT`).
Environments record
themselves in `ENVS` (for the tests to read what was closed).
"""
from __future__ import annotations

import json
import os
import random
import threading
import time

from gagar_jax.rollout.engine import Completion, EngineOptions
from gagar_jax.rollout.envs.base import EnvOptions, Step
from gagar_jax.rollout.pointer import read_latest, read_manifest

ENVS: list = []
PROMPT = [1, 2, 3, 4, 5]
STOP = 2          # the tokenizer's stop token (`tokenizer()`)


def routing(t: int) -> list:
    return [[t % 4, (t + 1) % 4], [(t + 2) % 4, (t + 3) % 4]]


class ScriptedEngine:
    name = "scripted"

    def __init__(self, path: str = "", options: EngineOptions | None = None, version=None,
                 stop_at: int | None = None):
        self.path, self.options, self.stop_at = path, options or EngineOptions(), stop_at
        self.version = (int((read_manifest(path) or {}).get("policy_version", 0))
                        if version is None else version)
        self.live, self.calls, self.cancelled, self.moves = {}, [], [], []
        self.finals = {}      # every sequence's ids as last generated (kept after a cancel)
        self.count = 0

    def generate(self, requests: list) -> list:
        self.calls.append(list(requests))
        out = []
        for i, r in enumerate(requests):
            if r.sequence is not None and r.sequence not in self.live:
                raise KeyError(f"request {i}: no live sequence {r.sequence!r}")
            prompt = (self.live[r.sequence] if r.sequence else []) + list(r.tokens)
            if len(prompt) >= self.options.max_model_len:
                raise ValueError(f"request {i}: {len(prompt)} tokens fill the context")
            rng, toks, finish = random.Random(r.seed), [], "length"
            stops = set(r.sampling.stop_token_ids)
            while len(toks) < r.sampling.max_tokens:
                t = rng.randrange(3, 100)
                if self.stop_at is not None and len(toks) == self.stop_at and stops:
                    t = min(stops)
                toks.append(t)
                if t in stops:
                    finish = "stop"
                    break
            seq = r.sequence or f"s{self.count}"
            self.count += 1
            self.live[seq] = self.finals[seq] = prompt + toks
            out.append([Completion(tokens=toks, logprobs=[-(1 + j) / 100 for j in range(len(toks))],
                                   routed_experts=[routing(t) for t in toks],
                                   finish_reason=finish, sequence=seq,
                                   policy_version=self.version)])
        return out

    def cancel(self, sequences: list) -> None:
        for s in sequences:
            self.cancelled.append(s)
            self.live.pop(s, None)

    def move_to(self, path: str) -> dict:
        self.path, self.version = path, int(read_manifest(path)["policy_version"])
        self.moves.append(self.version)
        return {"policy_version": self.version, "path": path, "deltas": None}

    def sync(self, workdir: str) -> dict | None:
        ptr = read_latest(workdir)
        return None if ptr["path"] == self.path else self.move_to(ptr["path"])

    def close(self) -> None:
        pass


def make_engine(path: str, options: EngineOptions) -> ScriptedEngine:
    """`--engine support.agent_fakes:make_engine`."""
    return ScriptedEngine(path, options)


class Tok:
    """Ids as text: `decode` writes them space-separated; every message is [9] + its ids."""
    stop_token_ids = (STOP,)

    def encode(self, text: str) -> list:
        return [int(x) for x in text.split()]

    def decode(self, ids) -> str:
        return " ".join(str(int(t)) for t in ids)

    def prompt(self, messages) -> list:
        return PROMPT

    def observation(self, messages) -> list:
        return [9]


def tokenizer() -> Tok:
    """`--tokenizer support.agent_fakes:tokenizer`."""
    return Tok()


def point(workdir: str, path: str) -> None:
    """`<workdir>/published/latest` names the version directory `path` (its manifest's version)."""
    version = int(read_manifest(path)["policy_version"])
    os.makedirs(os.path.join(workdir, "published"), exist_ok=True)
    tmp = os.path.join(workdir, "published", ".latest.tmp")
    with open(tmp, "w") as f:
        json.dump({"step": version, "policy_version": version, "path": path}, f)
    os.replace(tmp, os.path.join(workdir, "published", "latest"))


def publish(workdir: str, version: int) -> str:
    """A version directory with a manifest (no weights: the scripted engine reads none), and
    `latest` pointing at it."""
    step = os.path.join(workdir, "published", f"step_{version:08d}")
    os.makedirs(step, exist_ok=True)
    with open(os.path.join(step, "gagar_publish.json"), "w") as f:
        json.dump({"step": version, "policy_version": version, "seq": 1, "kind": "full"}, f)
    point(workdir, step)
    return step


class ScriptedEnv:
    def __init__(self, task: dict, tokenizer: Tok, options: EnvOptions, j: int):
        self.task, self.options, self.j = task, options, j
        self.task_id, self.workspace = task["task_id"], f"/ws/{task['task_id']}/{j}"
        self.turns, self.ended, self.closed, self.seen = 0, None, 0, []
        ENVS.append(self)

    def reset(self) -> list:
        return list(self.task.get("prompt", PROMPT))

    def step(self, turn) -> Step:
        self.turns += 1
        self.seen.append(list(turn))
        t = self.task
        if t.get("hang_at") == self.turns:
            time.sleep(30)
        if t.get("raise_at") == self.turns:
            raise RuntimeError("tool crashed")
        if t.get("move_latest_at") == self.turns and self.j == 0:
            if "move_path" in t:
                point(t["workdir"], t["move_path"])
            else:
                publish(t["workdir"], t["move_to"])
        errors = int(STOP not in turn and t.get("count_unstopped", False))
        if self.turns >= t.get("turns", 3):
            return Step(done=True, reason="submitted", tool_calls=1, tool_errors=errors)
        return Step(observation=[200 + self.turns] * t.get("obs", 2), tool_calls=1,
                    tool_errors=errors)

    def end(self, reason: str) -> None:
        self.ended = reason

    def verdict(self) -> dict:
        if self.task.get("verdict_raises"):
            raise RuntimeError("verdict crashed")
        p = self.task.get("pass", False)
        ok = p[self.j] if isinstance(p, list) else p
        return {"outcome": "pass" if ok else "fail", "hacked": False,
                "evidence": {"turns": self.turns}}

    def close(self) -> None:
        self.closed += 1


_lock = threading.Lock()
_next: dict = {}


def make_env(task: dict, tokenizer: Tok, options: EnvOptions) -> ScriptedEnv:
    """`--env support.agent_fakes:make_env`: the j-th environment made for a task id is
    trajectory j (environments of one group are made in order of j)."""
    with _lock:
        j = _next.get(task["task_id"], 0)
        _next[task["task_id"]] = j + 1
    return ScriptedEnv(task, tokenizer, options, j % task.get("n", 1_000_000))


def tasks(seed: int = 0):
    """`--tasks support.agent_fakes:tasks`: 3-turn tasks, trajectory 0 passes."""
    i = 0
    while True:
        yield {"task_id": f"scripted-{seed}-{i}", "turns": 3, "pass": [True, False, False],
               "n": 3}
        i += 1

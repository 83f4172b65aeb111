"""A scripted engine for the repository environment through the worker's agent mode
(`--engine support.repo_replay:make_engine`, byte tokenizer): its turns are tool calls.

The engine reads a new sequence's prompt (the task's statement is in it) to know the task; the
first sequence of each task replays the task's reference fix through the tools (apply_patch,
run_tests, submit: `repo_agents.replay_turns`), the next one does nothing (submit at once), and
so on alternately, so a group of 2 is mixed. Each turn's text is generated as its bytes and the
stop token (cut at `max_tokens`); log-prob of the j-th token of a turn = -(1 + j % 7) / 10; no
routing (a dense model). `grade` (`--grader support.repo_replay:grade`) writes what it sees of
each mixed group to `$REPLAY_GRADER_OUT/<task_id>.json` and ranks the passes.
"""
from __future__ import annotations

import json
import os
import threading

from gagar_jax.rollout.engine import Completion, EngineOptions
from gagar_jax.rollout.envs import repo_tasks
from gagar_jax.rollout.pointer import read_manifest
from support.repo_agents import TOKENIZER, call, replay_turns


class ReplayEngine:
    name = "repo-replay"

    def __init__(self, path: str = "", options: EngineOptions | None = None):
        self.path, self.options = path, options or EngineOptions()
        self.version = int((read_manifest(path) or {}).get("policy_version", 0))
        self.tasks = repo_tasks.load_tasks()
        self.script: dict = {}      # sequence -> the turns still to play
        self.started: dict = {}     # task id -> sequences started
        self.count = 0
        self.lock = threading.Lock()

    def _script(self, prompt: list) -> list:
        text = TOKENIZER.decode(prompt)
        [task] = [t for t in self.tasks if t.statement in text]
        k = self.started.get(task.task_id, 0)
        self.started[task.task_id] = k + 1
        return replay_turns(task, run_tests=True) if k % 2 == 0 else [call("submit")]

    def generate(self, requests: list) -> list:
        out = []
        with self.lock:
            for r in requests:
                if r.sequence is None:
                    seq, turns = f"s{self.count}", self._script(list(r.tokens))
                    self.count += 1
                else:
                    seq, turns = r.sequence, self.script[r.sequence]
                ids = TOKENIZER.encode(turns[0]) + list(r.sampling.stop_token_ids[:1])
                ids = ids[:r.sampling.max_tokens]
                self.script[seq] = turns[1:] or [call("submit")]
                finish = "stop" if ids[-1] in r.sampling.stop_token_ids else "length"
                out.append([Completion(tokens=ids,
                                       logprobs=[-(1 + j % 7) / 10 for j in range(len(ids))],
                                       routed_experts=None, finish_reason=finish, sequence=seq,
                                       policy_version=self.version)])
        return out

    def cancel(self, sequences: list) -> None:
        with self.lock:
            for s in sequences:
                self.script.pop(s, None)

    def move_to(self, path: str) -> dict:
        self.path, self.version = path, int(read_manifest(path)["policy_version"])
        return {"policy_version": self.version, "path": path, "deltas": None}

    def sync(self, workdir: str) -> dict | None:
        return None

    def close(self) -> None:
        pass


def make_engine(path: str, options: EngineOptions) -> ReplayEngine:
    """`--engine support.repo_replay:make_engine`."""
    return ReplayEngine(path, options)


def grade(task: dict, trajectories: list) -> list:
    """`--grader support.repo_replay:grade`: records the views (without the ids) and gives each
    pass a rank in order."""
    out = os.environ["REPLAY_GRADER_OUT"]
    with open(os.path.join(out, f"{task['task_id']}.json"), "w") as f:
        json.dump({"task": task, "views": [{k: v for k, v in t.items()
                                            if k not in ("tokens", "loss_mask")}
                                           for t in trajectories]}, f)
    passes = [t for t in trajectories if t["outcome"] == "pass"]
    return [{"quality": {"tier": "strong", "rank": passes.index(t)}} if t in passes else {}
            for t in trajectories]


class MixedReplayEngine(ReplayEngine):
    """The closed loop's scripted agent (`--engine support.repo_replay:make_mixed_engine`):
    per task, the k-th sequence started plays `MIXED_CYCLE[k % 3]`: the reference fix
    (apply_patch, submit: passes), the reference fix plus three sprawling files written with
    write_file (`planted.planted_files(task, "sprawling")`: passes, ranked lower), or a submit
    at once (fails); so a group of 3 is mixed with two passes of different quality. Tasks in
    `ALWAYS_FAIL` only submit (uniform groups, filtered by the learner). `sync` moves to the
    version `latest` names, so the records carry the learner's versions."""

    name = "repo-mixed"
    ALWAYS_FAIL = ("clamp_values", "leap_years", "median_even")

    def _script(self, prompt: list) -> list:
        from support.planted import planted_files
        text = TOKENIZER.decode(prompt)
        [task] = [t for t in self.tasks if t.statement in text]
        k = self.started.get(task.task_id, 0)
        self.started[task.task_id] = k + 1
        if task.task_id in self.ALWAYS_FAIL or k % 3 == 2:
            return [call("submit")]
        if k % 3 == 0:
            return replay_turns(task)
        files = planted_files(task, "sprawling")
        return ["".join(call("write_file", path=p, content=t) for p, t in sorted(files.items())),
                call("submit")]

    def sync(self, workdir: str) -> dict | None:
        from gagar_jax.rollout.pointer import read_latest
        ptr = read_latest(workdir)
        if ptr is None or ptr["path"] == self.path:
            return None
        return self.move_to(ptr["path"])


def make_mixed_engine(path: str, options: EngineOptions) -> MixedReplayEngine:
    """`--engine support.repo_replay:make_mixed_engine`."""
    return MixedReplayEngine(path, options)

"""The agent loop's bookkeeping: an episode (one trajectory in flight), a group, and the
threads environment calls run in (`gagar_jax/rollout/agent_loop.py`). Imports no JAX."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from gagar_jax.rollout.agent_record import AgentTrajectory
from gagar_jax.rollout.envs.base import check_verdict
from gagar_jax.rollout.queues import drain

log = logging.getLogger("gagar_jax.rollout.agent_loop")


class Episode:
    """One trajectory in flight: its environment, what it holds, where it stands."""

    def __init__(self, group: Group, j: int):
        self.group, self.j = group, j
        self.env = None
        self.traj = AgentTrajectory()
        self.sequence: str | None = None    # the engine's live sequence
        self.pending: list = []             # observation ids the engine has not seen yet
        self.turns = self.tool_calls = self.tool_errors = 0
        self.state = "resetting"            # resetting | ready | stepping | judging | done
        self.reason: str | None = None
        self.truncated = False
        self.verdict: dict | None = None
        self.deadline = 0.0
        self.epoch = 0                      # bumped when a job's answer is no longer wanted
        self.closing = False                # its environment is closed or being closed

    def info(self) -> dict:
        return {"end_reason": self.reason, "truncated": self.truncated, "turns": self.turns,
                "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                "workspace": getattr(self.env, "workspace", None)}


class Group:
    """A task's N episodes, started together on one version."""

    def __init__(self, no: int, task: dict, version: int, n: int):
        self.no, self.task, self.version, self.t0 = no, task, version, time.perf_counter()
        self.episodes = [Episode(self, j) for j in range(n)]
        self.grading = False


class Jobs:
    """Environment calls in daemon threads (a hung one never blocks the worker's exit), their
    answers in one queue; inline when `threads` is False."""

    def __init__(self, threads: bool):
        self.threads, self.answers = threads, queue.Queue()

    def submit(self, key: tuple, fn: Callable, *args) -> None:
        def call():
            try:
                self.answers.put((key, fn(*args), None))
            except Exception as e:   # an environment bug ends its episode, never the worker
                self.answers.put((key, None, e))
        if self.threads:
            threading.Thread(target=call, daemon=True).start()
        else:
            call()

    def collect(self, wait_s: float) -> list:
        return drain(self.answers, wait_s)


def judge(env: object, end_reason: str | None, task_id: str) -> dict:
    """Ends the episode (when the loop ended it), takes the verdict, closes the environment."""
    try:
        if end_reason is not None:
            env.end(end_reason)
        return check_verdict(env.verdict(), task_id)
    finally:
        env.close()


def quiet(fn: Callable) -> Callable:
    """`fn` with its exception logged, not raised (closing an environment in a thread)."""
    def call():
        try:
            fn()
        except Exception as e:
            log.warning("closing an environment failed: %r", e)
    return call

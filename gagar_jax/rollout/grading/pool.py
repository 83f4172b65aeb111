"""A pool of grader threads beside the rollouts: finished groups queue here, graders take them
while the engine rolls out the next groups (`--grader-workers N`; docs/grader.md).

The agent loop submits a finished group (`submit(key, fn, *args)`) and frees its slot at once;
`collect` hands back `(key, value, error)` like `agent_episode.Jobs`, so the loop emits the group
(the spool receives graded groups only). A grader that crashes (`agent_grading.GraderCrashed`,
or any exception escaping the grading function) loses nothing: the group goes back to the queue
(`requeued` counts it) and is retried up to `max_attempts` times, then `fallback(*args, error)`
gives its answer (binary credit, status failed). The ledger (`stats`) always balances:
`submitted == done + queued + in_flight`. Imports no JAX.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable

from gagar_jax.rollout.queues import drain

log = logging.getLogger(__name__)


class GraderPool:
    """`workers` daemon threads grading queued groups.

    Args:
      workers: grader threads (>= 1).
      fallback: `fallback(*args, error) -> value` after `max_attempts` crashes of one group.
      max_attempts: tries per group before the fallback.
    """

    def __init__(self, workers: int, fallback: Callable, max_attempts: int = 3):
        if workers < 1:
            raise ValueError(f"grader workers must be >= 1, got {workers}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.fallback, self.max_attempts = fallback, max_attempts
        self._todo: queue.Queue = queue.Queue()
        self.answers: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.counts = collections.Counter(submitted=0, done=0, requeued=0, crashes=0,
                                          fallbacks=0, in_flight=0)
        self.latency: dict = {}          # key -> seconds from submit to answer
        self._closed = False
        self.threads = [threading.Thread(target=self._work, daemon=True, name=f"grader-{i}")
                        for i in range(workers)]
        for t in self.threads:
            t.start()

    def submit(self, key: tuple, fn: Callable, *args) -> None:
        with self._lock:
            self.counts["submitted"] += 1
        self._todo.put((key, fn, args, 1, time.monotonic()))

    def _work(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            key, fn, args, attempt, t0 = item
            with self._lock:
                self.counts["in_flight"] += 1
            try:
                value, err = fn(*args), None
            except Exception as e:       # a crashed grader: the group goes back, never lost
                value, err = None, e
            if err is not None and attempt < self.max_attempts:
                log.warning("grader crashed on %s (attempt %d/%d): %s; re-queued", key[:1],
                            attempt, self.max_attempts, err)
                with self._lock:
                    self.counts["crashes"] += 1
                    self.counts["requeued"] += 1
                    self.counts["in_flight"] -= 1
                self._todo.put((key, fn, args, attempt + 1, t0))
                continue
            if err is not None:
                with self._lock:
                    self.counts["crashes"] += 1
                    self.counts["fallbacks"] += 1
                try:
                    value, err = self.fallback(*args, err), None
                except Exception as e:       # the loop sees the error (never a lost group)
                    value, err = None, e
            with self._lock:
                self.counts["in_flight"] -= 1
                self.counts["done"] += 1
                self.latency[key] = round(time.monotonic() - t0, 4)
            self.answers.put((key, value, err))

    def collect(self, wait_s: float = 0.0) -> list:
        """The answers that came, waiting up to `wait_s` for the first."""
        return drain(self.answers, wait_s)

    def stats(self) -> dict:
        """The ledger: submitted, done, queued, in_flight, requeued, crashes, fallbacks."""
        with self._lock:
            c = dict(self.counts)
        c["queued"] = c["submitted"] - c["done"] - c["in_flight"]
        return c

    def close(self) -> None:
        """Stops the threads once the queue drains (daemon threads: a hung grader never blocks
        the worker's exit)."""
        if not self._closed:
            self._closed = True
            for _ in self.threads:
                self._todo.put(None)

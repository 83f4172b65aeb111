"""The answers queue of the rollout's thread pools (the agent episodes' tool threads, the
grader pool): what came back so far, taken without blocking the loop that polls it."""
from __future__ import annotations

import queue


def drain(answers: queue.Queue, wait_s: float = 0.0) -> list:
    """Every item in `answers`, waiting up to `wait_s` for the first (0: no wait)."""
    out = []
    try:
        out.append(answers.get(timeout=wait_s) if wait_s > 0 else answers.get_nowait())
        while True:
            out.append(answers.get_nowait())
    except queue.Empty:
        pass
    return out

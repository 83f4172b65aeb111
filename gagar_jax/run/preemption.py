"""Stop signals -> a checkpoint at a step every process agrees on, then a clean exit.

    with Preemption() as stop:
        ... train a step ...; if stop.agreed(step): checkpoint, exit

SIGTERM (a preemption notice) and SIGINT (Ctrl-C) both set a flag the loop reads after every
step and while the feed waits: the run checkpoints, writes its summary and exits (0 after
SIGTERM, 130 after Ctrl-C, the shell's code for an interrupt). A second Ctrl-C exits at once,
saying so, without a checkpoint (the last saved step resumes).

One process: Python signal handlers. Several processes: JAX's preemption sync manager
(coordination service, no device collective that could interleave with the in-flight train
step) picks the step; it owns SIGTERM itself, and Ctrl-C keeps Python's default there (one
process's flag alone could not pick a step every process agrees on).
"""
from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any, Optional

import jax

SIGINT_EXIT = 130     # 128 + SIGINT: what shells report for a run stopped by Ctrl-C


def _say(text: str) -> None:
    # os.write, not logging or print: a handler may interrupt a write holding their locks.
    os.write(2, (text + "\n").encode())


class Preemption:
    """The stop flag of one run (a context manager that installs the handlers).

    Args:
      exit_now: called with the exit code on a second Ctrl-C (default `os._exit`: a background
        writer must not keep the process alive).

    Attributes:
      requested: a stop was asked for.
      signal_name: "SIGTERM" or "SIGINT", the first stop signal received (None: none).
    """

    def __init__(self, exit_now: Callable[[int], Any] = os._exit):
        self.requested = False
        self.signal_name: Optional[str] = None
        self._exit_now = exit_now
        self._old: dict = {}
        self._multi = False

    def __enter__(self) -> Preemption:
        self._multi = jax.process_count() > 1
        signums = () if self._multi else (signal.SIGTERM, signal.SIGINT)
        for signum in signums:
            try:
                self._old[signum] = signal.signal(signum, self.handle)
            except ValueError:  # not the main thread: no handler
                pass
        return self

    def handle(self, signum: int, frame: Any = None) -> None:
        """The signal handler: the first stop sets the flag; a second Ctrl-C exits now."""
        if signum == signal.SIGINT and self.requested:
            _say("gagar-train: second Ctrl-C: exiting now without a checkpoint (a rerun resumes "
                 "from the last saved step)")
            self._exit_now(SIGINT_EXIT)
            return
        if not self.requested:
            self.signal_name = signal.Signals(signum).name
        self.requested = True
        if signum == signal.SIGINT:
            _say("gagar-train: Ctrl-C: checkpointing after the current step, then exiting "
                 "(Ctrl-C again to exit at once)")

    def __exit__(self, *exc) -> None:
        for signum, old in self._old.items():
            if old is not None:     # None: the handler was not installed from Python
                signal.signal(signum, old)
        self._old = {}

    def agreed(self, step: int) -> bool:
        """Whether every process stops after `step`."""
        if not self._multi:
            return self.requested
        from jax.experimental import multihost_utils
        return multihost_utils.reached_preemption_sync_point(step)

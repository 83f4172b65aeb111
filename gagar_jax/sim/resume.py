"""Resumable long runs of the miniature: a deadline, atomic pickles, train states on the host.

A long sweep (round four's B-long: hours on two shared cores) runs as a chain of short processes
under the machine's CPU lock. Each process gets a `Deadline`; the warm start's SFT loop and the
RL loop check it between steps, save what they need to continue (`save_pickle`) and raise
`OutOfTime`; the script exits with `EXIT_UNFINISHED` and the driver starts it again, which
resumes where the last one stopped (`load_pickle`). A resumed run gives the same rows as an
uninterrupted one: every random draw depends on (seed, step) only.

    clock = Deadline(minutes=8)           # None: no limit
    if clock.passed(): save_pickle(path, snapshot); raise OutOfTime(path)
"""
from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable
from typing import Any, Optional

import jax
import numpy as np

EXIT_UNFINISHED = 3     # the script's exit code when it stopped at its deadline


class OutOfTime(Exception):
    """The process's deadline passed; its progress is saved (the message names where)."""


class Deadline:
    """A wall-clock budget for one process.

    Args:
      minutes: the budget, counted from construction; None (or <= 0) = no limit.
      clock: seconds (tests pass their own).
    """

    def __init__(self, minutes: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.end = None if not minutes or minutes <= 0 else clock() + 60.0 * minutes

    def passed(self) -> bool:
        return self.end is not None and self.clock() >= self.end


NEVER = Deadline(None)


def save_pickle(path: str, obj: Any) -> None:
    """Writes `obj` to `path` atomically (a temporary name, then a rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(path + ".tmp", path)


def load_pickle(path: str) -> Any:
    """The object `save_pickle` wrote to `path`, or None if there is none."""
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


class HostKey:
    """A typed PRNG key on the host: its implementation's name and its key data (a leaf)."""

    def __init__(self, impl: str, data: np.ndarray):
        self.impl, self.data = impl, data


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_host(tree: Any) -> Any:
    """A picklable numpy copy of a pytree of device arrays (typed PRNG keys as `HostKey`s)."""
    def one(x: Any) -> Any:
        if _is_key(x):
            return HostKey(str(jax.random.key_impl(x)), np.asarray(jax.random.key_data(x)))
        return np.asarray(jax.device_get(x))
    return jax.tree.map(one, tree)


def from_host(tree: Any, shardings: Any) -> Any:
    """Inverse of `to_host`, placed with `shardings` (a pytree of the same structure)."""
    def one(x: Any, sharding: Any) -> Any:
        if isinstance(x, HostKey):
            return jax.device_put(jax.random.wrap_key_data(x.data, impl=x.impl), sharding)
        return jax.device_put(x, sharding)
    return jax.tree.map(one, tree, shardings)

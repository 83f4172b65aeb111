"""One learner per workdir: an exclusive lock that process 0 holds for the whole run.

    lock = workdir_lock.acquire(workdir, wait_s=30)   # raises LockHeld naming the holder
    workdir_lock.verify_held(workdir)  # before each checkpoint / audit write: raises LockLost

The lock is `fcntl.flock` on `<workdir>/gagar.lock`, opened once and never reopened or closed
while the run lives: on NFS, flock is emulated with POSIX record locks, and any close() of any
descriptor of the file by the holding process would release them. After taking the lock, the
holder writes {"host", "pid", "started"} into the file (through the same descriptor), so a
refused learner can name it.

The kernel drops the lock when the holding process dies, SIGKILL included, so a killed learner
never blocks a restart on a live host. On NFSv4 the server keeps a dead client's lock until its
lease expires (90 s by default). This module does not import JAX: the CLI takes the lock before
JAX starts, and shares the result with the other processes afterwards (`agree`).

Deleting `gagar.lock` under a live holder would let a second learner take a new file's lock:
the holder checks before every checkpoint and audit write that the path is still the file it
locked (`verify_held`) and stops with `LockLost` (exit 1) if not.

Object-store workdirs (gs://, s3://) have no locks: `acquire` logs a warning and returns None;
keeping one learner per such workdir is the scheduler's job there (docs/reliability.md).
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import os
import socket
import time
from typing import Optional

from gagar_jax.distributed import is_remote, kv_client

LOCK_NAME = "gagar.lock"
_KEY = "gagar_jax/workdir_lock"
_held: dict = {}            # realpath(workdir) -> WorkdirLock held by this process
_warned: set = set()        # object-store workdirs already warned about


class LockHeld(RuntimeError):
    """Another learner holds the workdir; the message names it (host, pid, start time)."""

    def __init__(self, path: str, holder: dict):
        self.path, self.holder = path, holder
        who = (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started "
               f"{holder.get('started', '?')}") if holder else "holder unknown"
        super().__init__(f"workdir is in use by another learner ({who}); lock file {path}")


class LockLost(RuntimeError):
    """The lock file this process locked is no longer at its path (deleted, or replaced by
    another file): a second learner may hold the workdir now, so this one must stop."""


@dataclasses.dataclass(frozen=True)
class WorkdirLock:
    path: str
    fd: int
    holder: dict


def _holder(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        return json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {}


def acquire(workdir: str, *, wait_s: float = 0.0,
            poll_s: float = 0.25) -> Optional[WorkdirLock]:
    """Takes the workdir's lock, waiting up to `wait_s` seconds for a holder to go away.

    Idempotent within a process (the CLI takes it, `train.run` asks again).

    Args:
      workdir: the run directory (created if missing).
      wait_s: how long to retry, e.g. a predecessor's SIGTERM grace period.
      poll_s: seconds between attempts while waiting.
    Returns:
      The held lock (kept until the process exits); None on an object-store workdir.
    Raises:
      LockHeld: still held by another process after `wait_s`.
    """
    if is_remote(workdir):
        if str(workdir) not in _warned:
            _warned.add(str(workdir))
            logging.getLogger(__name__).warning(
                "workdir %s is on an object store: no workdir lock (run one learner per "
                "workdir)", workdir)
        return None
    real = os.path.realpath(workdir)
    if real in _held:
        return _held[real]
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + max(wait_s, 0.0)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                os.close(fd)
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                holder = _holder(fd)
                os.close(fd)     # we hold no lock on it, so closing releases nothing
                raise LockHeld(path, holder) from None
            time.sleep(min(poll_s, left))
    holder = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    os.fsync(fd)
    _held[real] = lock = WorkdirLock(path, fd, holder)
    return lock


def verify_held(workdir: str | os.PathLike) -> None:
    """Checks that this process's lock on `workdir` (if it holds one) is still the file at its
    path (inode and device); called before every checkpoint and audit write (one `stat`).

    Raises:
      LockLost: `gagar.lock` was deleted or replaced while held (someone removed it and a
        second learner may have taken a new one): writing on would duplicate steps.
    """
    if is_remote(str(workdir)):
        return
    real = os.path.realpath(os.fspath(workdir))
    lock = _held.get(real)
    if lock is None:
        return
    path = os.path.join(real, LOCK_NAME)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    mine = os.fstat(lock.fd)
    if st is None or (st.st_ino, st.st_dev) != (mine.st_ino, mine.st_dev):
        what = "deleted" if st is None else "replaced by another file"
        raise LockLost(f"the workdir lock {path} was {what} while this learner held it; "
                       "another learner may be using the workdir: stopping before the next "
                       "checkpoint or audit write")


def release(workdir: str) -> None:
    """Drops this process's lock on `workdir` (tests; a run keeps it until it exits)."""
    lock = _held.pop(os.path.realpath(workdir), None)
    if lock is not None:
        os.close(lock.fd)


def agree(error: Optional[str], process_index: int, *, timeout_s: float = 300.0) -> Optional[str]:
    """Every process learns process 0's lock result (call after `jax.distributed.initialize`).

    Process 0 publishes `error` (None = it holds the lock) in the coordination service's
    key-value store; the others block until it is there.

    Returns:
      None if process 0 holds the lock, else its one-line error.
    """
    client = kv_client()
    if client is None:
        return error
    if process_index == 0:
        client.key_value_set(_KEY, error or "ok")
    value = client.blocking_key_value_get(_KEY, int(timeout_s * 1000))
    return None if value == "ok" else value

"""One learner per workdir: the lock, its holder line, --lock_wait_s, SIGKILL, multi-process."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from support.paths import REPO, TINY_CONFIG

from gagar_jax.run import workdir_lock


def test_second_learner_exits_2_naming_the_holder_before_importing_jax(tmp_path):
    held = workdir_lock.acquire(str(tmp_path))
    try:
        lock_bytes = open(held.path, "rb").read()
        # A `jax` that kills the process on import: exit 2 proves JAX was never imported.
        fake = tmp_path / "fakejax"
        (fake / "jax").mkdir(parents=True)
        (fake / "jax" / "__init__.py").write_text("import sys\nsys.exit(99)\n")
        env = {**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{REPO}"}
        before = sorted(os.listdir(tmp_path))
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "gagar_jax.run.cli", "--workdir", str(tmp_path),
             "--config", TINY_CONFIG],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        workdir_lock.release(str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert (f"host {socket.gethostname()}" in err and f"pid {os.getpid()}" in err
            and f"started {held.holder['started']}" in err), err
    assert elapsed < 30
    # The refused learner touched nothing: same files, the holder's line intact.
    assert sorted(os.listdir(tmp_path)) == before
    assert open(held.path, "rb").read() == lock_bytes


def test_lock_wait_s_waits_out_the_predecessor(tmp_path):
    other = str(tmp_path / "w")
    # A second open file description conflicts with the first, as another process would.
    first = workdir_lock.acquire(other)
    workdir_lock._held.clear()            # forget it: this process now plays a second learner
    try:
        t0 = time.monotonic()
        with pytest.raises(workdir_lock.LockHeld, match=f"pid {os.getpid()}"):
            workdir_lock.acquire(other, wait_s=0.3, poll_s=0.05)
        assert 0.3 <= time.monotonic() - t0 < 3
        threading.Timer(0.4, os.close, [first.fd]).start()   # the predecessor exits
        second = workdir_lock.acquire(other, wait_s=10, poll_s=0.05)
        assert second.fd != first.fd
    finally:
        workdir_lock.release(other)


def test_sigkilled_holder_never_blocks_a_restart(tmp_path):
    code = (
        "import sys; from gagar_jax.run import workdir_lock; workdir_lock.acquire(sys.argv[1]); "
        "print('held', flush=True); import time; time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(workdir_lock.LockHeld, match=f"pid {proc.pid}"):
            workdir_lock.acquire(str(tmp_path))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        lock = workdir_lock.acquire(str(tmp_path))      # at once: the kernel dropped it
        assert lock.holder["pid"] == os.getpid()
    finally:
        proc.kill()
        workdir_lock.release(str(tmp_path))


def test_the_holder_never_reopens_the_lock_file(tmp_path, monkeypatch):
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: opened.append(p) or real_open(p, *a, **k))
    try:
        lock = workdir_lock.acquire(str(tmp_path))
        workdir_lock.acquire(str(tmp_path))             # train.run asks again: no new open
        assert opened.count(lock.path) == 1
    finally:
        workdir_lock.release(str(tmp_path))


class _FakeClient:
    def __init__(self):
        self.store, self.cond = {}, threading.Condition()

    def key_value_set(self, key, value):
        with self.cond:
            self.store[key] = value
            self.cond.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.store, timeout_ms / 1000)
            return self.store[key]


@pytest.mark.parametrize("error", [None, "workdir is in use by another learner (host h, pid 1)"])
def test_every_process_learns_process_0s_result(monkeypatch, error):
    from jax._src import distributed
    monkeypatch.setattr(distributed.global_state, "client", _FakeClient())
    results = {}
    workers = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, workdir_lock.agree(error if i == 0 else None, i, timeout_s=10))) for i in (2, 1, 0)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(10)
    assert results == {0: error, 1: error, 2: error}


def test_a_read_only_workdir_at_start_is_fatal_naming_the_lock_file(tmp_path, monkeypatch,
                                                                     capsys):
    import errno

    from gagar_jax.run import cli
    real_open = os.open

    def erofs(path, *a, **k):     # as root, chmod cannot make a directory read-only: inject
        if str(path).endswith(workdir_lock.LOCK_NAME):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, *a, **k)
    monkeypatch.setattr(os, "open", erofs)
    code = cli.main(["gagar-train", "--workdir", str(tmp_path / "ro"),
                     "--config", TINY_CONFIG])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1, err
    assert err == (f"gagar-train: fatal: {os.strerror(errno.EROFS)}: "
                   f"{tmp_path / 'ro' / workdir_lock.LOCK_NAME}")


def test_a_deleted_lock_stops_the_holder_before_its_next_write(tmp_path):
    """Issue 36 item 4: `gagar.lock` deleted under a live holder and a second learner locking
    a new file there: the holder's next audit write and checkpoint raise LockLost (exit 1 in
    the CLI, one line), and nothing more is written; with its own file in place it writes."""
    import fcntl

    import jax.numpy as jnp

    from gagar_jax.run import checkpoint, metrics
    wd = tmp_path / "w"
    workdir_lock.acquire(str(wd))
    try:
        writer = metrics.MetricsWriter(wd, tensorboard=False, enabled=True)
        ckpt = checkpoint.Checkpointer(str(wd / "checkpoints"), save_interval_steps=1)
        writer.write(1, {"loss": 1.0})
        writer.flush()
        os.remove(wd / workdir_lock.LOCK_NAME)            # the mistake
        second = os.open(wd / workdir_lock.LOCK_NAME, os.O_RDWR | os.O_CREAT)
        fcntl.flock(second, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a second learner takes it
        with pytest.raises(workdir_lock.LockLost, match="was replaced by another file"):
            writer.write(2, {"loss": 2.0})
        with pytest.raises(workdir_lock.LockLost):
            writer.write_groups([{"group_id": "g"}])
        with pytest.raises(workdir_lock.LockLost):
            ckpt.save(2, {"x": jnp.zeros(2)}, {}, {}, force=True)
        os.close(second)
        os.remove(wd / workdir_lock.LOCK_NAME)
        with pytest.raises(workdir_lock.LockLost, match="was deleted"):
            writer.sync()
        writer.flush()
        assert len((wd / "metrics.jsonl").read_text().splitlines()) == 1     # step 1 only
        groups = wd / "groups.jsonl"
        assert not (groups.exists() and groups.read_text()) and ckpt.latest_step() is None
        ckpt.close()
    finally:
        workdir_lock.release(str(wd))

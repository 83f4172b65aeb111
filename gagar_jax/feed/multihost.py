"""Agreement between the processes of a multi-host learner on the records they read: every
process must act on them alike (the same quarantined groups).

Each helper is one small collective over JSON-able values; with one process they return their
input unchanged. The broadcast of process 0's value (the spool listing) is a ground helper:
`gagar_jax.distributed.broadcast_from_process0`.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np


def allgather_from_processes(obj: Any) -> list:
    """Every process's JSON-able `obj`, in process order (one small all-gather)."""
    from jax.experimental import multihost_utils
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(data.size))).reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[:data.size] = data
    bufs = np.asarray(multihost_utils.process_allgather(buf)).reshape(sizes.size, -1)
    return [json.loads(bytes(bufs[p, :int(n)])) for p, n in enumerate(sizes)]


def merge_failures(per_process: list) -> dict:
    """The union of every process's row-build failures ({group_id: [reason, detail]}).

    A group any process failed to build is failed everywhere; for a group several processes
    report, the lowest process's entry wins, so every process writes the same.
    """
    merged: dict = {}
    for failures in per_process:
        for group_id, entry in failures.items():
            merged.setdefault(group_id, list(entry))
    return merged


def agree_across_processes(failures: dict) -> dict:
    """Every process's row-build failures merged (`merge_failures`); one small all-gather."""
    return merge_failures(allgather_from_processes(failures))

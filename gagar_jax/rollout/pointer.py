"""`<workdir>/published/latest` read with plain `json` (the format: gagar_jax/run/publish.py).

Local paths only (what a rollout host mounts); no JAX, no etils.
"""
from __future__ import annotations

import json
import os

PUBLISH_DIR = "published"   # = gagar_jax.run.publish.PUBLISH_DIR
POINTER = "latest"          # = gagar_jax.run.publish.POINTER


def read_latest(workdir: str) -> dict | None:
    """The pointer {"step", "policy_version", "path"} of `workdir` (None before any publish).

    A relative "path" is taken relative to `<workdir>/published/`.
    """
    f = os.path.join(workdir, PUBLISH_DIR, POINTER)
    try:
        with open(f) as fh:
            ptr = json.load(fh)
    except FileNotFoundError:
        return None
    if not isinstance(ptr, dict) or not {"step", "policy_version", "path"} <= set(ptr):
        raise ValueError(f"{f}: not a publish pointer: {ptr!r}")
    if not os.path.isabs(ptr["path"]):
        ptr = {**ptr, "path": os.path.join(workdir, PUBLISH_DIR, ptr["path"])}
    return ptr

"""`<workdir>/published/latest` and version manifests read with plain `json` (the version model:
gagar_jax/run/published.py and docs/checkpoints.md, "Versions and collection").

`latest` names a complete version directory at every moment, and nothing writes into or deletes
a directory while `latest` names it. Reload when `path` changes, not only `step`: a resumed
learner publishes a step again into a new directory (`step_<8-digit step>.a1`). The learner keeps
`train.keep_published` versions after `latest` moves on; a reader slower than that may find its
directory gone and should read `latest` again. Local paths only (what a rollout host mounts); no
JAX, no etils.
"""
from __future__ import annotations

import json
import os

from gagar_jax.publish_format import MANIFEST, POINTER, POINTER_KEYS, PUBLISH_DIR


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
    if not isinstance(ptr, dict) or not set(POINTER_KEYS) <= set(ptr):
        raise ValueError(f"{f}: not a publish pointer: {ptr!r}")
    if not os.path.isabs(ptr["path"]):
        ptr = {**ptr, "path": os.path.join(workdir, PUBLISH_DIR, ptr["path"])}
    return ptr


def read_manifest(path: str) -> dict | None:
    """The manifest of the version directory `path` ({"step", "policy_version", "seq", "kind",
    "base", "previous", "files", "time"}), or None while it is unfinished."""
    try:
        with open(os.path.join(path, MANIFEST)) as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None

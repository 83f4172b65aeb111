"""The published-version format: file names both sides of the rollout boundary agree on.

The learner writes versions (`gagar_jax/run/published.py`, `gagar_jax/run/publish.py`,
`gagar_jax/hf/save.py`, `gagar_jax/hf/delta.py`); a rollout host reads them without JAX
(`gagar_jax/rollout/pointer.py`, `gagar_jax/rollout/delta.py`). Every name of the layout is
declared here once, in plain Python (no JAX, no numpy), so the writer and the reader cannot drift
apart (docs/checkpoints.md, "Versions and collection" and "Delta publishing"):

    <workdir>/published/                   PUBLISH_DIR
      latest                               POINTER: {"step", "policy_version", "path"}
      step_00000010/                       step_dir_name(10): a full version
        gagar_publish.json                 MANIFEST, written after every other file
        config.json, model.safetensors     (or model-*.safetensors + INDEX_FILE)
      step_00000011/                       a delta version on its manifest's "base"
        delta-00000-00000.safetensors      delta_file_name(process 0, part 0): NAME, or
                                           NAME + IDX and NAME + VAL per changed tensor
"""
from __future__ import annotations

import re
from typing import Optional

PUBLISH_DIR = "published"               # under the run's workdir
POINTER = "latest"                      # names the current version (one atomic replace)
POINTER_KEYS = ("step", "policy_version", "path")
MANIFEST = "gagar_publish.json"         # a version is complete once this exists
NAME_RE = re.compile(r"^step_(\d{8,})(?:\.a(\d+))?$")

SINGLE_FILE = "model.safetensors"       # a full version in one file, or ...
INDEX_FILE = "model.safetensors.index.json"   # ... sharded, with the Hub's index

DELTA_PREFIX = "delta-"                 # a delta version's tensor files
IDX, VAL = ":idx", ":val"               # suffixes of a sparse entry: flat indices, new values


def step_dir_name(step: int, attempt: int = 0) -> str:
    """The directory name of a version.

    Args:
      step: the train step the weights are from.
      attempt: 0 for the step's first publish, k for its k-th re-publish (a resumed run).

    Returns:
      `step_00000010`, or `step_00000010.a<k>`.
    """
    return f"step_{step:08d}" + (f".a{attempt}" if attempt else "")


def parse_name(name: str) -> Optional[tuple]:
    """Reads a version directory name.

    Args:
      name: an entry of `published/`.

    Returns:
      (step, attempt), or None for an entry that is not a version directory.
    """
    m = NAME_RE.match(name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def delta_file_name(process: int, part: int) -> str:
    """The name of one delta file.

    Args:
      process: the writing process's index.
      part: that process's file number.

    Returns:
      `delta-00003-00000.safetensors` for process 3's first file.
    """
    return f"{DELTA_PREFIX}{process:05d}-{part:05d}.safetensors"

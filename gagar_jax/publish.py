"""Weight publishing for rollout engines: HF-format snapshots plus an atomic `latest` pointer.

Layout::

    <workdir>/published/
      step_00000010/            complete HF-format weights after train step 10
        gagar_publish.json      {"step": 10, "policy_version": 10}
        config.json, *.safetensors, ...   (whatever `save_fn` writes)
      step_00000020/
      latest                    JSON {"step": 20, "policy_version": 20, "path": "<abs dir>"}
      .tmp-step_00000030/       a publish in progress (never named by `latest`)

Protocol (readers: `read_latest`): a directory named `step_*` is only ever created by renaming a
fully written temp directory, and `latest` is only ever replaced (write temp file + fsync +
`os.replace`) after that rename, so `latest` always names a complete directory. Old snapshots
beyond `keep` are deleted after the pointer moves; a reader that is slower than `keep` publish
intervals may see its directory disappear and should re-read `latest`.

`policy_version` = learner train steps (docs/feed.md, "policy_version"): weights published after step n carry n.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from typing import Any, Callable, Optional

import jax

from gagar_jax import hf

log = logging.getLogger(__name__)

PUBLISH_DIR = "published"
POINTER = "latest"
MARKER = "gagar_publish.json"
_STEP_RE = re.compile(r"^step_(\d{8,})$")


def _is_primary() -> bool:
    return jax.process_index() == 0


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomic(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def published_steps(workdir: str | os.PathLike) -> list[int]:
    """Steps with a complete published directory, oldest first."""
    root = os.path.join(os.fspath(workdir), PUBLISH_DIR)
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(root) if (m := _STEP_RE.match(name)))


def read_latest(workdir: str | os.PathLike) -> Optional[dict]:
    """The `latest` pointer ({"step", "policy_version", "path"}), or None if nothing published."""
    pointer = os.path.join(os.fspath(workdir), PUBLISH_DIR, POINTER)
    try:
        with open(pointer) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def publish_weights(model: Any, step: int, workdir: str | os.PathLike,
                    save_fn: Callable[[Any, str], None], *, keep: int = 2) -> str:
    """Publishes HF-format weights for `step` and moves the `latest` pointer to them.

    Call on every process: `save_fn` runs on every process (it may gather shards with
    collectives) and must write files from process 0 only, like `hf.save_pretrained`; the
    renames and the pointer are done by process 0.

    Args:
      model: whatever `save_fn` takes (the model, or a state holding it).
      step: completed train steps; also the published `policy_version`.
      workdir: the run's workdir.
      save_fn: `save_fn(model, directory)` writes the weights into an existing empty directory.
      keep: number of published snapshots to keep (>= 1).

    Returns:
      The absolute path of the published directory.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = os.path.abspath(os.path.join(os.fspath(workdir), PUBLISH_DIR))
    final = os.path.join(root, step_dir_name(step))
    tmp = os.path.join(root, f".tmp-{step_dir_name(step)}")
    if _is_primary():
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a publish that was killed
        os.makedirs(tmp)
    _barrier(f"gagar_publish_start_{step}")
    save_fn(model, tmp)
    _barrier(f"gagar_publish_written_{step}")
    if _is_primary():
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump({"step": step, "policy_version": step}, f)
        _fsync_tree(tmp)
        trash = None
        if os.path.exists(final):
            # Re-publishing a step after a resume: swap the old copy out, then the new one in.
            trash = os.path.join(root, f".trash-{step_dir_name(step)}-{time.time_ns()}")
            os.replace(final, trash)
        os.replace(tmp, final)
        _fsync_dir(root)
        _write_json_atomic(os.path.join(root, POINTER),
                           {"step": step, "policy_version": step, "path": final})
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        _prune(root, keep, protect=final)
        log.info("published weights for step %d at %s", step, final)
    _barrier(f"gagar_publish_done_{step}")
    return final


# Files a rollout engine needs beside the weights, copied from the `init_from` directory.
SERVING_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                 "chat_template.jinja", "generation_config.json")


def copy_serving_files(src: str, dst: str) -> list:
    """Copies the tokenizer files and generation_config.json present in `src` into `dst`."""
    copied = []
    for name in SERVING_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
            copied.append(name)
    return copied


def hf_save_fn(init_from: str = "", dtype: str = "bfloat16") -> Callable[[Any, str], None]:
    """`save_fn` for `publish_weights`: HF weights in `dtype` (the model's export family), with
    the tokenizer files, generation_config.json and carried tensors (MiMo MTP) of `init_from`."""
    def save(model, directory: str) -> None:
        hf.save_pretrained(model, directory, dtype=dtype, carry_from=init_from)
        if init_from and _is_primary():
            copy_serving_files(init_from, directory)
    return save


def _fsync_tree(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(dirpath)


def _prune(root: str, keep: int, protect: str) -> None:
    steps = sorted(int(m.group(1)) for name in os.listdir(root) if (m := _STEP_RE.match(name)))
    for old in steps[:-keep]:
        path = os.path.join(root, step_dir_name(old))
        if path != protect:
            shutil.rmtree(path, ignore_errors=True)

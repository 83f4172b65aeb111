"""Weight publishing for rollout engines: HF-format snapshots plus a `latest` pointer, on local
disks and object stores alike (`etils.epath`; no rename, no append).

Layout and the version model (`published.py`; docs/checkpoints.md, "Versions and collection")::

    <workdir>/published/
      step_00000010/            complete HF-format weights after train step 10
        config.json, model-0000j-of-0000N.safetensors, model.safetensors.index.json, ...
        gagar_publish.json      the manifest {"step": 10, "policy_version": 10, ...} (written last)
      step_00000010.a1/         step 10 published again after a resume: a new directory
      latest                    JSON {"step": 10, "policy_version": 10, "path": "<dir>"}

Protocol (readers: `read_latest`): every publish writes a new directory, one no entry has had;
every process writes its files into it; then process 0 writes the index, then the manifest,
and only then replaces the `latest` pointer (one whole-object write on an object store; on a
local disk a temp file + fsync + `os.replace`), then collects old versions. Nothing ever writes
into or deletes the directory `latest` names, so `latest` always names a complete directory;
a directory without the manifest (a publish that was killed) is never named by `latest`, not
listed by `published_steps`, and collected. Collection keeps the last `keep` versions that were
`latest` (an engine that read `latest` just before it moved is still loading the previous one);
a reader slower than `keep` publish intervals may see its directory disappear and should re-read
`latest`.

`Publisher` (the trainer's): every process writes a disjoint share of the tensors (`hf_save`);
training waits only for the on-device reshard and the device-to-host copy of this process's
share; the files are written by a background thread. At most one publish is in flight: when the
next publish falls due while the previous one is still writing, it first waits for that write to
finish (bounded host memory: one share), and the wait is logged. A failed background write is
raised by the next `publish` or by `close`.

Delta publishing (`full_every` = `train.publish_full_every` = K > 1): every K-th publish is full,
the K - 1 between are deltas on the version before them (`gagar_jax/hf/delta.py`: the elements
whose publish-dtype bits changed; each process against its own previous share, kept on its host);
a delta directory holds config.json and `delta-*.safetensors` only, and its manifest names its
`base`. Engines apply the chain (`gagar_jax/rollout/delta.py`).

`policy_version` = learner train steps (docs/feed.md, "policy_version"): weights published after
step n carry n.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import jax
import numpy as np
from etils import epath

from gagar_jax.distributed import barrier, is_primary, kv_client
from gagar_jax.hf import api as hf
from gagar_jax.hf import delta as hf_delta
from gagar_jax.hf import save as hf_save
from gagar_jax.model.transformer import Transformer
from gagar_jax.publish_format import (  # noqa: F401 -- the public names of the layout
    MANIFEST,
    POINTER,
    PUBLISH_DIR,
    step_dir_name,
)
from gagar_jax.run import published
from gagar_jax.run.published import published_steps, read_latest, root_of  # noqa: F401

log = logging.getLogger(__name__)

DONE_TIMEOUT_S = 3600    # process 0 waits this long for the other processes' files
# Files a rollout engine needs beside the weights, copied from the `init_from` directory.
SERVING_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                 "chat_template.jinja", "generation_config.json")


def _prepare(root: epath.Path, step: int, key: str,
             base: Optional[str] = None) -> tuple[str, Optional[str]]:
    """A new, empty version directory for `step` (process 0 names and creates it, every process
    learns its name through the coordination service's key-value store), and the base a delta
    is written on: `base`, unless process 0 finds its chain broken (deleted by hand, say), then
    None (a full version instead, logged). Returns (name, base)."""
    client = kv_client() if jax.process_count() > 1 else None
    if is_primary():
        name = ""
        try:
            root.mkdir(parents=True, exist_ok=True)
            why = published.chain_error(root, base) if base is not None else None
            if why:
                log.warning("publish of step %d: a full version instead of a delta on %s: %s",
                            step, base, why)
                base = None
            name = published.new_name(root, step)
            (root / name).mkdir(parents=True, exist_ok=True)   # a fresh name (new_name)
        finally:   # "" tells the other processes that process 0 failed (its error is raised)
            if client is not None:
                client.key_value_set(key, json.dumps([name, base]) if name else "")
        return name, base
    value = client.blocking_key_value_get(key, DONE_TIMEOUT_S * 1000)
    if not value:
        raise RuntimeError(f"publish of step {step}: process 0 could not create its directory")
    name, base = json.loads(value)
    return name, base


def _finish(root: epath.Path, name: str, step: int, keep: int, base: Optional[str] = None,
            digests: Optional[dict] = None) -> str:
    """Process 0, after every file is written: manifest (with the files' `digests`), pointer,
    collection (a delta on `base` when `base` is given)."""
    final = published.commit(root, name, step, keep, kind="delta" if base else "full", base=base,
                             digests=digests)
    log.info("published %s for step %d at %s", f"a delta on {base}" if base else "weights",
             step, final)
    return final


def _check(step: int, keep: int) -> None:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")


_SYNC_COUNT = [0]   # publish_weights calls, equal on every process (the name keys)


def publish_weights(model: Any, step: int, workdir: epath.PathLike,
                    save_fn: Callable[[Any, str], None], *, keep: int = 2) -> str:
    """Publishes weights for `step` with `save_fn` (synchronously) and moves `latest` to them.

    Call on every process; `save_fn(model, directory)` runs on every process and writes into the
    existing empty directory (its own share of the files, like `hf.save_pretrained`).

    Returns:
      The path of the published directory (a new one: `step_<8-digit step>`, or `.a<k>` if the step
      was published before).
    """
    _check(step, keep)
    root = root_of(workdir)
    _SYNC_COUNT[0] += 1
    name, _ = _prepare(root, step, f"gagar_publish_weights/{_SYNC_COUNT[0]}/name")
    final = root / name
    barrier(f"gagar_publish_start_{step}")
    save_fn(model, os.fspath(final))
    barrier(f"gagar_publish_written_{step}")
    if is_primary():
        _finish(root, name, step, keep)
    barrier(f"gagar_publish_done_{step}")
    return os.fspath(final)


def copy_serving_files(src: epath.PathLike, dst: epath.PathLike) -> list:
    """Copies the tokenizer files and generation_config.json present in `src` into `dst`."""
    copied = []
    for name in SERVING_FILES:
        if (epath.Path(src) / name).exists():
            (epath.Path(dst) / name).write_bytes((epath.Path(src) / name).read_bytes())
            copied.append(name)
    return copied


def hf_save_fn(init_from: str = "", dtype: str = "bfloat16") -> Callable[[Any, str], None]:
    """`save_fn` for `publish_weights`: HF weights in `dtype` (the model's export family), with
    the tokenizer files, generation_config.json and carried tensors (MiMo MTP) of `init_from`."""
    def save(model: Transformer, directory: str) -> None:
        hf.save_pretrained(model, directory, dtype=dtype, carry_from=init_from)
        if init_from and is_primary():
            copy_serving_files(init_from, directory)
    return save


class Publisher:
    """The trainer's publisher: parallel shares, background writes, one publish in flight.

    Args:
      workdir: the run's workdir (local or object store).
      keep: published snapshots to keep (>= 1).
      dtype: publish dtype ("bfloat16" | "float32" | "float16"; fp32-kept tensors stay float32).
      init_from: checkpoint whose serving files and carried tensors (MiMo MTP) are published too,
        and whose config.json keys the model does not set are carried over.
      publish_fn: optional hook `publish_fn(step, tensors, directory)`, called on every process
        in the writer thread after its files are written, with this process's share
        (stored name -> numpy array, publish dtype): the place for an in-memory weight sync.
      max_shard_bytes: bound on one safetensors file.
      full_every: K: every K-th publish is a full version, the K - 1 between are deltas on the
        version before them (`hf.delta`; 1 = every publish full, no deltas). The first publish
        of a Publisher is always full. With K > 1 each process keeps its previous share on the
        host (publish dtype) to compare against.
    """

    def __init__(self, workdir: epath.PathLike, *, keep: int = 2, dtype: str = "bfloat16",
                 init_from: str = "", publish_fn: Optional[Callable] = None,
                 max_shard_bytes: int = 5 * 2**30, min_positions: int = 0, full_every: int = 1):
        _check(0, keep)
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        self.full_every = full_every
        self._prev: Optional[dict] = None   # the last published share (K > 1), contiguous
        self._prev_name: Optional[str] = None
        self._since_full = 0                # publishes since (and with) the last full one
        self._force_full = False            # a delta's chain broke at commit: next one is full
        self.last_delta: Optional[hf_delta.DeltaStats] = None   # None: the last was full
        self.root, self.keep, self.dtype, self.init_from = root_of(workdir), keep, dtype, init_from
        self.min_positions = min_positions    # max_position_embeddings floor (feed.seq_len)
        self.publish_fn, self.max_shard_bytes = publish_fn, max_shard_bytes
        self._plan = None
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._count = 0
        self.last_wait_s = 0.0    # time the last publish waited for the previous write
        self.last_bytes = 0       # bytes this process wrote in the last finished publish

    def publish(self, model: Transformer, step: int) -> str:
        """Starts publishing `model` as step `step` (every process calls it at the same step);
        returns once this process's share is on the host. Returns the directory."""
        _check(step, self.keep)
        t0 = time.perf_counter()
        self.wait()
        self.last_wait_s = time.perf_counter() - t0
        if self.last_wait_s > 0.1:
            log.info("publish of step %d waited %.1f s for the previous write", step,
                     self.last_wait_s)
        leaves = hf.model_leaves(model)
        if self._plan is None:
            if is_primary():  # once per run: what an engine would run differently
                for line in hf.engine_warnings(model.cfg):
                    log.warning("published weights differ in an engine: %s", line)
            carried = hf.carried_shapes(self.init_from) if self.init_from else None
            self._plan = hf_save.plan_save(leaves, model.cfg, jax.process_count(), self.dtype,
                                           carried, self.max_shard_bytes)
        self._count += 1
        # Every process takes the same decision (same counts; a failed write stops the run).
        base = (self._prev_name if self._prev is not None and self._since_full < self.full_every
                and not self._force_full else None)
        self._force_full = False
        # process 0 checks the base's whole chain; every process writes what it decided
        name, base = _prepare(self.root, step, f"gagar_publish/{self._count}/name", base)
        final = self.root / name
        if is_primary():
            (final / "config.json").write_text(json.dumps(hf.published_config(
                model.cfg, self.dtype, self.init_from, self.min_positions), indent=2))
        barrier(f"gagar_publish_start_{step}")
        share = hf_save.gather_share(leaves, self._plan)   # device-to-host: training waits here
        self._thread = threading.Thread(target=self._write,
                                        args=(share, step, final, self._count, base),
                                        name=f"gagar-publish-{step}", daemon=True)
        self._thread.start()
        return os.fspath(final)

    def _write(self, share: dict, step: int, final: epath.Path, count: int,
               base: Optional[str]) -> None:
        key = f"gagar_publish/{count}/"
        client = kv_client() if jax.process_count() > 1 else None
        digests: dict = {}          # file name -> sha256 of what this process wrote
        try:
            nbytes = self._write_files(share, final, base, digests)
            if self.publish_fn is not None:
                self.publish_fn(step, share, os.fspath(final))
            status = json.dumps({"digests": digests})
        except BaseException as e:  # reported by the next publish / close
            self._error, status, nbytes = e, f"process {jax.process_index()}: {e!r}", 0
        del share
        self.last_bytes = nbytes
        if client is not None and not is_primary():
            client.key_value_set(key + str(jax.process_index()), status)
            return
        try:
            for p in range(1, jax.process_count()):
                other = client.blocking_key_value_get(key + str(p), DONE_TIMEOUT_S * 1000)
                if not other.startswith("{"):
                    raise RuntimeError(f"publish of step {step} failed on {other}")
                digests.update(json.loads(other)["digests"])
            if self._error is None:
                if base is None:   # a delta is read on top of its chain's full version
                    if self.init_from:
                        copy_serving_files(self.init_from, final)
                    hf_save.write_index(self._plan, final)
                _finish(self.root, final.name, step, self.keep, base, digests)
        except published.BrokenChain as e:   # its base went while it was written
            try:
                self._full_instead(step, final, e)
            except BaseException as err:
                self._error = self._error or err
        except BaseException as e:
            self._error = self._error or e

    def _full_instead(self, step: int, delta_dir: epath.Path, why: Exception) -> None:
        """Process 0, after a delta's chain broke while it was written: one process publishes
        the step's full version from the share it keeps (`_prev`) in a new directory; with
        several (whose shares process 0 does not hold) the delta stays uncommitted, `latest`
        stays on a complete version, and the next publish is full. Never fails the run."""
        if jax.process_count() > 1 or self._prev is None:
            log.warning("publish of step %d not committed (latest stays on a complete "
                        "version); the next publish is full: %s", step, why)
            self._force_full = True
            return
        log.warning("publish of step %d: a full version instead of the delta: %s", step, why)
        name = published.new_name(self.root, step)
        final = self.root / name
        final.mkdir(parents=True, exist_ok=True)
        (final / "config.json").write_bytes((delta_dir / "config.json").read_bytes())
        share, digests = dict(self._prev), {}
        if self.init_from:
            share.update(hf_save.read_carried(self._plan, self.init_from))
            copy_serving_files(self.init_from, final)
        hf_save.write_share(share, self._plan, final, 0, digests)
        hf_save.write_index(self._plan, final)
        _finish(self.root, name, step, self.keep, None, digests)
        self._since_full, self._prev_name, self.last_delta = 1, name, None

    def _write_files(self, share: dict, final: epath.Path, base: Optional[str],
                     digests: dict) -> int:
        """This process's files of a full version (`base` None) or of a delta on `base`; keeps
        the share as the next delta's reference when deltas are on. Returns the bytes;
        `digests` gets each file's sha256."""
        proc = jax.process_index()
        if self.full_every > 1:   # carried tensors (MiMo MTP) never change: not compared
            current = {n: np.ascontiguousarray(a) for n, a in share.items()}
            share.update(current)
        if base is None:
            if self.init_from:
                share.update(hf_save.read_carried(self._plan, self.init_from))
            nbytes = hf_save.write_share(share, self._plan, final, proc, digests)
            self._since_full, self.last_delta = 1, None
        else:
            entries, stats = hf_delta.encode_share(self._prev, current)
            nbytes, _ = hf_delta.write_delta_share(entries, final, proc, self.max_shard_bytes,
                                                   digests)
            stats.bytes = nbytes
            self._since_full, self.last_delta = self._since_full + 1, stats
        if self.full_every > 1:
            self._prev, self._prev_name = current, final.name
        return nbytes

    def wait(self) -> None:
        """Waits for the write in flight; raises its error, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"publishing weights failed: {err}") from err

    close = wait


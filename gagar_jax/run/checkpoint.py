"""Checkpoints: the train state, the feed position and the config, saved together with orbax.

A resume is exact only if the train state and the feed position come from the same step, so
both (and the run's config) are written as items of one orbax step directory and committed
together: either the whole step exists or none of it does.

Directory layout (``directory`` is ``<workdir>/checkpoints`` in the trainer)::

    <directory>/
      <step>/                          one committed step (step = completed train steps)
        _CHECKPOINT_METADATA           orbax step metadata (commit time)
        commit_success.txt             orbax commit marker
        state/                         the TrainState pytree (OCDBT + zarr; sharding-agnostic)
        feed/metadata                  JSON: feed position/state (`Feed.state()`)
        config/metadata                JSON: the run's config (ConfigDict.to_dict())
        audit/metadata                 JSON: positions of metrics.jsonl / groups.jsonl (optional)
      <step>.orbax-checkpoint-tmp-*/   a save in flight (or killed mid-save): never read
      <step>.corrupt-<unix time>/      a step that failed to restore, moved aside \
(kept for forensics;
                                       on an object store, which has no rename, it is deleted
                                       and an object of that name records why)

A step that reads but holds another train state than the configured one (a changed model
shape, the KL reference switched on) is a config mistake, not damage: `restore` raises
`StateMismatch` and moves nothing (`resume.py` names the config keys first).

Saves are asynchronous: `save` returns once the arrays are copied off the devices, and the files
are written by a background thread, so the next train step may donate the state's buffers.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from gagar_jax.audit_file import unused_name
from gagar_jax.config import ConfigError
from gagar_jax.distributed import barrier, is_primary, is_remote
from gagar_jax.run import workdir_lock

log = logging.getLogger(__name__)

_ITEMS = ("state", "feed", "config", "audit")
# orbax splits each replicated array among its replicas for the device-to-host copy, one
# compiled slice program per array shape and replica: ~200 programs on the first save of a
# tiny model (5 s of compiles at -O0 in a test process, 1 s from the compile cache). A slice
# under this size is copied whole by one replica instead; large arrays are still split.
MIN_REPLICA_SLICE_BYTES = 4 << 20
# Files every committed step has; a step missing one is incomplete (e.g. deleted by hand).
_REQUIRED = ("_CHECKPOINT_METADATA", "state", "feed", "config")


@dataclasses.dataclass(frozen=True)
class Restored:
    """A restored checkpoint.

    Attributes:
      step: the step the checkpoint was written at.
      state: the train state, on the shardings of the abstract state passed to `restore`.
      feed: the feed position/state dict saved with it.
      config: the config dict saved with it.
      audit: {file name: AuditPosition JSON} of the audit logs at the save, or None for a
        checkpoint written without them (then nothing is truncated on resume).
    """

    step: int
    state: Any
    feed: dict
    config: dict
    audit: Optional[dict] = None


class StateMismatch(ConfigError):
    """A readable checkpoint whose saved train state has another tree, shapes or dtypes than
    the configured one: a config mistake, not damage (the checkpoint is left where it is)."""


class NoReadableCheckpoint(FileNotFoundError):
    """Every committed step failed to read and was moved aside (`moved`: their new names)."""

    def __init__(self, message: str, moved: list):
        super().__init__(message)
        self.moved = moved


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _tree_leaves(tree: Any) -> dict:
    """{normalized key path: (shape, dtype name)} of a state or of its saved metadata (dict
    keys, attribute names and sequence indices all become plain strings)."""
    out = {}
    for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = getattr(x, "dtype", None)
        name = "/".join(_key_name(k) for k in kp)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
            out[name] = None    # a typed PRNG key: stored as its key data; any shape matches
            continue
        out[name] = (tuple(getattr(x, "shape", ())), str(np.dtype(dtype)) if dtype else "?")
    return out


def _tree_differences(saved: dict, want: dict, limit: int = 3) -> list:
    """What differs between two `_tree_leaves` ([] when they match)."""
    out = [f"{k} missing from the checkpoint" for k in sorted(set(want) - set(saved))]
    out += [f"{k} only in the checkpoint" for k in sorted(set(saved) - set(want))]
    out += [f"{k}: checkpoint {saved[k][0]} {saved[k][1]}, config {want[k][0]} {want[k][1]}"
            for k in sorted(set(saved) & set(want))
            if want[k] is not None and saved[k] != want[k]]
    return out[:limit] + ([f"{len(out) - limit} more"] if len(out) > limit else [])


def _jsonable(obj: Any, what: str, *, lenient: bool = False) -> Any:
    """A JSON round-trip of `obj` (numpy scalars/arrays become Python), or a clear error.

    `obj` may be a dict, a ConfigDict or a JSON object string. With `lenient`, values JSON cannot
    hold are stored as their `str` (the config is kept for reference only).
    """

    def default(x: Any):
        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, (np.ndarray, jax.Array)):
            return np.asarray(x).tolist()
        if lenient:
            return str(x)
        raise TypeError(f"{what}: value of type {type(x).__name__} is not JSON-serializable")

    if isinstance(obj, str):
        obj = json.loads(obj)
    if hasattr(obj, "to_dict"):  # ml_collections.ConfigDict
        obj = obj.to_dict()
    if not isinstance(obj, Mapping):
        raise TypeError(f"{what} must be a dict, got {type(obj).__name__}")
    return json.loads(json.dumps(obj, default=default, allow_nan=False))


def _copy_small_arrays_whole() -> None:
    """orbax's jax.Array handler with `MIN_REPLICA_SLICE_BYTES` (its global registry: the
    standard save/restore arguments take no handler of their own); the same metadata store."""
    current = ocp.type_handlers.get_type_handler(jax.Array)
    if getattr(current, "gagar_min_slice", None) == MIN_REPLICA_SLICE_BYTES:
        return
    # orbax itself reads the store this way (array_metadata_store.resolve_array_metadata_store)
    store = getattr(current, "_array_metadata_store", None)
    handler = ocp.type_handlers.ArrayHandler(
        array_metadata_store=store, min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES)
    handler.gagar_min_slice = MIN_REPLICA_SLICE_BYTES
    ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)


def _check_abstract(abstract_state: Any) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
        if getattr(leaf, "sharding", None) is None:
            raise ValueError(
                "abstract_state: every leaf must be a jax.ShapeDtypeStruct (or jax.Array) with a "
                f"sharding; leaf {jax.tree_util.keystr(path)} has none")


class Checkpointer:
    """A small wrapper over `orbax.checkpoint.CheckpointManager` for the trainer.

    Args:
      directory: where step directories live (created if missing).
      save_interval_steps: `save` writes only at steps divisible by this (unless forced);
        0 = only forced saves (end of run, SIGTERM).
      max_to_keep: keep the newest K committed steps; older ones are deleted after a save.
      async_save: write files on a background thread (True in the trainer).
    """

    def __init__(self, directory: str | os.PathLike, *, save_interval_steps: int = 100,
                 max_to_keep: int = 3, async_save: bool = True):
        if save_interval_steps < 0:
            raise ValueError(f"save_interval_steps must be >= 0, got {save_interval_steps}")
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        directory = os.fspath(directory)
        # Object stores (gs://...): orbax writes them itself (no rename; commit marker files).
        self.directory = directory if is_remote(directory) else os.path.abspath(directory)
        self.save_interval_steps = save_interval_steps
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=max(save_interval_steps, 1),  # unused: we decide, see save()
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            # Removes `*.orbax-checkpoint-tmp-*` dirs left by a save that was killed.
            cleanup_tmp_directories=True,
        )
        _copy_small_arrays_whole()
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)

    # -- queries ------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> Optional[int]:
        """The newest committed step, or None if there is none."""
        return self._manager.latest_step()

    def should_save(self, step: int) -> bool:
        """Whether `save(step, ...)` without `force` would write."""
        # Our own rule, not orbax's default (which also saves the first step it sees).
        if self.save_interval_steps == 0 or step % self.save_interval_steps:
            return False
        latest = self.latest_step()
        return latest is None or step > latest

    # -- save ---------------------------------------------------------------------------------
    def save(self, step: int, state: Any, feed: Mapping[str, Any], config: Any, *,
             force: bool = False, audit: Optional[Mapping[str, Any]] = None) -> bool:
        """Starts an (async) save of state + feed position + config as one step.

        Call on every process. Writes when `step` is a multiple of `save_interval_steps`, or
        always with `force=True` (preemption, end of run); a step that already exists is never
        overwritten.

        Args:
          step: completed train steps.
          state: the train state pytree (sharded jax.Arrays).
          feed: the feed position/state, a JSON-serializable dict.
          config: the run's config (dict, ConfigDict or JSON string), stored for reference.
          force: write even off the save interval.
          audit: positions of the audit logs (`MetricsWriter.sync()`), taken after they were
            fsync'ed, so the committed step never points past what is on disk.

        Returns:
          True if a save was started.
        """
        feed_json = _jsonable(feed, "feed")
        config_json = _jsonable(config, "config", lenient=True)
        if not force and not self.should_save(step):
            return False
        if step in self._manager.all_steps():
            log.debug("checkpoint for step %d already exists; not saving again", step)
            return False
        # A second learner may hold the workdir (its lock deleted under us): LockLost.
        workdir_lock.verify_held(os.path.dirname(self.directory))
        items = dict(state=ocp.args.StandardSave(state), feed=ocp.args.JsonSave(feed_json),
                     config=ocp.args.JsonSave(config_json))
        if audit is not None:
            items["audit"] = ocp.args.JsonSave(_jsonable(audit, "audit"))
        args = ocp.args.Composite(**items)
        return bool(self._manager.save(step, args=args, force=True))

    def wait_until_finished(self) -> None:
        """Blocks until pending async saves are committed (re-raises their errors)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager's threads."""
        self._manager.wait_until_finished()
        self._manager.close()

    def abort(self, timeout_s: float = 10.0) -> bool:
        """Fatal-error cleanup: stops the background writers, waiting at most `timeout_s`.

        Errors of the pending save are logged, not raised (the run is failing already).

        Returns:
          True if the writers stopped in time (else they are left to die with the process).
        """
        def close():
            try:
                self._manager.close()
            except Exception as err:  # already failing: report, do not mask
                log.warning("checkpoint writer stopped with %s: %s", type(err).__name__, err)

        thread = threading.Thread(target=close, name="gagar-checkpoint-abort", daemon=True)
        thread.start()
        thread.join(timeout_s)
        return not thread.is_alive()

    def saved_config(self, step: int) -> Optional[dict]:
        """The config stored with `step` (its JSON file alone), or None if it cannot be read."""
        try:
            cfg = json.loads((epath.Path(self.directory) / str(step) / "config" / "metadata")
                             .read_text())
        except (OSError, ValueError):
            return None
        return cfg if isinstance(cfg, dict) else None

    def check_state_tree(self, abstract_state: Any, step: int) -> None:
        """Raises `StateMismatch` if `step`'s saved state tree (its metadata file: no array is
        read) differs from `abstract_state`'s; an unreadable tree is left to the restore."""
        try:
            meta = ocp.StandardCheckpointHandler().metadata(
                epath.Path(self.directory) / str(step) / "state")
            saved = _tree_leaves(getattr(meta, "tree", meta))
        except Exception:  # damaged metadata: the restore reports it
            return
        differ = _tree_differences(saved, _tree_leaves(abstract_state)) if saved else []
        if differ:
            raise StateMismatch(
                f"resume: checkpoint step {step} in {self.directory} holds a train state of "
                f"another shape than the config's ({'; '.join(differ)}); "
                "the checkpoints are untouched: restore the config it was written with, or "
                "train in a new --workdir")

    # -- restore ------------------------------------------------------------------------------
    def restore(self, abstract_state: Any, step: Optional[int] = None) -> Restored:
        """Restores a step onto the shardings of `abstract_state`.

        The checkpoint is sharding-agnostic: a state written on 8 devices restores onto any
        mesh whose shardings divide the shapes (e.g. 4 devices).

        With `step=None`, tries the newest committed step first; a step that is incomplete or
        fails to read (missing/truncated files, bad JSON) is logged as a warning, moved aside
        to `<step>.corrupt-<time>`, and the next older one is tried.

        Args:
          abstract_state: pytree of `jax.ShapeDtypeStruct` with `sharding` (e.g. from
            `jax.eval_shape` + the trainer's shardings), same structure as the saved state.
          step: a specific step (no fallback: errors propagate), or None for the latest good one.

        Returns:
          `Restored(step, state, feed, config)`.

        A step whose saved state tree (shapes, dtypes, structure) differs from
        `abstract_state` is not damaged: `StateMismatch` is raised and nothing is moved.

        Raises:
          FileNotFoundError: no step exists; `NoReadableCheckpoint` (a subclass): none of them
            could be read (all moved aside).
          StateMismatch: a readable step of another train state (a ConfigError).
        """
        _check_abstract(abstract_state)
        if step is not None:
            self.check_state_tree(abstract_state, step)
            return self._restore_step(abstract_state, step)
        self._manager.reload()
        candidates = sorted(self._manager.all_steps(), reverse=True)
        if not candidates:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        moved = []
        for candidate in candidates:
            self.check_state_tree(abstract_state, candidate)   # a config mistake: never moved
            try:
                return self._restore_step(abstract_state, candidate)
            except Exception as err:  # any read failure means "unusable step"
                log.warning("checkpoint step %d in %s is unusable (%s: %s); falling back to the "
                            "previous one", candidate, self.directory, type(err).__name__, err)
                moved.append(self._quarantine(candidate, f"{type(err).__name__}: {err}"))
        raise NoReadableCheckpoint(f"no readable checkpoint in {self.directory} "
                                   f"(tried steps {candidates})", moved)

    def _restore_step(self, abstract_state: Any, step: int) -> Restored:
        step_dir = epath.Path(self.directory) / str(step)
        missing = [name for name in _REQUIRED if not (step_dir / name).exists()]
        if missing:
            raise FileNotFoundError(f"step {step} is incomplete: missing {missing} in {step_dir}")
        items = dict(state=ocp.args.StandardRestore(abstract_state),
                     feed=ocp.args.JsonRestore(), config=ocp.args.JsonRestore())
        has_audit = (step_dir / "audit").exists()
        if has_audit:
            items["audit"] = ocp.args.JsonRestore()
        out = self._manager.restore(step, args=ocp.args.Composite(**items))
        if not isinstance(out.feed, dict) or not isinstance(out.config, dict):
            raise ValueError(f"step {step}: feed/config items are not JSON objects")
        audit = out.audit if has_audit else None
        if audit is not None and not isinstance(audit, dict):
            raise ValueError(f"step {step}: the audit item is not a JSON object")
        return Restored(step=step, state=out.state, feed=out.feed, config=out.config,
                        audit=audit)

    def _quarantine(self, step: int, reason: str = "") -> str:
        """Moves a bad step out of orbax's sight, so later saves of that step number can happen;
        returns its new name (`<step>.corrupt-<unix time>`).

        Object stores have no rename: there the bad step is deleted (and the warning says so),
        and a small object of that name records the reason, so later launches see the damage.
        """
        src = epath.Path(self.directory) / str(step)
        # A free name: two quarantines of one step in one second (or after the clock was set
        # back) never collide. Every process computes it; process 0's is the one used.
        dst = unused_name(src.parent, f"{src.name}.corrupt-{int(time.time())}")
        if is_primary():
            if src.exists() and is_remote(self.directory):
                src.rmtree()
                dst.write_text(f"deleted unusable checkpoint step {step}: {reason}\n")
                log.warning("deleted unusable checkpoint %s (object store: no rename)", src)
            elif src.exists():
                src.replace(dst)
                log.warning("moved unusable checkpoint %s to %s", src, dst)
        barrier(f"gagar_checkpoint_quarantine_{step}")
        self._manager.reload()
        return dst.name

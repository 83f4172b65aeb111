"""Metrics off the critical path: delayed host transfer, JSONL/TensorBoard writers, audit logs.

Files written in the workdir (process 0 only):
  metrics.jsonl     one JSON object per logged step: {"step", "time", <name>: float, ...};
                    non-finite values are written as null and listed under "nonfinite".
  groups.jsonl      one JSON object per trained group (see `group_records`); non-finite
                    values (e.g. the NaN factor of a pass sent without quality) are null.
  tensorboard/      TensorBoard event files (tensorboardX), one scalar per metric name.

The JSONL files are flushed every step and checkpointed like the dead-letter file: their
`AuditPosition`s are saved with each checkpoint (after an fsync), and a resumed run cuts them
back, so a step is in them exactly once even after a SIGKILL. On an object-store workdir they
are rolling segments instead of single files (`audit_file.py`).

The loop (`train.py`) dispatches step N+1 before it reads step N's metrics (`to_host`), so the
device never waits for the host to format numbers.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any, Mapping, Optional, Sequence

import jax
import numpy as np
from etils import epath

from gagar_jax.audit_file import AuditFile, AuditPosition, is_remote, truncate_to  # noqa: F401
from gagar_jax.run.fingerprint import params_fingerprint, params_l2, params_sha256  # noqa: F401
from gagar_jax.sharding import leaf_path

# -- device -> host -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HostMetrics:
    """One step's metrics on the host.

    Attributes:
      step: the train step they belong to.
      scalars: flattened name ("a/b") -> Python float, for every 0-d leaf.
      arrays: flattened name -> numpy array, for every leaf with ndim > 0 (e.g. `lam_G`).
      nonfinite: names of scalars that are NaN or +-inf (sorted).
    """

    step: int
    scalars: dict
    arrays: dict
    nonfinite: tuple

    @property
    def finite(self) -> bool:
        return not self.nonfinite


def to_host(step: int, device_metrics: Any) -> HostMetrics:
    """Copies a pytree of (device) metrics to the host in one transfer and classifies them.

    Args:
      step: the step the metrics belong to.
      device_metrics: pytree (nested dicts / struct dataclass) of arrays or numbers.

    Returns:
      `HostMetrics` with 0-d leaves as floats, other leaves as numpy arrays.
    """
    leaves = jax.tree_util.tree_flatten_with_path(device_metrics)[0]
    values = jax.device_get([leaf for _, leaf in leaves])
    scalars, arrays, bad = {}, {}, []
    for (path, _), value in zip(leaves, values):
        name = leaf_path(path)
        arr = np.asarray(value)
        if arr.ndim == 0:
            scalars[name] = float(arr)
            if not math.isfinite(scalars[name]):
                bad.append(name)
        else:
            arrays[name] = arr
    return HostMetrics(step=step, scalars=scalars, arrays=arrays, nonfinite=tuple(sorted(bad)))


# -- per-group audit records --------------------------------------------------------------------


def group_records(step: int, group_ids: Sequence[str], trajectory_ids: Sequence[Optional[str]],
                  group_index_T: np.ndarray, factors_T: np.ndarray, advantages_T: np.ndarray,
                  lam_G: np.ndarray, capped_G: np.ndarray, fallback_G: np.ndarray, *,
                  valid_T: Optional[np.ndarray] = None,
                  rewards_T: Optional[np.ndarray] = None,
                  outcome_advantages_T: Optional[np.ndarray] = None,
                  mixed_G: Optional[np.ndarray] = None,
                  hacked_T: Optional[np.ndarray] = None,
                  infra_ids: Optional[Sequence[Sequence[str]]] = None) -> list[dict]:
    """One audit record per real group of a batch, for `groups.jsonl`.

    Args:
      step: the train step.
      group_ids: the feed's group id of batch group g, for the real groups (len <= G; the
        rest of the G slots are padding and skipped).
      trajectory_ids: the feed's trajectory id of slot t, None (or missing, if shorter than T)
        for padding slots.
      group_index_T: int [T], batch group of each slot.
      factors_T, advantages_T: float [T], quality factor and final advantage.
      lam_G, capped_G, fallback_G: [G] per-group λ, cap fired, grading fallback.
      valid_T: optional bool [T]; written per trajectory when given.
      rewards_T: optional float [T], the binary outcome as sent (1 = pass). When given, each
        trajectory gets "outcome" ("pass" | "fail") and "reward", the effective reward (0 for
        a hacked pass, SPEC rule 2).
      outcome_advantages_T: optional float [T], the advantage before redistribution; written
        per trajectory as "outcome_advantage" when given.
      mixed_G: optional bool [G]; written per group as "mixed" when given.
      hacked_T: optional bool [T]; written per trajectory as "hacked" when given.
      infra_ids: optional, per real group, the ids of its infra_error trajectories (not in the
        batch); each is appended as {"id", "outcome": "infra_error", "valid": false,
        "advantage": 0.0}.

    Returns:
      A list of dicts {"step", "group_id", "lam", "capped", "fallback", ["mixed"],
      "trajectories": [{"id", "factor", "advantage", ["valid"], ["outcome", "reward"],
      ["hacked"], ["outcome_advantage"]}, ...]} in batch group order. Non-finite values (a
      pass sent without quality has factor NaN) are written as null by the writer.
    """
    group_index_T = np.asarray(group_index_T)
    T, G = group_index_T.shape[0], np.asarray(lam_G).shape[0]
    if len(group_ids) > G:
        raise ValueError(f"group_ids has {len(group_ids)} entries for {G} group slots")
    if len(trajectory_ids) > T:
        raise ValueError(f"trajectory_ids has {len(trajectory_ids)} entries for {T} slots")
    per_traj = {"factor": np.asarray(factors_T, np.float64),
                "advantage": np.asarray(advantages_T, np.float64)}
    if valid_T is not None:
        per_traj["valid"] = np.asarray(valid_T, bool)
    hacked = None if hacked_T is None else np.asarray(hacked_T, bool)
    if hacked is not None:
        per_traj["hacked"] = hacked
    if rewards_T is not None:
        raw = np.asarray(rewards_T, np.float64)
        per_traj["outcome"] = np.where(raw > 0, "pass", "fail")
        per_traj["reward"] = raw if hacked is None else np.where(hacked, 0.0, raw)
    if outcome_advantages_T is not None:
        per_traj["outcome_advantage"] = np.asarray(outcome_advantages_T, np.float64)
    for name, arr in per_traj.items():
        if arr.shape != (T,):
            raise ValueError(f"{name}_T has shape {arr.shape}, expected ({T},)")
    members: list[list[dict]] = [[] for _ in group_ids]
    for t, traj_id in enumerate(trajectory_ids):
        g = int(group_index_T[t])
        if traj_id is None or g >= len(group_ids):
            continue
        entry = {"id": traj_id}
        entry.update({k: v[t].item() for k, v in per_traj.items()})
        members[g].append(entry)
    lam, capped, fallback = (np.asarray(a) for a in (lam_G, capped_G, fallback_G))
    records = []
    for g, gid in enumerate(group_ids):
        record = {"step": int(step), "group_id": gid, "lam": float(lam[g]),
                  "capped": bool(capped[g]), "fallback": bool(fallback[g])}
        if mixed_G is not None:
            record["mixed"] = bool(np.asarray(mixed_G)[g])
        record["trajectories"] = members[g] + [
            {"id": tid, "outcome": "infra_error", "valid": False, "advantage": 0.0}
            for tid in (infra_ids[g] if infra_ids is not None else ())]
        records.append(record)
    return records


# -- writers ------------------------------------------------------------------------------------


def _finite(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by None (strict JSON has no NaN/inf)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _json_line(obj: Mapping[str, Any]) -> str:
    return json.dumps(_finite(obj), allow_nan=False, separators=(",", ":")) + "\n"


AUDIT_FILES = ("metrics.jsonl", "groups.jsonl")


class MetricsWriter:
    """Writes `metrics.jsonl`, `groups.jsonl` and TensorBoard events in `workdir`.

    Only process 0 writes; on other processes every method is a no-op. Write errors are
    raised as OSError naming the file. The JSONL files are `AuditFile`s: one file each on a
    local workdir, rolling segments (metrics-000000.jsonl, ...) on an object store
    (`audit_file.read_lines` reads either). TensorBoard events are written on local workdirs
    only (tensorboardX appends to its event files); on an object store metrics.jsonl is the
    record.

    Args:
      workdir: the run's workdir (created if missing); a local path or an `etils.epath` URI.
      tensorboard: also write TensorBoard event files under `workdir/tensorboard`.
      enabled: override the process-0 rule (tests).
      resume: positions saved with the checkpoint being resumed ({file name: AuditPosition});
        the files are cut back to them first. None: continue without cutting (a fresh
        run, or a checkpoint written before positions were saved).
      purge_step: TensorBoard drops events at or after this step (the resumed step + 1).
    """

    def __init__(self, workdir: str | os.PathLike, *, tensorboard: bool = True,
                 enabled: Optional[bool] = None,
                 resume: Optional[Mapping[str, AuditPosition]] = None,
                 purge_step: Optional[int] = None):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.workdir = epath.Path(workdir)
        self._files: dict = {}
        self._tb = None
        if not self.enabled:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._files = {name: AuditFile(self.workdir / name) for name in AUDIT_FILES}
        for name, position in (resume or {}).items():
            if name in self._files:
                self._files[name].restore(position)
        if tensorboard and not is_remote(workdir):
            self._tb = _summary_writer_cls()(logdir=os.fspath(self.workdir / "tensorboard"),
                                             purge_step=purge_step)

    def write(self, step: int, scalars: Mapping[str, float], *,
              wall_time: Optional[float] = None) -> None:
        """Writes one step's scalar metrics (non-finite values: null + listed in "nonfinite")."""
        if not self.enabled:
            return
        import time
        now = time.time() if wall_time is None else wall_time
        record: dict[str, Any] = {"step": int(step), "time": now}
        bad = []
        for name, value in scalars.items():
            value = float(value)
            if math.isfinite(value):
                record[name] = value
                if self._tb is not None:
                    self._tb.add_scalar(name, value, global_step=int(step), walltime=now)
            else:
                record[name] = None
                bad.append(name)
        if bad:
            record["nonfinite"] = sorted(bad)
        self._files["metrics.jsonl"].write(_json_line(record))

    def write_groups(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Appends `group_records(...)` output to groups.jsonl."""
        if not self.enabled:
            return
        f = self._files["groups.jsonl"]
        for record in records:
            f.write(_json_line(record))

    def flush(self) -> None:
        """Hands buffered lines to storage (the trainer calls this after every step)."""
        if not self.enabled:
            return
        for f in self._files.values():
            f.flush()
        if self._tb is not None:
            self._tb.flush()

    def sync(self) -> dict:
        """Makes the JSONL files durable; returns their positions for a checkpoint.

        Returns:
          {file name: AuditPosition.to_json()} ({} on processes that do not write).
        """
        if not self.enabled:
            return {}
        out = {name: f.sync().to_json() for name, f in self._files.items()}
        if self._tb is not None:
            self._tb.flush()
        return out

    def close(self) -> None:
        if not self.enabled:
            return
        for f in self._files.values():
            f.close()
        if self._tb is not None:
            self._tb.close()


# -- progress bar -------------------------------------------------------------------------------


def progress_postfix(*, tokens_per_s: float, loss: float, lam: float, groups: int) -> str:
    """The progress bar's right-hand text: tokens/s, loss, mean λ, groups trained."""
    return f"tok/s={tokens_per_s:,.0f} loss={loss:.4g} λ={lam:.3f} groups={groups}"


class Progress:
    """A tqdm bar over train steps (disabled on processes other than 0).

    Args:
      total: the last step of the run.
      initial: the step the run starts (or resumes) at.
      enabled: override the process-0 rule.
      file: stream for the bar (default stderr).
    """

    def __init__(self, total: int, initial: int = 0, *, enabled: Optional[bool] = None,
                 file: Any = None):
        from tqdm.auto import tqdm
        on = jax.process_index() == 0 if enabled is None else enabled
        self._bar = tqdm(total=total, initial=initial, disable=not on, unit="step",
                         dynamic_ncols=True, file=file)

    @property
    def n(self) -> int:
        """Steps counted so far (including `initial`)."""
        return self._bar.n

    def update(self, steps: int = 1, *, tokens_per_s: float, loss: float, lam: float,
               groups: int) -> None:
        self._bar.set_postfix_str(progress_postfix(tokens_per_s=tokens_per_s, loss=loss,
                                                   lam=lam, groups=groups), refresh=False)
        self._bar.update(steps)

    def close(self) -> None:
        self._bar.close()


def _summary_writer_cls():
    """tensorboardX's SummaryWriter, imported without torch.

    tensorboardX imports torch, when it is installed, only to accept torch tensors; we log
    Python floats. torch costs about 2.5 s of start-up per trainer process, so its import is
    refused while tensorboardX loads (tensorboardX falls back to numpy) and allowed again after.
    """
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None          # `import torch` raises ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter

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
import logging
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import jax
import numpy as np
from etils import epath

from gagar_jax.algo.advantage import GroupOutcomes
from gagar_jax.algo.step_metrics import GroupAudit, StepMetrics
from gagar_jax.audit_file import AuditFile, AuditPosition
from gagar_jax.batch import Batch
from gagar_jax.distributed import is_primary, is_remote
from gagar_jax.feed.batcher import BatchInfo, Feed
from gagar_jax.run import workdir_lock
from gagar_jax.run.fingerprint import params_fingerprint, params_l2, params_sha256  # noqa: F401
from gagar_jax.sharding import leaf_path

LOG = logging.getLogger("gagar_jax.run.train")   # the loop's warnings, under its name

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
    for (path, _), value in zip(leaves, values, strict=False):
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


def group_records(step: int, info: BatchInfo, outcomes: GroupOutcomes,
                  audit: GroupAudit) -> list[dict]:
    """One audit record per real group of a batch, for `groups.jsonl`.

    Args:
      step: the train step.
      info: the feed's `BatchInfo`: group ids (the real groups, <= G; the other group slots are
        padding), each group's trajectory ids and slots, its infra_error trajectories.
      outcomes: host copy of the batch's `GroupOutcomes` (group index, outcome, factor, valid,
        hacked per slot).
      audit: host copy of the step's `GroupAudit` (lambda, cap, fallback, mixed per group; final
        and outcome advantage per slot).

    Returns:
      A list of dicts {"step", "group_id", "lam", "capped", "fallback", "mixed",
      "trajectories": [{"id", "factor", "advantage", "valid", "hacked", "outcome", "reward",
      "outcome_advantage"}, ...]} in batch group order; a hacked pass has outcome "pass" and
      reward 0 (SPEC rule 2); each infra_error trajectory (not in the batch) is appended as
      {"id", "outcome": "infra_error", "valid": false, "advantage": 0.0}. Non-finite values (a
      pass sent without quality has factor NaN) are written as null by the writer.
    """
    group_index_T = np.asarray(outcomes.group_ids_T)
    T, G = group_index_T.shape[0], np.asarray(audit.lam_G).shape[0]
    if len(info.group_ids) > G:
        raise ValueError(f"info.group_ids has {len(info.group_ids)} entries for {G} group slots")
    raw = np.asarray(outcomes.rewards_T, np.float64)
    hacked = np.asarray(outcomes.hacked_T, bool)
    per_traj = {"factor": np.asarray(outcomes.factors_T, np.float64),
                "advantage": np.asarray(audit.advantages_T, np.float64),
                "valid": np.asarray(outcomes.valid_T, bool), "hacked": hacked,
                "outcome": np.where(raw > 0, "pass", "fail"),
                "reward": np.where(hacked, 0.0, raw),
                "outcome_advantage": np.asarray(audit.outcome_advantages_T, np.float64)}
    for name, arr in per_traj.items():
        if arr.shape != (T,):
            raise ValueError(f"{name}_T has shape {arr.shape}, expected ({T},)")
    members: list[list[dict]] = [[] for _ in info.group_ids]
    for g, (ids, slots) in enumerate(zip(info.trajectory_ids, info.traj_slots, strict=False)):
        if g >= len(members):
            break
        for traj_id, t in sorted(zip(ids, slots, strict=False), key=lambda x: x[1]):
            if not 0 <= t < T:
                raise ValueError(f"trajectory slot {t} of group {g} is outside [0, {T})")
            members[g].append({"id": traj_id, **{k: v[t].item() for k, v in per_traj.items()}})
    lam, capped, fallback, mixed = (np.asarray(a) for a in (audit.lam_G, audit.capped_G,
                                                              audit.fallback_G, audit.mixed_G))
    records = []
    for g, gid in enumerate(info.group_ids):
        records.append({
            "step": int(step), "group_id": gid, "lam": float(lam[g]), "capped": bool(capped[g]),
            "fallback": bool(fallback[g]), "mixed": bool(mixed[g]),
            "trajectories": members[g] + [
                {"id": tid, "outcome": "infra_error", "valid": False, "advantage": 0.0}
                for tid in info.infra_ids[g]]})
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
        self.enabled = is_primary() if enabled is None else enabled
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
        workdir_lock.verify_held(self.workdir)   # never write while another learner may hold it
        self._files["metrics.jsonl"].write(_json_line(record))

    def write_groups(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Appends `group_records(...)` output to groups.jsonl."""
        if not self.enabled:
            return
        f = self._files["groups.jsonl"]
        workdir_lock.verify_held(self.workdir)
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
        workdir_lock.verify_held(self.workdir)
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
        on = is_primary() if enabled is None else enabled
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


# -- finished steps -----------------------------------------------------------------------------


class StepLog:
    """Host-side bookkeeping of finished steps: ledger counts, audit log, metrics, summary.

    Args:
      feed: the run's `Feed` (trained groups go into its ledger).
      writer: the run's `MetricsWriter`; progress: its `Progress` bar.
      log_every: write metrics.jsonl every this many steps (groups.jsonl every step).
      guard: optional per-step warnings (`guardrails.Guardrails`).
    """

    def __init__(self, feed: Feed, writer: MetricsWriter, progress: Progress, log_every: int,
                 guard: Any = None):
        self.feed, self.writer, self.progress, self.log_every = feed, writer, progress, log_every
        self.guard = guard
        self.losses, self.lam_means, self.lam_max = [], [], 0.0
        self.tokens = 0
        self.rates = []           # per-step tokens/s (the first one includes compilation)
        self.skipped = 0
        self.t_last = time.perf_counter()

    def finish_step(self, step: int, info: BatchInfo, batch_np: Batch,
                    device_metrics: StepMetrics) -> HostMetrics:
        """Reads back one finished step: ledger, groups.jsonl, metrics.jsonl, progress bar.

        Args:
          step: the finished step; info, batch_np: its feed batch; device_metrics: its metrics.
        Returns:
          The step's `HostMetrics`.
        """
        host_metrics = jax.device_get(device_metrics)   # one transfer; to_host then copies nothing
        m = to_host(step, host_metrics)
        a, audit, n = m.arrays, host_metrics.audit, info.num_groups
        self.feed.record_trained(info.group_ids, audit.fallback_G[:n].tolist(),
                                 audit.capped_G[:n].tolist())
        self.writer.write_groups(group_records(
            step, info, GroupOutcomes.of_batch(batch_np), audit))
        s = dict(m.scalars)
        load_LxE = a.get("expert_load_LxE")
        if load_LxE is not None and load_LxE.size:
            # Balance per MoE layer: max and min expert load over the mean (1 = balanced).
            ratio = load_LxE / np.maximum(load_LxE.mean(axis=-1, keepdims=True), 1e-12)
            s["expert_load/max_over_mean"] = float(ratio.max())
            s["expert_load/min_over_mean"] = float(ratio.min())
        now = time.perf_counter()
        tok_s = info.num_tokens / max(now - self.t_last, 1e-9)
        self.t_last = now
        self.tokens += info.num_tokens
        self.rates.append(tok_s)
        self.losses.append(s["loss"])
        self.lam_means.append(s["lam_mean"])
        self.lam_max = max(self.lam_max, s["lam_max"])
        self.skipped += int(s["skipped"])
        if not m.finite or s["skipped"] > 0:
            LOG.warning("step %d: non-finite values %s; %d optimizer update(s) skipped",
                        step, list(m.nonfinite), int(s["skipped"]))
        if self.guard is not None:
            self.guard.check(step, s, quarantined=info.counts.get("quarantined", 0))
        if n:   # the batch was drawn at learner step `step - 1` (docs/feed.md, staleness)
            stale = [step - 1 - v for v in info.policy_versions[:n]]
            s["feed/staleness_mean"] = float(np.mean(stale))
            s["feed/staleness_max"] = float(max(stale))
        if step % self.log_every == 0:
            self.writer.write(step, {**s, "feed/packing_efficiency": info.packing_efficiency,
                                     "feed/ahead_of_learner": info.counts.get(
                                         "ahead_of_learner", 0),
                                     "perf/tokens_per_s": tok_s})
        self.writer.flush()       # every step: a crash loses no finished step's lines
        self.progress.update(1, tokens_per_s=tok_s, loss=s["loss"], lam=s["lam_mean"],
                             groups=int(s["groups"]))
        return m


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

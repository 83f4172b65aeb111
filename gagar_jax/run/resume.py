"""Resuming a workdir: the saved config against the new one, and fresh starts after damage.

    has_ckpt = check_launch(ckpt, cfg_json, check_fresh)     # before anything compiles
    restored = restore_or_fresh(ckpt, abstract_state, workdir, ...)   # None: a fresh run
    check_config(saved_cfg, new_cfg, step)       # ConfigError on a structural change; logs the rest
    guard_fresh_start(workdir, ckpt_dir, ...)    # no readable checkpoint: refuse, or move aside

The checkpoint directory decides fresh run or resume first (`check_launch`): outside weights
(`init_from` / `reference_from`) are checked and applied on a fresh run only; a resume restores
the checkpoint and never reads them (they may be gone, or changed, by then).

A checkpoint that does not match the config is not corrupt. A *structural* difference, one that
changes the saved train state's tree (model shapes and dtypes, the model family, the optimizer
state's structure, the KL reference switched on or off), refuses the launch (exit 2) naming the
keys, and no checkpoint is touched; `Checkpointer.restore` compares the saved tree itself as
well (`StateMismatch`), so a difference no key here names is refused too. Any other changed key
(learning rate, clip ranges, intervals, `train.steps`, the mesh) resumes, and the diff is logged.

Only real damage (unreadable or truncated files) moves a checkpoint aside (`<step>.corrupt-<t>`).
When none is left, the run must not start from step 0 over the audit lines of the earlier steps
(they would be logged twice): `guard_fresh_start` raises `ResumeRefused` (exit 1) unless the
user passes `--start_fresh`, which moves the old audit files, the damaged steps and the
TensorBoard events into `<workdir>/before_fresh_start-<t>/` first.
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from etils import epath

from gagar_jax.audit_file import AuditFile, unused_name
from gagar_jax.config import ConfigError
from gagar_jax.distributed import barrier, is_primary, is_remote
from gagar_jax.model.config import ModelConfig
from gagar_jax.run.checkpoint import Checkpointer, NoReadableCheckpoint, Restored
from gagar_jax.run.startup import ARCHITECTURE_FIELDS

log = logging.getLogger(__name__)

# Model fields that shape the saved parameters and optimizer moments.
STATE_FIELDS = (*ARCHITECTURE_FIELDS, "param_dtype")
# Keys whose on/off (value > 0) adds or removes part of the saved state.
SWITCHES = {"loss.kl_coef": "the KL reference parameters",
            "optim.grad_clip_norm": "the gradient clip's optimizer state"}
# Audit files whose lines a fresh start would repeat; what --start_fresh moves aside with them.
AUDIT_FILES = ("metrics.jsonl", "groups.jsonl")
ASIDE_FILES = (*AUDIT_FILES, "dead_letter.jsonl", "ledger.json", "summary.json", "fatal_error.txt")
_CORRUPT = re.compile(r"^\d+\.corrupt-\d+")
_ABSENT = "<absent>"


class ResumeRefused(RuntimeError):
    """No readable checkpoint is left while audit lines of earlier steps exist (exit 1)."""


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict:
    """{"section.key": value} of a nested config dict."""
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _model_fields(section: Any) -> Optional[dict]:
    """STATE_FIELDS of a model section as ModelConfig normalizes them (None if it cannot)."""
    try:
        m = ModelConfig.from_config(dict(section))
    except (ValueError, TypeError, KeyError):   # e.g. keys of another version of the project
        return None
    return {f: getattr(m, f) for f in STATE_FIELDS}


def _on(value: Any) -> bool:
    try:
        return float(value) > 0
    except (TypeError, ValueError):
        return bool(value)


def structural_changes(saved: Mapping[str, Any], new: Mapping[str, Any]) -> list:
    """[(key, saved value, new value)] of the changes that alter the saved state's tree."""
    out = []
    old_m, new_m = _model_fields(saved.get("model", {})), _model_fields(new.get("model", {}))
    if old_m is None or new_m is None:     # compare the raw values of the keys both have
        old_m = {f: v for f, v in dict(saved.get("model", {})).items() if f in STATE_FIELDS}
        new_m = {f: v for f, v in dict(new.get("model", {})).items() if f in old_m}
    out += [(f"model.{f}", old_m[f], new_m[f]) for f in STATE_FIELDS
            if f in old_m and f in new_m and old_m[f] != new_m[f]]
    flat_old, flat_new = flatten(saved), flatten(new)
    for key in SWITCHES:
        if key in flat_old and key in flat_new and _on(flat_old[key]) != _on(flat_new[key]):
            out.append((key, flat_old[key], flat_new[key]))
    return out


def config_diff(saved: Mapping[str, Any], new: Mapping[str, Any]) -> list:
    """[(key, saved value, new value)] of every key whose value differs (absent: "<absent>")."""
    a, b = flatten(saved), flatten(new)
    return [(k, a.get(k, _ABSENT), b.get(k, _ABSENT)) for k in sorted(set(a) | set(b))
            if a.get(k, _ABSENT) != b.get(k, _ABSENT)]


def _show(changes: Sequence) -> str:
    return ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in changes)


def check_config(saved: Optional[Mapping[str, Any]], new: Mapping[str, Any], step: int,
                 directory: str) -> list:
    """The saved run's config against the new one, before anything is restored.

    Args:
      saved: the config stored with the checkpoint (None: unreadable, left to the restore).
      new: the new run's config dict.
      step: the checkpoint's step; directory: where it lives (for the messages).
    Returns:
      The non-structural changes (also logged), which resume.
    Raises:
      ConfigError naming every structural change; no checkpoint has been touched.
    """
    if saved is None:
        return []
    structural = structural_changes(saved, new)
    if structural:
        raise ConfigError(
            f"resume: checkpoint step {step} in {directory} holds a train state of another "
            f"shape ({_show(structural)}); the checkpoints are untouched: set these keys back "
            "to resume, or train with this config in a new --workdir")
    changed = config_diff(saved, new)
    if changed:
        log.info("resume: config changed since checkpoint step %d (resuming): %s", step,
                 _show(changed))
    return changed


def damaged_steps(ckpt_dir: str) -> list:
    """Names of the steps moved aside (or, on object stores, deleted) as unreadable."""
    d = epath.Path(ckpt_dir)
    if not d.exists():
        return []
    return sorted(p.name for p in d.iterdir() if _CORRUPT.match(p.name))


def _audit_lines(workdir: epath.Path) -> list:
    """The audit files of `workdir` that hold lines (either layout)."""
    out = []
    for name in AUDIT_FILES:
        f = AuditFile(workdir / name)
        if f.remote:
            if any(seg.stat().length for _, seg in f.segments()):
                out.append(name)
        elif f.path.exists() and f.path.stat().length:
            out.append(name)
    return out


def _move(src: epath.Path, dst: epath.Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not is_remote(str(src)):
        src.replace(dst)
        return
    if src.is_dir():      # object stores: no rename; copy the (small) objects, then delete
        for p in src.iterdir():
            _move(p, dst / p.name)
        src.rmtree(missing_ok=True)
        return
    dst.write_bytes(src.read_bytes())
    src.unlink()


def move_aside(workdir: str, ckpt_dir: str, why: str) -> epath.Path:
    """Moves the audit files (any layout), ledger, summary, TensorBoard events and damaged
    steps of `workdir` into a new `before_fresh_start-<unix time>[.n]/` (logged with `why`);
    returns that directory. Call on every process (process 0 moves)."""
    wd = epath.Path(workdir)
    aside = unused_name(wd, f"before_fresh_start-{int(time.time())}")
    if is_primary():
        damaged = damaged_steps(ckpt_dir)
        names = [n for n in ASIDE_FILES if (wd / n).exists()]
        for name in AUDIT_FILES + ("dead_letter.jsonl",):
            names += [seg.name for _, seg in AuditFile(wd / name).segments()
                      if AuditFile(wd / name).remote]
        if (wd / "tensorboard").exists():
            names.append("tensorboard")
        for name in names:
            _move(wd / name, aside / name)
        for name in damaged:
            _move(epath.Path(ckpt_dir) / name, aside / "checkpoints" / name)
        log.warning("%s; moved %s to %s; training from step 0", why,
                    ", ".join(names + [f"checkpoints/{n}" for n in damaged]), aside)
    barrier("gagar_fresh_start")
    return aside


def guard_fresh_start(workdir: str, ckpt_dir: str, *, start_fresh: bool) -> None:
    """A run about to train from step 0: refuse, or move the old run's records aside.

    Refuses (`ResumeRefused`) when checkpoints of this workdir were found damaged (now or by
    an earlier launch) and audit lines of the steps they held exist, unless `start_fresh`. With
    `start_fresh`, or when no checkpoint was ever written (a run killed before its first one:
    its audit lines would be repeated), the audit files (any layout), ledger, summary,
    TensorBoard events and damaged steps move into `<workdir>/before_fresh_start-<unix time>/`
    (`move_aside`). Call on every process.
    """
    wd = epath.Path(workdir)
    damaged, lines = damaged_steps(ckpt_dir), _audit_lines(wd)
    if not lines:
        return
    if damaged and not start_fresh:
        raise ResumeRefused(
            f"no readable checkpoint in {ckpt_dir} (unreadable steps moved aside: "
            f"{', '.join(damaged)}) while {' and '.join(lines)} in {workdir} hold lines of the "
            "steps they held: training from step 0 would log those steps twice. Pass "
            "--start_fresh to train from step 0 with the old audit files moved aside")
    move_aside(workdir, ckpt_dir, "--start_fresh: no readable checkpoint" if start_fresh else
               f"no checkpoint yet while {' and '.join(lines)} hold lines (a run stopped before "
               "its first checkpoint)")


def check_launch(ckpt: Checkpointer, cfg_json: Mapping[str, Any],
                 check_fresh: Callable[[], None]) -> bool:
    """Fresh run or resume, decided before anything compiles or moves.

    Args:
      ckpt: the run's checkpointer; cfg_json: the new run's config dict.
      check_fresh: checks what a fresh run reads (outside weights); called on a fresh run only.
    Returns:
      Whether a checkpoint exists to resume (its config was checked against the new one).
    Raises:
      ConfigError: the checkpoint holds a train state of another shape (`check_config`).
    """
    latest = ckpt.latest_step()
    if latest is None:
        check_fresh()
        return False
    check_config(ckpt.saved_config(latest), cfg_json, latest, ckpt.directory)
    return True


def restore_or_fresh(ckpt: Checkpointer, abstract_state: Any, workdir: str, *,
                     has_checkpoint: bool, start_fresh: bool,
                     check_fresh: Callable[[], None]) -> Optional[Restored]:
    """Restores the latest readable checkpoint, or clears the way for a fresh run.

    Args:
      ckpt: the run's checkpointer; abstract_state: the train state's shapes and shardings.
      workdir: the run directory; has_checkpoint: `check_launch`'s answer.
      start_fresh: `--start_fresh` (see `guard_fresh_start`); ignored when a step restores.
      check_fresh: as in `check_launch`, called when every checkpoint proved unreadable.
    Returns:
      The restored checkpoint, or None for a fresh run (the caller applies outside weights).
    Raises:
      ResumeRefused: no readable checkpoint left over earlier audit lines, without start_fresh.
    """
    restored = None
    if has_checkpoint:
        try:
            restored = ckpt.restore(abstract_state)
        except NoReadableCheckpoint as e:     # all damaged (moved aside): maybe a fresh start
            log.warning("%s; every step was moved aside as unreadable", e)
            check_fresh()
    if restored is None:
        # Never train from step 0 over the audit lines of damaged checkpoints' steps.
        guard_fresh_start(workdir, ckpt.directory, start_fresh=start_fresh)
    elif start_fresh:
        log.info("--start_fresh ignored: checkpoint step %d resumed", restored.step)
    return restored

"""The visible training loop: feed -> train step -> metrics, checkpoints and published weights.

    summary = run(cfg, workdir)

One step consumes one feed batch. The loop dispatches step N+1 before it reads step N's metrics
(so the host never waits on the device for logging), saves the train state together with the
feed position (exact resume), writes a checkpoint and the summary on SIGTERM (preemption) or
Ctrl-C (`preemption.py`), and ends when `train.steps` are done or a finite feed is exhausted.

Before anything compiles, every cross-section rule is checked (`startup.py`; a `ConfigError`,
exit 2 in the CLI). The checkpoint directory decides fresh run or resume first: `init_from` /
`reference_from` apply to a fresh run only, a resume restores the checkpoint and never reads them.
The workdir may be local or an object-store URI (`audit_file.py`: no append, rename or os.path).

Audit logs are exactly-once: metrics.jsonl and groups.jsonl are flushed after every step,
fsync'ed before each checkpoint with their positions saved in it, and cut back to those
positions on resume. While the feed is idle, the finished step is read back at once, so its
lines appear without waiting for the next batch. A fatal error stops the checkpoint writer
(bounded by ABORT_TIMEOUT_S) before it propagates.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

import jax
import numpy as np
from etils import epath
from flax import nnx
from ml_collections import ConfigDict

from gagar_jax.config import ConfigError, TrainConfig, check_finite
from gagar_jax.distributed import broadcast_from_process0, is_primary
from gagar_jax.feed.batcher import Feed, make_source
from gagar_jax.feed.config import FeedConfig
from gagar_jax.feed.packing import global_shapes, make_global_batch
from gagar_jax.run import init_weights, publish, recipes, resume, workdir_lock
from gagar_jax.run import metrics as metrics_lib
from gagar_jax.run.checkpoint import Checkpointer
from gagar_jax.run.guardrails import Guardrails
from gagar_jax.run.preemption import Preemption
from gagar_jax.run.startup import check_hf_dir, check_layout, check_run
from gagar_jax.run.step import StepConfig, init_train_state, make_train_step
from gagar_jax.sharding import batch_shardings, make_mesh, process_row_block

log = logging.getLogger("gagar_jax.run.train")
ABORT_TIMEOUT_S = 10.0      # longest wait for background writers after a fatal error


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """All frozen section configs of one run."""

    step: StepConfig
    feed: FeedConfig
    train: TrainConfig
    seed: int

    @classmethod
    def from_config(cls, cfg: Any) -> RunConfig:
        check_finite(cfg)
        try:
            return cls(step=StepConfig.from_config(cfg), feed=FeedConfig.from_config(cfg.feed),
                       train=TrainConfig.from_config(cfg.train), seed=int(cfg.seed))
        except ConfigError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ConfigError(f"bad config: {e}") from e


def _abstract(state: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        state, shardings)


def run(cfg: Any, workdir: str, *, source: Any = None, start_fresh: bool = False,
        explicit: Iterable[str] = (), on_state: Optional[Callable[..., None]] = None,
        devices: Optional[Sequence[Any]] = None) -> Optional[dict]:
    """Trains until `train.steps` or the end of a finite feed; returns the run summary.

    Args:
      cfg: the locked ConfigDict (sections model, mesh, loss, optim, train, feed).
      workdir: run directory (local path or object-store URI such as gs://bucket/run); an
        existing checkpoint there is resumed from.
      source: optional feed source object (e.g. `IteratorSource` for in-process producers);
        default: `feed.path` / `feed.spool_dir` from the config.
      start_fresh: when no readable checkpoint is left (damaged ones moved aside) but audit
        lines of earlier steps exist, train from step 0 with them moved aside instead of
        raising `resume.ResumeRefused` (`resume.guard_fresh_start`).
      explicit: config keys the user set themselves; a `recipe` (`recipes.py`) sets the others
        of its row.
      on_state: called as `on_state(step, graphdef, state)` once the state is built or
        restored and after every step is dispatched (the colocated loop's sampler reads the
        parameters from it before the feed asks for the next batch; `run/colocated.py`).
      devices: the devices of the training mesh (default: all of them).
    Returns:
      The summary dict (also written to `workdir/summary.json` by process 0).
    Raises:
      ConfigError: a config mistake (also a checkpoint of another train state on resume).
      resume.ResumeRefused: see `start_fresh`.
    """
    recipes.apply(cfg, explicit)     # before anything reads the config
    # One learner per workdir (the CLI took the lock already, before JAX started).
    if is_primary():
        workdir_lock.acquire(workdir)
    # SIGTERM or Ctrl-C at any point of the run becomes a checkpoint and a clean exit.
    with Preemption() as preemption:
        return _run(cfg, workdir, source, preemption, start_fresh, on_state, devices)


class _Resources:
    """What a fatal error must stop before it propagates: the checkpoint writer's threads and
    the open audit files."""

    def __init__(self):
        self.ckpt: Optional[Checkpointer] = None
        self.writer: Optional[metrics_lib.MetricsWriter] = None
        self.progress = None

    def abort(self) -> None:
        if self.ckpt is not None and not self.ckpt.abort(ABORT_TIMEOUT_S):
            log.warning("checkpoint writer still busy after %.0f s; leaving it", ABORT_TIMEOUT_S)
        for closer in (self.writer, self.progress):
            try:
                if closer is not None:
                    closer.close()
            except Exception:  # e.g. the same full disk: already reported
                pass


def _run(cfg: Any, workdir: str, source: Any, preemption: Preemption, start_fresh: bool,
         on_state: Optional[Callable[..., None]], devices: Optional[Sequence[Any]]
         ) -> Optional[dict]:
    """`run` with the SIGTERM flag installed and background writers stopped on failure."""
    res = _Resources()
    try:
        return _train(cfg, workdir, source, preemption, res, start_fresh, on_state, devices)
    except BaseException:
        res.abort()
        raise


@dataclasses.dataclass
class _Run:
    """What setup built and the loop drives: the run's objects and its moving step."""
    rc: RunConfig
    workdir: epath.Path
    mesh: Any
    state: Any
    graphdef: Any
    shardings: Any
    feed: Feed
    ckpt: Checkpointer
    publisher: publish.Publisher
    writer: metrics_lib.MetricsWriter
    progress: Any
    steplog: metrics_lib.StepLog
    cfg_json: dict
    step: int
    start_step: int
    pending: Any = None     # (step, BatchInfo, numpy Batch, device metrics) not yet read back
    on_state: Optional[Callable[..., None]] = None   # the colocated sampler's view of the state

    def show_state(self) -> None:
        """Hands the current state to `on_state` (the colocated loop's sampler)."""
        if self.on_state is not None:
            self.on_state(self.step, self.graphdef, self.state)

    def drain(self) -> None:
        """Reads back the pending step's metrics (audit lines, ledger, progress)."""
        if self.pending is not None:
            self.steplog.finish_step(*self.pending)
            self.pending = None

    def checkpoint(self, force: bool) -> None:
        """Saves the state with the feed position and the audit logs' lengths."""
        self.drain()          # the ledger must include this step before saving
        # The audit logs and dead-letter file reach the disk before the step that points at
        # their lengths can commit. Every process passes the item (the same checkpoint
        # structure everywhere); only process 0 writes files, so its positions are stored.
        positions = self.writer.sync()
        self.feed.dead_letter.sync()
        self.ckpt.save(self.step, self.state, self.feed.state(), self.cfg_json, force=force,
                       audit=positions)

    def publish(self) -> None:
        """Publishes the weights for rollout engines (files written in the background)."""
        self.drain()
        # The publish reshard is a collective: let the in-flight step finish first. Training
        # waits for the device-to-host copy of this process's share (publish.Publisher).
        jax.block_until_ready(self.state)
        self.publisher.publish(nnx.merge(self.graphdef, self.state.params,
                                         self.state.router_bias), self.step)


def _setup(
    cfg: ConfigDict, workdir: str, source: Any, preemption: Preemption, res: _Resources,
    start_fresh: bool = False, devices: Optional[Sequence[Any]] = None,
) -> _Run:
    """Checks the config, builds the mesh, state, feed and writers; restores a checkpoint."""
    rc = RunConfig.from_config(cfg)
    wd = epath.Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    pidx, pcount = jax.process_index(), jax.process_count()
    # Every cross-section rule before anything compiles (docs/reliability.md: exit 2).
    try:
        mesh = make_mesh(cfg.mesh, devices)
        # The rows and S range of the batch this host's devices hold: with the context axis
        # spanning hosts, several hosts share rows, each building only its part of S.
        blocks = [process_row_block(mesh, b, n) for b, n in rc.feed.bucket_shapes]
        rows, cols = blocks[0] if not rc.feed.buckets else ([r for r, _ in blocks],
                                                             [c for _, c in blocks])
    except ValueError as e:
        raise ConfigError(f"mesh: {e}") from e
    model_cfg = rc.step.model
    check_run(rc.step, rc.feed, rc.train, source_given=source is not None)
    check_layout(rc.step, rc.feed, mesh, pcount)
    cfg_json = json.loads(cfg.to_json())
    # checkpoint_every = 0: only the forced saves (end of run, SIGTERM).
    ckpt = res.ckpt = Checkpointer(str(wd / "checkpoints"),
                                   save_interval_steps=rc.train.checkpoint_every,
                                   max_to_keep=rc.train.keep_checkpoints)

    def check_outside():      # what a fresh run reads: the outside weights
        for key, path in (("train.init_from", rc.train.init_from),
                          ("train.reference_from", rc.train.reference_from)):
            if path:
                check_hf_dir(path, key, model_cfg, rc.feed)

    has_ckpt = resume.check_launch(ckpt, cfg_json, check_outside)
    state, graphdef, shardings = init_train_state(rc.step, mesh, jax.random.PRNGKey(rc.seed))
    restored = resume.restore_or_fresh(ckpt, _abstract(state, shardings), workdir,
                                       has_checkpoint=has_ckpt, start_fresh=start_fresh,
                                       check_fresh=check_outside)
    fresh = restored is None
    if fresh:
        state = init_weights.outside_weights(state, rc.train, rc.step, shardings)
    if source is None:  # SIGTERM must also end an idle wait on a live spool
        source = make_source(rc.feed, process_count=pcount, stop=lambda: preemption.requested)
    # Weights published beyond the restored step (a kill after a publish, before the next
    # checkpoint) are rollout engines' newest version: their groups are not from the future.
    published = max(publish.published_steps(workdir), default=-1) if not fresh else -1
    if pcount > 1:
        published = int(broadcast_from_process0(published))
    run: Optional[_Run] = None
    feed = Feed(rc.feed, workdir, vocab_size=model_cfg.vocab_size,
                num_moe_layers=model_cfg.num_moe_layers, top_k=model_cfg.top_k,
                num_experts=model_cfg.num_experts, source=source, process_index=pidx,
                process_count=pcount, rows=rows, cols=cols, published_version=published,
                # an idle feed: show the finished step now (`run` is built below)
                on_idle=lambda: run.drain() if run is not None else None,
                # SIGTERM while a batch is still filling: keep its groups for the next run,
                # never train an undersized batch (a preempted run must equal an
                # uninterrupted one).
                stopped=lambda: preemption.requested)
    audit = None
    if restored is not None:
        state = restored.state
        feed.restore(restored.feed)
        audit = restored.audit or None
        log.info("resumed from checkpoint step %d in %s", restored.step, ckpt.directory)
        if audit is None:
            log.info("checkpoint has no audit-log positions: appending without truncating")
    step = int(jax.device_get(state.step))
    publisher = publish.Publisher(workdir, keep=rc.train.keep_published,
                                  dtype=rc.train.publish_dtype, init_from=rc.train.init_from,
                                  min_positions=rc.feed.seq_len,
                                  full_every=rc.train.publish_full_every)
    writer = res.writer = metrics_lib.MetricsWriter(
        workdir, purge_step=step + 1 if step else None,
        resume=None if audit is None else {
            k: metrics_lib.AuditPosition.from_json(v) for k, v in audit.items()})
    progress = res.progress = metrics_lib.Progress(total=rc.train.steps, initial=step)
    run = _Run(rc=rc, workdir=wd, mesh=mesh, state=state, graphdef=graphdef, shardings=shardings,
               feed=feed, ckpt=ckpt, publisher=publisher, writer=writer, progress=progress,
               steplog=metrics_lib.StepLog(feed, writer, progress, rc.train.log_every,
                                           Guardrails(log.warning, fresh=fresh)),
               cfg_json=cfg_json, step=step, start_step=step)
    return run


def _loop(run: _Run, preemption: Preemption) -> bool:
    """Trains until `train.steps`, the end of a finite feed or SIGTERM; True if preempted."""
    rc, step_fn, batch_sh = run.rc, None, None
    while run.step < rc.train.steps:
        item = run.feed.next_batch(run.step)
        if item is None:
            if preemption.requested:
                log.info("%s while waiting for the feed after step %d", preemption.signal_name,
                         run.step)
            else:
                log.info("feed exhausted after step %d", run.step)
            break
        batch_np, info = item
        if step_fn is None:
            shape = rc.feed.bucket_shapes if rc.feed.buckets else rc.feed.rows_per_batch
            batch_sh = batch_shardings(global_shapes(batch_np, shape, rc.feed.seq_len), run.mesh)
            step_fn = make_train_step(rc.step, run.mesh, run.shardings, batch_sh, run.graphdef)
        batch = make_global_batch(batch_np, batch_sh, rc.feed.bucket_shapes if rc.feed.buckets
                                  else rc.feed.rows_per_batch, rc.feed.seq_len)
        run.state, device_metrics = step_fn(run.state, batch)
        run.step += 1
        run.show_state()
        run.drain()                   # step - 1's metrics, read while this step runs
        run.pending = (run.step, info, batch_np, device_metrics)
        preempted = preemption.agreed(run.step)
        if preempted or (rc.train.checkpoint_every and run.ckpt.should_save(run.step)):
            run.checkpoint(force=preempted)
        if rc.train.publish_every and run.step % rc.train.publish_every == 0:
            run.publish()
        if preempted:
            log.info("%s: checkpoint written at step %d; exiting", preemption.signal_name,
                     run.step)
            return True
    run.drain()
    return preemption.requested       # also while idle on a spool


def _latest_pointer(workdir: epath.Path) -> Optional[str]:
    """`<workdir>/published/latest` if weights were published (None otherwise)."""
    pointer = publish.root_of(workdir) / publish.POINTER
    return str(pointer) if pointer.exists() else None


def _finish(run: _Run, preempted: bool, elapsed: float, stop_signal: Optional[str]) -> dict:
    """The final checkpoint, the writers closed, and the run summary (summary.json)."""
    jax.block_until_ready(run.state)  # before the collectives of the final save and hashes
    if run.step > run.start_step:  # end of run, or SIGTERM while idle (a saved step is kept)
        run.checkpoint(force=True)
    run.ckpt.close()
    run.publisher.close()
    run.progress.close()
    ledger = run.feed.finish() if not preempted else run.feed.ledger
    log_ = run.steplog
    summary = {
        "steps": run.step,
        "steps_this_run": run.step - run.start_step,
        "preempted": preempted,
        "signal": stop_signal if preempted else None,     # SIGTERM | SIGINT (Ctrl-C)
        "tokens": log_.tokens,
        "tokens_per_s": log_.tokens / max(elapsed, 1e-9),          # compilation included
        "tokens_per_s_steady": float(np.median(log_.rates[1:])) if len(log_.rates) > 1 else None,
        "wall_s": elapsed,
        "final_loss": log_.losses[-1] if log_.losses else None,
        "lam_mean": float(np.mean(log_.lam_means)) if log_.lam_means else None,
        "lam_max": log_.lam_max,
        "skipped_updates": log_.skipped,
        "ledger": ledger.to_json(),
        "dead_lettered": run.feed.dead_letter.count,
        "published_latest": _latest_pointer(run.workdir),
    }
    summary["params_sha256"], summary["params_l2"] = metrics_lib.params_fingerprint(
        run.state.params)
    run.writer.close()
    if is_primary():   # one object written whole: no rename needed on object stores
        (run.workdir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    return summary


def _train(cfg: ConfigDict, workdir: str, source: Any, preemption: Preemption,
           res: _Resources, start_fresh: bool, on_state: Optional[Callable[..., None]] = None,
           devices: Optional[Sequence[Any]] = None) -> Optional[dict]:
    """Setup, the loop, the summary; registers what it opens in `res`."""
    run = _setup(cfg, workdir, source, preemption, res, start_fresh, devices)
    run.on_state = on_state
    run.show_state()
    if run.start_step == 0 and run.rc.train.publish_every and run.rc.train.publish_initial:
        # Version 0 before the first step: that step needs groups that rollout workers can
        # only sample from published weights (a resume has published already).
        run.publish()
    t0 = time.perf_counter()
    preempted = _loop(run, preemption)
    return _finish(run, preempted, time.perf_counter() - t0, preemption.signal_name)

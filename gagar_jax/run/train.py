"""The visible training loop: feed -> train step -> metrics, checkpoints and published weights.

    summary = run(cfg, workdir)

One step consumes one feed batch. The loop dispatches step N+1 before it reads step N's metrics
(so the host never waits on the device for logging), saves the train state together with the
feed position (exact resume), writes a checkpoint and exits 0 on SIGTERM (preemption), and ends
when `train.steps` are done or a finite feed is exhausted.

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
import signal
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from gagar_jax.hf import api as hf
from gagar_jax.hf import families as hf_families
from gagar_jax.run import metrics as metrics_lib
from gagar_jax.run import publish
from gagar_jax.run import workdir_lock
from gagar_jax.run.checkpoint import Checkpointer
from gagar_jax.config import ConfigError, TrainConfig
from gagar_jax.feed.batcher import Feed, make_source
from gagar_jax.feed.config import FeedConfig
from gagar_jax.feed.packing import global_shapes, make_global_batch
from gagar_jax.sharding import batch_shardings, make_mesh, process_row_block
from gagar_jax.run.startup import ARCHITECTURE_FIELDS, check_hf_dir, check_layout
from gagar_jax.run.step import StepConfig, init_train_state, make_train_step

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
    def from_config(cls, cfg: Any) -> "RunConfig":
        try:
            return cls(step=StepConfig.from_config(cfg), feed=FeedConfig.from_config(cfg.feed),
                       train=TrainConfig.from_config(cfg.train), seed=int(cfg.seed))
        except ConfigError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ConfigError(f"bad config: {e}") from e


class _Preemption:
    """SIGTERM (preemption notice) -> a checkpoint at a step every process agrees on.

    One process: a Python SIGTERM handler sets a flag the loop reads after every step. Several
    processes: JAX's preemption sync manager (coordination service, no device collective that
    could interleave with the in-flight train step) picks the step; it owns SIGTERM itself.
    """

    def __init__(self):
        self.requested = False
        self._old = None
        self._multi = False

    def __enter__(self):
        self._multi = jax.process_count() > 1
        if not self._multi:
            try:
                self._old = signal.signal(signal.SIGTERM, self._handle)
            except ValueError:  # not the main thread: no handler
                self._old = None
        return self

    def _handle(self, signum: int, frame: Any):
        self.requested = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)

    def agreed(self, step: int) -> bool:
        if not self._multi:
            return self.requested
        from jax.experimental import multihost_utils
        return multihost_utils.reached_preemption_sync_point(step)


def _load_hf_params(path: str, step_cfg: StepConfig, like: Any, shardings: Any,
                    with_router_bias: bool = False) -> Any:
    """Parameters of a HF checkpoint directory, checked against the configured model, sharded
    (with `with_router_bias`: (params, router bias), the bias on the default device)."""
    model_cfg = step_cfg.model
    # Each process reads only its own shards, straight into the training sharding (hf_load).
    mesh = jax.tree.leaves(shardings)[0].mesh if shardings is not None else None
    model, ckpt_cfg = hf.from_pretrained(path, dtype=model_cfg.param_dtype, mesh=mesh)
    # Same shapes are not enough: a softmax checkpoint must not load into a sigmoid config.
    differ = [f for f in ARCHITECTURE_FIELDS if getattr(ckpt_cfg, f) != getattr(model_cfg, f)]
    if differ:
        raise ConfigError(f"{path}: checkpoint architecture does not match the config's model "
                          f"section: checkpoint has {', '.join(f'{f}={getattr(ckpt_cfg, f)!r}' for f in differ)}")
    from gagar_jax.run.step import split_model
    _, params, bias = split_model(model)
    want = jax.tree.map(lambda x: (x.shape, x.dtype), like)
    got = jax.tree.map(lambda x: (x.shape, x.dtype), params)
    if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
        raise ConfigError(f"{path}: checkpoint architecture does not match the config's model "
                          "section (set model.* to the checkpoint's shapes)")
    params = jax.device_put(params, shardings)
    return (params, bias) if with_router_bias else params


def _own_copy(tree: Any, shardings: Any) -> Any:
    """A copy of `tree` in buffers of its own (the step donates the state: the KL reference
    must never alias the live parameters)."""
    return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings)(tree)


def _outside_weights(state: Any, rc: RunConfig, shardings: Any) -> Any:
    """A fresh run's state with `init_from` and the KL reference applied.

    The reference (kl_coef > 0) is `reference_from`, else the initial weights; either way it
    gets its own parameter buffers and its own frozen router bias.
    """
    if rc.train.init_from:
        params, bias = _load_hf_params(rc.train.init_from, rc.step, state.params,
                                       shardings.params, with_router_bias=True)
        bias = jax.device_put(bias, shardings.router_bias)  # MiMo: e_score_correction_bias
        state = state.replace(params=params, router_bias=bias)
    if state.ref_params is None or not (rc.train.init_from or rc.train.reference_from):
        return state      # the jitted init gave the reference buffers of its own already
    ref, ref_bias = state.params, state.router_bias
    if rc.train.reference_from:
        ref, ref_bias = _load_hf_params(rc.train.reference_from, rc.step, state.params,
                                        shardings.params, with_router_bias=True)
    return state.replace(ref_params=_own_copy(ref, shardings.params),
                         ref_router_bias=_own_copy(ref_bias, shardings.router_bias))


def _abstract(state: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        state, shardings)


class _StepLog:
    """Host-side bookkeeping of finished steps: ledger counts, audit log, metrics, summary."""

    def __init__(self, feed: Feed, writer: metrics_lib.MetricsWriter,
                 progress: metrics_lib.Progress, log_every: int):
        self.feed, self.writer, self.progress, self.log_every = feed, writer, progress, log_every
        self.losses, self.lam_means, self.lam_max = [], [], 0.0
        self.tokens = 0
        self.rates = []           # per-step tokens/s (the first one includes compilation)
        self.skipped = 0
        self.t_last = time.perf_counter()

    def finish_step(self, step: int, info: Any, batch_np: Any,
                    device_metrics: Any) -> metrics_lib.HostMetrics:
        m = metrics_lib.to_host(step, device_metrics)
        a = m.arrays
        n = info.num_groups
        self.feed.record_trained(info.group_ids, a["audit/fallback_G"][:n].tolist(),
                                 a["audit/capped_G"][:n].tolist())
        traj_ids: list = [None] * a["audit/advantages_T"].shape[0]
        for ids, slots in zip(info.trajectory_ids, info.traj_slots):
            for tid, t in zip(ids, slots):
                traj_ids[t] = tid
        self.writer.write_groups(metrics_lib.group_records(
            step, info.group_ids, traj_ids, batch_np.group_ids_T, batch_np.factors_T,
            a["audit/advantages_T"], a["audit/lam_G"], a["audit/capped_G"],
            a["audit/fallback_G"], valid_T=batch_np.valid_T, rewards_T=batch_np.rewards_T,
            outcome_advantages_T=a["audit/outcome_advantages_T"], mixed_G=a["audit/mixed_G"],
            hacked_T=batch_np.hacked_T, infra_ids=info.infra_ids))
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
            log.warning("step %d: non-finite values %s; %d optimizer update(s) skipped",
                        step, list(m.nonfinite), int(s["skipped"]))
        if step % self.log_every == 0:
            self.writer.write(step, {**s, "feed/packing_efficiency": info.packing_efficiency,
                                     "perf/tokens_per_s": tok_s})
        self.writer.flush()       # every step: a crash loses no finished step's lines
        self.progress.update(1, tokens_per_s=tok_s, loss=s["loss"], lam=s["lam_mean"],
                             groups=int(s["groups"]))
        return m


def run(cfg: Any, workdir: str, *, source: Any = None) -> Optional[dict]:
    """Trains until `train.steps` or the end of a finite feed; returns the run summary.

    Args:
      cfg: the locked ConfigDict (sections model, mesh, loss, optim, train, feed).
      workdir: run directory (local path or object-store URI such as gs://bucket/run); an
        existing checkpoint there is resumed from.
      source: optional feed source object (e.g. `IteratorSource` for in-process producers);
        default: `feed.path` / `feed.spool_dir` from the config.
    Returns:
      The summary dict (also written to `workdir/summary.json` by process 0).
    """
    # One learner per workdir (the CLI took the lock already, before JAX started).
    if jax.process_index() == 0:
        workdir_lock.acquire(workdir)
    # SIGTERM at any point of the run becomes a checkpoint and a clean exit.
    with _Preemption() as preemption:
        return _run(cfg, workdir, source, preemption)


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
            except Exception:  # noqa: BLE001 -- e.g. the same full disk: already reported
                pass


def _run(cfg: Any, workdir: str, source: Any, preemption: "_Preemption") -> Optional[dict]:
    """`run` with the SIGTERM flag installed and background writers stopped on failure."""
    res = _Resources()
    try:
        return _train(cfg, workdir, source, preemption, res)
    except BaseException:
        res.abort()
        raise


def _train(cfg: Any, workdir: str, source: Any, preemption: "_Preemption",
           res: _Resources) -> Optional[dict]:
    """The run itself; registers what it opens in `res`."""
    rc = RunConfig.from_config(cfg)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    wd = epath.Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    pidx, pcount = jax.process_index(), jax.process_count()
    # Every cross-section rule before anything compiles (docs/reliability.md: exit 2).
    if rc.feed.path and not any(ch in rc.feed.path for ch in "*?[") and not epath.Path(
            rc.feed.path).exists():
        raise ConfigError(f"feed.path: no such file: {rc.feed.path}")
    try:
        mesh = make_mesh(cfg.mesh)
        # The rows and S range of the batch this host's devices hold: with the context axis
        # spanning hosts, several hosts share rows, each building only its part of S.
        rows, cols = process_row_block(mesh, rc.feed.rows_per_batch, rc.feed.seq_len)
    except ValueError as e:
        raise ConfigError(f"mesh: {e}") from e
    model_cfg = rc.step.model
    check_layout(rc.step, rc.feed, mesh, pcount)
    if rc.train.publish_every and model_cfg.export_family is None:
        raise ConfigError(f"train.publish_every={rc.train.publish_every}: "
                          f"{hf_families.export_error(model_cfg)}")
    # checkpoint_every = 0: only the forced saves (end of run, SIGTERM).
    ckpt = res.ckpt = Checkpointer(str(wd / "checkpoints"),
                                   save_interval_steps=rc.train.checkpoint_every,
                                   max_to_keep=rc.train.keep_checkpoints)
    fresh = ckpt.latest_step() is None
    # Outside weights apply to a fresh run only: a resume restores the checkpoint and never
    # reads init_from / reference_from (they may be gone, or changed, by then).
    outside = [(key, path) for key, path in (("train.init_from", rc.train.init_from),
                                             ("train.reference_from", rc.train.reference_from))
               if path and fresh]
    for key, path in outside:
        check_hf_dir(path, key, model_cfg, rc.feed)

    state, graphdef, shardings = init_train_state(rc.step, mesh, jax.random.PRNGKey(rc.seed))
    if fresh:
        state = _outside_weights(state, rc, shardings)
    if source is None:  # SIGTERM must also end an idle wait on a live spool
        source = make_source(rc.feed, process_count=pcount, stop=lambda: preemption.requested)
    feed = Feed(rc.feed, workdir, vocab_size=model_cfg.vocab_size,
                num_moe_layers=model_cfg.num_moe_layers, top_k=model_cfg.top_k,
                num_experts=model_cfg.num_experts, source=source, process_index=pidx,
                process_count=pcount, rows=rows, cols=cols)
    audit = None
    if not fresh:
        restored = ckpt.restore(_abstract(state, shardings))
        state = restored.state
        feed.restore(restored.feed)
        audit = restored.audit or None
        log.info("resumed from checkpoint step %d in %s", restored.step, ckpt.directory)
        if audit is None:
            log.info("checkpoint has no audit-log positions: appending without truncating")

    step = int(jax.device_get(state.step))
    start_step = step
    publisher = publish.Publisher(workdir, keep=rc.train.keep_published,
                                  dtype=rc.train.publish_dtype, init_from=rc.train.init_from)
    writer = res.writer = metrics_lib.MetricsWriter(
        workdir, purge_step=step + 1 if step else None,
        resume=None if audit is None else {
            k: metrics_lib.AuditPosition.from_json(v) for k, v in audit.items()})
    progress = res.progress = metrics_lib.Progress(total=rc.train.steps, initial=step)
    steplog = _StepLog(feed, writer, progress, rc.train.log_every)
    step_fn, batch_sh = None, None
    pending = None            # (step, BatchInfo, numpy Batch, device metrics) not yet read back
    cfg_json = json.loads(cfg.to_json())
    t0 = time.perf_counter()
    preempted = False

    def drain():
        nonlocal pending
        if pending is not None:
            steplog.finish_step(*pending)
            pending = None

    def save(force: bool) -> None:
        # The audit logs and dead-letter file reach the disk before the step that points at
        # their lengths can commit.
        positions = writer.sync()
        feed.dead_letter.sync()
        # Every process passes the item (the same checkpoint structure everywhere); only
        # process 0 writes files, so its positions are the ones stored.
        ckpt.save(step, state, feed.state(), cfg_json, force=force, audit=positions)

    feed.on_idle = drain            # an idle feed: show the finished step now

    while step < rc.train.steps:
        item = feed.next_batch(step)
        if item is None:
            log.info("feed exhausted after step %d", step)
            break
        batch_np, info = item
        if step_fn is None:
            batch_sh = batch_shardings(
                global_shapes(batch_np, rc.feed.rows_per_batch, rc.feed.seq_len), mesh)
            step_fn = make_train_step(rc.step, mesh, shardings, batch_sh, graphdef)
        batch = make_global_batch(batch_np, batch_sh, rc.feed.rows_per_batch, rc.feed.seq_len)
        state, device_metrics = step_fn(state, batch)
        step += 1
        drain()                       # step - 1's metrics, read while step runs
        pending = (step, info, batch_np, device_metrics)
        preempted = preemption.agreed(step)
        publish_now = rc.train.publish_every and step % rc.train.publish_every == 0
        save_now = bool(rc.train.checkpoint_every) and ckpt.should_save(step)
        if preempted or save_now or publish_now:
            drain()                   # the ledger must include this step before saving
        if preempted or save_now:
            save(force=preempted)
        if publish_now:
            # The publish reshard is a collective: let the in-flight step finish first. Training
            # waits for the device-to-host copy of this process's share; files are written in
            # the background (publish.Publisher).
            jax.block_until_ready(state)
            publisher.publish(nnx.merge(graphdef, state.params, state.router_bias), step)
        if preempted:
            log.info("SIGTERM: checkpoint written at step %d; exiting", step)
            break
    drain()
    preempted = preempted or preemption.requested   # also while idle on a spool
    jax.block_until_ready(state)  # before the collectives of the final save and hashes
    if step > start_step:  # end of run, or SIGTERM while idle (a step saved already is kept)
        save(force=True)
    ckpt.close()
    publisher.close()
    progress.close()
    ledger = feed.finish() if not preempted else feed.ledger
    elapsed = time.perf_counter() - t0
    summary = {
        "steps": step,
        "steps_this_run": step - start_step,
        "preempted": preempted,
        "tokens": steplog.tokens,
        "tokens_per_s": steplog.tokens / max(elapsed, 1e-9),          # compilation included
        "tokens_per_s_steady": float(np.median(steplog.rates[1:])) if len(steplog.rates) > 1 else None,
        "wall_s": elapsed,
        "final_loss": steplog.losses[-1] if steplog.losses else None,
        "lam_mean": float(np.mean(steplog.lam_means)) if steplog.lam_means else None,
        "lam_max": steplog.lam_max,
        "skipped_updates": steplog.skipped,
        "ledger": ledger.to_json(),
    }
    summary["params_sha256"], summary["params_l2"] = metrics_lib.params_fingerprint(state.params)
    writer.close()
    if pidx == 0:   # one object written whole: no rename needed on object stores
        (wd / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    return summary

"""The miniature's in-process closed loop: sample -> grade -> feed records -> `Feed` -> train step.

    learner = Learner(cfg)                                    # cfg: configs/miniature.py
    warm = warm_start(cfg, task_cfg, seed=0, sft_steps=2000)  # shared by every arm
    rows = run_loop(learner, "control", warm, task_cfg, seed=1, rl_steps=30, ...)

Each RL step samples one group per fresh task with the live policy (`producer.sample_groups`),
and trains on the previous step's groups (staleness 1): the arm's records (`sim/arms.py`; the
control rewrites them) go through the product's `Feed` (an `IteratorSource`: validation,
dynamic sampling of mixed groups, packing, routing replay) and the jitted `train_step`.
Measurements per step: `run_loop`'s docstring and `sim/measure.py`. One train step is compiled
per advantage mode (the mode is static in `LossConfig`); every seed and arm of a mode reuses it.
The two-process path (producer + `gagar-train`) is in `scripts/miniature.py`.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Optional

import jax
import ml_collections
import numpy as np
from flax import nnx

from gagar_jax import grading
from gagar_jax.algo.advantage import MODES
from gagar_jax.batch import Batch
from gagar_jax.feed import schema
from gagar_jax.feed.batcher import BatchInfo, Feed
from gagar_jax.feed.config import FeedConfig
from gagar_jax.feed.packing import make_global_batch
from gagar_jax.feed.sources import IteratorSource
from gagar_jax.model.moe import RouterBias
from gagar_jax.model.transformer import ModelConfig, Transformer
from gagar_jax.run.step import StepConfig, TrainState, make_train_step, train_state_initializer
from gagar_jax.sharding import batch_shardings, make_mesh
from gagar_jax.sim import arms, demos, difficulty, measure, producer, resume
from gagar_jax.sim import task as task_lib

# Train-step metrics kept per step (see `step_metrics.StepMetrics`).
STEP_KEYS = ("entropy", "mean_response_len", "pos_credit_before", "pos_credit_after",
             "neg_credit", "net_credit_per_traj", "token_net_credit", "token_net_frac",
             "token_outcome_credit", "lam_mean", "lam_max", "capped_groups", "fallback_groups",
             "mixed_groups", "groups", "trajectories", "loss", "grad_norm", "approx_kl",
             "clip_frac_low", "clip_frac_high")


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """The SFT checkpoint every run starts from (host numpy copies) and its step-0 report.

    params / router_bias: `nnx.State`s of numpy arrays. stats: `producer.RolloutStats` on the
    held-out tasks. sft_losses: the SFT loss per step. seconds: wall time of the phase.
    """
    params: object
    router_bias: object
    stats: producer.RolloutStats
    sft_losses: list
    seconds: float
    extra: dict = dataclasses.field(default_factory=dict)


def heldout_tasks(task_cfg: task_lib.TaskConfig, n: int) -> list:
    """The fixed held-out evaluation tasks (never used for demonstrations or training)."""
    return task_lib.make_tasks(task_cfg, 987_654_321, n, prefix="heldout")


def warm_start(cfg: ml_collections.ConfigDict, task_cfg: task_lib.TaskConfig, *, seed: int,
               sft_steps: int, num_demos: int = 4000, batch_size: int = 32, lr: float = 3e-3,
               recipe: demos.Recipe = demos.ROUND2_RECIPE, eval_tasks: int = 32,
               group_size: int = 8, lam_cap: float = 1.5,
               table: Optional[grading.FactorTable] = None, snapshot: Optional[str] = None,
               deadline: resume.Deadline = resume.NEVER) -> WarmStart:
    """Supervised warm start on mixed-quality demonstrations, then the step-0 tier mix.

    Args:
      cfg: the run's ConfigDict (its `model` section). task_cfg: the task family.
      seed: init, demonstration and shuffle seed. sft_steps: SFT optimizer steps (0 = none).
      num_demos, batch_size, lr: SFT set size, rows per step, Adam rate.
      recipe: how the demonstrations are drawn (`demos.Recipe`).
      eval_tasks, group_size: held-out report (`extra`: f_bar and the cap rate it implies at
      `lam_cap`, see `pass_factor_stats`). table: the factor table (default: the grader's).
      snapshot, deadline: a resumable SFT phase (`demos.warm_start`).
    """
    t0 = time.perf_counter()
    model = Transformer(ModelConfig.from_config(cfg.model), rngs=nnx.Rngs(seed))
    losses = []
    if sft_steps > 0:
        demo_eps = demos.make_demos(
            task_cfg, task_lib.make_tasks(task_cfg, seed, num_demos, prefix="demo"), seed, recipe)
        seq_len = -(-max(len(e.tokens) for e in demo_eps) // 8) * 8
        losses = demos.warm_start(model, demo_eps, steps=sft_steps, batch_size=batch_size,
                                  seq_len=seq_len, lr=lr, seed=seed, snapshot=snapshot,
                                  deadline=deadline)
    _, params, bias = nnx.split(model, nnx.Param, RouterBias)
    records, stats = producer.sample_groups(model, heldout_tasks(task_cfg, eval_tasks), task_cfg,
                                            jax.random.key(seed), group_size=group_size,
                                            policy_version=0)
    return WarmStart(params=jax.device_get(params), router_bias=jax.device_get(bias), stats=stats,
                     sft_losses=[float(x) for x in losses], seconds=time.perf_counter() - t0,
                     extra=pass_factor_stats(records, table or grading.FactorTable(), lam_cap))


class Learner:
    """The product's jitted train step on a one-process mesh, compiled once per advantage mode.

    `table` is the feed's tier/rank -> factor table (default: the grader's; Design B of round
    three uses a harsher one). `compiler_options`: XLA options for the train steps alone (a
    smoke test compiles them at `{"xla_backend_optimization_level": 0}`, 2-3x faster, and runs
    each only a few times; None = the process's flags)."""

    def __init__(self, cfg: ml_collections.ConfigDict,
                 table: Optional[grading.FactorTable] = None,
                 compiler_options: Optional[dict] = None):
        if compiler_options and cfg.debug_checks:
            raise ValueError("compiler_options: not with debug_checks (a chexified step)")
        self.cfg = cfg
        self.mesh = make_mesh(cfg.mesh)
        self.feed_cfg = FeedConfig.from_config(cfg.feed)
        self.feed_table = table or grading.FactorTable()
        self.compiler_options = compiler_options
        self._steps: dict = {}      # mode -> (StepConfig, step_fn)
        self._init = None           # (init, graphdef, shardings), built on the first run

    def step_config(self, mode: str) -> StepConfig:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        cfg = self.cfg.copy_and_resolve_references()
        cfg.loss.mode = mode
        return StepConfig.from_config(cfg)

    def init_state(self, mode: str, warm: WarmStart,
                   seed: int) -> tuple[TrainState, nnx.GraphDef, TrainState]:
        """A fresh TrainState holding (copies of) the warm-start weights; fresh Adam moments."""
        self.step_config(mode)   # validates the mode
        # The state's structure does not depend on the advantage mode: one init program for
        # every arm and seed, traced and compiled on the first run.
        if self._init is None:
            self._init = train_state_initializer(self.step_config("binary"), self.mesh)
        init, graphdef, shardings = self._init
        state = init(jax.random.key(seed))
        params = jax.device_put(warm.params, shardings.params)
        bias = jax.device_put(warm.router_bias, shardings.router_bias)
        return state.replace(params=params, router_bias=bias), graphdef, shardings

    def step_fn(self, mode: str, batch_np: Batch, graphdef: nnx.GraphDef,
                shardings: TrainState) -> tuple[Callable, Batch]:
        """The mode's jitted step (built on first use; every later run of the mode reuses it)."""
        if mode not in self._steps:
            batch_sh = batch_shardings(batch_np, self.mesh)
            fn = make_train_step(self.step_config(mode), self.mesh, shardings, batch_sh, graphdef)
            if self.compiler_options:
                fn = self._compiled_on_first_call(fn)
            self._steps[mode] = (fn, batch_sh)
        return self._steps[mode]

    def _compiled_on_first_call(self, step_fn: Callable) -> Callable:
        """`step_fn`'s jitted program compiled ahead of its first call with the learner's
        `compiler_options` (the same program, other code generation)."""
        compiled = []

        def call(state: TrainState, batch: Batch):
            with jax.set_mesh(self.mesh):
                if not compiled:
                    compiled.append(step_fn.jitted.lower(state, batch).compile(
                        compiler_options=self.compiler_options))
                return compiled[0](state, batch)
        return call

    def feed(self, records: Sequence[schema.Group], workdir: str) -> Feed:
        """A `Feed` over one step's records (validation, mixed-group filter, packing)."""
        m = self.step_config("binary").model
        return Feed(self.feed_cfg, workdir, vocab_size=m.vocab_size,
                    num_moe_layers=m.num_moe_layers, top_k=m.top_k, num_experts=m.num_experts,
                    source=IteratorSource(records), factor_table=self.feed_table,
                    log=lambda s: None)


def strong_credit_share(records: Sequence[schema.Group], info: BatchInfo,
                        advantages_T: np.ndarray) -> float:
    """Share of the step's positive credit that lands on passes graded strong.

    Args:
      records: the step's `feed.schema.Group`s. info: the batch's `BatchInfo`.
      advantages_T: the train step's final advantages (audit output), by trajectory slot.
    Returns:
      sum of positive advantages of strong passes / sum of positive advantages (nan if none).
    """
    tier = {t.trajectory_id: (t.quality.tier if t.quality else None)
            for g in records for t in g.trajectories}
    strong = total = 0.0
    for ids, slots in zip(info.trajectory_ids, info.traj_slots, strict=False):
        for tid, slot in zip(ids, slots, strict=False):
            a = float(advantages_T[slot])
            if a > 0:
                total += a
                strong += a * (tier[tid] == "strong")
    return strong / total if total > 0 else math.nan


def _rollout_row(prefix: str, stats: producer.RolloutStats) -> dict:
    keys = ("pass_rate", "true_pass_rate", "strong_share", "mean_generated", "p90_generated",
            "mean_turns", "timeout_rate", "entropy", "entropy_note", "entropy_action",
            "note_share", "hacked", "mixed_groups", "flaked")
    row = {f"{prefix}_{k}": float(getattr(stats, k)) for k in keys}
    row[f"{prefix}_tiers"] = dict(stats.tiers)
    return row


def pass_factor_stats(records: Sequence[schema.Group], table: grading.FactorTable,
                      lam_cap: float) -> dict:
    """Mean pass factor f_bar over mixed groups, and the share of mixed groups whose f_bar is
    below 1 / lam_cap (where sum-preserving's lambda cap fires)."""
    fbars = []
    for g in records:
        clean = [t.outcome == "pass" and not t.hacked for t in g.trajectories]
        if 0 < sum(clean) < len(clean):
            f = arms.pass_factors(g, table)
            fbars.append(float(np.nanmean(f)))
    if not fbars:
        return {"fbar": math.nan, "cap_would_fire": math.nan}
    return {"fbar": float(np.mean(fbars)),
            "cap_would_fire": float(np.mean([fb * lam_cap < 1.0 for fb in fbars]))}


def _sampling_model(graphdef: nnx.GraphDef, state: TrainState) -> Transformer:
    """The policy of `state` for sampling, the probe and evaluation: a copy on the default device,
    placed like the warm start's model, so the sampler reuses the programs the warm start's
    evaluation compiled (arguments on the train state's mesh compile each of them again)."""
    params, bias = jax.device_put(jax.device_get((state.params, state.router_bias)))
    return nnx.merge(graphdef, params, bias)


def run_loop(learner: Learner, arm: str, warm: WarmStart, task_cfg: task_lib.TaskConfig, *,
             seed: int, rl_steps: int, workdir: str, groups: int = 16, group_size: int = 8,
             eval_tasks: int = 32, eval_every: int = 5, probe: Optional[measure.ProbeSet] = None,
             temperature: float = 1.0, top_p: float = 1.0,
             flaky: Optional[difficulty.FlakyRunner] = None,
             deadline: resume.Deadline = resume.NEVER, save_every: int = 10,
             log: Callable[[str], None] = print) -> list:
    """One RL run of an arm (`arms.ARMS`) from the warm start; one dict per step 0..rl_steps.

    Staleness 1: step t trains on the batch sampled with policy version t - 1 (step 0 on one
    sampled with version 0), through a `Feed`. Row t holds, for policy version t: the probe-set
    entropy; the stats of its own samples (the batch it sampled, trained at step t + 1:
    `train_*`, entropy split into note and action tokens, length, turns, timeouts); every
    `eval_every` steps and at the end the held-out evaluation (`heldout_*`) and the KL to the
    warm start on those samples; and, for t < rl_steps, the train step's metrics on the batch it
    trained (`STEP_KEYS`, net credit per sequence and token-weighted, f_bar, lambda-cap rate).
    Tasks and sampling keys depend only on (seed, t): arms see common random numbers at step 0.

    Resumable: the loop's state is saved to `workdir/resume.pkl` every `save_every` steps and
    when `deadline` passes (then `resume.OutOfTime` is raised); a later call with the same
    arguments continues from it and returns the rows an uninterrupted run would have (but for
    their `seconds`).

    Args:
      learner: the `Learner` (its compiled step for the arm's mode is reused across seeds).
      arm: `arms.ARMS`. warm: the `WarmStart`. task_cfg: task family.
      seed: task, sampling and train-state seed. rl_steps: train steps.
      workdir: where each step's `Feed` writes ledger.json / dead_letter.jsonl, and the resume
        file.
      groups, group_size: tasks per step, rollouts per task. eval_tasks: held-out tasks.
      eval_every: held-out evaluation interval. probe: teacher-forced probe set (None: none).
      temperature, top_p: sampling of the training batches (held-out evaluation always samples
        the full distribution). flaky: adaptive difficulty for the training batches (a fresh
        `difficulty.FlakyRunner`; None = off; held-out evaluation never flakes).
      deadline, save_every: see "Resumable". log: progress lines.
    Returns:
      rows: list of dicts; the last row also holds the summed feed ledger ("ledger_totals").
    """
    mode = arms.arm_mode(arm)
    state, graphdef, shardings = learner.init_state(mode, warm, seed)
    ref_model = nnx.merge(graphdef, jax.device_put(warm.params), jax.device_put(warm.router_bias))
    table = learner.feed_table
    lam_cap = float(learner.cfg.loss.lam_cap)
    held = heldout_tasks(task_cfg, eval_tasks)
    tasks = producer.task_batches(task_cfg, seed, groups)
    os.makedirs(workdir, exist_ok=True)
    ckpt = os.path.join(workdir, "resume.pkl")
    key0 = jax.random.key(seed)

    def sample(model: Transformer, t: int, key: jax.Array):
        q = 0.0 if flaky is None else flaky.prob()
        records, stats = producer.sample_groups(
            model, next(tasks), task_cfg, key, group_size=group_size, policy_version=t,
            temperature=temperature, group_prefix=f"{arm}-s{seed}", top_p=top_p,
            flake_prob=q, flake_seed=seed * 1_000_003 + t)
        if flaky is not None:
            flaky.update(stats.true_pass_rate)
        return records, stats

    saved = resume.load_pickle(ckpt)
    if saved is not None:
        t_start, rows, totals = saved["t"], saved["rows"], saved["totals"]
        pending = saved["pending"]
        state = resume.from_host(saved["state"], shardings)
        if flaky is not None:
            flaky.estimate = saved["flaky"]
        for _ in range(t_start + 1):     # the task batches already drawn
            next(tasks)
        log(f"{arm} seed={seed}: resumed at step {t_start}")
    else:
        t_start, rows = 0, []
        totals = {"received": 0, "trained": 0, "filtered_uniform": 0, "filtered_stale": 0}
        pending, _ = sample(_sampling_model(graphdef, state), 0,
                            jax.random.fold_in(key0, 10_000_019))

    def save(t: int) -> None:
        resume.save_pickle(ckpt, {"t": t, "rows": rows, "totals": totals, "pending": pending,
                                  "state": resume.to_host(state),
                                  "flaky": None if flaky is None else flaky.estimate})

    for t in range(t_start, rl_steps + 1):
        if t > t_start and (deadline.passed() or t % save_every == 0):
            save(t)
            if deadline.passed():
                raise resume.OutOfTime(f"{arm} seed {seed}: saved at step {t} in {ckpt}")
        t0 = time.perf_counter()
        model = _sampling_model(graphdef, state)
        key = jax.random.fold_in(key0, t)
        row = {"step": t}
        if probe is not None:
            row.update(probe.entropy(model))
        if t % eval_every == 0 or t == rl_steps:
            ev_records, ev_stats = producer.sample_groups(
                model, held, task_cfg, jax.random.fold_in(key, 1), group_size=group_size,
                policy_version=t, temperature=temperature, group_prefix="heldout")
            row.update(_rollout_row("heldout", ev_stats))
            row["kl_ref"] = measure.kl_to_reference(ref_model, ev_records)
        if t == rl_steps:
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            break
        q = 0.0 if flaky is None else flaky.prob()
        records, stats = sample(model, t, jax.random.fold_in(key, 0))
        row.update(_rollout_row("train", stats))
        if flaky is not None:
            row["flake_prob"] = q
        train_records = arms.transform(arm, pending, table)
        row.update(pass_factor_stats(pending, table, lam_cap))
        pending = records
        feed = learner.feed(train_records, workdir)
        item = feed.next_batch(t)
        ledger = feed.finish().to_json()
        for k in totals:
            totals[k] += ledger.get(k, 0)
        if item is None:            # no mixed group: nothing to train on this step
            row.update({k: math.nan for k in STEP_KEYS + ("strong_credit_share",)})
        else:
            batch_np, info = item
            fn, batch_sh = learner.step_fn(mode, batch_np, graphdef, shardings)
            batch = make_global_batch(batch_np, batch_sh, learner.feed_cfg.rows_per_batch)
            state, metrics = fn(state, batch)
            m = jax.device_get(metrics)
            row.update({k: float(getattr(m, k)) for k in STEP_KEYS})
            row["strong_credit_share"] = strong_credit_share(train_records, info,
                                                             m.audit.advantages_T)
            row.update(measure.credit_metrics(train_records, info, m.audit.advantages_T,
                                              m.audit.outcome_advantages_T))
            row["cap_rate"] = row["capped_groups"] / max(row["mixed_groups"], 1.0)
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        log(f"{arm} seed={seed} step={t} pass={row['train_pass_rate']:.3f} "
            f"strong={row['train_strong_share']:.3f} len={row['train_mean_generated']:.1f} "
            f"ent={row['train_entropy']:.3f} (note {row['train_entropy_note']:.3f}) "
            f"net/seq={row.get('net_credit_per_seq', math.nan):.3f} "
            f"fbar={row['fbar']:.2f} cap={row.get('cap_rate', math.nan):.2f} "
            f"({row['seconds']:.1f}s)")
    rows[-1]["ledger_totals"] = totals
    if os.path.exists(ckpt):
        os.remove(ckpt)
    return rows

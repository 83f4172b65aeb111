"""The miniature's in-process closed loop: sample -> grade -> feed records -> `Feed` -> train step.

    learner = Learner(cfg)                                   # cfg: configs/miniature.py
    warm = warm_start(cfg, task_cfg, seed=0, sft_steps=300)  # shared by every mode and seed
    steps = run_loop(learner, "sum_preserving", warm, task_cfg, seed=1, rl_steps=30, ...)

Each RL step samples one group per fresh task with the live policy (`producer.sample_groups`),
hands the records to the product's `Feed` (an `IteratorSource`: validation, dynamic sampling of
mixed groups, packing, routing replay) and runs the jitted `train_step`. The held-out pass rate,
strong share and response length come from `producer.tier_mix` on a fixed set of held-out tasks.
One train step is compiled per advantage mode (the mode is static in `LossConfig`); every seed of
a mode reuses it. The two-process path (producer + `gagar-train`) is in `scripts/miniature.py`.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Callable, Optional

import jax
import numpy as np
from flax import nnx

from gagar_jax.advantage import MODES
from gagar_jax.feed.batcher import Feed
from gagar_jax.feed.config import FeedConfig
from gagar_jax.feed.packing import make_global_batch
from gagar_jax.feed.sources import IteratorSource
from gagar_jax.model import ModelConfig, Transformer
from gagar_jax.moe import RouterBias
from gagar_jax.sharding import batch_shardings, make_mesh
from gagar_jax.sim import demos, producer
from gagar_jax.sim import task as task_lib
from gagar_jax.train_step import StepConfig, init_train_state, make_train_step

# Train-step metrics kept per step (see `step_metrics.StepMetrics`).
STEP_KEYS = ("entropy", "mean_response_len", "pos_credit_before", "pos_credit_after",
             "neg_credit", "lam_mean", "lam_max", "capped_groups", "fallback_groups",
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


def heldout_tasks(task_cfg: task_lib.TaskConfig, n: int) -> list:
    """The fixed held-out evaluation tasks (never used for demonstrations or training)."""
    return task_lib.make_tasks(task_cfg, 987_654_321, n, prefix="heldout")


def warm_start(cfg, task_cfg: task_lib.TaskConfig, *, seed: int, sft_steps: int, num_demos: int = 4000,
               batch_size: int = 32, lr: float = 3e-3, mix: Optional[dict] = None,
               eval_tasks: int = 32, group_size: int = 8) -> WarmStart:
    """Supervised warm start on mixed-quality demonstrations, then the step-0 tier mix.

    Args:
      cfg: the run's ConfigDict (its `model` section). task_cfg: the task family.
      seed: init, demonstration and shuffle seed. sft_steps: SFT optimizer steps (0 = none).
      num_demos, batch_size, lr, mix: see `sim.demos`. eval_tasks, group_size: held-out report.
    """
    t0 = time.perf_counter()
    model = Transformer(ModelConfig.from_config(cfg.model), rngs=nnx.Rngs(seed))
    losses = []
    if sft_steps > 0:
        demo_eps = demos.make_demos(
            task_cfg, task_lib.make_tasks(task_cfg, seed, num_demos, prefix="demo"), seed, mix=mix)
        losses = demos.warm_start(model, demo_eps, steps=sft_steps, batch_size=batch_size,
                                  seq_len=producer.cache_len(task_cfg), lr=lr, seed=seed)
    _, params, bias = nnx.split(model, nnx.Param, RouterBias)
    stats = producer.tier_mix(model, heldout_tasks(task_cfg, eval_tasks), task_cfg,
                              jax.random.key(seed), group_size=group_size)
    return WarmStart(params=jax.device_get(params), router_bias=jax.device_get(bias), stats=stats,
                     sft_losses=[float(x) for x in losses], seconds=time.perf_counter() - t0)


class Learner:
    """The product's jitted train step on a one-process mesh, compiled once per advantage mode."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.mesh = make_mesh(cfg.mesh)
        self.feed_cfg = FeedConfig.from_config(cfg.feed)
        self._steps: dict = {}      # mode -> (StepConfig, step_fn)

    def step_config(self, mode: str) -> StepConfig:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        cfg = self.cfg.copy_and_resolve_references()
        cfg.loss.mode = mode
        return StepConfig.from_config(cfg)

    def init_state(self, mode: str, warm: WarmStart, seed: int):
        """A fresh TrainState holding (copies of) the warm-start weights; fresh Adam moments."""
        step_cfg = self.step_config(mode)
        state, graphdef, shardings = init_train_state(step_cfg, self.mesh, jax.random.key(seed))
        params = jax.device_put(warm.params, shardings.params)
        bias = jax.device_put(warm.router_bias, shardings.router_bias)
        return state.replace(params=params, router_bias=bias), graphdef, shardings

    def step_fn(self, mode: str, batch_np, graphdef, shardings):
        """The mode's jitted step (built on first use; every later run of the mode reuses it)."""
        if mode not in self._steps:
            batch_sh = batch_shardings(batch_np, self.mesh)
            fn = make_train_step(self.step_config(mode), self.mesh, shardings, batch_sh, graphdef)
            self._steps[mode] = (fn, batch_sh)
        return self._steps[mode]

    def feed(self, records, workdir: str) -> Feed:
        """A `Feed` over one step's records (validation, mixed-group filter, packing)."""
        m = self.step_config("binary").model
        return Feed(self.feed_cfg, workdir, vocab_size=m.vocab_size,
                    num_moe_layers=m.num_moe_layers, top_k=m.top_k, num_experts=m.num_experts,
                    source=IteratorSource(records), log=lambda s: None)


def strong_credit_share(records, info, advantages_T) -> float:
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
    for ids, slots in zip(info.trajectory_ids, info.traj_slots):
        for tid, slot in zip(ids, slots):
            a = float(advantages_T[slot])
            if a > 0:
                total += a
                strong += a * (tier[tid] == "strong")
    return strong / total if total > 0 else math.nan


def _eval_row(stats: producer.RolloutStats) -> dict:
    return {"heldout_pass_rate": stats.pass_rate, "heldout_strong_share": stats.strong_share,
            "heldout_len": stats.mean_generated, "heldout_hacked": stats.hacked,
            "heldout_tiers": dict(stats.tiers)}


def run_loop(learner: Learner, mode: str, warm: WarmStart, task_cfg: task_lib.TaskConfig, *, seed: int,
             rl_steps: int, workdir: str, groups: int = 16, group_size: int = 8,
             eval_tasks: int = 32, log: Callable[[str], None] = print) -> list:
    """One RL run from the warm start; returns one dict per step 0..rl_steps.

    Row t holds the held-out evaluation of policy version t and, for t < rl_steps, the train
    batch sampled with it and the metrics of the train step on that batch (entropy is the
    policy's per-token entropy on its own samples, credits sum over the step's groups). Tasks
    and sampling keys depend only on (seed, t), so modes see common random numbers.

    Args:
      learner: the `Learner` (its compiled step for `mode` is reused across seeds).
      mode: advantage mode (`MODES`). warm: the shared `WarmStart`. task_cfg: task family.
      seed: task, sampling and train-state seed. rl_steps: train steps.
      workdir: where each step's `Feed` writes ledger.json / dead_letter.jsonl.
      groups, group_size: tasks per step, rollouts per task. eval_tasks: held-out tasks.
      log: progress lines.
    Returns:
      rows: list of dicts (`STEP_KEYS`, held-out and train-batch stats, `strong_credit_share`,
      seconds); the last row also holds the summed feed ledger counts ("ledger_totals").
    """
    state, graphdef, shardings = learner.init_state(mode, warm, seed)
    held = heldout_tasks(task_cfg, eval_tasks)
    tasks = producer.task_batches(task_cfg, seed, groups)
    os.makedirs(workdir, exist_ok=True)
    rows, totals = [], {"received": 0, "trained": 0, "filtered_uniform": 0}
    for t in range(rl_steps + 1):
        t0 = time.perf_counter()
        model = nnx.merge(graphdef, state.params, state.router_bias)
        key = jax.random.fold_in(jax.random.key(seed), t)
        row = {"step": t, **_eval_row(producer.tier_mix(
            model, held, task_cfg, jax.random.fold_in(key, 1), group_size=group_size))}
        if t == rl_steps:
            rows.append(row)
            break
        records, stats = producer.sample_groups(
            model, next(tasks), task_cfg, jax.random.fold_in(key, 0), group_size=group_size,
            policy_version=t, group_prefix=f"{mode}-s{seed}")
        row.update(train_pass_rate=stats.pass_rate, train_strong_share=stats.strong_share,
                   train_hacked=stats.hacked, train_mixed=stats.mixed_groups)
        feed = learner.feed(records, workdir)
        item = feed.next_batch(t)
        ledger = feed.finish().to_json()
        for k in totals:
            totals[k] += ledger[k]
        if item is None:            # no mixed group: nothing to train on this step
            row.update({k: math.nan for k in STEP_KEYS + ("strong_credit_share",)})
        else:
            batch_np, info = item
            fn, batch_sh = learner.step_fn(mode, batch_np, graphdef, shardings)
            batch = make_global_batch(batch_np, batch_sh, learner.feed_cfg.rows_per_batch)
            state, metrics = fn(state, batch)
            m = jax.device_get(metrics)
            row.update({k: float(getattr(m, k)) for k in STEP_KEYS})
            row["strong_credit_share"] = strong_credit_share(records, info,
                                                             m.audit.advantages_T)
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        log(f"{mode} seed={seed} step={t} pass={row['heldout_pass_rate']:.3f} "
            f"strong={row['heldout_strong_share']:.3f} len={row['heldout_len']:.1f} "
            f"ent={row['entropy']:.3f} pos={row['pos_credit_after']:.2f} "
            f"neg={row['neg_credit']:.2f} lam={row['lam_mean']:.3f} "
            f"capped={row['capped_groups']:.0f} ({row['seconds']:.1f}s)")
    rows[-1]["ledger_totals"] = totals
    return rows

"""The colocated loop: the learner and the JAX sampler in one program, weights handed over in
memory (`gagar-loop --engine jax --colocated`, docs/sampler.md).

    summary = run_colocated(cfg, workdir, ColocatedOptions(n=8, handover="same"))

1. The learner is `train.run`, unchanged (feed, steps, checkpoints, audit files, ledger), fed by
   an in-process source instead of a spool, and it shows the sampler its state after every step
   (`on_state`).
2. Whenever the feed asks for groups, the source hands the state's current parameters to the
   sampler (`sample/handover.py`: the learner's own arrays on its mesh, `handover="same"`; or a
   `jax.device_put` onto the sampler's own devices, `handover="reshard"`), runs the rollout
   function over a round of tasks, grades each group and yields its record (policy version =
   the learner's step: staleness 0). With "same" the sampler drops the parameters before the
   source returns, so no reference survives into the train step that donates them.
3. The rollout function talks to the engine interface only (`generate`, `cancel`):
   `single_turn` (one request of `n` samples per task, the rollout worker's tasks and graders)
   is the default. With `env` set (`gagar-loop --engine jax --colocated --env module:factory`)
   each round is the rollout worker's agent loop instead (`rollout/agent_loop.py`: groups of
   multi-turn episodes, environment calls in threads, the environment's verdict the outcome,
   an agent `--grader` on mixed groups): learner, sampler and the agent environments in one
   program. No version moves inside a round (the learner waits for the source), so every
   trajectory is on-policy.
4. Per group the worker's log line goes to `<workdir>/rollout/worker-colocated.jsonl` (and per
   hand-over its mode, bytes and seconds), so `loop.report` reads this loop like the others.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any, Optional

import jax
from flax import nnx

from gagar_jax.feed.sources import IteratorSource
from gagar_jax.rollout import engine as engine_lib
from gagar_jax.rollout.agent_loop import AgentLoop, AgentOptions
from gagar_jax.rollout.agent_worker import load_tokenizer
from gagar_jax.rollout.feed_writer import group_record
from gagar_jax.rollout.worker import load_callable, normalize_grades
from gagar_jax.run import train
from gagar_jax.sample import handover
from gagar_jax.sample.engine import JaxEngine
from gagar_jax.sample.sampler import Sampler, SamplerConfig
from gagar_jax.sharding import make_mesh

WRITER = "worker-colocated"
SINGLE_TURN_TASKS = "gagar_jax.rollout.example_task:tasks"
SINGLE_TURN_GRADER = "gagar_jax.rollout.example_task:grade"


@dataclasses.dataclass(frozen=True)
class ColocatedOptions:
    """What the colocated loop samples, and how the weights reach the sampler.

    Attributes:
      tasks, grader: the rollout worker's `module:function` task source and grader ("": the
        mode's default: the example task and its grader in single turn, see `env`).
      n: samples per task (a group). spec: their `SamplingSpec`.
      seed: task stream and sampling seeds.
      handover: "same" (the learner's arrays), "copy" (a copy on its devices) or "reshard"
        (onto the last `sampler_devices` devices, which the learner then does not use).
      sampler_devices: devices of the sampler's own mesh (reshard only).
      sampler: the sampler's `SamplerConfig`.
      groups_per_version: the feed ends after this many groups of one version without a new
        step (the policy solved the task: every group uniform; 0 = never).
      env: agent mode, the environment factory `module:factory` ("" = single turn); `tasks`
        then defaults to the environment module's `tasks` and `grader` to none (the
        environment's verdict alone), `spec.max_tokens` is per turn.
      tokenizer: agent mode, the worker's `--tokenizer` ("" = bytes).
      agent: agent mode, the loop's limits (`n`, `seed`, `concurrent_groups` and
        `max_model_len` are set from the options above).
    """
    tasks: str = ""
    grader: str = ""
    n: int = 8
    spec: engine_lib.SamplingSpec = engine_lib.SamplingSpec(max_tokens=8)
    seed: int = 0
    handover: str = "same"
    sampler_devices: int = 0
    sampler: SamplerConfig = SamplerConfig(slots=16, max_len=64)
    groups_per_version: int = 64
    env: str = ""
    tokenizer: str = ""
    agent: AgentOptions = AgentOptions(max_turns=8, threads=True)

    def __post_init__(self):
        if self.handover not in handover.MODES:
            raise ValueError(f"handover must be one of {handover.MODES}, got {self.handover!r}")
        if (self.handover == "reshard") != (self.sampler_devices > 0):
            raise ValueError("sampler_devices > 0 goes with handover='reshard', and only it")


def single_turn(engine: Any, tasks: Sequence[dict], spec: engine_lib.SamplingSpec, n: int,
                seed: int) -> list:
    """One request of `n` samples per task, all in one `generate` (continuous batching); the
    sequences are cancelled (single turn). Returns per task its completions."""
    requests = [engine_lib.Request(t["prompt"], spec, seed=seed + i * n, n=n)
                for i, t in enumerate(tasks)]
    groups = engine.generate(requests)
    engine.cancel([c.sequence for cs in groups for c in cs])
    return groups


class _Live:
    """The learner's state as `train.run` shows it, and the sampler built on it on first use."""

    def __init__(self, opts: ColocatedOptions, devices: Sequence[Any]):
        self.opts, self.step, self.graphdef, self.state = opts, 0, None, None
        self.engine: Optional[JaxEngine] = None
        self.sampler_mesh = None
        if opts.handover == "reshard":
            mesh_cfg = SimpleNamespace(data=-1, fsdp=1, expert=1, context=1, tensor=1)
            self.sampler_mesh = make_mesh(mesh_cfg, devices[-opts.sampler_devices:])
        self.shardings = None

    def show(self, step: int, graphdef: nnx.GraphDef, state: Any) -> None:
        self.step, self.graphdef, self.state = step, graphdef, state

    def hand_over(self) -> dict:
        """The current parameters to the sampler (built on first use); the measured hand-over."""
        params = handover.model_state(self.graphdef, self.state.params, self.state.router_bias)
        mode = self.opts.handover
        if self.engine is None:
            mesh = (self.sampler_mesh if mode == "reshard"
                    else jax.tree.leaves(params)[0].sharding.mesh)
            if mode == "reshard":
                self.shardings = handover.sampler_shardings(params, mesh)
            first = handover.reshard(params, self.shardings) if mode == "reshard" else params
            sampler = Sampler(nnx.merge(self.graphdef, first), self.opts.sampler, mesh)
            sampler.release_params()
            self.engine = JaxEngine(sampler, "", engine_lib.EngineOptions(
                seed=self.opts.seed, max_model_len=self.opts.sampler.max_len), self.step)
        return handover.timed_hand_over(self.engine, params, self.step, mode, self.shardings)


def agent_round(engine: Any, tasks: Sequence[dict], opts: ColocatedOptions, env: Callable,
                tokenizer: Any, grader: Optional[Callable], seed: int, prefix: str) -> list:
    """One round of the agent loop on the sampler's engine: a group of `opts.n` episodes per
    task, all concurrent, to the end. Returns [(record, the worker's per-group info)]."""
    out = []
    agent = dataclasses.replace(opts.agent, n=opts.n, seed=seed,
                                concurrent_groups=len(tasks),
                                max_model_len=opts.sampler.max_len)
    loop = AgentLoop(engine, env, tokenizer, opts.spec, agent,
                     emit=lambda rec, info: out.append((rec, info)), grader=grader,
                     grader_name=opts.grader, prefix=prefix)
    try:
        for t in tasks:
            loop.start(t)
        while loop.live:
            loop.tick()
    finally:
        loop.close()
    return out


def colocated_records(live: _Live, rollout: Callable[..., list], log: Any) -> Iterator:
    """The source's records: rounds of tasks sampled with the live parameters, graded."""
    opts = live.opts
    if opts.env:
        return _agent_records(live, log)
    return _single_turn_records(live, rollout, log)


def _agent_records(live: _Live, log: Any) -> Iterator:
    opts = live.opts
    env = load_callable(opts.env, "--env")
    tasks = load_callable(opts.tasks or opts.env.rpartition(":")[0] + ":tasks",
                          "--tasks")(opts.seed)
    tokenizer = load_tokenizer(opts.tokenizer, load_callable)
    grader = load_callable(opts.grader, "--grader") if opts.grader else None
    drawn, at_version, version = 0, 0, -1
    while True:
        if live.step != version:
            version, at_version = live.step, 0
        if opts.groups_per_version and at_version >= opts.groups_per_version:
            return
        info = live.hand_over()
        round_tasks = [next(tasks) for _ in range(max(1, opts.sampler.slots // opts.n))]
        try:
            done = agent_round(live.engine, round_tasks, opts, env, tokenizer, grader,
                               opts.seed * 1_000_003 + drawn, f"colocated-v{version}-{drawn}")
        finally:
            if opts.handover == "same":
                live.engine.sampler.release_params()
        drawn += opts.n * len(round_tasks)
        log.write(json.dumps({"handover": info["mode"], "bytes": info["bytes"],
                              "s": round(info["seconds"], 6), "policy_version": version}) + "\n")
        for rec, row in done:
            log.write(json.dumps(row) + "\n")
            at_version += 1
            yield rec
        log.flush()


def _single_turn_records(live: _Live, rollout: Callable[..., list], log: Any) -> Iterator:
    opts = live.opts
    tasks = load_callable(opts.tasks or SINGLE_TURN_TASKS, "--tasks")(opts.seed)
    grader_name = opts.grader or SINGLE_TURN_GRADER
    grader = load_callable(grader_name, "--grader")
    drawn, at_version, version = 0, 0, -1
    while True:
        if live.step != version:
            version, at_version = live.step, 0
        if opts.groups_per_version and at_version >= opts.groups_per_version:
            return                      # no new step after that many groups: end of the feed
        t0 = time.perf_counter()
        info = live.hand_over()
        round_tasks = [next(tasks) for _ in range(max(1, opts.sampler.slots // opts.n))]
        try:
            groups = rollout(live.engine, round_tasks, opts.spec, opts.n,
                             opts.seed * 1_000_003 + drawn)
        finally:
            if opts.handover == "same":   # no reference into the next (donating) step
                live.engine.sampler.release_params()
        drawn += opts.n * len(round_tasks)
        log.write(json.dumps({"handover": info["mode"], "bytes": info["bytes"],
                              "s": round(info["seconds"], 6), "policy_version": version}) + "\n")
        for task, comps in zip(round_tasks, groups, strict=True):
            verdicts, status, evidence = normalize_grades(grader(task, [c.tokens for c in comps]),
                                                          opts.n)
            rec = group_record(f"colocated-{task['task_id']}-v{version}", task["task_id"],
                               version, task["prompt"], comps, verdicts, grader=grader_name,
                               sampling=opts.spec.record(live.engine.name), evidence=evidence,
                               grading_ok=status == "ok")
            n_pass = sum(t.outcome == "pass" and not t.hacked for t in rec.trajectories)
            n_valid = sum(t.outcome != "infra_error" for t in rec.trajectories)
            log.write(json.dumps({"group_id": rec.group_id, "policy_version": version,
                                  "passes": n_pass, "valid": n_valid,
                                  "mixed": 0 < n_pass < n_valid,
                                  "s": round(time.perf_counter() - t0, 4)}) + "\n")
            log.flush()
            at_version += 1
            yield rec


def run_colocated(cfg: Any, workdir: str, opts: ColocatedOptions,
                  rollout: Callable[..., list] = single_turn) -> Optional[dict]:
    """Trains `cfg` on groups its own policy samples in this program; returns the run summary.

    Args:
      cfg: the learner's ConfigDict (`feed.spool_dir` / `feed.path` are not read).
      workdir: the learner's workdir (also the per-group log's).
      opts: `ColocatedOptions`.
      rollout: `(engine, tasks, spec, n, seed) -> completions per task`, engine interface only.
    """
    devices = jax.devices()
    if opts.handover == "reshard":
        if opts.sampler_devices >= len(devices):
            raise ValueError(f"sampler_devices={opts.sampler_devices} leaves the learner none "
                             f"of {len(devices)} devices")
        learner_devices = devices[:-opts.sampler_devices]
    else:
        learner_devices = devices
    live = _Live(opts, devices)
    os.makedirs(os.path.join(workdir, "rollout"), exist_ok=True)
    with open(os.path.join(workdir, "rollout", f"{WRITER}.jsonl"), "a") as log:
        source = IteratorSource(colocated_records(live, rollout, log))
        return train.run(cfg, workdir, source=source, on_state=live.show,
                         devices=learner_devices)

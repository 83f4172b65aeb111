"""`gagar-loop`: the learner plus N rollout workers on one machine, one command.

    gagar-loop --workdir runs/loop [--workers 1] [--steps 40] [--seed 0]
               [--engine vllm|jax] [--colocated [--handover same|copy|reshard]
               [--sampler-devices K]]
               [--tasks module:factory] [--grader module:factory] [--config FILE]
               [--config.KEY=VALUE ...]       (passed to the learner)
    gagar-loop ... --env module:factory [--tokenizer T] [--max-turns N] [--worker-arg=--F=V]
                                      (agent mode: multi-turn episodes, rollout/agent_worker.py;
                                      with --colocated: the agent loop in this program)

Prints a line per policy version while it runs (pass rate, groups, the staleness the learner
trained at), then the report (`run/loop.py`). The learner runs in this interpreter's
environment (.venv), the workers in the vLLM one (`--vllm-python`, default
`<source root>/.venv-vllm/bin/python`, built by `make vllm`), or with `--engine jax` in this
one, each reading the published files with the JAX sampler. `--engine jax --colocated` runs
learner and sampler in this one program, the weights handed over in memory
(`run/colocated.py`; no worker process, nothing published unless
`--config.train.publish_every` asks for it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from gagar_jax.run import loop

# The checkout this package was imported from (an entry point may know where it is installed;
# the library takes every path as an argument): the workers import the package from there too.
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _args(argv: Sequence[str]) -> tuple[argparse.Namespace, list]:
    p = argparse.ArgumentParser(prog="gagar-loop", description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True, help="a fresh directory for this loop")
    p.add_argument("--config", default=os.path.join(SOURCE_ROOT, "configs", "tiny_vllm.py"),
                   help="the learner's config (default configs/tiny_vllm.py)")
    p.add_argument("--workers", type=int, default=1, help="rollout worker processes")
    p.add_argument("--steps", type=int, default=40, help="learner steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-from", default="", metavar="DIR",
                   help="start from these Hugging Face weights (e.g. an SFT checkpoint) instead "
                        "of a fresh init of --seed")
    p.add_argument("--learning-rate", type=float, default=None,
                   help="override optim.learning_rate (0: a frozen-policy control)")
    p.add_argument("--tasks", default="", help="the workers' tasks, module:factory "
                   "(default gagar_jax.rollout.example_task:tasks)")
    p.add_argument("--grader", default="", help="the workers' grader, module:factory "
                   "(default gagar_jax.rollout.example_task:grade)")
    p.add_argument("--env", default="", help="agent mode: the workers' environment, "
                   "module:factory (multi-turn episodes; tasks default to the module's `tasks`)")
    p.add_argument("--tokenizer", default="", help="agent mode: the workers' --tokenizer")
    p.add_argument("--max-turns", type=int, default=0, help="agent mode: the workers' "
                   "--max-turns (0: theirs)")
    p.add_argument("--worker-arg", action="append", default=[], metavar="--FLAG=VALUE",
                   help="a flag passed to every worker (repeatable), e.g. "
                   "--worker-arg=--max-tokens=4")
    p.add_argument("--vllm-python", default=os.path.join(SOURCE_ROOT, ".venv-vllm", "bin",
                                                         "python"))
    p.add_argument("--timeout-s", type=float, default=3600.0, help="kill the learner after this")
    p.add_argument("--engine", choices=sorted(loop.ENGINES), default="vllm",
                   help="the rollout engine (jax: the JAX sampler, gagar_jax.sample)")
    p.add_argument("--colocated", action="store_true",
                   help="learner and JAX sampler in this program, weights handed over in "
                   "memory (needs --engine jax)")
    p.add_argument("--handover", choices=("same", "copy", "reshard"), default="same",
                   help="colocated: the learner's own arrays, a copy, or a reshard onto the "
                   "last --sampler-devices devices")
    p.add_argument("--sampler-devices", type=int, default=0,
                   help="colocated reshard: devices of the sampler's own mesh")
    p.add_argument("--n", type=int, default=8, help="colocated: samples per task")
    p.add_argument("--max-tokens", type=int, default=0, help="colocated: tokens per "
                   "completion, per turn with --env (0: the config's loss.max_response_len)")
    a, rest = p.parse_known_args(list(argv))
    bad = [x for x in rest if not x.startswith("--config.")]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)}")
    return a, rest


def agent_args(a: argparse.Namespace) -> tuple:
    """The workers' agent-mode flags (`--env`, `--tokenizer`, `--max-turns`) and `--worker-arg`s;
    they come after the loop's own worker flags, so they win (`--max-tokens` per turn)."""
    out = [f"--env={a.env}"] if a.env else []
    out += [f"--tokenizer={a.tokenizer}"] if a.tokenizer else []
    out += [f"--max-turns={a.max_turns}"] if a.max_turns else []
    return (*out, *a.worker_arg)


def main(argv: Sequence[str] | None = None) -> int:
    a, learner_args = _args(sys.argv[1:] if argv is None else argv)
    if a.workers < 1:
        print(f"gagar-loop: error: --workers must be >= 1, got {a.workers}", file=sys.stderr)
        return 2
    if a.colocated and a.engine != "jax":
        print("gagar-loop: error: --colocated needs --engine jax", file=sys.stderr)
        return 2
    if a.colocated:
        return _colocated(a, learner_args)
    paths = loop.LoopPaths(config=os.path.abspath(a.config), vllm_python=a.vllm_python,
                           source_root=SOURCE_ROOT)
    workdir = os.path.abspath(a.workdir)
    print(f"gagar-loop: learner + {a.workers} worker(s) in {workdir} (logs: learner.log, "
          "worker<i>.log); a line per policy version follows", flush=True)
    try:
        rep = loop.run_loop(workdir, paths, seed=a.seed, steps=a.steps, worker_args=agent_args(a),
                            learning_rate=a.learning_rate, workers=a.workers, tasks=a.tasks,
                            grader=a.grader, timeout_s=a.timeout_s,
                            learner_args=tuple(learner_args), engine=a.engine,
                            init_from=a.init_from,
                            on_version=lambda v: print(loop.format_version(v), flush=True))
    except FileNotFoundError as e:
        print(f"gagar-loop: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"gagar-loop: {str(e).splitlines()[0]} (see {workdir}/learner.log)",
              file=sys.stderr)
        return 1
    print(f"gagar-loop: {rep['steps_trained']} steps, {rep['groups_sampled']} groups sampled in "
          f"{rep['wall_s']} s; pass rate {rep['early']:.3f} at version 0 -> {rep['late']:.3f} "
          f"over the last versions; ledger {'balanced' if rep['ledger_balanced'] else 'UNBALANCED'}"
          f" ({workdir}/loop_report.json)")
    return 0


def apply_overrides(cfg: object, args: Sequence[str]) -> None:
    """`--config.KEY=VALUE` strings applied to a ConfigDict, each value read as the type of the
    value it replaces (a bool from true/false); a one-line ValueError for a key it lacks."""
    for arg in args:
        key, _, value = arg[len("--config."):].partition("=")
        *parents, leaf = key.split(".")
        node = cfg
        for k in parents:
            node = node[k]
        if leaf not in node:
            raise ValueError(f"{arg}: no config key {key!r}")
        old = node[leaf]
        if isinstance(old, bool):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{arg}: expected true or false")
            node[leaf] = value.lower() in ("true", "1")
        elif isinstance(old, (int, float, str)):
            node[leaf] = type(old)(value)
        else:
            raise ValueError(f"{arg}: {key} is not a number, bool or string")


def _colocated(a: argparse.Namespace, learner_args: list) -> int:
    """`--engine jax --colocated`: `run/colocated.py` in this process, then the report."""
    import dataclasses
    import time

    from gagar_jax.config import load_config_file
    from gagar_jax.rollout.engine import SamplingSpec
    from gagar_jax.run import colocated

    workdir = os.path.abspath(a.workdir)
    cfg = load_config_file(os.path.abspath(a.config))
    cfg.seed, cfg.train.steps = a.seed, a.steps
    cfg.train.publish_every = 0             # the weights reach the sampler in memory
    cfg.feed.spool_dir, cfg.feed.path = "", ""
    if a.learning_rate is not None:
        cfg.optim.learning_rate = a.learning_rate
    try:
        if a.init_from:                     # the learner's state; the sampler gets it in memory
            cfg.train.init_from = loop.check_init_from(a.init_from)
        apply_overrides(cfg, learner_args)
        agent = colocated.ColocatedOptions.agent
        if a.max_turns:
            agent = dataclasses.replace(agent, max_turns=a.max_turns)
        opts = colocated.ColocatedOptions(
            tasks=a.tasks, grader=a.grader, n=a.n, seed=a.seed,
            spec=SamplingSpec(max_tokens=a.max_tokens or int(cfg.loss.max_response_len)),
            handover=a.handover, sampler_devices=a.sampler_devices, env=a.env,
            tokenizer=a.tokenizer, agent=agent)
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"gagar-loop: error: {e}", file=sys.stderr)
        return 2
    print(f"gagar-loop: learner + JAX sampler in this process in {workdir} (hand-over "
          f"{a.handover}); the per-version lines follow the run", flush=True)
    t0 = time.perf_counter()
    colocated.run_colocated(cfg, workdir, opts)
    for line in loop.VersionWatch(workdir).closed(final=True):
        print(loop.format_version(line), flush=True)
    rep = loop.report(workdir, a.steps)
    rep.update(seed=a.seed, engine="jax", colocated=True, handover=a.handover,
               wall_s=round(time.perf_counter() - t0, 1))
    with open(os.path.join(workdir, "loop_report.json"), "w") as f:
        json.dump(rep, f, indent=2)
    print(f"gagar-loop: {rep['steps_trained']} steps, {rep['groups_sampled']} groups sampled in "
          f"{rep['wall_s']} s; pass rate {rep['early']:.3f} at version 0 -> {rep['late']:.3f} "
          f"over the last versions; ledger {'balanced' if rep['ledger_balanced'] else 'UNBALANCED'}"
          f" ({workdir}/loop_report.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

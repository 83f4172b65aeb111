"""The rollout worker: an engine samples groups of the policy `latest` names, a grader grades them,
and the groups go into the learner's spool as feed records (docs/rollout.md). With the default
engine (vLLM) it runs in .venv-vllm.

    PYTHONPATH=. .venv-vllm/bin/python -m gagar_jax.rollout.worker --workdir runs/loop \\
        --tasks gagar_jax.rollout.example_task:tasks \\
        --grader gagar_jax.rollout.example_task:grade --n 8 --temperature 1.0 --top-p 1.0

The worker talks to its engine through `gagar_jax.rollout.engine.Engine` only: `--engine
module:factory` (default `gagar_jax.rollout.vllm_engine:make`, loaded by name, so this module
imports no engine) builds it on the version `latest` names. Per task: one request for a group of
`--n` completions sharing the prompt (sample j seeded `seed + j`), each with its behaviour
log-probs (`--logprobs-mode`) and the experts every generated token was routed to; the grader's
verdicts; one record with `policy_version` = the version the engine serves and `sampling` = the
sampling parameters, written as an atomic shard. Between groups the worker re-reads `latest`
and moves the engine to it when it moved (`Engine.sync`: a reload in place, or once the learner
publishes deltas (`train.publish_full_every` > 1) only the deltas after the version it holds),
so every group comes from one policy version.
With `--mixed-per-version M` / `--groups-per-version G` it waits for a new version after M
mixed / G groups at the current one (bounded staleness, and no flood of uniform groups once
the policy solves the task: the learner trains `feed.groups_per_batch` mixed groups per step);
with `--stall-s` it ends the feed (`_DONE`) when no new version comes.
SIGTERM / SIGINT end it after the group in flight. Imports no JAX.

Agent mode (`--env module:factory`, `gagar_jax/rollout/agent_worker.py`): each trajectory is a
multi-turn episode in an environment, each model turn one engine request, the environment's
verdict the outcome and `--grader` (optional) quality on top; the engine follows `latest`
between turns, so a trajectory may span versions (`policy_version_spans`).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

from gagar_jax.rollout import agent_worker, delta
from gagar_jax.rollout import engine as engine_lib
from gagar_jax.rollout.feed_writer import SpoolWriter, group_record
from gagar_jax.rollout.pointer import read_latest

DEFAULT_ENGINE = "gagar_jax.rollout.vllm_engine:make"
DEFAULT_TASKS = "gagar_jax.rollout.example_task:tasks"
DEFAULT_GRADER = "gagar_jax.rollout.example_task:grade"

log = logging.getLogger("gagar_jax.rollout.worker")


class UsageError(ValueError):
    """A bad flag: one line on stderr, exit code 2."""


def load_callable(spec: str, flag: str) -> Callable:
    """`module:function` -> the function; a one-line error naming the flag otherwise."""
    mod, _, fn = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(mod), fn) if mod and fn else None
    except (ImportError, AttributeError) as e:
        raise UsageError(f"{flag} {spec!r}: {e}") from e
    if not callable(obj):
        raise UsageError(f"{flag} {spec!r}: expected module:function")
    return obj


def normalize_grades(result: object, n: int) -> tuple:
    """A grader's answer -> (verdicts, status, evidence); raises ValueError on a bad shape."""
    status, evidence = "ok", None
    if isinstance(result, dict):
        status, evidence = result.get("status", "ok"), result.get("evidence")
        result = result.get("verdicts")
    if not isinstance(result, (list, tuple)) or len(result) != n:
        raise ValueError(f"the grader must return {n} verdicts, got {result!r:.200}")
    if status not in ("ok", "failed"):
        raise ValueError(f"grading status must be 'ok' or 'failed', got {status!r}")
    return list(result), status, evidence


class _Stop:
    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._set)

    def _set(self, *_):
        self.requested = True


def wait_latest(workdir: str, stop: _Stop, timeout_s: float) -> dict | None:
    """The `latest` pointer, waiting for the first publish (None on stop or timeout)."""
    t0 = time.monotonic()
    while not stop.requested and time.monotonic() - t0 < timeout_s:
        ptr = read_latest(workdir)
        if ptr is not None:
            return ptr
        time.sleep(0.2)
    return None


def run(args: argparse.Namespace) -> dict:
    """The worker loop; returns counts {"groups", "mixed", "passes", "completions", "reloads"}."""
    if args.n < 1:
        raise UsageError(f"--n must be >= 1, got {args.n}")
    if args.env:     # agent mode: the tasks beside the environment, a grader only if given
        env = load_callable(args.env, "--env")
        tasks_spec = args.tasks or f"{args.env.partition(':')[0]}:tasks"
        grader = load_callable(args.grader, "--grader") if args.grader else None
        try:
            tokenizer = agent_worker.load_tokenizer(args.tokenizer, load_callable)
            agent_worker.agent_options(args)
        except (ValueError, OSError) as e:
            raise UsageError(str(e)) from e
    else:
        tasks_spec = args.tasks or DEFAULT_TASKS
        grader = load_callable(args.grader or DEFAULT_GRADER, "--grader")
    tasks = load_callable(tasks_spec, "--tasks")(args.seed)
    factory = load_callable(args.engine, "--engine")
    try:
        spec = engine_lib.SamplingSpec(temperature=args.temperature, top_p=args.top_p,
                                       top_k=args.top_k, max_tokens=args.max_tokens,
                                       logprobs_mode=args.logprobs_mode)
    except ValueError as e:
        raise UsageError(str(e)) from e
    stop = _Stop()
    ptr = wait_latest(args.workdir, stop, args.wait_s)
    if ptr is None:
        raise SystemExit(f"nothing published under {args.workdir} after {args.wait_s} s")
    options = engine_lib.EngineOptions(seed=args.seed, max_model_len=args.max_model_len,
                                       logprobs_mode=args.logprobs_mode,
                                       routing=not args.no_routing)
    built = factory(ptr["path"], options)
    try:
        engine = engine_lib.check_engine(built, args.engine)
    except TypeError as e:
        raise UsageError(f"--engine {e}") from e
    version, mixed_here, groups_here, capped_since = engine.version, 0, 0, None
    writer = SpoolWriter(args.spool or os.path.join(args.workdir, "spool"), args.writer_id)
    log_path = args.log or os.path.join(args.workdir, "rollout", f"{args.writer_id}.jsonl")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    counts = dict(groups=0, mixed=0, passes=0, completions=0, reloads=0, grader_errors=0)
    if args.env:
        with open(log_path, "a") as logf, contextlib.closing(engine):
            counts = agent_worker.run_agent(args, engine, spec, tasks, env, tokenizer, grader,
                                            writer, logf, lambda: stop.requested)
        log.info("worker done: %s", counts)
        return counts
    with open(log_path, "a") as logf, contextlib.closing(engine):    # close() on any exit
        while not stop.requested and (not args.max_groups or counts["groups"] < args.max_groups):
            ptr = read_latest(args.workdir)
            if ptr is not None and int(ptr["policy_version"]) != version:
                t0 = time.perf_counter()
                try:
                    info = engine.sync(args.workdir)
                except (FileNotFoundError, delta.ChainError) as e:   # pruned under us: again
                    log.warning("reload failed (%s); retrying", e)
                    continue
                if info is None:          # the same directory under another version number
                    version = int(ptr["policy_version"])
                    continue
                version = int(info["policy_version"])
                mixed_here, groups_here, capped_since = 0, 0, None
                counts["reloads"] += 1
                logf.write(json.dumps({"reload": version, "deltas": info.get("deltas"),
                                       "s": round(time.perf_counter() - t0, 4)}) + "\n")
            elif ((args.mixed_per_version and mixed_here >= args.mixed_per_version)
                  or (args.groups_per_version and groups_here >= args.groups_per_version)):
                # Enough groups from this version: wait for the next one. A learner that cannot
                # fill a batch from them (the policy's groups are all uniform) never publishes
                # one: after --stall-s the worker ends the feed (_DONE) and stops.
                capped_since = capped_since or time.monotonic()
                if args.stall_s and time.monotonic() - capped_since > args.stall_s:
                    log.info("no new policy %.0f s after version %d's %d groups: ending the "
                             "feed", args.stall_s, version, groups_here)
                    writer.done()
                    counts["ended_feed"] = True
                    break
                time.sleep(0.05)
                continue
            task = next(tasks)
            t0 = time.perf_counter()
            [comps] = engine.generate([engine_lib.Request(
                task["prompt"], spec, seed=args.seed * 1_000_003 + counts["completions"],
                n=args.n)])
            engine.cancel([c.sequence for c in comps])       # single turn: nothing continues
            counts["completions"] += args.n
            try:
                verdicts, status, evidence = normalize_grades(
                    grader(task, [c.tokens for c in comps]), args.n)
                rec = group_record(f"{args.writer_id}-{task['task_id']}-v{version}",
                                   task["task_id"], version, task["prompt"], comps, verdicts,
                                   grader=args.grader, sampling=spec.record(engine.name),
                                   evidence=evidence,
                                   grading_ok=status == "ok")
            except Exception as e:  # a grader bug skips the group, loudly
                counts["grader_errors"] += 1
                log.error("task %s: grading failed, group skipped: %r", task["task_id"], e)
                continue
            writer.write([rec])
            n_pass = sum(t.outcome == "pass" and not t.hacked for t in rec.trajectories)
            n_valid = sum(t.outcome != "infra_error" for t in rec.trajectories)
            is_mixed = 0 < n_pass < n_valid
            counts["groups"] += 1
            counts["passes"] += n_pass
            counts["mixed"] += is_mixed
            mixed_here += is_mixed
            groups_here += 1
            logf.write(json.dumps({"group_id": rec.group_id, "policy_version": version,
                                   "passes": n_pass, "valid": n_valid, "mixed": is_mixed,
                                   "s": round(time.perf_counter() - t0, 4)}) + "\n")
            logf.flush()
    log.info("worker done: %s", counts)
    return counts


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gagar_jax.rollout.worker",
                                description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True, help="the learner's workdir (published/latest)")
    p.add_argument("--spool", default="",
                   help="the learner's feed.spool_dir (default WORKDIR/spool)")
    p.add_argument("--engine", default=DEFAULT_ENGINE,
                   help="module:factory(path, EngineOptions) -> an engine (rollout/engine.py)")
    p.add_argument("--tasks", default="",
                   help="module:function(seed) -> iterator of {'task_id', 'prompt'} (default "
                   f"{DEFAULT_TASKS}; with --env: the env module's `tasks`)")
    p.add_argument("--grader", default="",
                   help=f"module:function(task, completions) -> verdicts (default "
                   f"{DEFAULT_GRADER}; with --env: none, or one for agent groups)")
    agent = p.add_argument_group("agent mode (multi-turn episodes in an environment)")
    agent.add_argument("--grader-workers", type=int, default=0,
                       help="> 0: grade finished groups in a pool of that many threads while "
                       "the next groups roll out (docs/grader.md)")
    agent.add_argument("--env", default="",
                       help="module:factory(task, tokenizer, EnvOptions) -> Environment")
    agent.add_argument("--tokenizer", default="",
                       help="'' = bytes; a Hugging Face tokenizer directory; module:function")
    agent.add_argument("--max-turns", type=int, default=8, help="model turns per trajectory")
    agent.add_argument("--max-traj-tokens", type=int, default=0,
                       help="tokens per trajectory (0 = --max-model-len); longer: truncated")
    agent.add_argument("--concurrent-groups", type=int, default=2, help="groups in flight")
    agent.add_argument("--tool-timeout-s", type=float, default=30.0,
                       help="seconds per tool call")
    agent.add_argument("--episode-timeout-s", type=float, default=0.0,
                       help="seconds per episode (0 = none)")
    agent.add_argument("--max-version-lag", type=int, default=-1,
                       help="restart a group whose oldest token lags the engine by more "
                       "versions (-1 = no bound)")
    agent.add_argument("--workspace-root", default="",
                       help="per-trajectory workspaces (default WORKDIR/workspaces/ID)")
    p.add_argument("--n", type=int, default=8, help="completions per group")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--logprobs-mode", default="raw_logprobs", choices=engine_lib.LOGPROBS_MODES)
    p.add_argument("--no-routing", action="store_true", help="do not record routed experts")
    p.add_argument("--mixed-per-version", type=int, default=0,
                   help="wait for a new version after this many mixed groups (0 = never)")
    p.add_argument("--groups-per-version", type=int, default=0,
                   help="wait for a new version after this many groups (0 = never)")
    p.add_argument("--stall-s", type=float, default=0.0,
                   help="capped and no new version for this long: write _DONE, stop (0 = never)")
    p.add_argument("--max-groups", type=int, default=0, help="stop after this many (0 = never)")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--writer-id", default="worker0")
    p.add_argument("--wait-s", type=float, default=600.0, help="wait this long for `latest`")
    p.add_argument("--log", default="", help="per-group log (default WORKDIR/rollout/ID.jsonl)")
    return p


def main(argv: list | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parser().parse_args(argv)
    try:
        counts = run(args)
    except UsageError as e:
        print(f"gagar_jax.rollout.worker: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main()

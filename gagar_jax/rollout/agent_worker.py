"""The rollout worker's agent mode (`--env module:factory`): multi-turn episodes in an
environment, the environment's verdict as the outcome (docs/rollout.md, "The agent loop").

    PYTHONPATH=. .venv-vllm/bin/python -m gagar_jax.rollout.worker --workdir runs/agent \\
        --env gagar_jax.rollout.envs.lookup:make_env --tasks gagar_jax.rollout.envs.lookup:tasks \\
        --tokenizer gagar_jax.rollout.envs.lookup:tokenizer --n 8 --max-turns 4 --max-tokens 4

`worker.run` builds the engine, the spool writer and the per-group log, then hands them to
`run_agent`, which keeps `--concurrent-groups` groups in flight on an `AgentLoop` and between
turns follows `latest` (`AgentLoop.sync`). The single-turn mode's bounds apply per version:
after `--mixed-per-version` mixed or `--groups-per-version` groups from the current version no
new group starts (those in flight finish), and `--stall-s` after that without a new version ends
the feed (`_DONE`; ten times as long before the engine first moved, while the learner's first
step compiles). Imports no JAX.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from gagar_jax.rollout.agent_loop import AgentLoop, AgentOptions
from gagar_jax.rollout.envs.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger("gagar_jax.rollout.worker")


def load_tokenizer(spec: str, load_callable: Callable) -> Tokenizer:
    """`--tokenizer`: "" = bytes (`ByteTokenizer`, ids 0-255 and "<|end|>" = 256); a directory
    = a Hugging Face tokenizer there, its chat template applied to each new turn only
    (the hf_tokenizer adapter of rollout/envs); `module:function` = what `function()` returns."""
    if not spec:
        return ByteTokenizer()
    factory = None if os.path.isdir(spec) else load_callable(spec, "--tokenizer")
    try:
        if factory is None:
            from transformers import AutoTokenizer

            from gagar_jax.rollout.envs.hf_tokenizer import HFTokenizer
            return HFTokenizer(AutoTokenizer.from_pretrained(spec))
        tok = factory()
    except Exception as e:     # a usage error in one line, whatever the loader raised
        raise ValueError(f"--tokenizer {spec!r}: {type(e).__name__}: {e}") from e
    missing = [m for m in ("stop_token_ids", "encode", "decode", "prompt", "observation")
               if not hasattr(tok, m)]
    if missing:
        raise ValueError(f"--tokenizer {spec!r} returned a {type(tok).__name__}, which lacks "
                         f"{', '.join(missing)} (gagar_jax.rollout.envs.tokenizer.Tokenizer)")
    return tok


def agent_options(args: argparse.Namespace) -> AgentOptions:
    """The worker's flags as `AgentOptions` (a ValueError names a bad one)."""
    return AgentOptions(
        n=args.n, max_turns=args.max_turns, max_model_len=args.max_model_len,
        max_traj_tokens=args.max_traj_tokens, concurrent_groups=args.concurrent_groups,
        tool_timeout_s=args.tool_timeout_s, episode_timeout_s=args.episode_timeout_s,
        max_version_lag=args.max_version_lag, seed=args.seed,
        workspace_root=args.workspace_root or os.path.join(args.workdir, "workspaces",
                                                           args.writer_id))


def run_agent(args: argparse.Namespace, engine: Any, spec: Any, tasks: Iterator, env: Callable,
              tokenizer: Tokenizer, grader: Callable | None, writer: Any, logf: Any,
              stopped: Callable[[], bool]) -> dict:
    """The agent mode's loop; returns the counts (`AgentLoop.counts` and "ended_feed").

    Args:
      args: the worker's flags.
      engine, spec: the engine and the per-turn sampling.
      tasks: the task stream; env: the environment factory; grader: `--grader` or None.
      writer, logf: the spool writer and the per-group log.
      stopped: True once SIGTERM / SIGINT came (groups in flight are abandoned).
    """
    here = {"mixed": 0, "groups": 0}

    def emit(rec: Any, info: dict) -> None:
        writer.write([rec])
        logf.write(json.dumps(info) + "\n")
        logf.flush()
        here["mixed"] += info["mixed"]
        here["groups"] += 1

    loop = AgentLoop(engine, env, tokenizer, spec, agent_options(args), workdir=args.workdir,
                     emit=emit, grader=grader, grader_name=args.grader or "",
                     prefix=args.writer_id,
                     grader_workers=getattr(args, "grader_workers", 0))
    started, exhausted, capped_since, ended = 0, False, None, False
    try:
        while not stopped() and not (args.max_groups and loop.counts["groups"] >= args.max_groups):
            t0 = time.perf_counter()
            moved = loop.sync()
            if moved is not None:
                here.update(mixed=0, groups=0)
                capped_since = None
                logf.write(json.dumps({"reload": loop.version, "deltas": moved.get("deltas"),
                                       "s": round(time.perf_counter() - t0, 4)}) + "\n")
            capped = ((args.mixed_per_version and here["mixed"] >= args.mixed_per_version)
                      or (args.groups_per_version and here["groups"] >= args.groups_per_version))
            wanted = args.max_groups + loop.counts["stale_restarts"] if args.max_groups else 0
            while loop.room > 0 and not capped and not exhausted and (
                    not wanted or started < wanted):
                task = loop.requeued.pop(0) if loop.requeued else next(tasks, None)
                if task is None:
                    exhausted = True
                    break
                loop.start(task)
                started += 1
            if not loop.live:
                if exhausted or (wanted and started >= wanted):
                    break
                # Capped and idle: wait for a new version (the single-turn mode's --stall-s;
                # ten times as long before the first move: the learner's first step compiles).
                capped_since = capped_since or time.monotonic()
                stall = args.stall_s * (1 if loop.counts["reloads"] else 10)
                if args.stall_s and time.monotonic() - capped_since > stall:
                    log.info("no new policy %.0f s after version %d's %d groups: ending the "
                             "feed", args.stall_s, loop.version, here["groups"])
                    writer.done()
                    ended = True
                    break
                time.sleep(0.05)
                continue
            loop.tick()
    finally:
        loop.close()
    return {**loop.counts, **({"ended_feed": True} if ended else {})}

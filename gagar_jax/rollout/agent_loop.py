"""The agent loop: groups of multi-turn episodes on one engine, through the environment interface
(`gagar_jax.rollout.envs.base`), into feed records. The rollout worker runs it with `--env`.

    loop = AgentLoop(engine, make_env, tokenizer, spec, AgentOptions(n=8, max_turns=8),
                     workdir=workdir, emit=write_record)
    loop.start(task); loop.start(other_task)       # up to `concurrent_groups` groups at once
    while loop.live:
        loop.sync()      # between turns: `latest` moved -> the engine moves (delta chains too)
        loop.tick()      # one engine call for every episode ready for its next turn, tool
                         # results collected, finished groups judged, graded and emitted
    loop.close()

Every episode is one trajectory; a group's N episodes and several groups run concurrently. Each
model turn is one engine `Request` (the first on the prompt, the next ones continuing the live
sequence with the observation), and every ready episode's request goes into one `generate` call
(the engine serialises them where its routing capture requires). Environment calls (reset, a
turn's tools, the verdict) run in threads, so a slow tool holds only its own episode.

Limits: `max_turns` model turns ("turn_limit"); the engine's context `max_model_len`
("context_full") and the trajectory budget `max_traj_tokens` ("token_limit"): a turn's
`max_tokens` is clipped to what is left, and a trajectory that reaches either limit ends
`truncated` (its record says so and the learner's `feed.overlong` decides); the environment keeps
`tool_timeout_s` per tool call, and the loop ends an episode whose environment call has not
returned after `step_timeout_s` as `infra_error` (the environment failed to keep its limit).

Versions: the tokens of each turn carry the version the engine served when it generated them
(`policy_version_spans` in the record; the group's `policy_version` is the newest). After a move,
a group whose oldest generated token is more than `max_version_lag` versions behind the new one
is abandoned (its episodes cancelled and closed, nothing written) and its task is queued again
(`requeued`): it restarts from scratch on the current weights. Imports no JAX.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import zlib
from collections.abc import Callable, Sequence

from gagar_jax.rollout import agent_grading, delta
from gagar_jax.rollout.agent_episode import Episode, Group, Jobs, judge, quiet
from gagar_jax.rollout.agent_record import agent_group_record
from gagar_jax.rollout.engine import Request, SamplingSpec
from gagar_jax.rollout.envs.base import EnvOptions
from gagar_jax.rollout.grading.pool import GraderPool
from gagar_jax.rollout.pointer import read_latest

log = logging.getLogger("gagar_jax.rollout.agent_loop")


@dataclasses.dataclass(frozen=True)
class AgentOptions:
    """How the agent loop runs its episodes.

    Attributes:
      n: trajectories (episodes) per group.
      max_turns: model turns per trajectory ("turn_limit").
      max_model_len: the engine's context (prompt and every turn; "context_full").
      max_traj_tokens: tokens per trajectory, prompt included (0 = the context; "token_limit").
      concurrent_groups: groups in flight at once.
      tool_timeout_s: seconds per tool call (the environment enforces it).
      step_timeout_s: the loop's guard on one environment call (0 = 4 x tool_timeout_s + 60).
      episode_timeout_s: seconds per episode (the environment enforces it; 0 = none).
      max_version_lag: the most versions a trajectory's oldest token may lag the engine's
        (-1 = no bound); see the module docstring.
      workspace_root: where environments keep their per-trajectory directories.
      seed: requests are seeded from it, the group number, the episode and the turn; each
        episode's environment gets `EnvOptions.seed` from it, the group and the episode.
      threads: environment calls in threads (False: inline, for tests).
    """
    n: int = 8
    max_turns: int = 8
    max_model_len: int = 256
    max_traj_tokens: int = 0
    concurrent_groups: int = 2
    tool_timeout_s: float = 30.0
    step_timeout_s: float = 0.0
    episode_timeout_s: float = 0.0
    max_version_lag: int = -1
    workspace_root: str = ""
    seed: int = 0
    threads: bool = True

    def __post_init__(self):
        if self.n < 1 or self.max_turns < 1 or self.concurrent_groups < 1:
            raise ValueError(f"n, max_turns and concurrent_groups must be >= 1: {self}")
        if self.max_version_lag < -1:
            raise ValueError(f"max_version_lag must be >= 0 (or -1: no bound), "
                             f"got {self.max_version_lag}")

    @property
    def limit(self) -> tuple:
        """(tokens a trajectory may hold, the end reason when it reaches them)."""
        if self.max_traj_tokens and self.max_traj_tokens < self.max_model_len:
            return self.max_traj_tokens, "token_limit"
        return self.max_model_len, "context_full"


class AgentLoop:
    """Runs groups of episodes on `engine`; see the module docstring.

    Args:
      engine: an `engine.Engine`.
      env_factory: `--env module:factory` (task, tokenizer, EnvOptions) -> Environment.
      tokenizer: the `envs.tokenizer.Tokenizer` environments encode with.
      spec: sampling of every turn (its `max_tokens` per turn; stop tokens: the tokenizer's).
      options: `AgentOptions`.
      workdir: whose `published/latest` `sync` follows (None: never moves).
      emit: called with (record, info) for every finished group.
      grader: `--grader` for agent groups (`agent_grading`), or None.
      grader_name: the grader field of the record's grading.
      prefix: group ids start with it (the worker's id).
      grader_workers: > 0: finished groups go to a `grading.pool.GraderPool` of that many
        threads and free their slot at once (grading overlapped with the next rollouts).
    """

    def __init__(self, engine: object, env_factory: Callable, tokenizer: object,
                 spec: SamplingSpec, options: AgentOptions, *, workdir: str | None = None,
                 emit: Callable = lambda rec, info: None, grader: Callable | None = None,
                 grader_name: str = "", prefix: str = "agent", grader_workers: int = 0):
        self.engine, self.env_factory, self.tokenizer = engine, env_factory, tokenizer
        self.spec = dataclasses.replace(spec, stop_token_ids=tuple(tokenizer.stop_token_ids))
        self.options, self.workdir, self.emit = options, workdir, emit
        self.grader, self.grader_name, self.prefix = grader, grader_name, prefix
        self.pool = GraderPool(grader_workers, self._grade_crashed) if grader_workers else None
        self.grading: list = []            # groups handed to the pool, not yet emitted
        self.version = int(engine.version)
        self.groups: list = []
        self.requeued: list = []
        self._numbers = itertools.count()
        self._jobs = Jobs(options.threads)
        self.counts = dict(groups=0, mixed=0, passes=0, trajectories=0, turns=0, tool_calls=0,
                           tool_errors=0, truncated=0, spanning=0, infra_errors=0,
                           grader_errors=0, stale_restarts=0, reloads=0)
        self.env_options = EnvOptions(max_turns=options.max_turns,
                                      tool_timeout_s=options.tool_timeout_s,
                                      episode_timeout_s=options.episode_timeout_s,
                                      workspace_root=options.workspace_root, seed=options.seed)

    @property
    def live(self) -> int:
        """Groups in flight (being graded included)."""
        return len(self.groups) + len(self.grading)

    @property
    def room(self) -> int:
        """Groups that may start now (with a grader pool: fewer once more than two groups per
        grader wait, so a slow grader holds the rollouts back instead of growing a backlog)."""
        backlog = max(0, len(self.grading) - 2 * len(self.pool.threads)) if self.pool else 0
        return self.options.concurrent_groups - len(self.groups) - backlog

    def _step_timeout(self) -> float:
        return self.options.step_timeout_s or 4 * self.options.tool_timeout_s + 60

    def start(self, task: dict) -> None:
        """Starts a group of `n` episodes of `task` (their environments reset in threads)."""
        g = Group(next(self._numbers), task, self.version, self.options.n)
        self.groups.append(g)
        for e in g.episodes:
            e.deadline = time.monotonic() + self._step_timeout()
            self._jobs.submit(("reset", e, e.epoch), self._reset, e, task)

    def _reset(self, e: Episode, task: dict) -> list:
        # Each episode its own seed (an environment that draws, draws differently per episode).
        seed = zlib.crc32(f"{self.options.seed}/{self.prefix}/{e.group.no}/{e.j}".encode())
        e.env = self.env_factory(task, self.tokenizer,
                                 dataclasses.replace(self.env_options, seed=seed))
        return list(e.env.reset())

    def _close(self, e: Episode) -> None:
        """Closes an episode's environment once, in a thread (it may be hung)."""
        if e.env is not None and not e.closing:
            e.closing = True
            threading.Thread(target=quiet(e.env.close), daemon=True).start()

    # -- versions ---------------------------------------------------------------------------
    def sync(self) -> dict | None:
        """Moves the engine to what `latest` names when it moved (returns the move's answer),
        then abandons and requeues the groups that now lag more than `max_version_lag`."""
        ptr = read_latest(self.workdir) if self.workdir else None
        if ptr is None or int(ptr["policy_version"]) == self.version:
            return None
        try:
            info = self.engine.sync(self.workdir)
        except (FileNotFoundError, delta.ChainError) as e:   # pruned under us: next time
            log.warning("reload failed (%s); retrying", e)
            return None
        if info is None:          # the same directory under another version number
            self.version = int(ptr["policy_version"])
            return None
        self.version = int(info["policy_version"])
        self.counts["reloads"] += 1
        lag = self.options.max_version_lag
        for g in list(self.groups):
            oldest = [e.traj.oldest_version for e in g.episodes
                      if e.traj.oldest_version is not None]
            if lag >= 0 and oldest and self.version - min(oldest) > lag:
                log.info("group %s lags %d versions (> %d): restarted", g.task["task_id"],
                         self.version - min(oldest), lag)
                self._abandon(g)
                self.requeued.append(g.task)
                self.counts["stale_restarts"] += 1
        return info

    # -- one round ----------------------------------------------------------------------------
    def tick(self, wait_s: float = 0.05) -> None:
        """One engine call for every ready episode, then the environment's answers that came
        (waiting up to `wait_s` for one when no episode was ready), deadlines, finished groups."""
        ready = [e for g in self.groups for e in g.episodes if e.state == "ready"]
        if ready:
            self._generate(ready)
        for key, value, err in self._jobs.collect(0 if ready else wait_s):
            self._answer(key, value, err)
        now = time.monotonic()
        for g in self.groups:
            for e in g.episodes:
                if e.state in ("resetting", "stepping", "judging") and now > e.deadline:
                    self._fail(e, f"the environment's {e.state} took over "
                               f"{self._step_timeout():.0f} s")
        for g in list(self.groups):
            if not g.grading and all(e.state == "done" for e in g.episodes):
                g.grading = True
                if self.pool is None:
                    self._jobs.submit(("grade", g, 0), self._grade, g)
                else:                      # its slot is free for the next group at once
                    self.groups.remove(g)
                    self.grading.append(g)
                    self.pool.submit(("grade", g, 0), self._grade, g)
        for key, value, err in self.pool.collect() if self.pool else ():
            self._answer(key, value, err)

    def _seed(self, e: Episode) -> int:
        key = f"{self.options.seed}/{self.prefix}/{e.group.no}/{e.j}/{e.turns}"
        return zlib.crc32(key.encode())

    def _generate(self, ready: list) -> None:
        limit, _ = self.options.limit
        reqs = []
        for e in ready:
            spec = dataclasses.replace(self.spec, max_tokens=min(self.spec.max_tokens,
                                                                 limit - len(e.traj)))
            reqs.append(Request(e.pending, spec, seed=self._seed(e), sequence=e.sequence))
        answers = self.engine.generate(reqs)
        for e, req, [c] in zip(ready, reqs, answers, strict=True):
            e.pending, e.sequence = [], c.sequence
            e.traj.generated(c.tokens, c.logprobs, c.routed_experts, self.version)
            e.turns += 1
            cut = (c.finish_reason != "stop" and req.sampling.max_tokens < self.spec.max_tokens
                   and len(c.tokens) >= req.sampling.max_tokens)
            if cut:                    # the limit, not the turn's own length, ended it
                self._end(e, self.options.limit[1], truncated=True)
                continue
            e.state, e.deadline = "stepping", time.monotonic() + self._step_timeout()
            self._jobs.submit(("step", e, e.epoch), e.env.step, list(c.tokens))

    def _answer(self, key: tuple, value: object, err: Exception | None) -> None:
        kind, who, epoch = key
        if kind == "grade":
            self._emit(who, value)
            return
        e = who
        if epoch != e.epoch or e.group not in self.groups:
            if kind != "judge":        # abandoned or timed out meanwhile: close it now
                self._close(e)
            return
        if err is not None:
            e.closing = e.closing or kind == "judge"    # `_judge` closed it
            self._fail(e, f"the environment's {kind} raised {type(err).__name__}: {err}")
        elif kind == "reset" and not value:
            self._fail(e, "the environment's first observation is empty")
        elif kind == "reset" and len(value) >= self.options.limit[0]:
            self._fail(e, f"the prompt's {len(value)} tokens leave no room for a turn "
                       f"({self.options.limit[1]} {self.options.limit[0]})")
        elif kind == "reset":
            self._observe(e, value)
        elif kind == "step":
            e.tool_calls += value.tool_calls
            e.tool_errors += value.tool_errors
            if value.done:
                e.reason = value.reason
                self._judge(e, None)
            elif e.turns >= self.options.max_turns:
                self._end(e, "turn_limit")
            else:
                self._observe(e, value.observation)
        elif kind == "judge":
            e.verdict, e.state = value, "done"

    def _observe(self, e: Episode, ids: Sequence[int]) -> None:
        """Appends an observation, or ends the episode when it leaves no room for a turn."""
        limit, reason = self.options.limit
        if len(e.traj) + len(ids) >= limit:
            self._end(e, reason, truncated=True)
            return
        e.traj.observe(ids)
        e.pending += [int(t) for t in ids]
        e.state = "ready"

    def _end(self, e: Episode, reason: str, truncated: bool = False) -> None:
        e.reason, e.truncated = reason, truncated
        self._judge(e, reason)

    def _cancel(self, e: Episode) -> None:
        if e.sequence is not None:
            self.engine.cancel([e.sequence])
            e.sequence = None

    def _judge(self, e: Episode, loop_reason: str | None) -> None:
        self._cancel(e)
        e.closing = True                   # `_judge` closes it
        e.state, e.deadline = "judging", time.monotonic() + self._step_timeout()
        self._jobs.submit(("judge", e, e.epoch), judge, e.env, loop_reason,
                          e.group.task["task_id"])

    def _fail(self, e: Episode, why: str) -> None:
        """The environment failed (raised, hung): `infra_error`, its answer no longer wanted."""
        log.warning("task %s, trajectory %d: %s", e.group.task["task_id"], e.j, why)
        e.epoch += 1
        self._cancel(e)
        self._close(e)
        e.verdict = {"outcome": "infra_error", "hacked": False, "evidence": {"error": why}}
        e.reason = e.reason or "tool_error"
        e.state = "done"

    def _abandon(self, g: Group) -> None:
        self.groups.remove(g)
        for e in g.episodes:
            e.epoch += 1
            self._cancel(e)
            if e.state == "ready":         # busy ones are closed when their call returns
                self._close(e)

    def close(self) -> None:
        """Abandons every group in flight (nothing written for them)."""
        for g in list(self.groups):
            self._abandon(g)
        if self.pool is not None:
            self.pool.close()

    # -- a finished group -----------------------------------------------------------------------
    def _grade(self, g: Group) -> tuple:
        views = [agent_grading.grader_view(f"t{e.j}", e.traj, e.verdict, e.info(),
                                           self.tokenizer.decode) for e in g.episodes]
        return agent_grading.grade_group(self.grader, self.grader_name, g.task, views)

    def _grade_crashed(self, g: Group, err: Exception) -> tuple:
        """The pool's answer for a group whose grader crashed every attempt: binary credit."""
        def crashed(task: dict, views: list) -> None:
            raise RuntimeError(f"the grader crashed on every attempt: {err}")
        views = [agent_grading.grader_view(f"t{e.j}", e.traj, e.verdict, e.info(),
                                           self.tokenizer.decode) for e in g.episodes]
        return agent_grading.grade_group(crashed, self.grader_name, g.task, views)

    def _emit(self, g: Group, graded: tuple) -> None:
        if g in self.grading:
            self.grading.remove(g)
        elif g in self.groups:
            self.groups.remove(g)
        else:
            return
        verdicts, grading, error = graded
        if error is not None:
            self.counts["grader_errors"] += 1
            log.error("task %s: grading failed, binary credit: %s", g.task["task_id"], error)
        envs = [{**e.info(), "evidence": e.verdict.get("evidence")} for e in g.episodes]
        grading = {**grading, "evidence": {"grader": grading.get("evidence"), "env": envs}}
        trajs = [e.traj.feed_dict(f"t{e.j}", v, truncated=e.truncated)
                 for e, v in zip(g.episodes, verdicts, strict=True)]
        rec = agent_group_record(f"{self.prefix}-{g.task['task_id']}-v{g.version}-g{g.no}",
                                 g.task["task_id"], trajs, grading, version=self.version,
                                 sampling=self.spec.record(self.engine.name))
        valid = [v for v in verdicts if v["outcome"] != "infra_error"]
        passes = sum(v["outcome"] == "pass" and not v["hacked"] for v in valid)
        spanning = sum(len({*e.traj.versions}) > 1 for e in g.episodes)
        oldest = [e.traj.oldest_version for e in g.episodes if e.traj.versions]
        info = {"group_id": rec.group_id, "policy_version": rec.policy_version,
                "oldest_version": min(oldest, default=rec.policy_version),
                "passes": passes, "valid": len(valid), "mixed": 0 < passes < len(valid),
                "turns": sum(e.turns for e in g.episodes), "spanning": spanning,
                "truncated": sum(e.truncated for e in g.episodes),
                "tool_calls": sum(e.tool_calls for e in g.episodes),
                "tool_errors": sum(e.tool_errors for e in g.episodes),
                "end_reasons": sorted(str(e.reason) for e in g.episodes),
                "s": round(time.perf_counter() - g.t0, 4)}
        if self.pool is not None:          # the worker's log: queue depth, grading latency
            info.update(grade_s=self.pool.latency.pop(("grade", g, 0), None),
                        grade_queue=self.pool.stats())
        c = self.counts
        c["groups"] += 1
        c["mixed"] += info["mixed"]
        c["passes"] += passes
        c["trajectories"] += len(g.episodes)
        c["infra_errors"] += len(g.episodes) - len(valid)
        for k in ("turns", "spanning", "truncated", "tool_calls", "tool_errors"):
            c[k] += info[k]
        self.emit(rec, info)

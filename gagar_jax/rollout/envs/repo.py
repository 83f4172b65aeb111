"""The code-repository environment: an agent fixes a bug in a small Python repository.

    --env gagar_jax.rollout.envs.repo:make_env --tasks gagar_jax.rollout.envs.repo:tasks

Each episode gets its own workspace (`workspace.Workspace`: a fresh copy of the task's
repository and the artifacts a grader reads). The prompt lists the tools (`repo_tools.TOOLS`)
and the one call format (`tools.parse_tool_calls`); every `<tool_call>` of a model turn runs in
order and its result (or error) comes back as one tool message each. A malformed or unknown
call is answered with an error and counted; a turn with **no** call gets a nudge (never taken
as a final answer: only `submit` ends the work). `run_tests` runs the visible tests in the
sandbox (`sandbox`); `submit` ends the episode ("submitted"), and so do the episode clock
("timeout") and a failure of the sandbox itself ("tool_error"). The verdict
(`repo_verdict.judge`) runs after any end, on the tree as the agent left it.
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator, Sequence

from gagar_jax.rollout.envs import patch, repo_tasks, repo_verdict, sandbox, workspace
from gagar_jax.rollout.envs.base import END_REASONS, EnvOptions, Step, check_verdict
from gagar_jax.rollout.envs.repo_tools import BY_NAME, TOOLS, RepoTools, SandboxFailure, ToolFailure
from gagar_jax.rollout.envs.tokenizer import Tokenizer
from gagar_jax.rollout.envs.tools import CallError, format_tool_call, parse_tool_calls

SYSTEM = """You fix bugs in Python repositories, working only through tools. To call a tool, \
write a block like this (one JSON object per block; several blocks in one turn run in order):
{example}
The tools:
{tools}
Fix the library code so that the tests pass. Do not change tests, conftest.py or test \
configuration: a submission that does is rejected. Hidden tests check the fix on other \
inputs, so fix the cause, not the visible case. Call submit when you are done."""
NUDGE = ("Your last turn had no tool call. Call a tool in a <tool_call> block, or call submit "
         "when you are done.")


def _tool_lines() -> str:
    lines = []
    for t in TOOLS:
        args = ", ".join(f"{k}{'' if k in t.required else '?'}: {v}"
                         for k, v in t.parameters.items())
        lines.append(f"- {t.name}({args}): {t.description}")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class RepoEnvConfig:
    """The environment's settings beyond `EnvOptions`.

    Attributes:
      sandbox: how tests run; its `limits.wall_s` is replaced by `EnvOptions.tool_timeout_s`.
      max_observation_chars: a tool answer longer than this is cut (head and tail kept).
      max_file_bytes: the largest file write_file / apply_patch may produce.
      max_files: files the working copy may hold.
    """
    sandbox: sandbox.SandboxConfig = sandbox.SandboxConfig()
    max_observation_chars: int = 8000
    max_file_bytes: int = 256 << 10
    max_files: int = 500


def private_paths(task_dir: str, workspace_root: str) -> tuple:
    """What agent code must not read: every task (fixes, held-out tests), every trajectory's
    workspace, and the git objects of a checkout that holds the tasks."""
    out = [os.path.dirname(os.path.abspath(task_dir)), os.path.abspath(workspace_root)]
    d = os.path.abspath(task_dir)
    while d != os.path.dirname(d):
        git = os.path.join(d, ".git")
        if os.path.isdir(git):
            out.append(git)
            break
        if os.path.isfile(git):      # a worktree: its git dir and the common one
            with open(git) as f:
                gitdir = os.path.join(d, f.read().partition("gitdir:")[2].strip())
            out.append(os.path.normpath(gitdir))
            common = os.path.join(gitdir, "commondir")
            if os.path.isfile(common):
                with open(common) as f:
                    out.append(os.path.normpath(os.path.join(gitdir, f.read().strip())))
            break
        d = os.path.dirname(d)
    return tuple(dict.fromkeys(out))


class RepoEnv:
    """One episode of one repository task (the `Environment` interface)."""

    def __init__(self, task: repo_tasks.RepoTask, tokenizer: Tokenizer, options: EnvOptions,
                 config: RepoEnvConfig = RepoEnvConfig()):
        self.task, self.tok, self.options = task, tokenizer, options
        self.task_id = task.task_id
        limits = dataclasses.replace(config.sandbox.limits, wall_s=options.tool_timeout_s)
        self.sandbox = dataclasses.replace(config.sandbox, limits=limits)
        self.config = config
        self.ws = workspace.Workspace(options.workspace_root, task.task_id)
        self.workspace = self.ws.path
        self.hide = private_paths(task.dir, self.ws.root)
        self.tools = RepoTools(task, self.ws, self.sandbox, self.hide,
                               max_file_bytes=config.max_file_bytes, max_files=config.max_files)
        self.turns = self.tool_calls = self.tool_errors = self.nudges = 0
        self.end_reason: str | None = None
        self.infra_error = ""
        self._verdict: dict | None = None
        self._enforced: dict = {}       # what the verdict's sandbox enforced
        self._t0 = time.monotonic()

    # ---------------------------------------------------------------- the interface
    def reset(self) -> list:
        self.ws.start_copy(self.task.repo_dir)
        self.infra_error = sandbox.check_interpreter(self.sandbox)
        files = "\n".join(workspace.relative_files(self.ws.repo))
        system = SYSTEM.format(example=format_tool_call("read_file", {"path": "pkg/module.py"}),
                               tools=_tool_lines())
        user = (f"Issue:\n{self.task.statement}\n\nThe visible tests: "
                f"{', '.join(self.task.visible_tests)}.\nThe repository's files:\n{files}")
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        ids = self.tok.prompt(messages)
        self.ws.event({"kind": "prompt", "messages": messages, "tokens": len(ids)})
        return ids

    def step(self, turn: Sequence[int]) -> Step:
        if self.end_reason is not None:
            raise RuntimeError(f"task {self.task_id}: step after the episode ended "
                               f"({self.end_reason})")
        self.turns += 1
        text = self.tok.decode(turn)
        self.ws.event({"kind": "model", "turn": self.turns, "text": text, "tokens": len(turn)})
        if self.options.episode_timeout_s and \
                time.monotonic() - self._t0 > self.options.episode_timeout_s:
            return self._finish("timeout")
        calls = parse_tool_calls(text, BY_NAME)
        if not calls:
            self.nudges += 1
            return self._observe([{"role": "user", "content": NUDGE}], "nudge", 0, 0)
        messages, errors = [], 0
        for i, call in enumerate(calls):
            if isinstance(call, CallError):
                errors += 1
                answer = f"error: {call.message}"
            elif call.name == "submit":
                self._count(len(calls), errors)
                self.ws.event({"kind": "call", "turn": self.turns, "name": "submit",
                               "ignored_after": len(calls) - i - 1})
                return self._finish("submitted", len(calls), errors)
            else:
                try:
                    answer = self.tools.call(call)
                except ToolFailure as e:
                    errors += 1
                    answer = f"error: {e}"
                except SandboxFailure as e:
                    self.infra_error = f"sandbox failure in run_tests: {e}"
                    self._count(len(calls), errors + 1)
                    return self._finish("tool_error", len(calls), errors + 1)
            name = call.name if not isinstance(call, CallError) else None
            self.ws.event({"kind": "call", "turn": self.turns, "name": name,
                           "arguments": None if name is None else call.arguments,
                           "ok": not answer.startswith("error: "), "answer": answer})
            messages.append({"role": "tool", "content": self._cut(answer)})
        self._count(len(calls), errors)
        return self._observe(messages, "results", len(calls), errors)

    def end(self, reason: str) -> None:
        if reason not in END_REASONS:
            raise ValueError(f"end reason must be one of {END_REASONS}, got {reason!r}")
        if self.end_reason is None:
            self.end_reason = reason
            self.ws.event({"kind": "end", "turn": self.turns, "reason": reason})

    def verdict(self) -> dict:
        if self.end_reason is None:
            raise RuntimeError(f"task {self.task_id}: verdict before the episode ended")
        if self._verdict is None:
            self._verdict = self._judge()
            self._write_meta()
        return self._verdict

    def close(self) -> None:
        self._write_meta()

    # ---------------------------------------------------------------- helpers
    def _count(self, calls: int, errors: int) -> None:
        self.tool_calls += calls
        self.tool_errors += errors

    def _observe(self, messages: list, kind: str, calls: int, errors: int) -> Step:
        ids = self.tok.observation(messages)
        self.ws.event({"kind": kind, "turn": self.turns, "tokens": len(ids),
                       **({"text": messages[0]["content"]} if kind == "nudge" else {})})
        return Step(observation=ids, tool_calls=calls, tool_errors=errors)

    def _finish(self, reason: str, calls: int = 0, errors: int = 0) -> Step:
        self.end(reason)
        return Step(done=True, reason=reason, tool_calls=calls, tool_errors=errors)

    def _cut(self, text: str) -> str:
        n = self.config.max_observation_chars
        if len(text) <= n:
            return text
        return f"{text[:n // 4]}\n[... {len(text) - n} characters cut ...]\n{text[-(n - n // 4):]}"

    def _judge(self) -> dict:
        final = workspace.read_tree(self.ws.repo)
        self.ws.write("final.diff", patch.diff(workspace.read_tree(self.task.repo_dir), final))
        if self.infra_error:
            return {"outcome": "infra_error", "hacked": False,
                    "evidence": {"error": self.infra_error}}
        verdict, output, report, enforced = repo_verdict.judge(
            self.task, self.ws.repo, self.sandbox, self.hide)
        self.ws.write("tests/verdict.log", output)
        self.ws.write("tests/verdict_junit.xml", report)
        self._enforced = enforced
        return check_verdict(verdict, self.task_id)

    def _write_meta(self) -> None:
        self.ws.write_meta({
            "env": "repo", "task_id": self.task_id, "bug_class": self.task.bug_class,
            "task_dir": self.task.dir, "workspace": self.workspace, "turns": self.turns,
            "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
            "nudges": self.nudges, "test_runs": self.tools.test_runs,
            "end_reason": self.end_reason, "elapsed_s": round(time.monotonic() - self._t0, 3),
            "verdict": self._verdict, "python": self.sandbox.interpreter,
            "limits": dataclasses.asdict(self.sandbox.limits),
            "sandbox": self._enforced or self.tools.last_enforced
            or sandbox.enforced(self.sandbox)})


def make_env(task: dict, tokenizer: Tokenizer, options: EnvOptions) -> RepoEnv:
    """`--env gagar_jax.rollout.envs.repo:make_env`: an episode of `task` (what `tasks` yields;
    `task["task_dir"]` names the task directory)."""
    if "task_dir" not in task:
        raise ValueError(f"repo task {task.get('task_id')!r}: no 'task_dir' (use "
                         "gagar_jax.rollout.envs.repo:tasks)")
    return RepoEnv(repo_tasks.load_task(task["task_dir"]), tokenizer, options)


def factory(config: RepoEnvConfig) -> object:
    """A `make_env` with other settings (sandbox limits, the task interpreter), for a user's
    module: `my_env = repo.factory(RepoEnvConfig(...))`, then `--env mymodule:my_env`."""
    def make(task: dict, tokenizer: Tokenizer, options: EnvOptions) -> RepoEnv:
        return RepoEnv(repo_tasks.load_task(task["task_dir"]), tokenizer, options, config)
    return make


def tasks(seed: int) -> Iterator[dict]:
    """`--tasks gagar_jax.rollout.envs.repo:tasks`: the shipped tasks (or `$GAGAR_REPO_TASKS`),
    every task once per epoch, in an order drawn from `seed`."""
    return repo_tasks.iter_tasks(seed)

"""The environment interface: what an agent environment gives the rollout worker's agent loop.

Token ids in, token ids out (SPEC section 6): the loop hands the environment exactly the ids the
engine generated for a turn (never decoded and re-encoded into the trajectory), and appends
exactly the ids the environment returns as the next observation. So a trajectory's `tokens` are
the ids the engine saw and produced, in order; generated ids get `loss_mask` 1 and the engine's
log-probs, the prompt and every observation `loss_mask` 0.

    env = make_env(task, tokenizer, EnvOptions(max_turns=8))     # `--env module:factory`
    prompt_ids = env.reset()                                    # the first observation
    while True:
        turn_ids = <engine generates after everything so far>
        step = env.step(turn_ids)                               # a `Step`
        if step.done: break                                     # step.reason in END_REASONS
        <append step.observation to the live sequence>
    verdict = env.verdict()      # {"outcome": "pass" | "fail" | "infra_error", "hacked": ...}
    env.close()

Limits the loop enforces (it knows the engine and its flags): the turn limit ("turn_limit"),
the engine's context ("context_full") and the worker's token budget per trajectory
("token_limit"); it then tells the environment with `end(reason)` and asks for the verdict.
The environment itself ends an episode when the agent submits ("submitted"), when its tools fail
past recovery ("tool_error") or when its own clock runs out ("timeout").
Importing this module imports no JAX.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from gagar_jax.rollout.envs.tokenizer import Tokenizer

# Why an episode ended. The last three cut a trajectory short: its record says `truncated`
# (the learner's overlong policy, `feed.overlong`, decides what becomes of it) for
# "context_full" and "token_limit"; "turn_limit" is a normal end (the verdict still runs).
END_REASONS = ("submitted", "tool_error", "timeout", "turn_limit", "context_full", "token_limit")
TRUNCATING = ("context_full", "token_limit")
OUTCOMES = ("pass", "fail", "infra_error")


@dataclasses.dataclass(frozen=True)
class EnvOptions:
    """What the worker tells an environment's factory besides the task and the tokenizer.

    Attributes:
      max_turns: model turns before the loop ends the episode ("turn_limit").
      tool_timeout_s: wall-clock limit of one tool call (the environment enforces it).
      episode_timeout_s: wall-clock limit of the whole episode (0 = none): "timeout".
      workspace_root: where the environment may create per-trajectory directories
        (its workspace, artifacts); "" = a temporary directory of its choosing.
      seed: for environments that draw anything at random.
    """
    max_turns: int = 8
    tool_timeout_s: float = 30.0
    episode_timeout_s: float = 0.0
    workspace_root: str = ""
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Step:
    """The environment's answer to one model turn.

    Attributes:
      observation: token ids appended to the trajectory before the next model turn (tool output,
        a nudge; `loss_mask` 0). Empty when `done`.
      done: the episode is over.
      reason: when done, one of END_REASONS.
      tool_calls: tool calls the turn made (parsed, well-formed or not).
      tool_errors: malformed or unknown calls and tool failures in this turn (each answered
        with an error observation, counted, never raised).
    """
    observation: Sequence[int] = ()
    done: bool = False
    reason: str | None = None
    tool_calls: int = 0
    tool_errors: int = 0

    def __post_init__(self):
        if self.done and self.reason not in END_REASONS:
            raise ValueError(f"a finished step needs a reason in {END_REASONS}, "
                             f"got {self.reason!r}")
        if self.done and len(self.observation):
            raise ValueError("a finished step has no observation")


@runtime_checkable
class Environment(Protocol):
    """One episode of one task (one trajectory). `tests/` check every shipped environment.

    Attributes:
      task_id: the task's id (the record's `task_id`).
      workspace: the directory holding this trajectory's artifacts (its final diff, the test
        logs, the transcript; what a group grader reads), or None when it keeps none.
    """
    task_id: str
    workspace: str | None

    def reset(self) -> list:
        """The first observation's token ids (the prompt: system text, tools, the task)."""
        ...

    def step(self, turn: Sequence[int]) -> Step:
        """Takes the ids the engine generated for one turn (a stop token, when one ended it,
        is the last) and returns the next observation, or the end of the episode."""
        ...

    def end(self, reason: str) -> None:
        """The loop ended the episode (`reason` one of END_REASONS: its own limits)."""
        ...

    def verdict(self) -> dict:
        """After the end: {"outcome": one of OUTCOMES, "hacked": bool, "evidence": {...}}
        ("infra_error" only for a failure of the environment itself, never of the agent)."""
        ...

    def close(self) -> None:
        """Releases what the episode holds (processes, temporary copies); artifacts stay."""
        ...


class EnvFactory(Protocol):
    """`--env module:factory`: builds one episode's environment."""

    def __call__(self, task: dict, tokenizer: Tokenizer, options: EnvOptions) -> Environment:
        ...


class TaskSource(Protocol):
    """`--tasks module:function`: an endless (or finite) stream of task dicts with "task_id"."""

    def __call__(self, seed: int) -> Iterator[dict]:
        ...


def check_verdict(verdict: Any, task_id: str) -> dict:
    """`verdict` when it is a well-formed verdict; a ValueError naming the task otherwise."""
    if not isinstance(verdict, dict) or verdict.get("outcome") not in OUTCOMES:
        raise ValueError(f"task {task_id}: the environment's verdict must be a dict with "
                         f"outcome in {OUTCOMES}, got {verdict!r:.200}")
    return verdict

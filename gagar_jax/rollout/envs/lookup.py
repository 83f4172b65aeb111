"""Look up and copy: a three-turn tool-use task a tiny model learns from a random start
(`make agent_loop`, docs/rollout.md "The agent loop, closed").

An episode hides a code, one of the digits 0-3, and runs three model turns: two tool turns, then
the answer turn. A tool turn calls `look` in the compact form (`tools.CompactCalls`: the one
token `<look>` anywhere in the turn); the tool's result, the code, is the next observation
(`<|tool|>` code; a turn without the call gets an empty result, `<|tool|>`), and the model's
next turn follows it. The answer turn has no call: its first digit is the answer. The episode
passes when the agent looked in a tool turn and the answer is the code, so the tool's result has
to be copied into the answer: a policy that never looks never passes, one that looks and
answers a digit of its own passes 1 in 4.

The code is drawn from the episode's seed (`EnvOptions.seed`, one per episode), so the
trajectories of a group face different codes behind the same prompt: a group stays mixed while
the policy copies some codes and not others. With one code per group, a policy that answers a
fixed digit makes all-pass and all-fail groups, which carry no signal (measured: the first
calibration run stalled at a pass rate of 0.5 that way). A task may fix its "code". (A second
design put the header `<|assistant|>` after each result, so copying needed an attention head:
its calibration run learned to look and then answered one digit for every code, pass rate 0.22
after 60 steps; docs/rollout.md has both.)

The vocabulary is nine tokens (`LookupTokenizer`; `configs/tiny_agent.py` has `vocab_size` 9):
`<|end|>` (the stop token that ends a model turn), `<look>`, `<|user|>`, `<|tool|>`,
`<|assistant|>` and the digits 0-3; the prompt is `<|user|><look><|assistant|>`. A uniform
random policy with 4-token turns looks in a tool turn with p = (1/9)(1 - (7/9)^4)/(2/9) = 0.317,
so in one of two with 0.534, and its answer turn's first digit is the code with 0.769 / 4 =
0.192: it passes 0.103 of its episodes, so most groups of 8 start mixed.

    --env gagar_jax.rollout.envs.lookup:make_env --tasks gagar_jax.rollout.envs.lookup:tasks
    --tokenizer gagar_jax.rollout.envs.lookup:tokenizer --max-turns 3 --max-tokens 4

Imports no JAX.
"""
from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence

from gagar_jax.rollout.envs.base import EnvOptions, Step
from gagar_jax.rollout.envs.tools import CompactCalls

SYMBOLS = ("<|end|>", "<look>", "<|user|>", "<|tool|>", "<|assistant|>", "0", "1", "2", "3")
END, LOOK, USER, TOOL, ASSISTANT = range(5)
DIGITS = {s: i for i, s in enumerate(SYMBOLS) if s.isdigit()}     # "0" -> 5 ... "3" -> 8
CODES = 4
TOOL_TURNS = 2              # then the answer turn: three turns per episode
CALLS = CompactCalls({LOOK: ("look", "")})


class LookupTokenizer:
    """The task's nine symbols as token ids 0-8 (`SYMBOLS`); `<|end|>` ends a model turn.

    Chat format (stateless: a new turn renders the same alone as in context): each message is
    its role's header token and its content; the first model turn opens with `<|assistant|>`,
    and a tool's result is spliced into the conversation with no header after it: the model's
    next turn follows the result directly (its first token is predicted from the result's last
    token, so copying a one-token result needs no attention at all: a tiny model finds it)."""

    stop_token_ids = (END,)
    vocab_size = len(SYMBOLS)

    def encode(self, text: str) -> list:
        out, i = [], 0
        while i < len(text):
            hit = next((s for s in SYMBOLS if text.startswith(s, i)), None)
            if hit is None:
                raise ValueError(f"{text[i]!r} at {i} is not a symbol of the lookup task")
            out.append(SYMBOLS.index(hit))
            i += len(hit)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(SYMBOLS[int(t)] if 0 <= int(t) < len(SYMBOLS) else f"<|{int(t)}|>"
                       for t in ids)

    def _render(self, messages: Sequence[Mapping]) -> list:
        ids = []
        for m in messages:
            ids += self.encode(f"<|{m['role']}|>{m['content']}")
        return ids

    def prompt(self, messages: Sequence[Mapping]) -> list:
        return self._render(messages) + [ASSISTANT]

    def observation(self, messages: Sequence[Mapping]) -> list:
        return self._render(messages)


def tokenizer() -> LookupTokenizer:
    """`--tokenizer gagar_jax.rollout.envs.lookup:tokenizer`."""
    return LookupTokenizer()


def tasks(seed: int = 0) -> Iterator[dict]:
    """An endless stream of tasks {"task_id"}: each episode draws its own code (from its
    `EnvOptions.seed`), so the trajectories of a group see different codes behind the same
    prompt; a task with a "code" fixes it for every episode."""
    i = 0
    while True:
        yield {"task_id": f"lookup-{seed}-{i}"}
        i += 1


def first_digit(turn: Sequence[int]) -> int | None:
    """The first digit in a turn's ids (its value 0-3), or None."""
    values = {i: int(s) for s, i in DIGITS.items()}
    return next((values[int(t)] for t in turn if int(t) in values), None)


class LookupEnv:
    """One episode of one task (the `Environment` interface of `envs/base.py`)."""

    def __init__(self, task: dict, tokenizer: LookupTokenizer, options: EnvOptions):
        code = task.get("code", random.Random(options.seed).randrange(CODES))
        if not 0 <= int(code) < CODES:
            raise ValueError(f"task {task.get('task_id')}: code must be in [0, {CODES})")
        self.task_id, self.code = task["task_id"], int(code)
        self.tok, self.options = tokenizer, options
        self.workspace = None
        self.turns, self.looked, self.answer, self.reason = 0, False, None, None

    def reset(self) -> list:
        return self.tok.prompt([{"role": "user", "content": "<look>"}])

    def step(self, turn: Sequence[int]) -> Step:
        self.turns += 1
        if self.turns > TOOL_TURNS:                     # the answer turn
            self.answer = first_digit(turn)
            self.reason = "submitted"
            return Step(done=True, reason="submitted")
        calls = CALLS.parse(turn, self.tok.decode, self.tok.stop_token_ids)
        self.looked = self.looked or bool(calls)
        result = str(self.code) if calls else ""
        return Step(observation=self.tok.observation([{"role": "tool", "content": result}]),
                    tool_calls=len(calls))

    def end(self, reason: str) -> None:
        self.reason = reason

    def verdict(self) -> dict:
        ok = self.reason == "submitted" and self.looked and self.answer == self.code
        return {"outcome": "pass" if ok else "fail", "hacked": False,
                "evidence": {"looked": self.looked, "answer": self.answer, "code": self.code,
                             "end": self.reason}}

    def close(self) -> None:
        pass


def make_env(task: dict, tokenizer: LookupTokenizer, options: EnvOptions) -> LookupEnv:
    """`--env gagar_jax.rollout.envs.lookup:make_env`."""
    return LookupEnv(task, tokenizer, options)

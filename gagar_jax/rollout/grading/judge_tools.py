"""The LLM judge's optional tools: read a candidate's file, rerun a candidate's visible tests.

Opt-in (`LLMGrader(..., tools=ToolConfig())`, or `GAGAR_JUDGE_TOOLS=1`); off by default. The
protocol (docs/grader.md, "Tool use"): before its final answer the judge may, one call per turn,
answer a JSON tool call instead of the ranking,

    {"tool": "read_file", "trajectory_id": "t0", "path": "calc/core.py"}
    {"tool": "run_tests", "trajectory_id": "t1"}

each turn's answer constrained to `turn_schema` (a tool call or the ranking) and checked by hand
against it (`parse_call`). The result goes back as a user message ("tool result ..."), cut with
`prompt.CUT` to its share of `ToolConfig.budget` tokens. After `max_turns` tool turns the answer
is demanded with the answer schema alone; a judge still calling a tool then raises (the group's
`status: failed`, with the reason). A failing tool (a path outside the candidate's copy, through a
link, absolute or with `..`; a missing file; a test run past its time) is answered as a tool
result, never raised. `read_file` reads the candidate's working copy as the agent left it (at
most `max_file_bytes`); `run_tests` runs the visible tests through the agents' sandbox
(`envs.sandbox.run`: a fresh copy of that working copy, the time and memory limits of
`ToolConfig.sandbox`, no network where namespaces work, the tasks and workspaces hidden). Every
call is logged (`ToolSession.log`: name, trajectory id, argument, seconds, truncated, error) for
the grading evidence. Imports no JAX.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable

from gagar_jax.rollout.envs import repo, repo_verdict, sandbox, workspace
from gagar_jax.rollout.grading import prompt
from gagar_jax.rollout.grading.workspace import Candidate, GroupWorkspace

NAMES = ("read_file", "run_tests")
INSTRUCTIONS = """
Before answering you may use tools, one call per reply, by replying with only a JSON object:
{{"tool": "read_file", "trajectory_id": ..., "path": ...}}: a file of that candidate's \
repository as it left it (a path inside the repository, like pkg/module.py);
{{"tool": "run_tests", "trajectory_id": ...}}: rerun the visible tests on that candidate's \
repository and see the output.
You have at most {turns} tool calls; then answer with the ranking JSON."""


@dataclasses.dataclass(frozen=True)
class ToolConfig:
    """The judge's tools.

    Attributes:
      max_turns: tool calls per ordering before the answer is demanded.
      budget: tokens of all tool results of one ordering together.
      max_result_tokens: tokens of one result (head and tail kept, `prompt.CUT` between).
      max_file_bytes: bytes read_file reads of one file.
      sandbox: the sandbox the tests run in (the agents' one; wall_s bounds one run).
    """
    max_turns: int = 4
    budget: int = 4000
    max_result_tokens: int = 1500
    max_file_bytes: int = 64 << 10
    sandbox: sandbox.SandboxConfig = sandbox.SandboxConfig(limits=sandbox.Limits(wall_s=60.0))

    def __post_init__(self):
        if self.max_turns < 1 or self.budget < 64 or self.max_result_tokens < 64:
            raise ValueError(f"ToolConfig needs max_turns >= 1, budget and max_result_tokens "
                             f">= 64; got {self.max_turns}, {self.budget}, "
                             f"{self.max_result_tokens}")


def call_schema(ids: list) -> dict:
    """The JSON schema of one tool call on the candidates `ids`."""
    return {"type": "object", "properties": {
        "tool": {"type": "string", "enum": list(NAMES)},
        "trajectory_id": {"type": "string", "enum": list(ids)},
        "path": {"type": "string"}},
        "required": ["tool", "trajectory_id"], "additionalProperties": False}


def turn_schema(ids: list, answer_schema: dict) -> dict:
    """A reply while tools are open: a tool call or the ranking."""
    return {"anyOf": [call_schema(ids), answer_schema]}


def parse_call(raw: str, ids: list) -> dict | None:
    """The tool call `raw` holds, checked against `call_schema(ids)`.

    Returns:
      None when `raw` is not a JSON object with a "tool" key (an answer: `answer.parse_answer`
      judges it), else {"tool", "trajectory_id", "path"?, "error"?}: "error" says in one line
      why the call breaks the schema (answered to the judge as the tool's result).
    """
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, TypeError):
        return None
    if not isinstance(obj, dict) or "tool" not in obj:
        return None
    call = {k: obj.get(k) for k in ("tool", "trajectory_id", "path") if k in obj}
    extra = sorted(set(obj) - {"tool", "trajectory_id", "path"})
    if obj["tool"] not in NAMES:
        call["error"] = f"unknown tool {obj['tool']!r} (tools: {', '.join(NAMES)})"
    elif obj.get("trajectory_id") not in ids:
        call["error"] = f"trajectory_id {obj.get('trajectory_id')!r} is not one of {list(ids)}"
    elif extra:
        call["error"] = f"unknown keys {extra}"
    elif obj["tool"] == "read_file" and not isinstance(obj.get("path"), str):
        call["error"] = "read_file needs a string path"
    return call


class ToolSession:
    """The tools of one group (`ws`) for one judge; `log` collects every call.

    Args:
      ws: the group; only its passing candidates (the ones shown) can be named.
      config: the `ToolConfig`.
      count: text -> tokens (the judge's).
    """

    def __init__(self, ws: GroupWorkspace, config: ToolConfig, count: Callable[[str], int]):
        self.ws, self.config, self.count = ws, config, count
        self.ids = [c.trajectory_id for c in ws.passing()]
        self.log: list = []

    def run(self, call: dict, left: int) -> str:
        """The result text of `call` (from `parse_call`) within `left` tokens; logged."""
        t0 = time.monotonic()
        arg = call.get("path") if call.get("tool") == "read_file" else None
        error, text = call.get("error"), ""
        if error is None and left < 64:
            error = f"the tool results' budget ({self.config.budget} tokens) is spent; answer now"
        if error is None:
            try:
                text = getattr(self, f"_{call['tool']}")(self.ws.by_id(call["trajectory_id"]), arg)
            except ToolError as e:
                error = str(e)
        if error is not None:
            text = f"tool error: {error}"
        # within what is left (>= 64 tokens, else the call was refused above: room for that)
        limit = min(self.config.max_result_tokens, max(left, 64))
        text, n = prompt.cut(text, limit, self.count)
        self.log.append({"name": call.get("tool"), "trajectory_id": call.get("trajectory_id"),
                         "argument": arg, "seconds": round(time.monotonic() - t0, 3),
                         "truncated": n > 0, "error": error})
        return text

    def _read_file(self, c: Candidate, path: str) -> str:
        if c.repo_dir is None:
            raise ToolError(f"candidate {c.trajectory_id} has no working copy")
        try:
            full = workspace.resolve(c.repo_dir, path)
        except workspace.PathRefused as e:
            raise ToolError(str(e)) from None
        if not os.path.isfile(full):
            raise ToolError(f"{path}: no such file in candidate {c.trajectory_id}'s repository")
        size = os.path.getsize(full)
        with open(full, "rb") as f:
            text = f.read(self.config.max_file_bytes).decode(errors="replace")
        if size > self.config.max_file_bytes:
            text += "\n" + prompt.CUT.format(n=size - self.config.max_file_bytes)
        return text or "(empty file)"

    def _run_tests(self, c: Candidate, _arg: object) -> str:
        if c.repo_dir is None or not self.ws.visible_tests:
            raise ToolError(f"candidate {c.trajectory_id} has no working copy or visible tests")
        root = os.path.dirname(os.path.abspath(c.workspace))
        hide = repo.private_paths(self.ws.task_dir, root) if self.ws.task_dir else (root,)
        cfg = self.config.sandbox
        run = sandbox.run(c.repo_dir, repo_verdict.pytest_argv(
            cfg.interpreter, self.ws.visible_tests), cfg, hide=hide)
        if run.status == "infra_error":
            raise ToolError(f"the sandbox could not run the tests: {run.error}")
        if run.status == "timeout":
            raise ToolError(f"the tests did not finish in {cfg.limits.wall_s:g} s and were "
                            f"killed\n{run.output}")
        head = (f"killed by signal {run.signal}" if run.signal is not None
                else f"pytest exit code {run.exit_code}")
        return f"{head}\n{run.output}"


class ToolError(Exception):
    """A tool that could not answer; its message is the judge's tool result."""


def converse(judge: object, messages: list, answer_schema: dict, session: ToolSession) -> tuple:
    """Asks `judge` for its answer, running the tool calls it makes first.

    Args:
      judge: the `llm.Judge` (`ask(messages, schema)`: the whole conversation is sent again
        each turn).
      messages: the rendered prompt (system, user).
      answer_schema: the ranking's schema (`answer.answer_schema`).
      session: the group's `ToolSession`.
    Returns:
      (the answer text, the conversation before it, judge calls made).
    Raises:
      ValueError when the judge still calls a tool after `max_turns` calls.
    """
    cfg = session.config
    msgs = [{**messages[0], "content": messages[0]["content"]
             + INSTRUCTIONS.format(turns=cfg.max_turns)}, *messages[1:]]
    schema, left = turn_schema(session.ids, answer_schema), cfg.budget
    for turn in range(cfg.max_turns):
        raw = judge.ask(msgs, schema)
        call = parse_call(raw, session.ids)
        if call is None:
            return raw, msgs, turn + 1
        result = session.run(call, left)
        left -= session.count(result)
        msgs = msgs + [{"role": "assistant", "content": raw},
                       {"role": "user", "content": f"tool result ({call.get('tool')}):\n{result}"}]
    msgs = msgs + [{"role": "user", "content": f"You have used all {cfg.max_turns} tool calls. "
                                               "Answer now with the ranking JSON only."}]
    raw = judge.ask(msgs, answer_schema)
    if parse_call(raw, session.ids) is not None:
        ran = "; ".join(f"{x['name']}({x['trajectory_id']}, {x['argument']})"
                        for x in session.log[-cfg.max_turns:])
        raise ValueError(f"the judge's tool turns ({cfg.max_turns}) ran out without an answer "
                         f"(calls: {ran})")
    return raw, msgs, cfg.max_turns + 1

"""The one tool-call format, parsed from a model turn; and a compact form for tiny models.

The format is Qwen3's / Hermes' (what their chat templates teach and vLLM's `hermes` parser
reads): anywhere in a turn's text,

    <tool_call>
    {"name": "read_file", "arguments": {"path": "src/calc.py"}}
    </tool_call>

one JSON object per block, several blocks per turn allowed (run in order). A turn with no block
is a final answer or gets a nudge, as the environment decides. Every problem with a block is a
`CallError` the environment answers with an error observation and counts, never an exception:
unparseable JSON, not an object, an unknown tool, arguments that are not an object, a missing
required argument, an argument of the wrong JSON type, an unclosed block.

Compact form (`CompactCalls`): an environment for a tiny model may instead reserve one token
id per tool; a turn calls that tool when it holds the token, its one string argument being the
decoded text between the token and the next reserved token or the end of the turn (stop tokens
excluded). It is parsed from the ids, so it needs no JSON at all.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.S)
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
               "object": dict, "array": list}


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """One tool an environment offers.

    Attributes:
      name: what a call names.
      description: one line shown to the model.
      parameters: argument name -> JSON type ("string", "integer", "number", "boolean",
        "object", "array").
      required: the arguments a call must give (the others are optional).
    """
    name: str
    description: str
    parameters: Mapping[str, str] = dataclasses.field(default_factory=dict)
    required: tuple = ()

    def schema(self) -> dict:
        """The OpenAI / Hugging Face `tools=` entry for this tool (chat templates render it)."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object",
                           "properties": {k: {"type": t} for k, t in self.parameters.items()},
                           "required": list(self.required)}}}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's name and its arguments."""
    name: str
    arguments: dict


@dataclasses.dataclass(frozen=True)
class CallError:
    """A call that could not be made; `message` is what the model is shown."""
    message: str


def _check(obj: Any, tools: Mapping[str, ToolSpec]) -> ToolCall | CallError:
    if not isinstance(obj, dict):
        return CallError(f"a tool call must be a JSON object, got {type(obj).__name__}")
    name, args = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or name not in tools:
        return CallError(f"unknown tool {name!r}; the tools are {', '.join(sorted(tools))}")
    if not isinstance(args, dict):
        return CallError(f"{name}: arguments must be a JSON object, got {type(args).__name__}")
    spec = tools[name]
    missing = [k for k in spec.required if k not in args]
    if missing:
        return CallError(f"{name}: missing argument(s) {', '.join(missing)}")
    for k, v in args.items():
        if k not in spec.parameters:
            return CallError(f"{name}: unknown argument {k!r}")
        kind = spec.parameters[k]
        # bool is an int in Python, not in JSON: true is no integer.
        if not isinstance(v, _JSON_TYPES[kind]) or (isinstance(v, bool) and kind != "boolean"):
            return CallError(f"{name}: argument {k!r} must be a {kind}")
    return ToolCall(name, args)


def parse_tool_calls(text: str, tools: Mapping[str, ToolSpec]) -> list:
    """The `<tool_call>` blocks of a turn's text, in order: each a `ToolCall` or a `CallError`.

    An opening tag with no closing one (a turn cut by its token limit) is a `CallError`; text
    outside the blocks is ignored."""
    out = []
    for block in _BLOCK.finditer(text):
        try:
            out.append(_check(json.loads(block.group(1)), tools))
        except json.JSONDecodeError as e:
            out.append(CallError(f"tool call is not valid JSON: {e.msg} at character {e.pos}"))
    if CALL_OPEN in _BLOCK.sub("", text):
        out.append(CallError(f"unclosed {CALL_OPEN} (no {CALL_CLOSE})"))
    return out


def format_tool_call(name: str, arguments: Mapping) -> str:
    """A call in the format above (what a scripted agent writes, what the prompt shows)."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': dict(arguments)})}\n{CALL_CLOSE}"


@dataclasses.dataclass(frozen=True)
class CompactCalls:
    """One reserved token per tool (tiny models): token id -> (tool name, argument name).

    A tool whose `argument` is "" takes no argument."""
    tokens: Mapping[int, tuple]

    def parse(self, turn: Sequence[int], decode: Any, stop_token_ids: Sequence[int] = ()) -> list:
        """The calls of a turn's ids, in order (`decode`: ids -> text, for the arguments)."""
        stops = set(int(t) for t in stop_token_ids)
        ids = [int(t) for t in turn if int(t) not in stops]
        marks = [i for i, t in enumerate(ids) if t in self.tokens]
        out = []
        for j, i in enumerate(marks):
            name, arg = self.tokens[ids[i]]
            end = marks[j + 1] if j + 1 < len(marks) else len(ids)
            out.append(ToolCall(name, {arg: decode(ids[i + 1:end])} if arg else {}))
        return out

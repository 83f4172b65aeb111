"""`gagar-train --help`'s key list: every config key, its value, and its comment in the file.

    comments = key_comments("configs/tiny_cpu.py")   # {"train.steps": "train steps (...)", ...}

Config files comment each key on its line (`t.steps = 6   # train steps`) or on the comment
lines just above it; a file built on another (`load_config_file(...with_name("tiny_cpu.py"))`)
inherits that file's comments, its own winning. The source is read as text, never run twice.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

# `m = c.model = ...`, `t.steps = 6  # ...`, `c.mesh.data = -1`: targets, value, comment.
_ASSIGN = re.compile(r"^\s*((?:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*\s*=\s*)+)(.*)$")
_BASE = re.compile(r"""with_name\(\s*["']([\w.]+\.py)["']\s*\)""")


def _comment_of(value: str) -> tuple[str, str]:
    """(code, trailing comment) of an assignment's right-hand side (`#` outside quotes)."""
    quote = None
    for i, ch in enumerate(value):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return value[:i].strip(), value[i + 1:].strip()
    return value.strip(), ""


def key_comments(path: str, _depth: int = 0) -> dict:
    """{"section.key": comment} of a config file (and of the file it is built on).

    Args:
      path: a config file (`get_config() -> ConfigDict`).
    Returns:
      The comment of every key assigned with one; keys without a comment are absent.
    """
    with open(path) as f:
        lines = f.read().splitlines()
    out: dict = {}
    text = "\n".join(lines)
    base = _BASE.search(text)
    if base and _depth < 3:
        base_path = os.path.join(os.path.dirname(os.path.abspath(path)), base.group(1))
        if os.path.isfile(base_path):
            out.update(key_comments(base_path, _depth + 1))
    aliases = {"c": ""}
    above: list = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        m = _ASSIGN.match(line)
        if not m:
            above = []
            continue
        targets = [t.strip() for t in m.group(1).split("=") if t.strip()]
        code, trailing = _comment_of(m.group(2))
        paths = []
        for t in targets:
            head, _, rest = t.partition(".")
            if head in aliases:
                paths.append(".".join(p for p in (aliases[head], rest) if p))
        if "ConfigDict(" in code or code in {f"c.{p}" for p in paths}:
            # A section (or an alias of one): `m = c.model = ConfigDict()`, `t = c.train`.
            section = next((p for p in paths if p), None)
            if section is not None:
                for t in targets:
                    if "." not in t:
                        aliases[t] = section
        elif "." in targets[0] or targets[0] == "c":
            comment = trailing or " ".join(above)
            for p in paths:
                if comment and p:
                    out[p] = comment
        if len(targets) == 1 and "." not in targets[0] and targets[0] not in aliases \
                and code.startswith("c."):
            aliases[targets[0]] = code[2:]
        above = []
    return out


def key_lines(values: Mapping[str, Any], comments: Mapping[str, str]) -> list:
    """`  key = value   # comment` for every key of a config dict, sorted, sections flattened."""
    def walk(prefix: str, node: Mapping[str, Any]):
        for key, value in sorted(node.items()):
            if hasattr(value, "items"):
                yield from walk(f"{prefix}{key}.", value)
            else:
                yield f"{prefix}{key}", value
    rows = [(f"  {k} = {v!r}", comments.get(k, "")) for k, v in walk("", values)]
    width = min(max((len(a) for a, _ in rows), default=0), 48)
    return [f"{a:<{width}}  # {c}" if c else a for a, c in rows]

"""The LLM judge's rubric prompt, rendered from a group workspace within a token budget.

`render(ws, order, budget, count)` gives the chat messages for one ordering of the passing
candidates: the rubric (the five axes of the paper, the three tiers, the answer format) as the
system message; the task statement, then per candidate its diff, its last visible test log and
its transcript as the user message. Every section is cut to its share of the budget with a
visible marker (`CUT`: how many characters were left out, head and tail kept), never silently;
`Rendered.cuts` lists what was cut for the grading evidence. Imports no JAX.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence

from gagar_jax.rollout.grading.workspace import Candidate, GroupWorkspace

RUBRIC = """You grade candidate fixes to one software task. Every candidate below already \
passes the task's tests; rank them by quality on five axes:
1. approach suitability: does it fix the cause the task describes, in the general case (not a \
special case for the visible tests' inputs)?
2. implementation precision: is the change correct and complete, with no new bugs; did its \
test runs pass?
3. minimality: does it change only what the fix needs (small diff, few files)?
4. side effects: does it leave unrelated code, files, tests and behaviour alone (no new \
modules, prints, swallowed errors, weakened assertions)?
5. codebase consistency: does it follow the repository's style, structure and existing helpers?
Put each candidate in one tier: "strong" (a fix a maintainer would merge as is), \
"intermediate" (correct, with flaws on some axis), "defective" (passes, but wrong in approach \
or with harmful side effects). Within a tier give ranks 0, 1, 2, ... (0 = best; equal \
candidates share a rank). Judge the content, not the order in which candidates are shown.
Answer with JSON only: {"ranking": [{"trajectory_id": ..., "tier": ..., "rank": ...}, ...]}, \
one entry per candidate."""

CUT = "[... {n} characters cut ...]"
# shares of a candidate's budget: the diff, its last visible test log, the transcript
SHARES = {"diff": 0.5, "tests": 0.3, "transcript": 0.2}
TASK_SHARE = 0.25        # of what the rubric leaves: the task statement


@dataclasses.dataclass(frozen=True)
class Rendered:
    """One ordering's prompt.

    Attributes:
      messages: [{"role": "system", ...}, {"role": "user", ...}].
      order: the candidate ids in the order shown.
      tokens: the prompt's token count (`count` of both messages).
      cuts: [{"section", "trajectory_id", "cut_chars"}] of every section that was cut.
    """
    messages: list
    order: tuple
    tokens: int
    cuts: tuple


def cut(text: str, max_tokens: int, count: Callable[[str], int]) -> tuple:
    """`text` within `max_tokens`, its middle replaced by the `CUT` marker when it is longer.

    Returns:
      (the text, characters cut): head and tail kept in equal parts, the marker between them;
      ("", 0) for an empty text.
    """
    if count(text) <= max_tokens:
        return text, 0
    keep = len(text)
    while keep > 0:
        # shrink in proportion to the overshoot (tokens per character varies along the text)
        keep = min(keep - 1, int(keep * max_tokens / max(count(text[:keep]), 1) * 0.95))
        keep = max(keep, 0)
        head, tail = text[:keep // 2], text[len(text) - (keep - keep // 2):] if keep else ""
        out = head + "\n" + CUT.format(n=len(text) - keep) + "\n" + tail
        if count(out) <= max_tokens or keep == 0:
            return out, len(text) - keep
    return CUT.format(n=len(text)), len(text)


def _transcript_text(c: Candidate) -> str:
    """The transcript as lines: the repository environment's events (model turns, tool calls
    with their answers, the end), or a view's decoded turns."""
    lines = []
    for e in c.transcript:
        if not isinstance(e, dict):
            continue
        kind = e.get("kind")
        if "role" in e and "text" in e:                      # a view's decoded turns
            lines.append(f"{e['role']}: {e['text']}")
        elif kind == "model":
            lines.append(f"model (turn {e.get('turn')}): {e.get('text', '')}")
        elif kind == "call":
            args = json.dumps(e.get("arguments"))[:300]
            lines.append(f"tool {e.get('name')}({args}) -> {str(e.get('answer', ''))[:600]}")
        elif kind == "end":
            lines.append(f"end: {e.get('reason')}")
    return "\n".join(lines)


def _section(name: str, c: Candidate) -> str:
    if name == "diff":
        return c.diff or "(no change)"
    if name == "tests":
        return c.test_logs[-1][1] if c.test_logs else "(the visible tests were never run)"
    return _transcript_text(c) or "(no transcript)"


def render(ws: GroupWorkspace, order: Sequence[str], budget: int,
           count: Callable[[str], int]) -> Rendered:
    """The prompt showing the candidates `order` of `ws`, within `budget` tokens.

    Args:
      ws: the group.
      order: the passing candidates' ids, in the order to show them.
      budget: the prompt's token budget (rubric, task and candidates together).
      count: text -> tokens (the judge's tokenizer, or an estimate for a hosted judge).
    Returns:
      The `Rendered` prompt.
    Raises:
      ValueError when the rubric and headers alone exceed the budget.
    """
    fixed = count(RUBRIC) + 64 * (len(order) + 1)
    free = budget - fixed
    if free < 32 * (len(order) + 1):
        raise ValueError(f"prompt budget {budget} tokens is too small for the rubric and "
                         f"{len(order)} candidates (needs > {fixed + 32 * (len(order) + 1)})")
    cuts = []
    task, n = cut(ws.prompt, int(free * TASK_SHARE), count)
    if n:
        cuts.append({"section": "task", "trajectory_id": None, "cut_chars": n})
    parts = [f"## Task {ws.task_id}\n{task}\n"]
    per = (free - count(task)) // max(len(order), 1)
    for i, tid in enumerate(order):
        c = ws.by_id(tid)
        parts.append(f"## Candidate {i + 1}: trajectory_id {tid!r}\nfiles touched: "
                     f"{', '.join(c.files_touched) or 'none'} (+{c.lines_added} "
                     f"-{c.lines_removed} lines)")
        for name, share in SHARES.items():
            text, n = cut(_section(name, c), int(per * share) - 16, count)
            if n:
                cuts.append({"section": name, "trajectory_id": tid, "cut_chars": n})
            title = {"diff": "final diff", "tests": "last visible test run",
                     "transcript": "transcript"}[name]
            parts.append(f"### {title}\n{text}")
    user = "\n".join(parts) + (f"\n\nRank these {len(order)} candidates: "
                               f"{', '.join(repr(t) for t in order)}.")
    messages = [{"role": "system", "content": RUBRIC}, {"role": "user", "content": user}]
    return Rendered(messages=messages, order=tuple(order),
                    tokens=count(RUBRIC) + count(user), cuts=tuple(cuts))


def approx_tokens(text: str) -> int:
    """A hosted judge's token count estimated without its tokenizer: 1 per 3 characters
    (conservative for English and code; byte tokenizers count 1 per byte: pass theirs)."""
    return (len(text) + 2) // 3

"""The tokenizer interface observations are encoded through, and a byte-level one for tests.

An environment encodes what it shows the model (the task, tool output, nudges) exactly once,
through a `Tokenizer`; the ids the model generates are never decoded and re-encoded into the
trajectory (decoding a turn to parse its tool calls is fine: the trajectory keeps the ids).

Chat formats: `prompt(messages)` renders the first messages and the header that opens the
model's turn; `observation(messages)` renders only the messages that follow a model turn (tool
results, a nudge) and the next header. Templates such as Qwen3's rewrite earlier turns when the
whole conversation is rendered again (they drop the reasoning of past assistant turns), so an
adapter of a Hugging Face tokenizer renders each new turn alone, never the history.

    tok = ByteTokenizer(specials={"<|end|>": 256})    # bytes are ids 0..255
    ids = tok.prompt([{"role": "user", "content": "fix the bug"}])
    tok.stop_token_ids                                  # (256,): the end of a model turn
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """What environments need of a tokenizer.

    Attributes:
      stop_token_ids: the ids that end a model turn (the engine's stop tokens).
    """
    stop_token_ids: tuple

    def encode(self, text: str) -> list:
        """Plain text -> ids (no special tokens added)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text (special tokens as their text; for parsing a turn, never for the
        trajectory)."""
        ...

    def prompt(self, messages: Sequence[Mapping]) -> list:
        """The first observation: `messages` ({"role", "content"}) and the model's turn header."""
        ...

    def observation(self, messages: Sequence[Mapping]) -> list:
        """What follows a model turn: these messages alone, then the model's next turn header."""
        ...


class ByteTokenizer:
    """Bytes are ids 0..255 (UTF-8); `specials` maps special-token text to ids of their own.

    Chat format (plain and stateless, so a new turn renders the same alone as in context):
    each message is `<|role|>\\n` + content + `\\n`, and the model's turn opens with
    `<|assistant|>\\n`; `end` (a special, default "<|end|>") ends a model turn. With no room in
    the vocab for specials (a 256-token model), pass `specials={}` and `stop_token_ids` of a byte.
    """

    def __init__(self, specials: Mapping[str, int] | None = None, *, end: str = "<|end|>",
                 stop_token_ids: Sequence[int] | None = None):
        self.specials = dict({end: 256} if specials is None else specials)
        self.by_id = {i: s for s, i in self.specials.items()}
        if len(self.by_id) != len(self.specials) or any(i < 256 for i in self.by_id):
            raise ValueError(f"special ids must be distinct and >= 256, got {self.specials}")
        if stop_token_ids is None:
            if end not in self.specials:
                raise ValueError(f"no stop token: {end!r} is not a special; pass stop_token_ids")
            stop_token_ids = (self.specials[end],)
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self.vocab_size = max(self.by_id, default=255) + 1   # the model's vocab must hold this

    def encode(self, text: str) -> list:
        """UTF-8 bytes; special-token texts become their ids."""
        if not self.specials:
            return list(text.encode())
        out, i = [], 0
        while i < len(text):
            hit = next((s for s in self.specials if text.startswith(s, i)), None)
            if hit is not None:
                out.append(self.specials[hit])
                i += len(hit)
            else:
                out.extend(text[i].encode())
                i += 1
        return out

    def decode(self, ids: Sequence[int]) -> str:
        out, run = [], bytearray()
        for t in ids:
            t = int(t)
            if 0 <= t < 256:
                run.append(t)
                continue
            out.append(run.decode(errors="replace"))
            run = bytearray()
            out.append(self.by_id.get(t, f"<|{t}|>"))
        out.append(run.decode(errors="replace"))
        return "".join(out)

    def _render(self, messages: Sequence[Mapping]) -> list:
        ids = []
        for m in messages:
            ids += self.encode(f"<|{m['role']}|>\n{m['content']}\n")
        return ids + self.encode("<|assistant|>\n")

    def prompt(self, messages: Sequence[Mapping]) -> list:
        return self._render(messages)

    def observation(self, messages: Sequence[Mapping]) -> list:
        return self._render(messages)

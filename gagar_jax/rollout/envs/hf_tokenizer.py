"""Any Hugging Face tokenizer behind the `Tokenizer` interface, its chat template applied to
each new turn only.

Templates such as Qwen3's rewrite earlier turns when a conversation is rendered again (they drop
the `<think>` reasoning of every assistant turn before the last user message), so rendering the
history anew would change tokens the model already saw and produced. This adapter never renders
the history: `prompt` renders the first messages; `observation` renders only the messages that
follow a model turn, in the template's own words, by rendering them after a fixed anchor (a user
message and an assistant message holding a sentinel) and keeping what the template writes after
the anchor's end-of-turn token (the model generated that token itself; a newline the template
puts after it, as Qwen3's `<|im_end|>\\n` does, opens the observation).

    from transformers import AutoTokenizer
    tok = HFTokenizer(AutoTokenizer.from_pretrained(path), template_kwargs={"tools": schemas})
    tok.stop_token_ids          # ids of the tokenizer's eos token(s), or `stop_tokens` given

Generated ids are decoded only to parse tool calls; the trajectory keeps the engine's ids.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

SENTINEL = "GAGAR-ANCHOR-7f3a9c"


class HFTokenizer:
    """A `Tokenizer` over a Hugging Face tokenizer (`transformers.PreTrainedTokenizerBase`).

    Args:
      hf: the tokenizer; it needs a chat template (its chat_template attribute).
      stop_tokens: texts or ids that end a model turn; default: the tokenizer's eos token(s).
      template_kwargs: passed to every `apply_chat_template` call (e.g. `tools=`,
        `enable_thinking=`).
    """

    def __init__(self, hf: Any, stop_tokens: Sequence | None = None,
                 template_kwargs: Mapping | None = None):
        if not getattr(hf, "chat_template", None):
            raise ValueError("the Hugging Face tokenizer has no chat template (set "
                             "tokenizer.chat_template)")
        self.hf = hf
        self.template_kwargs = dict(template_kwargs or {})
        if stop_tokens is None:
            eos = hf.eos_token_id
            stop_tokens = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        ids = []
        for t in stop_tokens:
            tid = hf.convert_tokens_to_ids(t) if isinstance(t, str) else t
            if tid is None or (isinstance(t, str) and tid == hf.unk_token_id):
                raise ValueError(f"stop token {t!r} is not in the tokenizer's vocabulary")
            ids.append(int(tid))
        if not ids:
            raise ValueError("no stop token: pass stop_tokens (the tokenizer has no eos token)")
        self.stop_token_ids = tuple(ids)
        self._stop_texts = [hf.convert_ids_to_tokens(i) for i in ids]

    def encode(self, text: str) -> list:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def _render(self, messages: Sequence[Mapping]) -> str:
        return self.hf.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                           add_generation_prompt=True, **self.template_kwargs)

    def prompt(self, messages: Sequence[Mapping]) -> list:
        return self.encode(self._render(messages))

    def observation_text(self, messages: Sequence[Mapping]) -> str:
        """The text `observation` encodes: what the template writes for `messages` after a
        model turn's stop token, ending with the next turn's header."""
        anchor = [{"role": "user", "content": "."}, {"role": "assistant", "content": SENTINEL}]
        text = self._render(anchor + list(messages))
        if text.count(SENTINEL) != 1:
            raise ValueError("the chat template must render an assistant message's content "
                             "once (the anchor of observation rendering)")
        after = text.split(SENTINEL, 1)[1]
        hits = [(after.find(s), s) for s in self._stop_texts if s in after]
        if not hits:
            raise ValueError(f"the chat template ends an assistant turn with none of the stop "
                             f"tokens {self._stop_texts}")
        at, stop = min(hits)
        return after[at + len(stop):]

    def observation(self, messages: Sequence[Mapping]) -> list:
        return self.encode(self.observation_text(messages))

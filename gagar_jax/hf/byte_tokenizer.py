"""A byte-level Hugging Face tokenizer built locally (the `tokenizers` library, no download), for
the tiny test models: published beside their weights it lets vLLM serve them with a tokenizer
(chat completions, structured outputs), e.g. as the LLM grader's test judge (docs/grader.md).

Ids are the repository environment's `ByteTokenizer`'s: byte b is id b (0-255) and `<|end|>` is
256 (the end-of-sequence token); a model needs `vocab_size >= 257`. No merges: one token per byte,
so a text's token count is its UTF-8 length. The chat template writes each message as
`<|role|>\\ncontent\\n` and ends with `<|assistant|>\\n` (plain bytes, no special ids).
"""
from __future__ import annotations

import json
import os

END = "<|end|>"
END_ID = 256
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def bytes_to_unicode() -> dict:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def build() -> object:
    """The `tokenizers.Tokenizer`: byte b -> id b, `<|end|>` -> 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([END])
    if tok.token_to_id(END) != END_ID:
        raise RuntimeError(f"{END} got id {tok.token_to_id(END)}, expected {END_ID}")
    return tok


def save(directory: str) -> None:
    """Writes tokenizer.json, tokenizer_config.json (the chat template, `<|end|>` as eos) and
    special_tokens_map.json into `directory` (a published weights directory)."""
    os.makedirs(directory, exist_ok=True)
    build().save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": END,
              "pad_token": END, "model_max_length": 1 << 20, "chat_template": CHAT_TEMPLATE,
              "clean_up_tokenization_spaces": False}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(directory, "special_tokens_map.json"), "w") as f:
        json.dump({"eos_token": END, "pad_token": END}, f)

"""A minimal OpenAI-compatible chat/completions client on the standard library.

For an LLM judge served over HTTP (vLLM's OpenAI server, a hosted endpoint). Structured outputs
go as `response_format = {"type": "json_schema", ...}`. Every failure (connection refused or
dropped, timeout, non-2xx, a body without a message) raises `JudgeHTTPError` with a one-line
reason, which the grader records as `status: failed`. Imports no JAX.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request


class JudgeHTTPError(RuntimeError):
    """The endpoint did not give an answer; the message says why."""


def chat(base_url: str, model: str, messages: list, *, schema: dict | None = None,
         max_tokens: int = 512, temperature: float = 0.0, timeout_s: float = 60.0,
         api_key: str | None = None) -> str:
    """One chat/completions call; returns the first choice's message content.

    Args:
      base_url: e.g. "http://127.0.0.1:8000/v1" (the path "/chat/completions" is appended).
      model: the served model's name.
      messages: [{"role", "content"}].
      schema: JSON schema of the answer (structured outputs), or None for free text.
      max_tokens, temperature: sampling.
      timeout_s: socket timeout for connecting and for each read.
      api_key: sent as a Bearer token when given (hosted judges).
    Returns:
      The answer text.
    Raises:
      JudgeHTTPError naming the failure.
    """
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": temperature}
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "ranking", "schema": schema,
                                                   "strict": True}}
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    url = base_url.rstrip("/") + "/chat/completions"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            payload = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:200].decode(errors="replace")
        raise JudgeHTTPError(f"{url}: HTTP {e.code}: {detail}") from None
    except TimeoutError:
        raise JudgeHTTPError(f"{url}: timed out after {timeout_s} s") from None
    except (urllib.error.URLError, ConnectionError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise JudgeHTTPError(f"{url}: {type(reason).__name__}: {reason}") from None
    try:
        return json.loads(payload)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise JudgeHTTPError(f"{url}: answer without choices[0].message.content: "
                             f"{payload[:200]!r}") from None

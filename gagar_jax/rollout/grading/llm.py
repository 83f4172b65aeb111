"""The LLM group grader: a judge model ranks a mixed group's passing candidates (issue 40).

    judge = HTTPJudge("http://127.0.0.1:8000/v1", "judge-model")        # a hosted judge, or
    judge = EngineJudge(engine, tokenizer, max_tokens=512)              # any rollout engine
    grader = as_grader_fn(LLMGrader(judge, orderings=3, retries=2, budget=6000))

Per group: the passing candidates are shown in `orderings` orders (the first sorted by id, the
second reversed, the rest shuffled with `seed`) against position bias; each prompt is the rubric of
`prompt.py` within `budget` tokens; each answer is constrained to `answer.answer_schema` (vLLM's
structured outputs, or `response_format` over HTTP), then validated (`answer.parse_answer`; ranks
with gaps renumbered densely) and asked again up to `retries` times with the error. The k rankings
are aggregated by Borda (`answer.borda`); Kendall's tau of each ordering against the aggregate, and
the mean over pairs, go into the grading evidence with the prompts' sizes and cuts. Any failure (an
answer still invalid, a timeout of the whole group `timeout_s`, the endpoint or engine raising)
gives `status: failed` with the reason (`base.grade_workspace`): the learner's binary fallback.
With `tools=judge_tools.ToolConfig()` (off by default) the judge may first read candidates' files
and rerun their visible tests in the agents' sandbox (`judge_tools.py`, a bounded number of turns).

The judge is configured on its own, never the policy by default: `--grader
gagar_jax.rollout.grading.llm:grader` builds it from the environment (`from_env`): a URL
(`GAGAR_JUDGE_URL`, `GAGAR_JUDGE_MODEL`, `GAGAR_JUDGE_API_KEY`) or an engine
(`GAGAR_JUDGE_ENGINE=module:factory`, `GAGAR_JUDGE_PATH` its weights, `GAGAR_JUDGE_TOKENIZER`
a tokenizer as the worker's `--tokenizer` takes it); without either it is a one-line error.
Imports no JAX (a JAX engine is imported only when named).
"""
from __future__ import annotations

import concurrent.futures
import json
import math
import os
import random
from collections.abc import Callable, Sequence
from typing import Protocol

from gagar_jax.rollout.engine import Engine, EngineOptions, Request, SamplingSpec
from gagar_jax.rollout.envs.tokenizer import Tokenizer
from gagar_jax.rollout.grading import answer, http_client, judge_tools, prompt
from gagar_jax.rollout.grading.base import GroupGrade, as_grader_fn
from gagar_jax.rollout.grading.workspace import GroupWorkspace


class Judge(Protocol):
    """What the LLM grader asks of a judge."""

    count: Callable[[str], int]      # text -> tokens, for the prompt's budget

    def ask(self, messages: list, schema: dict) -> str:
        """The answer text to the chat `messages`, constrained to `schema` where it can be."""
        ...


class HTTPJudge:
    """An OpenAI-compatible chat endpoint (`http_client.chat`, structured outputs on).

    Attributes:
      count: text -> tokens for the prompt budget (default `prompt.approx_tokens`: the judge's
        tokenizer is not at hand; pass its count when it is).
    """

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 max_tokens: int = 512, temperature: float = 0.0, timeout_s: float = 600.0,
                 count: Callable[[str], int] = prompt.approx_tokens):
        self.base_url, self.model, self.api_key = base_url, model, api_key
        self.max_tokens, self.temperature, self.timeout_s = max_tokens, temperature, timeout_s
        self.count = count

    def ask(self, messages: list, schema: dict) -> str:
        """The judge's answer text; `http_client.JudgeHTTPError` when there is none."""
        return http_client.chat(self.base_url, self.model, messages, schema=schema,
                                max_tokens=self.max_tokens, temperature=self.temperature,
                                timeout_s=self.timeout_s, api_key=self.api_key)


class EngineJudge:
    """A rollout engine (`engine.Engine`: vLLM offline, the JAX sampler, ...) as the judge.

    The messages go through the tokenizer's `prompt` (its chat format), the answer is decoded
    with its `decode`; the schema rides in `SamplingSpec.json_schema` (the vLLM engine hands it
    to structured outputs; an engine without them samples freely and validation catches it).
    """

    def __init__(self, engine: Engine, tokenizer: Tokenizer, *, max_tokens: int = 512,
                 temperature: float = 1e-3, seed: int = 0):
        self.engine, self.tok = engine, tokenizer
        self.max_tokens, self.temperature, self.seed = max_tokens, temperature, seed
        self.count = lambda text: len(tokenizer.encode(text))

    def ask(self, messages: list, schema: dict) -> str:
        spec = SamplingSpec(temperature=self.temperature, max_tokens=self.max_tokens,
                            stop_token_ids=tuple(self.tok.stop_token_ids),
                            json_schema=json.dumps(schema, sort_keys=True))
        ids = list(self.tok.prompt(messages))
        [[c]] = self.engine.generate([Request(ids, spec, seed=self.seed)])
        self.engine.cancel([c.sequence])
        stops = set(self.tok.stop_token_ids)
        return self.tok.decode([t for t in c.tokens if t not in stops])


def orderings(ids: Sequence[str], k: int, seed: int) -> list:
    """k orders of the candidates: sorted, reversed, then shuffles drawn from `seed`
    (distinct while there are orders left)."""
    base = sorted(ids)
    out = [tuple(base), tuple(reversed(base))][:k]
    rng = random.Random(seed)
    while len(out) < k:
        order = base[:]
        rng.shuffle(order)
        if tuple(order) not in out or len(set(out)) >= math.factorial(len(base)):
            out.append(tuple(order))
    return out


class LLMGrader:
    """The `GroupGrader` on a judge (`HTTPJudge`, `EngineJudge`, or any `ask(messages,
    schema) -> text` with a `count(text) -> tokens`).

    Args:
      judge: the judge.
      orderings: k >= 1 candidate orders per group (position bias, Borda, Kendall's tau).
      retries: extra asks per ordering after an invalid answer.
      budget: the prompt's token budget.
      timeout_s: the whole group's grading (0 = none): past it, status failed.
      seed: the shuffled orderings' seed.
      name: the grader's name in the evidence.
      tools: `judge_tools.ToolConfig` to let the judge read candidates' files and rerun their
        visible tests before answering (None, the default: no tools).
    """

    def __init__(self, judge: Judge, *, orderings: int = 3, retries: int = 2, budget: int = 6000,
                 timeout_s: float = 0.0, seed: int = 0, name: str = "llm",
                 tools: judge_tools.ToolConfig | None = None):
        if orderings < 1 or retries < 0:
            raise ValueError(f"orderings must be >= 1 and retries >= 0, got {orderings}, "
                             f"{retries}")
        self.judge, self.k, self.retries, self.budget = judge, orderings, retries, budget
        self.timeout_s, self.seed, self.name, self.tools = timeout_s, seed, name, tools

    def grade(self, ws: GroupWorkspace) -> GroupGrade:
        """Ranks `ws.passing()` (see the module docstring); raises on failure."""
        if self.timeout_s <= 0:
            return self._grade(ws)
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llm-judge")
        try:
            return pool.submit(self._grade, ws).result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the judge took more than {self.timeout_s} s on group "
                               f"{ws.task_id}") from None
        finally:
            pool.shutdown(wait=False)

    def _grade(self, ws: GroupWorkspace) -> GroupGrade:
        ids = [c.trajectory_id for c in ws.passing()]
        if len(ids) <= 1:        # nothing to compare: one pass is strong by itself
            return GroupGrade([{"trajectory_id": t, "tier": "strong", "rank": 0} for t in ids],
                              evidence={"grader": self.name, "judge_calls": 0})
        rankings, prompts, asks = [], [], 0
        session = judge_tools.ToolSession(ws, self.tools, self.judge.count) if self.tools else None
        for order in orderings(ids, self.k, self.seed):
            schema = answer.answer_schema(order)         # entries in the order shown
            r = prompt.render(ws, order, self.budget, self.judge.count)
            prompts.append({"order": list(order), "tokens": r.tokens, "cuts": list(r.cuts)})
            messages, errors, convo = list(r.messages), [], list(r.messages)
            for attempt in range(self.retries + 1):
                if session is not None and attempt == 0:     # tool turns, then the answer
                    raw, convo, n = judge_tools.converse(self.judge, messages, schema, session)
                    asks += n
                else:
                    asks += 1
                    raw = self.judge.ask(messages, schema)
                try:
                    rankings.append(answer.parse_answer(raw, ids, renumber=True))
                    break
                except ValueError as e:
                    errors.append(str(e)[:300])
                    messages = convo + [
                        {"role": "assistant", "content": raw[:2000]},
                        {"role": "user", "content": f"That answer is invalid: {e}. Answer again "
                                                    "with the JSON object only."}]
            else:
                raise ValueError(f"invalid judge answer after {self.retries + 1} attempts "
                                 f"(order {list(order)}): {errors[-1]}")
            prompts[-1]["invalid"] = errors
        final = answer.borda(rankings)
        taus = [answer.kendall_tau(r, final) for r in rankings]
        pairs = [answer.kendall_tau(a, b) for i, a in enumerate(rankings)
                 for b in rankings[i + 1:]]
        evidence = {"grader": self.name, "judge_calls": asks, "orderings": prompts,
                    "rankings": rankings, "kendall_tau_to_borda": taus,
                    "kendall_tau_pairs_mean": sum(pairs) / len(pairs) if pairs else 1.0}
        if session is not None:
            evidence["tools"] = session.log
        return GroupGrade(final, evidence=evidence)


def _context(opts: dict, max_tokens: int) -> int:
    """The judge's context: the prompt, its answers and, with tools, the tool turns."""
    t = opts.get("tools")
    extra = 0 if t is None else t.budget + (t.max_turns + 1) * (max_tokens + 32)
    return opts["budget"] + max_tokens + 64 + extra


def from_env(env: dict | None = None) -> LLMGrader:
    """The LLM grader the environment configures (the module docstring names the variables;
    `GAGAR_JUDGE_ORDERINGS`, `_RETRIES`, `_BUDGET`, `_TIMEOUT_S`, `_MAX_TOKENS` tune it).

    Raises:
      ValueError in one line when no judge is configured (the policy is never the default).
    """
    env = os.environ if env is None else env
    opts = {"orderings": int(env.get("GAGAR_JUDGE_ORDERINGS", 3)),
            "retries": int(env.get("GAGAR_JUDGE_RETRIES", 2)),
            "budget": int(env.get("GAGAR_JUDGE_BUDGET", 6000)),
            "timeout_s": float(env.get("GAGAR_JUDGE_TIMEOUT_S", 900))}
    if env.get("GAGAR_JUDGE_TOOLS", "0") not in ("", "0"):
        opts["tools"] = judge_tools.ToolConfig(
            max_turns=int(env.get("GAGAR_JUDGE_TOOL_TURNS", 4)),
            budget=int(env.get("GAGAR_JUDGE_TOOL_BUDGET", 4000)))
    max_tokens = int(env.get("GAGAR_JUDGE_MAX_TOKENS", 512))
    if env.get("GAGAR_JUDGE_URL"):
        judge = HTTPJudge(env["GAGAR_JUDGE_URL"], env.get("GAGAR_JUDGE_MODEL", ""),
                          api_key=env.get("GAGAR_JUDGE_API_KEY") or None, max_tokens=max_tokens,
                          timeout_s=opts["timeout_s"])
    elif env.get("GAGAR_JUDGE_ENGINE"):
        from gagar_jax.rollout.agent_worker import load_tokenizer
        from gagar_jax.rollout.worker import load_callable
        if not env.get("GAGAR_JUDGE_PATH"):
            raise ValueError("GAGAR_JUDGE_ENGINE needs GAGAR_JUDGE_PATH (the judge's weights)")
        engine = load_callable(env["GAGAR_JUDGE_ENGINE"], "GAGAR_JUDGE_ENGINE")(
            env["GAGAR_JUDGE_PATH"], EngineOptions(max_model_len=_context(opts, max_tokens),
                                                   routing=False))
        tok = load_tokenizer(env.get("GAGAR_JUDGE_TOKENIZER", ""), load_callable)
        judge = EngineJudge(engine, tok, max_tokens=max_tokens)
    else:
        raise ValueError("the LLM grader needs a judge: set GAGAR_JUDGE_URL (an OpenAI-compatible "
                         "endpoint) or GAGAR_JUDGE_ENGINE + GAGAR_JUDGE_PATH; the policy under "
                         "training is never the judge by default")
    return LLMGrader(judge, **opts)


def __getattr__(name: str):
    """`--grader gagar_jax.rollout.grading.llm:grader`: built from the environment on first use."""
    if name == "grader":
        fn = as_grader_fn(from_env())
        globals()["grader"] = fn
        return fn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

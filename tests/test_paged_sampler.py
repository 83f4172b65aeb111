"""The paged sampler (`gagar_jax/sample/`) against the learner's own forward, and its draws.

* Raw log-probs within 2e-5 (fp32) and routing exactly the learner's teacher-forced ones, on both
  families (MiMo: window exceeded, sinks, partial RoPE, router bias), over three turns of live
  sequences with continuous batching: more samples than slots, two decode steps per call (they
  join and leave mid-run), prefill in chunks of 8 for up to 2 sequences per call, a prompt's
  samples sharing its pages, new prompts joining the later turns; Qwen3 on per-layer weight
  copies, MiMo on the layer scan.
* Draws: top-k / top-p / temperature frequencies over 20k draws within 3 standard errors of the
  truncated distribution worked out in NumPy; the processed log-prob is that distribution's;
  the same key gives the same token, alone or in a batch.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.learner_ref import teacher
from support.vllm_served import CONFIGS, model_config, random_model

from gagar_jax.sample import draw
from gagar_jax.sample.sampler import SampleParams, Sampler, SamplerConfig, Work

TOL = 2e-5
rng = np.random.default_rng(7)
PROMPTS = [rng.integers(0, 256, n).tolist() for n in (12, 9, 5, 14, 7)]


@pytest.fixture(scope="module", params=list(CONFIGS))
def served(request):
    cfg = model_config(request.param)
    model = random_model(cfg, 3)
    # Qwen3 runs on per-layer weight copies (`layer_copies`), MiMo on the stacked scan: both
    # paths, no extra compile.
    sampler = Sampler(model, SamplerConfig(slots=3, page=4, max_len=64, decode_steps=2,
                                           max_chunk=8, max_prefill_rows=2,
                                           layer_copies=request.param == "qwen3_moe"))
    return cfg, model, sampler


def _check(model, cfg, context, turn, params):
    """One turn against the learner's teacher-forced pass on context + its tokens."""
    toks, c = turn.tokens, len(context)
    assert 1 <= len(toks) <= params.max_tokens
    t = teacher(model, list(context) + toks)
    want = np.asarray(t["logprobs"][c - 1:c - 1 + len(toks)])
    assert np.max(np.abs(np.asarray(turn.raw) - want)) < TOL
    np.testing.assert_array_equal(turn.routed, t["routes"][c - 1:c - 1 + len(toks)])
    assert turn.routed.shape == (len(toks), cfg.num_moe_layers, cfg.top_k)
    if params.top_k == 1:                                   # greedy: the argmax, log-prob 0
        assert toks == t["argmax"][c - 1:c - 1 + len(toks)]
        np.testing.assert_allclose(turn.processed, 0.0, atol=1e-6)
    if params.temperature == 1 and params.top_k <= 0 and params.top_p == 1:
        np.testing.assert_allclose(turn.processed, turn.raw, atol=1e-5)
    if turn.finish == "stop":
        assert toks[-1] in params.stop and not set(toks[:-1]) & set(params.stop)
    else:
        assert len(toks) == params.max_tokens and not set(toks) & set(params.stop)


def test_three_turns_with_continuous_batching_match_the_learner(served):
    cfg, model, sampler = served
    P = SampleParams
    turn1 = [Work(PROMPTS[0], [P(seed=1, max_tokens=7), P(seed=2, max_tokens=3)]),
             Work(PROMPTS[1], [P(top_k=1, max_tokens=5)]),
             Work(PROMPTS[2], [P(temperature=0.8, top_p=0.9, max_tokens=7, seed=3)]),
             Work(PROMPTS[3], [P(top_k=3, max_tokens=4, seed=4, stop=(17, 99))])]
    contexts = {}
    for work, turns in zip(turn1, sampler.generate(turn1), strict=True):
        for p, t in zip(work.params, turns, strict=True):
            _check(model, cfg, work.tokens, t, p)
            contexts[t.sequence] = list(work.tokens) + t.tokens
    assert sampler.stats["forks"] == 1 and sampler.stats["joined_running"] >= 1
    assert sampler.stats["prefill_chunks"] > len(turn1)          # the 12- and 14-token prompts
    # turns 2 and 3: every live sequence continues (appended tokens, or none), a new prompt joins
    for turn, appended in ((2, [[3, 44, 12], [7], [], [250, 1], [9, 9]]),
                           (3, [[5], [], [61, 2, 8], [0], [4]])):
        seqs = sorted(contexts)
        works = [Work(a, [P(seed=10 * turn + i, max_tokens=3 + i % 3, top_k=1 if i == 1 else -1)],
                      sequence=s) for i, (s, a) in enumerate(zip(seqs, appended, strict=True))]
        works.append(Work(PROMPTS[4], [P(seed=turn, max_tokens=4)]))
        for work, [t] in zip(works, sampler.generate(works), strict=True):
            context = contexts.get(work.sequence, []) + list(work.tokens)
            _check(model, cfg, context, t, work.params[0])
            if work.sequence is not None:
                assert t.sequence == work.sequence
                contexts[t.sequence] = context + t.tokens
            else:
                sampler.cancel([t.sequence])
    assert sampler.stats["joined_running"] >= 3
    sampler.cancel(list(contexts))
    assert sampler.pages.full.used == sampler.pages.rings.used == 0   # every page back


def test_errors_name_the_work(served):
    _, _, sampler = served
    with pytest.raises(KeyError, match="work 0: no live sequence 'nope'"):
        sampler.generate([Work([1], [SampleParams()], sequence="nope")])
    with pytest.raises(ValueError, match="work 1: 64 tokens fill the context"):
        sampler.generate([Work([1], [SampleParams()]), Work([2] * 64, [SampleParams()])])
    with pytest.raises(ValueError, match=r"work 0: token ids \[300\] outside"):
        sampler.generate([Work([1, 300], [SampleParams()])])
    assert not sampler.seqs


# ----------------------------------------------------------------------------- draws
LOGITS = np.array([2.0, 1.5, 1.2, 0.9, 0.4, 0.1, -0.3, -0.8, -1.0, -1.7, -2.5, -3.0], np.float32)
N = 20_000


def truncated(logits, temperature, top_k, top_p):
    """vLLM's order, in NumPy: temperature, then the k most likely, then the smallest most likely
    set whose renormalised mass reaches p."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z)
    keep = np.zeros(len(z), bool)
    keep[order[:top_k if top_k > 0 else len(z)]] = True
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    mass = 0.0
    for i in order:
        if not keep[i]:
            continue
        if mass >= top_p:
            keep[i] = False
        mass += p[i]
    p = np.where(keep, p, 0.0)
    return p / p.sum()


@jax.jit
def _draws(keys, temperature, top_k, top_p):
    n = keys.shape[0]
    full = lambda v, dt: jnp.full((n,), v, dt)
    return draw.sample(jnp.broadcast_to(LOGITS, (n, len(LOGITS))), keys,
                       full(temperature, jnp.float32), full(top_k, jnp.int32),
                       full(top_p, jnp.float32))


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 5, 1.0), (1.0, -1, 0.8),
                                                      (1.3, 4, 0.7), (1.0, -1, 1.0)])
def test_draw_frequencies_match_the_truncated_distribution(temperature, top_k, top_p):
    keys = draw.row_keys(jnp.full((N,), 1234, jnp.uint32), jnp.arange(N))
    d = jax.device_get(_draws(keys, temperature, top_k, top_p))
    want = truncated(LOGITS, temperature, top_k, top_p)
    freq = np.bincount(d.token_B, minlength=len(LOGITS)) / N
    se = np.sqrt(want * (1 - want) / N)
    assert np.all(np.abs(freq - want) <= 3 * se), (freq, want)
    assert np.all(freq[want == 0] == 0)
    assert (want == 0).any() == (top_k > 0 or top_p < 1)        # truncated where asked
    np.testing.assert_allclose(d.processed_logprob_B, np.log(want[d.token_B]), atol=1e-5)
    raw = LOGITS - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    np.testing.assert_allclose(d.raw_logprob_B, raw[d.token_B], atol=1e-5)
    # the same keys, the same tokens; a row drawn alone equals the same row in the batch
    again = jax.device_get(_draws(keys, temperature, top_k, top_p))
    np.testing.assert_array_equal(again.token_B, d.token_B)
    one = jax.device_get(_draws(keys[7:8], temperature, top_k, top_p))
    assert one.token_B[0] == d.token_B[7]

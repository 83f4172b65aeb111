"""The sampler: its log-probs and routing equal the learner's on the same tokens and weights.

One shape for every test (B = 8 rows, cache C = 64, 10 new tokens): one compile of `generate`.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.paths import load_config, load_tiny_config

from gagar_jax.model.logprobs import token_logprobs
from gagar_jax.model.transformer import ModelConfig, Transformer
from gagar_jax.sim import sampler

B, C, M = 8, 64, 10
STOP = (7, 8)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.from_config(load_tiny_config().model)
    return Transformer(cfg, rngs=nnx.Rngs(0))


def _pad(seqs, experts=None, LK=(2, 2)):
    """Right-pads sequences to C (segment id 0 on padding): one jitted shape for every check."""
    tok, seg = np.zeros((len(seqs), C), np.int32), np.zeros((len(seqs), C), np.int32)
    ex = np.full((len(seqs), C) + tuple(LK), -1, np.int32)
    for i, s in enumerate(seqs):
        tok[i, :len(s)], seg[i, :len(s)] = s, 1
        if experts:
            ex[i, :len(s)] = experts[i]
    pos = np.broadcast_to(np.arange(C, dtype=np.int32), tok.shape) * (seg > 0)
    return jnp.asarray(tok), jnp.asarray(seg), jnp.asarray(pos), jnp.asarray(ex)


@nnx.jit
def _learner(model, tok, seg, pos, ex):
    return token_logprobs(model, tok, seg, pos, ex)[0]


@nnx.jit
def _routing(model, tok, seg, pos):
    x = model.embedding[...][tok]
    _, stats = model._scan(model.moe_layers, x, seg, pos, None)
    return stats.routed_BxSxK


def learner_logprobs(model, seqs, experts=None):
    """Learner log-probs of each sequence (routing replayed from `experts` where given)."""
    tok, seg, pos, ex = _pad(seqs, experts, (model.cfg.num_moe_layers, model.cfg.top_k))
    lp = np.asarray(_learner(model, tok, seg, pos, ex))
    return [lp[i, :len(s)] for i, s in enumerate(seqs)]


def model_routing(model, seqs):
    """[S, L, K] experts the model's own forward pass (blockwise attention, layer scan) picks."""
    tok, seg, pos, _ = _pad(seqs)
    r = np.moveaxis(np.asarray(_routing(model, tok, seg, pos)), 0, 2)
    return [r[i, :len(s)] for i, s in enumerate(seqs)]


@pytest.fixture(scope="module")
def generated(model):
    rng = np.random.default_rng(0)
    ctx = rng.integers(13, 200, (B, C)).astype(np.int32)
    lengths = np.array([1, 3, 5, 9, 17, 30, 41, 54], np.int32)
    gen = jax.device_get(sampler.generate(model, ctx, lengths, jax.random.key(1), max_new=M,
                                          stop_tokens=STOP))
    return ctx, lengths, gen


def test_logprobs_and_routing_match_learner(model, generated):
    ctx, lengths, gen = generated
    L, K = model.cfg.num_moe_layers, model.cfg.top_k
    nm = [(lengths[b], int(gen.num_new_B[b])) for b in range(B)]
    seqs = [np.concatenate([ctx[b, :n], gen.tokens_BxM[b, :m]]) for b, (n, m) in enumerate(nm)]
    experts = [np.concatenate([gen.prefill_experts_BxCxLxK[b, :n], gen.new_experts_BxMxLxK[b, :m]])
               for b, (n, m) in enumerate(nm)]
    replayed, free = learner_logprobs(model, seqs, experts), learner_logprobs(model, seqs)
    routing = model_routing(model, seqs)
    for b, (n, m) in enumerate(nm):
        assert experts[b].shape == (n + m, L, K)
        # Every token but the last generated one (never fed back) has a record...
        assert (experts[b][:-1] >= 0).all() and (experts[b][-1] == -1).all()
        # ...equal to the model's own routing of the whole sequence.
        np.testing.assert_array_equal(experts[b][:-1], routing[b][:-1])
        np.testing.assert_allclose(gen.logprobs_BxM[b, :m], replayed[b][n:], atol=1e-5, rtol=0)
        np.testing.assert_allclose(gen.logprobs_BxM[b, :m], free[b][n:], atol=1e-5, rtol=0)
        assert (gen.logprobs_BxM[b, m:] == 0).all() and (gen.tokens_BxM[b, m:] == 0).all()


def test_stop_tokens_end_rows(generated):
    _, _, gen = generated
    for b in range(B):
        m = int(gen.num_new_B[b])
        body = gen.tokens_BxM[b, :m]
        assert not np.isin(body[:-1], STOP).any()
        assert m == M or body[-1] in STOP


def test_sampling_follows_the_distribution(model):
    """Temperature sampling of the first token matches softmax(logits / T) (chi-square-ish)."""
    ctx = np.tile(np.arange(C, dtype=np.int32) % 50 + 20, (B, 1))
    lengths = np.full((B,), 4, np.int32)
    counts = np.zeros(model.cfg.vocab_size)
    for i in range(25):
        gen = sampler.generate(model, ctx, lengths, jax.random.key(100 + i), max_new=M,
                               temperature=2.0, stop_tokens=STOP)
        np.add.at(counts, np.asarray(gen.tokens_BxM[:, 0]), 1)
    logits, _ = model(jnp.asarray(ctx[:1, :4]))
    p = np.asarray(jax.nn.softmax(logits[0, -1] / 2.0))
    # 200 draws: the empirical mass of the 20 likeliest tokens is within 4 sigma of theirs.
    top = np.argsort(-p)[:20]
    mass, n = p[top].sum(), counts.sum()
    assert abs(counts[top].sum() / n - mass) < 4 * np.sqrt(mass * (1 - mass) / n)
    # Greedy decoding is deterministic and picks the argmax.
    g0 = sampler.generate(model, ctx, lengths, jax.random.key(0), max_new=M, temperature=0.0,
                          stop_tokens=STOP)
    g1 = sampler.generate(model, ctx, lengths, jax.random.key(5), max_new=M, temperature=0.0,
                          stop_tokens=STOP)
    np.testing.assert_array_equal(g0.tokens_BxM, g1.tokens_BxM)
    assert int(g0.tokens_BxM[0, 0]) == int(np.argmax(p))


def test_top_p_samples_the_nucleus_and_records_untruncated_logprobs(model):
    ctx = np.tile(np.arange(C, dtype=np.int32) % 50 + 20, (B, 1))
    lengths = np.full((B,), 4, np.int32)
    logits, _ = model(jnp.asarray(ctx[:1, :4]))
    logits = np.asarray(logits[0, -1], np.float64)
    p = np.exp(logits / 2.0 - np.max(logits / 2.0))
    p /= p.sum()
    order = np.argsort(-p)
    nucleus = set(order[:np.searchsorted(np.cumsum(p[order]), 0.5) + 1].tolist())
    assert 1 < len(nucleus) < 100
    drawn = set()
    for i in range(4):
        gen = sampler.generate(model, ctx, lengths, jax.random.key(200 + i), max_new=M,
                               temperature=2.0, stop_tokens=STOP, top_p=0.5)
        toks = np.asarray(gen.tokens_BxM[:, 0])
        drawn |= set(toks.tolist())
        logp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        np.testing.assert_allclose(np.asarray(gen.logprobs_BxM[:, 0]), logp[toks], atol=1e-5)
    assert drawn <= nucleus and len(drawn) > 1
    # top_p is traced: another mass, or none (1), reuses the compiled program.
    compiled = sampler._extend._cache_size()
    for top_p in (0.9, 1.0):
        sampler.generate(model, ctx, lengths, jax.random.key(0), max_new=M, temperature=2.0,
                         stop_tokens=STOP, top_p=top_p)
    assert sampler._extend._cache_size() == compiled
    with pytest.raises(ValueError, match="top_p"):
        sampler.generate(model, ctx, lengths, jax.random.key(0), max_new=M, top_p=0.0)


class EchoEnv:
    """Always continues: appends a 3-token tool span after each turn, ends after 3 turns."""

    def __init__(self, prompt):
        self.tokens, self.loss_mask = list(prompt), [0] * len(prompt)
        self.turns, self.done = 0, False

    def step(self, turn):
        self.tokens += list(turn)
        self.loss_mask += [1] * len(turn)
        self.turns += 1
        if self.turns == 3:
            self.done = True
            return []
        tool = [9, 11 + self.turns, 10]
        self.tokens += tool
        self.loss_mask += [0] * len(tool)
        return tool


def test_multi_turn_rollout_matches_learner(model):
    rng = np.random.default_rng(3)
    envs = [EchoEnv(rng.integers(13, 200, 3 + b)) for b in range(B)]
    rolls = sampler.rollout(model, envs, jax.random.key(7), cache_len=C, max_turns=3,
                            max_turn_tokens=M, stop_tokens=STOP)
    seqs = [r.episode.tokens for r in rolls]
    lps = learner_logprobs(model, seqs, [r.experts for r in rolls])
    routing = model_routing(model, seqs)
    for r, lp, routed in zip(rolls, lps, routing, strict=False):
        toks, mask = r.episode.tokens, np.array(r.episode.loss_mask)
        assert len(r.logprobs) == len(toks) == len(r.experts) and r.episode.turns == 3
        np.testing.assert_allclose(np.array(r.logprobs), lp * mask, atol=1e-5, rtol=0)
        assert (np.array(r.logprobs)[mask == 0] == 0).all()
        # Tool-output tokens were routed in the next round's prefill; the last token never.
        assert (r.experts[:-1] >= 0).all() and (r.experts[-1] == -1).all()
        np.testing.assert_array_equal(r.experts[:-1], routed[:-1])


def test_bad_arguments(model):
    ctx = np.zeros((B, C), np.int32)
    with pytest.raises(ValueError, match="cache"):
        sampler.generate(model, ctx, np.full((B,), 60, np.int32), jax.random.key(0), max_new=M,
                         stop_tokens=STOP)
    with pytest.raises(ValueError, match="lengths_B"):
        sampler.generate(model, ctx, np.zeros((B,), np.int32), jax.random.key(0), max_new=M,
                         stop_tokens=STOP)


def test_mimo_family_sampler_matches_learner():
    """MiMo-V2-Flash features in the KV-cache sampler: sliding window (32 < the longest row),
    sinks, own sliding KV heads, value width, partial rotary, no q/k norm, the layer pattern,
    and a dense first layer (both kinds of cached stacks, routing from the MoE layers only)."""
    c = load_config("tiny_mimo").model
    model = Transformer(ModelConfig.from_config(c), rngs=nnx.Rngs(5))
    assert model.cfg.sliding_window < 54
    ctx = np.random.default_rng(6).integers(13, 200, (B, C)).astype(np.int32)
    lengths = np.arange(2, 2 + 7 * B, 7).astype(np.int32)
    gen = jax.device_get(sampler.generate(model, ctx, lengths, jax.random.key(3), max_new=M,
                                          stop_tokens=STOP))
    assert gen.new_experts_BxMxLxK.shape == (B, M, 3, model.cfg.top_k)
    nm = [(lengths[b], int(gen.num_new_B[b])) for b in range(B)]
    seqs = [np.concatenate([ctx[b, :n], gen.tokens_BxM[b, :m]]) for b, (n, m) in enumerate(nm)]
    experts = [np.concatenate([gen.prefill_experts_BxCxLxK[b, :n], gen.new_experts_BxMxLxK[b, :m]])
               for b, (n, m) in enumerate(nm)]
    for b, lp in enumerate(learner_logprobs(model, seqs, experts)):
        n, m = nm[b]
        np.testing.assert_allclose(gen.logprobs_BxM[b, :m], lp[n:], atol=1e-5, rtol=0)

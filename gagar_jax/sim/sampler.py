"""Batched autoregressive sampling for the MoE policy, with a KV cache (the miniature's rollout
engine).

One call of `generate` runs, under one `jax.jit`:
  * prefill: the whole right-padded context [B, C] through the model's own blocks, keeping each
    layer's keys and values as the cache (C = cache length) and the experts every MoE layer chose
    for every context token (routing replay in: positions with recorded experts reuse them);
  * decode: a `lax.while_loop` of one-token steps (at most `max_new`, stopping early once every
    row has emitted a stop token), each writing its key/value at the row's own position,
    sampling the next token at a temperature, and recording its log-prob and the experts the
    input token was routed to.
The decode step reuses the model's parameters and submodules (norms, projections, RoPE, the MoE
layer with its router); only attention against the cache is written here.

Recorded log-probs are those of the untempered policy (what the learner recomputes); they equal
the behavior log-probs when `temperature == 1`, the setting of the miniature.

Multi-turn episodes (`rollout`): each round re-prefills every unfinished episode's whole context
(prompt, earlier turns, tool output) with routing replay of every recorded position, decodes one
turn, and hands it to the environment, which appends the tool-output span. Replaying the recorded
routing keeps one routing per token across rounds, exactly what the learner replays.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


_NEG = -1e30


@flax.struct.dataclass
class Generation:
    """One decoded turn per row.

    tokens_BxM: generated tokens (0 after a row's stop token); logprobs_BxM: their untempered
    log-probs (0 after the stop); num_new_B: tokens generated per row, stop token included;
    prefill_experts_BxCxLxK: the experts each context token used (-1 past the row's length);
    new_experts_BxMxLxK: the experts each generated token used as an input (-1 for the last
    generated token of a row, which is never fed back, and after the stop).
    """
    tokens_BxM: jax.Array
    logprobs_BxM: jax.Array
    num_new_B: jax.Array
    prefill_experts_BxCxLxK: jax.Array
    new_experts_BxMxLxK: jax.Array


# ----------------------------------------------------------------------------- model pieces
def _attend(attn, x_BxNxD, positions_BxN, k_BxCxKxD, v_BxCxKxV, write_B):
    """The model's attention over a KV cache. N = C (prefill: the cache is this pass's keys) or
    N = 1 (decode: the new key/value is written at each row's position `write_B`). Full or
    sliding-window layers, with sinks where the layer has them."""
    dt = x_BxNxD.dtype
    q, k, v = attn.project_qkv(x_BxNxD, positions_BxN)
    if write_B is None:
        k_BxCxKxD, v_BxCxKxV = k, v
    else:
        rows = jnp.arange(k.shape[0])
        k_BxCxKxD = k_BxCxKxD.at[rows, write_B].set(k[:, 0])
        v_BxCxKxV = v_BxCxKxV.at[rows, write_B].set(v[:, 0])
    B, N, H, Dh = q.shape
    C, Kv, Dv = k_BxCxKxD.shape[1], k_BxCxKxD.shape[2], v_BxCxKxV.shape[3]
    qg = q.reshape(B, N, Kv, H // Kv, Dh)
    s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k_BxCxKxD, preferred_element_type=jnp.float32)
    s = s * (Dh ** -0.5)
    # Causal over the row: the cache index of a key is its position (one segment per row).
    ago = positions_BxN[:, :, None] - jnp.arange(C)[None, None, :]
    visible = (ago >= 0) & ((ago < attn.window) if attn.window else True)
    s = jnp.where(visible[:, None, None], s, _NEG)
    sinks = attn.sinks_H()
    if sinks is None:
        p = jax.nn.softmax(s, axis=-1)
    else:  # the sink logit joins the denominator only
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, Kv, H // Kv, 1, 1),
                                s.shape[:-1] + (1,))
        p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    o = jnp.einsum("bkgqs,bskd->bqkgd", p.astype(v_BxCxKxV.dtype), v_BxCxKxV,
                   preferred_element_type=jnp.float32).reshape(B, N, H, Dv).astype(dt)
    return jnp.einsum("bshk,hkd->bsd", o, attn.wo[...].astype(dt)), k_BxCxKxD, v_BxCxKxV


def _blocks(model, spec):
    """The Block stacks of a `LayerStack`, one per pattern position."""
    mod = getattr(model, spec.name)
    return [mod] if len(spec.pattern) == 1 else [getattr(mod, f"p{k}") for k in range(len(spec.pattern))]


def _run_stack(model, spec, x_BxNxD, positions_BxN, cache, write_B, routed_RxPxBxNxK):
    """Scans one `LayerStack` (its layer pattern per scan step); returns x, the new cache (per
    pattern position k, v: [R, B, C, Kv, D]) and the experts chosen per MoE layer in layer order
    ([R * P, B, N, K], or None for dense layers)."""
    splits = [nnx.split(b) for b in _blocks(model, spec)]
    mask_BxN = jnp.ones(positions_BxN.shape, jnp.bool_)

    def body(x, inputs):
        states, k_cs, v_cs, routed = inputs
        new_k, new_v, ids = [], [], []
        for pos, (graphdef, _) in enumerate(splits):
            block = nnx.merge(graphdef, states[pos])
            a, k_c, v_c = _attend(block.attn, block.attn_norm(x), positions_BxN, k_cs[pos],
                                  v_cs[pos], write_B)
            h = x + a
            if block.is_moe:
                y, stats = block.mlp(block.mlp_norm(h), mask_BxN, None if routed is None else routed[pos])
                x = h + y
                ids.append(stats.routed_BxSxK)
            else:
                x = h + block.mlp(block.mlp_norm(h))
            new_k.append(k_c)
            new_v.append(v_c)
        return x, (new_k, new_v, jnp.stack(ids) if ids else None)

    k_L, v_L = cache
    x, (k_L, v_L, ids) = jax.lax.scan(body, x_BxNxD, ([s for _, s in splits], k_L, v_L,
                                                       routed_RxPxBxNxK))
    if ids is not None:
        ids = ids.reshape(-1, *ids.shape[2:])
    return x, (k_L, v_L), ids


def _forward(model, tokens_BxN, positions_BxN, caches, write_B, routed_LxBxNxK):
    """Final-normed hidden states [B, N, D], updated caches, MoE experts [L, B, N, K]."""
    cfg = model.cfg
    x = model.embedding[...].astype(cfg.compute_dtype)[tokens_BxN]
    new_caches, ids = {}, []
    for spec in model.stacks:
        routed = None
        if routed_LxBxNxK is not None and spec.moe:
            m0 = spec.first - cfg.num_dense_layers
            routed = routed_LxBxNxK[m0:m0 + spec.repeats * len(spec.pattern)]
            routed = routed.reshape(spec.repeats, len(spec.pattern), *routed.shape[1:])
        x, new_caches[spec.name], got = _run_stack(model, spec, x, positions_BxN,
                                                   caches[spec.name], write_B, routed)
        if spec.moe:
            ids.append(got)
    return model.final_norm(x), new_caches, (jnp.concatenate(ids) if ids else None)


def _empty_caches(model, B: int, C: int):
    cfg, dt = model.cfg, model.cfg.compute_dtype
    caches = {}
    for spec in model.stacks:
        kv = [cfg.sliding_kv_heads if sl else cfg.num_kv_heads for sl in spec.pattern]
        caches[spec.name] = ([jnp.zeros((spec.repeats, B, C, n, cfg.head_dim), dt) for n in kv],
                             [jnp.zeros((spec.repeats, B, C, n, cfg.value_head_dim), dt) for n in kv])
    return caches


# ----------------------------------------------------------------------------- generation
def _sample(logits_BxV, key, temperature):
    """Samples at `temperature` (a traced scalar; 0 = greedy), returns (token, untempered lp)."""
    logp = jax.nn.log_softmax(logits_BxV, axis=-1)
    drawn = jax.random.categorical(key, logits_BxV / jnp.maximum(temperature, 1e-6), axis=-1)
    tok = jnp.where(temperature > 0, drawn, jnp.argmax(logits_BxV, axis=-1)).astype(jnp.int32)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new", "stop_tokens"))
def _generate(graphdef, state, context_BxC, lengths_B, routed_BxCxLxK, key, temperature, *,
              max_new: int, stop_tokens: tuple):
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    B, C = context_BxC.shape
    L, K = cfg.num_moe_layers, cfg.top_k
    rows = jnp.arange(B)
    w_DxV = model.output_kernel_DxV()
    stops = jnp.asarray(stop_tokens, jnp.int32)

    positions = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, C))
    routed_in = jnp.moveaxis(routed_BxCxLxK, 2, 0) if L else None
    h, caches, ids = _forward(model, context_BxC, positions, _empty_caches(model, B, C), None,
                              routed_in)
    in_context = (jnp.arange(C)[None, :] < lengths_B[:, None])[:, :, None, None]
    prefill_experts = (jnp.where(in_context, jnp.moveaxis(ids, 0, 2), -1) if L
                       else jnp.zeros((B, C, 0, K), jnp.int32))
    logits = jnp.einsum("bd,dv->bv", h[rows, lengths_B - 1], w_DxV,
                        preferred_element_type=jnp.float32)
    tok, lp = _sample(logits, jax.random.fold_in(key, 0), temperature)

    out_tok = jnp.zeros((B, max_new), jnp.int32).at[:, 0].set(tok)
    out_lp = jnp.zeros((B, max_new), jnp.float32).at[:, 0].set(lp)
    out_ids = jnp.full((B, max_new, L, K), -1, jnp.int32)
    done = jnp.isin(tok, stops) | (max_new == 1)

    def cond(carry):
        t, _, done, *_ = carry
        return (t < max_new - 1) & ~jnp.all(done)

    def body(carry):
        t, tok, done, caches, out_tok, out_lp, out_ids = carry
        pos_B = lengths_B + t  # the fed token's position
        h, caches, ids = _forward(model, tok[:, None], pos_B[:, None], caches, pos_B, None)
        logits = jnp.einsum("bd,dv->bv", h[:, 0], w_DxV, preferred_element_type=jnp.float32)
        nxt, lp = _sample(logits, jax.random.fold_in(key, t + 1), temperature)
        nxt, lp = jnp.where(done, 0, nxt), jnp.where(done, 0.0, lp)
        if L:
            rec = jnp.where(done[:, None, None], -1, jnp.moveaxis(ids[:, :, 0], 0, 1))
            out_ids = out_ids.at[:, t].set(rec)
        out_tok = out_tok.at[:, t + 1].set(nxt)
        out_lp = out_lp.at[:, t + 1].set(lp)
        return t + 1, nxt, done | jnp.isin(nxt, stops), caches, out_tok, out_lp, out_ids

    carry = (jnp.zeros((), jnp.int32), tok, done, caches, out_tok, out_lp, out_ids)
    t, _, _, _, out_tok, out_lp, out_ids = jax.lax.while_loop(cond, body, carry)
    # Tokens up to and including the first stop (or all max_new).
    is_stop = jnp.isin(out_tok, stops)
    first_stop = jnp.where(is_stop.any(1), jnp.argmax(is_stop, axis=1) + 1, max_new)
    return Generation(tokens_BxM=out_tok, logprobs_BxM=out_lp,
                      num_new_B=first_stop.astype(jnp.int32),
                      prefill_experts_BxCxLxK=prefill_experts, new_experts_BxMxLxK=out_ids)


def generate(model, context_BxC, lengths_B, key, *, max_new: int, temperature: float = 1.0,
             stop_tokens: Sequence[int] = (), routed_experts_BxCxLxK=None) -> Generation:
    """Samples up to `max_new` tokens after each row's context.

    Args:
      model: a `Transformer`.
      context_BxC: int32 right-padded contexts; C is the cache length and must leave room for
        `max_new` tokens after every row's context.
      lengths_B: context length per row (>= 1).
      key: PRNG key.
      max_new: tokens to generate per row (a row stops early at any of `stop_tokens`).
      temperature: sampling temperature (0 = greedy).
      stop_tokens: tokens that end a row's turn (kept in the output).
      routed_experts_BxCxLxK: optional routing replay for context tokens (-1 = router selects).
    Returns:
      A `Generation`.
    """
    context_BxC = np.asarray(context_BxC, np.int32)
    lengths_B = np.asarray(lengths_B, np.int32)
    B, C = context_BxC.shape
    if lengths_B.shape != (B,) or lengths_B.min() < 1:
        raise ValueError(f"lengths_B must be [{B}] with entries >= 1, got {lengths_B}")
    if lengths_B.max() + max_new > C:
        raise ValueError(f"context length {lengths_B.max()} + max_new {max_new} exceeds the cache "
                         f"length C={C}")
    if max_new < 1 or temperature < 0:
        raise ValueError("max_new must be >= 1 and temperature >= 0")
    L, K = model.cfg.num_moe_layers, model.cfg.top_k
    if routed_experts_BxCxLxK is None:
        routed_experts_BxCxLxK = np.full((B, C, L, K), -1, np.int32)
    graphdef, state = nnx.split(model)
    return _generate(graphdef, state, jnp.asarray(context_BxC), jnp.asarray(lengths_B),
                     jnp.asarray(routed_experts_BxCxLxK, jnp.int32), key,
                     jnp.asarray(temperature, jnp.float32), max_new=int(max_new),
                     stop_tokens=tuple(int(s) for s in stop_tokens))


# ----------------------------------------------------------------------------- episodes
@dataclasses.dataclass
class Rollout:
    """A finished episode with what the rollout engine recorded for every token of it.

    logprobs: float per token (0.0 on prompt and tool-output tokens); experts: int32
    [len(tokens), L, K], the experts token t used as an input (-1 = not recorded).
    """
    episode: object
    logprobs: list
    experts: np.ndarray


def rollout(model, episodes, key, *, cache_len: int, max_turns: int, max_turn_tokens: int,
            temperature: float = 1.0, stop_tokens: Sequence[int] = ()) -> list:
    """Plays multi-turn episodes to the end with the policy (one fixed-shape batch, B = rows).

    Args:
      model: a `Transformer`.
      episodes: fresh environments with `tokens`, `done` and `step(turn_tokens) -> tool tokens`
        (e.g. `sim.task.Episode`); one batch row each.
      key: PRNG key. cache_len: C (>= longest episode). max_turns, max_turn_tokens: limits.
      temperature, stop_tokens: as in `generate`.
    Returns:
      A `Rollout` per episode, in order.
    """
    L, K = model.cfg.num_moe_layers, model.cfg.top_k
    B = len(episodes)
    lps = [[0.0] * len(ep.tokens) for ep in episodes]
    experts = [np.full((len(ep.tokens), L, K), -1, np.int32) for ep in episodes]
    for turn in range(max_turns):
        active = [i for i, ep in enumerate(episodes) if not ep.done]
        if not active:
            break
        ctx = np.zeros((B, cache_len), np.int32)
        routed = np.full((B, cache_len, L, K), -1, np.int32)
        lengths = np.ones((B,), np.int32)
        for i in active:
            n = len(episodes[i].tokens)
            ctx[i, :n], routed[i, :n], lengths[i] = episodes[i].tokens, experts[i], n
        gen = jax.device_get(generate(model, ctx, lengths, jax.random.fold_in(key, turn),
                                      max_new=max_turn_tokens, temperature=temperature,
                                      stop_tokens=stop_tokens, routed_experts_BxCxLxK=routed))
        for i in active:
            ep, n0, m = episodes[i], lengths[i], int(gen.num_new_B[i])
            experts[i][:n0] = gen.prefill_experts_BxCxLxK[i, :n0]
            tool = ep.step(gen.tokens_BxM[i, :m].tolist())
            lps[i] += gen.logprobs_BxM[i, :m].tolist() + [0.0] * len(tool)
            experts[i] = np.concatenate([experts[i], gen.new_experts_BxMxLxK[i, :m],
                                         np.full((len(tool), L, K), -1, np.int32)])
    for ep in episodes:
        if not ep.done:
            ep.step([])  # out of turns: the environment ends it (an empty turn is a truncation)
    return [Rollout(ep, lp, ex) for ep, lp, ex in zip(episodes, lps, experts)]

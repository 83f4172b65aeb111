"""Batched autoregressive sampling for the MoE policy, with a KV cache kept across turns (the
miniature's rollout engine).

One call of `_extend` runs, under one `jax.jit`:
  * extend: a right-padded chunk of new tokens [B, N] (the prompt on the first turn; the last
    generated token and the tool output afterwards) through the model's own blocks, writing each
    token's key and value at its row's position in the fixed-length cache [B, C] and recording
    the experts every MoE layer chose for it (routing replay in: recorded experts are reused);
  * decode: a `lax.while_loop` of one-token steps (at most `max_new`, stopping early once every
    active row has emitted a stop token), each writing its key/value at the row's own position,
    sampling the next token at a temperature, and recording its log-prob, the entropy of the
    distribution it came from and the experts the input token was routed to.
It returns the cache, so the next turn only runs the new tokens: nothing is prefilled twice.
The blocks reuse the model's parameters and submodules (norms, projections, RoPE, the MoE layer
with its router); only attention against the cache is written here.

Recorded log-probs are those of the untempered policy (what the learner recomputes); they equal
the behavior log-probs when `temperature == 1`, the setting of the miniature.

Multi-turn episodes (`rollout`): each round feeds every unfinished episode's unseen tokens into
its cache row, decodes one turn, and hands it to the environment, which appends the tool-output
span. Every token passes through the model exactly once, so it has exactly one routing, the one
the learner replays.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

if TYPE_CHECKING:
    from gagar_jax.model.layer_pattern import LayerStack
    from gagar_jax.model.layers import Attention
    from gagar_jax.model.transformer import Transformer


_NEG = -1e30


@flax.struct.dataclass
class Generation:
    """One decoded turn per row.

    tokens_BxM: generated tokens (0 after a row's stop token); logprobs_BxM: their untempered
    log-probs (0 after the stop); entropy_BxM: the untempered entropy of the distribution each
    was drawn from (0 after the stop); num_new_B: tokens generated per row, stop token included
    (0 for inactive rows); prefill_experts_BxCxLxK: the experts each fed chunk token used (-1
    past the row's chunk; C = the chunk length);
    new_experts_BxMxLxK: the experts each generated token used as an input (-1 for the last
    generated token of a row, which is never fed back, and after the stop).
    """
    tokens_BxM: jax.Array
    logprobs_BxM: jax.Array
    entropy_BxM: jax.Array
    num_new_B: jax.Array
    prefill_experts_BxCxLxK: jax.Array
    new_experts_BxMxLxK: jax.Array


# ----------------------------------------------------------------------------- model pieces
def _attend(attn: Attention, x_BxNxD: jax.Array, positions_BxN: jax.Array, k_BxCxKxD: jax.Array,
            v_BxCxKxV: jax.Array, write_BxN: jax.Array):
    """The model's attention over a KV cache: each of the N new keys/values is written at its
    cache index `write_BxN` (indices >= C are dropped: padding, finished rows), then every query
    attends to the cache entries at or before its position. Full or sliding-window layers, with
    sinks where the layer has them."""
    dt = x_BxNxD.dtype
    q, k, v = attn.project_qkv(x_BxNxD, positions_BxN)
    rows = jnp.arange(k.shape[0])[:, None]
    k_BxCxKxD = k_BxCxKxD.at[rows, write_BxN].set(k.astype(k_BxCxKxD.dtype), mode="drop")
    v_BxCxKxV = v_BxCxKxV.at[rows, write_BxN].set(v.astype(v_BxCxKxV.dtype), mode="drop")
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


def _blocks(model: Transformer, spec: LayerStack):
    """The Block stacks of a `LayerStack`, one per pattern position."""
    mod = getattr(model, spec.name)
    return (
        [mod]
        if len(spec.pattern) == 1
        else [getattr(mod, f"p{k}") for k in range(len(spec.pattern))]
    )


def _run_stack(model: Transformer, spec: LayerStack, x_BxNxD: jax.Array, positions_BxN: jax.Array,
               cache: tuple[list[jax.Array], list[jax.Array]], write_BxN: jax.Array,
               routed_RxPxBxNxK: jax.Array | None):
    """Scans one `LayerStack` (its layer pattern per scan step); returns x, the new cache (per
    pattern position k, v: [R, B, C, Kv, D]) and the experts chosen per MoE layer in layer order
    ([R * P, B, N, K], or None for dense layers)."""
    splits = [nnx.split(b) for b in _blocks(model, spec)]
    mask_BxN = jnp.ones(positions_BxN.shape, jnp.bool_)

    def body(x: jax.Array, inputs: tuple):
        states, k_cs, v_cs, routed = inputs
        new_k, new_v, ids = [], [], []
        for pos, (graphdef, _) in enumerate(splits):
            block = nnx.merge(graphdef, states[pos])
            a, k_c, v_c = _attend(block.attn, block.attn_norm(x), positions_BxN, k_cs[pos],
                                  v_cs[pos], write_BxN)
            h = x + a
            if block.is_moe:
                y, stats = block.mlp(
                    block.mlp_norm(h), mask_BxN, None if routed is None else routed[pos]
                )
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


def _forward(model: Transformer, tokens_BxN: jax.Array, positions_BxN: jax.Array,
             caches: dict[str, tuple[list[jax.Array], list[jax.Array]]], write_BxN: jax.Array,
             routed_LxBxNxK: jax.Array | None):
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
                                                   caches[spec.name], write_BxN, routed)
        if spec.moe:
            ids.append(got)
    return model.final_norm(x), new_caches, (jnp.concatenate(ids) if ids else None)


def _empty_caches(model: Transformer, B: int, C: int):
    cfg, dt = model.cfg, model.cfg.compute_dtype
    caches = {}
    for spec in model.stacks:
        kv = [cfg.sliding_kv_heads if sl else cfg.num_kv_heads for sl in spec.pattern]
        caches[spec.name] = (
            [jnp.zeros((spec.repeats, B, C, n, cfg.head_dim), dt) for n in kv],
            [jnp.zeros((spec.repeats, B, C, n, cfg.value_head_dim), dt) for n in kv],
        )
    return caches


# ----------------------------------------------------------------------------- generation
def _nucleus(scaled_BxV: jax.Array, top_p: jax.Array) -> jax.Array:
    """`scaled_BxV` with every token outside the smallest set of most likely tokens whose mass
    reaches `top_p` set to -inf (in effect)."""
    order = jnp.argsort(-scaled_BxV, axis=-1)
    p_sorted = jax.nn.softmax(jnp.take_along_axis(scaled_BxV, order, axis=-1), axis=-1)
    keep_sorted = (jnp.cumsum(p_sorted, axis=-1) - p_sorted) < top_p
    keep = jnp.zeros_like(keep_sorted).at[
        jnp.arange(scaled_BxV.shape[0])[:, None], order].set(keep_sorted)
    return jnp.where(keep, scaled_BxV, _NEG)


def _sample(logits_BxV: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array):
    """Samples at `temperature` (a traced scalar; 0 = greedy) from the nucleus of mass `top_p`
    (a traced scalar; 1 = the whole distribution); returns (token, untempered untruncated
    log-prob, untempered entropy).

    `top_p` is traced so that truncated and untruncated sampling (a sweep's training batches and
    its held-out evaluation) share one compiled program; `lax.cond` runs the sort only when
    `top_p < 1`, and leaves the logits untouched (bit for bit) otherwise."""
    logp = jax.nn.log_softmax(logits_BxV, axis=-1)
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    scaled = logits_BxV / jnp.maximum(temperature, 1e-6)
    scaled = jax.lax.cond(top_p < 1.0, _nucleus, lambda x, _: x, scaled, top_p)
    drawn = jax.random.categorical(key, scaled, axis=-1)
    tok = jnp.where(temperature > 0, drawn, jnp.argmax(logits_BxV, axis=-1)).astype(jnp.int32)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0], ent


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new", "stop_tokens"))
def _extend(graphdef: nnx.GraphDef, state: nnx.State,
            caches: dict[str, tuple[list[jax.Array], list[jax.Array]]], chunk_BxN: jax.Array,
            start_B: jax.Array, n_B: jax.Array, active_B: jax.Array, routed_BxNxLxK: jax.Array,
            key: jax.Array, temperature: jax.Array, top_p: jax.Array, *, max_new: int,
            stop_tokens: tuple):
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    B, N = chunk_BxN.shape
    C = next(iter(caches.values()))[0][0].shape[2]   # (k list, v list) of [R, B, C, Kv, D]
    L, K = cfg.num_moe_layers, cfg.top_k
    rows = jnp.arange(B)
    w_DxV = model.output_kernel_DxV()
    stops = jnp.asarray(stop_tokens, jnp.int32)
    # Inactive rows write nowhere (index C is dropped) and stop at once.
    start_B = jnp.where(active_B, start_B, C)
    positions = start_B[:, None] + jnp.arange(N, dtype=jnp.int32)[None]
    in_chunk = jnp.arange(N)[None, :] < n_B[:, None]
    write = jnp.where(in_chunk, positions, C)
    routed_in = jnp.moveaxis(routed_BxNxLxK, 2, 0) if L else None
    h, caches, ids = _forward(model, chunk_BxN, positions, caches, write, routed_in)
    keep = (in_chunk & active_B[:, None])[:, :, None, None]
    chunk_experts = (jnp.where(keep, jnp.moveaxis(ids, 0, 2), -1) if L
                     else jnp.zeros((B, N, 0, K), jnp.int32))
    logits = jnp.einsum("bd,dv->bv", h[rows, n_B - 1], w_DxV, preferred_element_type=jnp.float32)
    tok, lp, ent = _sample(logits, jax.random.fold_in(key, 0), temperature, top_p)

    out_tok = jnp.zeros((B, max_new), jnp.int32).at[:, 0].set(tok)
    out_lp = jnp.zeros((B, max_new), jnp.float32).at[:, 0].set(lp)
    out_ent = jnp.zeros((B, max_new), jnp.float32).at[:, 0].set(ent)
    out_ids = jnp.full((B, max_new, L, K), -1, jnp.int32)
    done = ~active_B | jnp.isin(tok, stops) | (max_new == 1)

    def cond(carry: tuple):
        t, _, done, *_ = carry
        return (t < max_new - 1) & ~jnp.all(done)

    def body(carry: tuple):
        t, tok, done, caches, out_tok, out_lp, out_ent, out_ids = carry
        pos_B = start_B + n_B + t  # the fed token's position
        h, caches, ids = _forward(model, tok[:, None], pos_B[:, None], caches,
                                  jnp.where(done, C, pos_B)[:, None], None)
        logits = jnp.einsum("bd,dv->bv", h[:, 0], w_DxV, preferred_element_type=jnp.float32)
        nxt, lp, ent = _sample(logits, jax.random.fold_in(key, t + 1), temperature, top_p)
        nxt, lp, ent = jnp.where(done, 0, nxt), jnp.where(done, 0.0, lp), jnp.where(done, 0.0, ent)
        if L:
            rec = jnp.where(done[:, None, None], -1, jnp.moveaxis(ids[:, :, 0], 0, 1))
            out_ids = out_ids.at[:, t].set(rec)
        out_tok = out_tok.at[:, t + 1].set(nxt)
        out_lp = out_lp.at[:, t + 1].set(lp)
        out_ent = out_ent.at[:, t + 1].set(ent)
        return (t + 1, nxt, done | jnp.isin(nxt, stops), caches, out_tok, out_lp, out_ent,
                out_ids)

    carry = (jnp.zeros((), jnp.int32), tok, done, caches, out_tok, out_lp, out_ent, out_ids)
    _, _, _, caches, out_tok, out_lp, out_ent, out_ids = jax.lax.while_loop(cond, body, carry)
    # Tokens up to and including the first stop (or all max_new).
    is_stop = jnp.isin(out_tok, stops)
    first_stop = jnp.where(is_stop.any(1), jnp.argmax(is_stop, axis=1) + 1, max_new)
    gen = Generation(tokens_BxM=out_tok, logprobs_BxM=out_lp, entropy_BxM=out_ent,
                     num_new_B=jnp.where(active_B, first_stop, 0).astype(jnp.int32),
                     prefill_experts_BxCxLxK=chunk_experts, new_experts_BxMxLxK=out_ids)
    return gen, caches


def _check_lengths(lengths_B: np.ndarray, B: int, C: int, max_new: int, temperature: float):
    if lengths_B.shape != (B,) or lengths_B.min() < 1:
        raise ValueError(f"lengths_B must be [{B}] with entries >= 1, got {lengths_B}")
    if lengths_B.max() + max_new > C:
        raise ValueError(f"context length {lengths_B.max()} + max_new {max_new} exceeds the cache "
                         f"length C={C}")
    if max_new < 1 or temperature < 0:
        raise ValueError("max_new must be >= 1 and temperature >= 0")


def _check_top_p(top_p: float):
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def generate(model: Transformer, context_BxC: np.ndarray, lengths_B: np.ndarray, key: jax.Array, *,
             max_new: int, temperature: float = 1.0, stop_tokens: Sequence[int] = (),
             routed_experts_BxCxLxK: np.ndarray | None = None, top_p: float = 1.0) -> Generation:
    """Samples up to `max_new` tokens after each row's context (one turn from an empty cache).

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
      top_p: nucleus sampling mass in (0, 1] (1 = off); log-probs stay untruncated.
    Returns:
      A `Generation`.
    """
    context_BxC = np.asarray(context_BxC, np.int32)
    lengths_B = np.asarray(lengths_B, np.int32)
    B, C = context_BxC.shape
    _check_lengths(lengths_B, B, C, max_new, temperature)
    _check_top_p(top_p)
    L, K = model.cfg.num_moe_layers, model.cfg.top_k
    if routed_experts_BxCxLxK is None:
        routed_experts_BxCxLxK = np.full((B, C, L, K), -1, np.int32)
    graphdef, state = nnx.split(model)
    gen, _ = _extend(graphdef, state, _empty_caches(model, B, C), jnp.asarray(context_BxC),
                     jnp.zeros((B,), jnp.int32), jnp.asarray(lengths_B),
                     jnp.ones((B,), jnp.bool_), jnp.asarray(routed_experts_BxCxLxK, jnp.int32),
                     key, jnp.asarray(temperature, jnp.float32), jnp.asarray(top_p, jnp.float32),
                     max_new=int(max_new), stop_tokens=tuple(int(s) for s in stop_tokens))
    return gen


# ----------------------------------------------------------------------------- episodes
@dataclasses.dataclass
class Rollout:
    """A finished episode with what the rollout engine recorded for every token of it.

    logprobs: float per token (0.0 on prompt and tool-output tokens); entropy: float per token,
    the sampling distribution's untempered entropy (0.0 where not generated); experts: int32
    [len(tokens), L, K], the experts token t used as an input (-1 = not recorded).
    """
    episode: object
    logprobs: list
    experts: np.ndarray
    entropy: list = dataclasses.field(default_factory=list)


def _bucket(n: int) -> int:
    """Chunk widths are rounded up to a multiple of 8, so few shapes are ever compiled."""
    return -(-n // 8) * 8


def rollout(model: Transformer, episodes: Sequence[Any], key: jax.Array, *, cache_len: int,
            max_turns: int, max_turn_tokens: int, temperature: float = 1.0,
            stop_tokens: Sequence[int] = (), top_p: float = 1.0) -> list:
    """Plays multi-turn episodes to the end with the policy (one fixed-shape batch, B = rows).

    The KV cache lives across turns: each round feeds only the tokens a row's cache has not seen
    (the prompt first; then the turn's last generated token and the tool output).

    Args:
      model: a `Transformer`.
      episodes: fresh environments with `tokens`, `done` and `step(turn_tokens) -> tool tokens`
        (e.g. `sim.task.Episode`); one batch row each.
      key: PRNG key. cache_len: C (>= longest episode). max_turns, max_turn_tokens: limits.
      temperature, stop_tokens: as in `generate`.
      top_p: nucleus sampling mass (1 = off); recorded log-probs stay untruncated (the probe of
        docs/miniature.md: the learner sees the full policy's log-probs, not the sampler's).
    Returns:
      A `Rollout` per episode, in order.
    """
    _check_top_p(top_p)
    L, K = model.cfg.num_moe_layers, model.cfg.top_k
    B = len(episodes)
    graphdef, state = nnx.split(model)
    caches = _empty_caches(model, B, cache_len)
    stops = tuple(int(s) for s in stop_tokens)
    lps = [[0.0] * len(ep.tokens) for ep in episodes]
    ents = [[0.0] * len(ep.tokens) for ep in episodes]
    experts = [np.full((len(ep.tokens), L, K), -1, np.int32) for ep in episodes]
    fed = np.zeros((B,), np.int64)          # tokens already in each row's cache
    for turn in range(max_turns):
        active = [i for i, ep in enumerate(episodes) if not ep.done]
        if not active:
            break
        chunks = {i: episodes[i].tokens[fed[i]:] for i in active}
        N = _bucket(max(len(c) for c in chunks.values()))
        chunk = np.zeros((B, N), np.int32)
        start, n = np.zeros((B,), np.int32), np.ones((B,), np.int32)
        is_active = np.zeros((B,), bool)
        for i, c in chunks.items():
            if fed[i] + len(c) + max_turn_tokens > cache_len + 1:
                raise ValueError(f"episode {i}: {fed[i] + len(c)} tokens + a turn of "
                                 f"{max_turn_tokens} exceed the cache length {cache_len}")
            chunk[i, :len(c)], start[i], n[i], is_active[i] = c, fed[i], len(c), True
        gen, caches = _extend(graphdef, state, caches, jnp.asarray(chunk), jnp.asarray(start),
                              jnp.asarray(n), jnp.asarray(is_active),
                              jnp.full((B, N, L, K), -1, jnp.int32), jax.random.fold_in(key, turn),
                              jnp.asarray(temperature, jnp.float32),
                              jnp.asarray(top_p, jnp.float32), max_new=int(max_turn_tokens),
                              stop_tokens=stops)
        gen = jax.device_get(gen)
        for i in active:
            ep, n0, m = episodes[i], int(n[i]), int(gen.num_new_B[i])
            experts[i][fed[i]:fed[i] + n0] = gen.prefill_experts_BxCxLxK[i, :n0]
            tool = ep.step(gen.tokens_BxM[i, :m].tolist())
            lps[i] += gen.logprobs_BxM[i, :m].tolist() + [0.0] * len(tool)
            ents[i] += gen.entropy_BxM[i, :m].tolist() + [0.0] * len(tool)
            experts[i] = np.concatenate([experts[i], gen.new_experts_BxMxLxK[i, :m],
                                         np.full((len(tool), L, K), -1, np.int32)])
            fed[i] += n0 + m - 1            # the turn's last token is fed with the next chunk
    for ep in episodes:
        if not ep.done:
            ep.step([])  # out of turns: the environment ends it (an empty turn is a truncation)
    return [
        Rollout(ep, lp, ex, en)
        for ep, lp, ex, en in zip(episodes, lps, experts, ents, strict=False)
    ]

"""The sampler's jitted steps, module-level functions of (parameters, cache, inputs): each compiles
once per static bucket (rows and chunk length for `prefill`; slots, steps and page-table width
for `decode`) and takes the cache donated, so it is updated in place.

    cache, scores = prefill(graphdef, state, cache, chunk, kernels=..., score=False)
    cache, out, slots = decode(graphdef, state, cache, slots, kernels=..., steps=8)

`prefill` writes a chunk's keys and values (with `score`, it also returns every position's
argmax and log-prob of the next token: teacher forcing). `decode` runs up to `steps` one-token
steps of every slot in a `lax.while_loop` (it ends early once every slot is done): feed each
active slot's token, sample the next from its own key, record both log-probs and the experts
of the forward that produced it, stop a slot at a stop token or when its budget is spent. The
host (`sampler.py`) admits and retires sequences between calls.
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from gagar_jax.sample import draw, forward
from gagar_jax.sample.forward import Chunk, Kernels


@flax.struct.dataclass
class Slots:
    """The decode batch: S slots, each idle or running one sequence.

    token_S: the token to feed next. pos_S: its position. active_S: running. budget_S: tokens
    it may still generate. pages_SxM / ring_SxR: its page tables. temperature_S, top_k_S,
    top_p_S: its sampling. seed_S: its request seed (+ sample index). count_S: tokens generated
    so far in this turn (the draw's key index). stops_SxX: its stop tokens (-1: none).
    """
    token_S: jax.Array
    pos_S: jax.Array
    active_S: jax.Array
    budget_S: jax.Array
    pages_SxM: jax.Array
    ring_SxR: jax.Array
    temperature_S: jax.Array
    top_k_S: jax.Array
    top_p_S: jax.Array
    seed_S: jax.Array
    count_S: jax.Array
    stops_SxX: jax.Array


@flax.struct.dataclass
class Generated:
    """Per decode step t and slot s: the token drawn (valid where `valid_TxS`), its raw and
    processed log-probs, and the experts of the forward that produced it [T, S, L, K]."""
    token_TxS: jax.Array
    raw_TxS: jax.Array
    processed_TxS: jax.Array
    routed_TxSxLxK: jax.Array
    valid_TxS: jax.Array


@flax.struct.dataclass
class Scores:
    """Teacher forcing of a chunk: per position i, the argmax and the raw log-prob of the
    chunk's token i + 1, and the experts of position i ([B, N - 1] / [B, N, L, K])."""
    argmax_BxN: jax.Array
    logprob_BxN: jax.Array
    routed_BxNxLxK: jax.Array


def _logits(model: nnx.Module, h: jax.Array) -> jax.Array:
    return jnp.einsum("...d,dv->...v", h, model.output_kernel_DxV(),
                      preferred_element_type=jnp.float32)


def _pin(cache: dict, shardings: tuple | None) -> dict:
    """The cache out as it came in (`shardings`: one per pool, in leaf order): the next call
    then hits the same program."""
    if shardings is None:
        return cache
    leaves, tree = jax.tree.flatten(cache)
    return jax.tree.unflatten(tree, [jax.lax.with_sharding_constraint(x, s)
                                     for x, s in zip(leaves, shardings, strict=True)])


@functools.partial(jax.jit, static_argnames=("graphdef", "kernels", "score", "cache_sharding"),
                   donate_argnames=("cache",))
def prefill(graphdef: nnx.GraphDef, state: nnx.State, cache: dict, chunk: Chunk,
            layers: dict | None = None, *, kernels: Kernels, score: bool = False,
            cache_sharding: tuple | None = None) -> tuple[dict, Scores | None]:
    """Writes a chunk's keys and values; with `score`, teacher-forced `Scores` too (else None).
    `layers`: per-layer parameter copies (`forward.unstack`) or None. `cache_sharding`: the
    pools' placements (`cache.cache_shardings`), kept on the way out."""
    model = nnx.merge(graphdef, state)
    h, cache, routed = forward.extend(model, cache, chunk, kernels, layers)
    cache = _pin(cache, cache_sharding)
    if not score:
        return cache, None
    lp = jax.nn.log_softmax(_logits(model, h), axis=-1)                        # [B, N, V]
    nxt = jnp.concatenate([chunk.tokens_BxN[:, 1:], chunk.tokens_BxN[:, -1:]], axis=1)
    return cache, Scores(argmax_BxN=jnp.argmax(lp, axis=-1).astype(jnp.int32),
                         logprob_BxN=jnp.take_along_axis(lp, nxt[..., None], axis=-1)[..., 0],
                         routed_BxNxLxK=routed)


@functools.partial(jax.jit, static_argnames=("graphdef", "kernels", "steps", "cache_sharding"),
                   donate_argnames=("cache",))
def decode(graphdef: nnx.GraphDef, state: nnx.State, cache: dict, slots: Slots,
           layers: dict | None = None, *, kernels: Kernels, steps: int,
           cache_sharding: tuple | None = None) -> tuple[dict, Generated, Slots]:
    """Up to `steps` decode steps of every active slot; returns (cache, `Generated`, slots
    after the last step: a slot that drew a stop token or spent its budget is inactive)."""
    model = nnx.merge(graphdef, state)
    S = slots.token_S.shape[0]
    L, K = model.cfg.num_moe_layers, model.cfg.top_k
    out = Generated(token_TxS=jnp.zeros((steps, S), jnp.int32),
                    raw_TxS=jnp.zeros((steps, S), jnp.float32),
                    processed_TxS=jnp.zeros((steps, S), jnp.float32),
                    routed_TxSxLxK=jnp.full((steps, S, L, K), -1, jnp.int32),
                    valid_TxS=jnp.zeros((steps, S), bool))

    def cond(carry: tuple):
        t, _, sl, _ = carry
        return (t < steps) & jnp.any(sl.active_S)

    def body(carry: tuple):
        t, cache, sl, out = carry
        live = sl.active_S
        chunk = Chunk(tokens_BxN=sl.token_S[:, None], start_B=sl.pos_S,
                      n_B=live.astype(jnp.int32), pages_BxM=sl.pages_SxM, ring_BxR=sl.ring_SxR)
        h, cache, routed = forward.extend(model, cache, chunk, kernels, layers)
        cache = _pin(cache, cache_sharding)
        d = draw.sample(_logits(model, h[:, 0]), draw.row_keys(sl.seed_S, sl.count_S),
                            sl.temperature_S, sl.top_k_S, sl.top_p_S)
        stop = jnp.any(d.token_B[:, None] == sl.stops_SxX, axis=-1)
        out = Generated(token_TxS=out.token_TxS.at[t].set(d.token_B),
                        raw_TxS=out.raw_TxS.at[t].set(d.raw_logprob_B),
                        processed_TxS=out.processed_TxS.at[t].set(d.processed_logprob_B),
                        routed_TxSxLxK=out.routed_TxSxLxK.at[t].set(routed[:, 0]),
                        valid_TxS=out.valid_TxS.at[t].set(live))
        step = live.astype(jnp.int32)
        sl = sl.replace(token_S=jnp.where(live, d.token_B, sl.token_S), pos_S=sl.pos_S + step,
                        budget_S=sl.budget_S - step, count_S=sl.count_S + step,
                        active_S=live & ~stop & (sl.budget_S - step > 0))
        return t + 1, cache, sl, out

    _, cache, slots, out = jax.lax.while_loop(cond, body, (jnp.int32(0), cache, slots, out))
    return _pin(cache, cache_sharding), out, slots

"""The model's forward over a paged KV cache: a chunk of new tokens per row through the learner's
own blocks (`model/`), writing each token's keys and values into the row's pages.

    h_BxNxD, cache, routed_BxNxLxK = extend(model, cache, chunk, kernels)

The blocks are the model's modules, merged from its parameters: the norms, the attention's q/k/v
projection with q/k norm, value scale and partial RoPE (`Attention.project_qkv`), its output
projection, the dense MLP and the MoE layer with its router (sigmoid scores and selection bias,
group-limited top-k, renormalisation, scaling: `model/router.py`). Only attention against the
cache is the sampler's: paged kernels chosen through `kernels/attention/registry.py`
(`paged.py`). The experts every token was routed to come out per MoE layer, exactly the
router's choice (R3 replay records them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from gagar_jax.kernels.attention import paged
from gagar_jax.kernels.attention import registry as attention_registry
from gagar_jax.sharding import constrain, device_platform

if TYPE_CHECKING:
    from gagar_jax.model.layer_pattern import LayerStack
    from gagar_jax.model.layers import Attention
    from gagar_jax.model.transformer import Transformer


class Chunk(NamedTuple):
    """One call's rows: N new tokens each, after `start_B` cached positions.

    tokens_BxN: token ids (padding after n_B). start_B: positions already cached. n_B: real
    tokens of the row (0: an idle row, which writes nothing). pages_BxM / ring_BxR: the row's
    full-layer page table and window-ring pages.
    """
    tokens_BxN: jax.Array
    start_B: jax.Array
    n_B: jax.Array
    pages_BxM: jax.Array
    ring_BxR: jax.Array


class Kernels(NamedTuple):
    """Resolved paged kernels (`registry.resolve_paged`) for full and sliding layers."""
    full: str = "xla"
    sliding: str = "xla"


def _attend(attn: Attention, x_BxNxD: jax.Array, chunk: Chunk, k_pool: jax.Array,
            v_pool: jax.Array, kernel: str, sliding: bool, offset: jax.Array):
    """One attention layer against its stack's pools (its pages start at `offset`); returns
    (output [B, N, D], k_pool, v_pool)."""
    dt = x_BxNxD.dtype
    N = x_BxNxD.shape[1]
    positions = chunk.start_B[:, None] + jnp.arange(N, dtype=jnp.int32)[None, :]
    q, k, v = attn.project_qkv(x_BxNxD, positions)
    q = constrain(q, "batch", None, "heads", None)
    table = (chunk.ring_BxR if sliding else chunk.pages_BxM) + offset
    rec = attention_registry.paged_kernel(kernel)
    if rec.write_first:   # decode against pages that already hold the new key (Pallas)
        k_pool = paged.write(k_pool, k, table, chunk.start_B, chunk.n_B, ring=sliding)
        v_pool = paged.write(v_pool, v, table, chunk.start_B, chunk.n_B, ring=sliding)
        o = rec.fn(q[:, 0], k_pool, v_pool, chunk.start_B + chunk.n_B, table,
                   interpret=device_platform() != "tpu")[:, None]
    else:
        o = rec.fn(q, k, v, k_pool, v_pool, table, chunk.start_B, chunk.n_B,
                   window=attn.window, ring=sliding, sinks_H=attn.sinks_H())
        # written after the read (in place: `write`'s `after`)
        k_pool = paged.write(k_pool, k, table, chunk.start_B, chunk.n_B, ring=sliding, after=o)
        v_pool = paged.write(v_pool, v, table, chunk.start_B, chunk.n_B, ring=sliding, after=o)
    return jnp.einsum("bshk,hkd->bsd", o.astype(dt), attn.wo[...].astype(dt)), k_pool, v_pool


def _blocks(model: Transformer, spec: LayerStack) -> list:
    mod = getattr(model, spec.name)
    return [mod] if len(spec.pattern) == 1 else [getattr(mod, f"p{k}")
                                                   for k in range(len(spec.pattern))]


def unstack(model: Transformer) -> dict:
    """Per-layer copies of the model's stacked layer parameters: {stack name: ((block state per
    pattern position) per repeat)}, for `extend(..., layers=...)` (`SamplerConfig.layer_copies`).
    """
    out = {}
    for spec in model.stacks:
        states = [nnx.state(b) for b in _blocks(model, spec)]
        out[spec.name] = jax.jit(lambda st, n=spec.repeats: tuple(
            tuple(jax.tree.map(lambda x, r=r: x[r], s) for s in st) for r in range(n)))(states)
    return out


def _run_stack(model: Transformer, spec: LayerStack, x: jax.Array, chunk: Chunk, pools: list,
               kernels: Kernels, layers: tuple | None = None):
    """Scans one layer stack, its pools in the carry (updated in place); returns x, the pools,
    and the experts per MoE layer in layer order ([R * P, B, N, K]) or None. With `layers`
    (per-layer parameter copies, `unstack`) the layers run unrolled on them instead: XLA:CPU
    copies a layer's weights out of the stacked arrays at every step of a scan."""
    splits = [nnx.split(b) for b in _blocks(model, spec)]
    mask_BxN = jnp.arange(x.shape[1])[None, :] < chunk.n_B[:, None]

    def body(carry: tuple, inputs: tuple):
        x, layer_pools = carry
        states, r = inputs
        new_pools, ids = [], []
        for pos, (graphdef, _) in enumerate(splits):
            block = nnx.merge(graphdef, states[pos])
            sliding = spec.pattern[pos]
            k_pool, v_pool = layer_pools[pos]
            offset = r * (k_pool.shape[1] // spec.repeats)
            a, k_pool, v_pool = _attend(block.attn, block.attn_norm(x), chunk, k_pool, v_pool,
                                        kernels.sliding if sliding else kernels.full, sliding,
                                        offset)
            h = x + a
            if block.is_moe:
                y, stats = block.mlp(block.mlp_norm(h), mask_BxN)
                x = h + y
                ids.append(stats.routed_BxSxK)
            else:
                x = h + block.mlp(block.mlp_norm(h))
            new_pools.append((k_pool, v_pool))
        return (x, new_pools), (jnp.stack(ids) if ids else None)

    if layers is not None:
        carry, got = (x, pools), []
        for r, states in enumerate(layers):
            carry, ids_r = body(carry, (list(states), r))
            got.append(ids_r)
        (x, pools), ids = carry, (None if got[0] is None else jnp.stack(got))
    else:
        (x, pools), ids = jax.lax.scan(body, (x, pools), ([s for _, s in splits],
                                                          jnp.arange(spec.repeats)))
    if ids is not None:
        ids = ids.reshape(-1, *ids.shape[2:])
    return x, pools, ids


def extend(model: Transformer, cache: dict, chunk: Chunk, kernels: Kernels,
           layers: dict | None = None) -> tuple[jax.Array, dict, jax.Array]:
    """Runs `chunk` through the model against (and into) `cache` (with `layers`: on per-layer
    parameter copies, `unstack`).

    Returns:
      (final-normed hidden states [B, N, D] in compute dtype, the updated cache, the experts
      of every token per MoE layer [B, N, L, K] (-1 on padding and idle rows)).
    """
    cfg = model.cfg
    x = model.embedding[...].astype(cfg.compute_dtype)[chunk.tokens_BxN]
    new_cache, ids = {}, []
    for spec in model.stacks:
        x, new_cache[spec.name], got = _run_stack(
            model, spec, x, chunk, cache[spec.name], kernels,
            None if layers is None else layers[spec.name])
        if spec.moe:
            ids.append(got)
    B, N = chunk.tokens_BxN.shape
    if ids:
        routed = jnp.moveaxis(jnp.concatenate(ids), 0, 2)
        mask = (jnp.arange(N)[None, :] < chunk.n_B[:, None])[:, :, None, None]
        routed = jnp.where(mask, routed, -1)
    else:
        routed = jnp.zeros((B, N, 0, cfg.top_k), jnp.int32)
    return model.final_norm(x), new_cache, routed

"""The device side of the paged KV cache: one page pool per layer, stacked like the model's layers.

    cache = init_cache(model_cfg, spec)        # {stack name: [(k, v) per pattern position]}

Each layer stack of the model (`model.layer_stacks`: a pattern of layer kinds repeated R times)
gets, per pattern position, a key pool `[Kv, R * NP, T, Dh]` and a value pool
`[Kv, R * NP, T, Dv]`: layer r of the stack owns pages [r * NP, (r + 1) * NP), so the layer scan
carries the whole pool and reads and writes it in place at page `r * NP + id` (no layer's pool
is ever sliced out and copied back), and JAX's Pallas paged kernel takes it as it is. Full-
attention positions draw NP = `spec.num_pages` pages, sliding ones NP = `spec.num_ring_pages`
(window rings). Page ids are shared by every layer of a kind: a sequence's page table addresses
all its layers at once.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from gagar_jax import sharding as shd
from gagar_jax.model.layer_pattern import layer_stacks
from gagar_jax.model.transformer import ModelConfig


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """The cache's static shape.

    Attributes:
      page: positions per page (T).
      max_len: the longest sequence (prompt and every turn); M = ceil(max_len / T) pages.
      num_pages: full-attention pages in the pool (shared by every live sequence).
      num_ring_pages: window-ring pages in the pool (`ring_pages` per live sequence).
      ring_pages: pages of one window ring (Mr; 0 without sliding layers).
      dtype: the dtype keys and values are kept in.
    """
    page: int
    max_len: int
    num_pages: int
    num_ring_pages: int
    ring_pages: int
    dtype: str = "float32"

    @property
    def max_pages(self) -> int:
        return -(-self.max_len // self.page)


def ring_pages(cfg: ModelConfig, page: int) -> int:
    """Pages of one window ring: enough for the W - 1 positions a query sees before itself
    (at least one page); 0 for a model without sliding layers."""
    if not cfg.has_sliding:
        return 0
    return max(1, math.ceil((cfg.sliding_window - 1) / page))


def pool_shapes(cfg: ModelConfig, spec: CacheSpec) -> dict:
    """{stack name: [((k shape), (v shape), sliding) per pattern position]}."""
    out = {}
    for st in layer_stacks(cfg):
        out[st.name] = []
        for sliding in st.pattern:
            kv = cfg.sliding_kv_heads if sliding else cfg.num_kv_heads
            n = spec.num_ring_pages if sliding else spec.num_pages
            out[st.name].append(((kv, st.repeats * n, spec.page, cfg.head_dim),
                                 (kv, st.repeats * n, spec.page, cfg.value_head_dim), sliding))
    return out


def sliding_kinds(cfg: ModelConfig) -> tuple:
    """((stack name, (sliding per pattern position)), ...): hashable, for static arguments."""
    return tuple((st.name, tuple(st.pattern)) for st in layer_stacks(cfg))


# The pools' logical axes: [Kv, R * NP, T, D]: KV heads split over `tensor` (as the model's k/v
# projections are), everything else whole on every chip of the sampler's mesh.
POOL_AXES = ("kv_heads", None, None, None)


def cache_shardings(cfg: ModelConfig, spec: CacheSpec, mesh: jax.sharding.Mesh | None,
                    device: Any = None) -> tuple:
    """One sharding per pool, in the cache's leaf order (hashable: a static argument of the
    sampler's programs): `POOL_AXES` on `mesh`, or `device` alone without one."""
    tree = {name: [(k, v) for k, v, _ in pos] for name, pos in pool_shapes(cfg, spec).items()}
    shapes = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple) and
                             all(isinstance(d, int) for d in x))
    if mesh is None:
        return tuple(jax.sharding.SingleDeviceSharding(device) for _ in shapes)
    return tuple(shd.named_sharding(mesh, POOL_AXES, shape) for shape in shapes)


def init_cache(cfg: ModelConfig, spec: CacheSpec, shardings: tuple | None = None) -> dict:
    """Zeroed pools (`pool_shapes`), placed with `shardings` (`cache_shardings`, or None)."""
    dt = jnp.dtype(spec.dtype)
    tree = {name: [(k, v) for k, v, _ in pos] for name, pos in pool_shapes(cfg, spec).items()}
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x)
    shapes, treedef = jax.tree.flatten(tree, is_leaf=is_shape)
    shardings = shardings or (None,) * len(shapes)
    leaves = [jnp.zeros(shape, dt) if sh is None else
              jax.jit(lambda shape=shape: jnp.zeros(shape, dt), out_shardings=sh)()
              for shape, sh in zip(shapes, shardings, strict=True)]
    return jax.tree.unflatten(treedef, leaves)


def cache_bytes(cfg: ModelConfig, spec: CacheSpec) -> int:
    """Bytes of every pool together."""
    size = jnp.dtype(spec.dtype).itemsize
    return sum(math.prod(k) * size + math.prod(v) * size
               for pos in pool_shapes(cfg, spec).values() for k, v, _ in pos)


@functools.partial(jax.jit, static_argnames=("sliding", "pages", "cache_sharding"),
                   donate_argnames=("cache",))
def copy_pages(cache: dict, src_C: jax.Array, dst_C: jax.Array, ring_src_C: jax.Array,
               ring_dst_C: jax.Array, sliding: tuple, pages: tuple,
               cache_sharding: tuple | None = None) -> dict:
    """Copies pages src -> dst in every layer (forks of a shared prompt: its partial last
    page and its window ring).

    Args:
      cache: the pools. src_C, dst_C: full-layer pages. ring_src_C, ring_dst_C: ring pages
        (page ids of one layer: every layer of a stack is copied).
      sliding: `sliding_kinds(cfg)` (static). pages: (num_pages, num_ring_pages) of one layer;
        a dst >= that is padding (dropped).
      cache_sharding: the pools' placements (`cache_shardings`), kept on the way out.
    """
    kinds = dict(sliding)
    def one(pool: jax.Array, src: jax.Array, dst: jax.Array, n: int) -> jax.Array:
        layers = pool.shape[1] // n                      # R: page r * n + id in layer r
        off = (jnp.arange(layers) * n)[:, None]
        src = (off + jnp.clip(src, 0, n - 1)[None]).reshape(-1)
        dst = jnp.where(dst[None] < n, off + dst[None], pool.shape[1]).reshape(-1)
        return pool.at[:, dst].set(pool[:, src], mode="drop")

    out = {}
    for name, pools in cache.items():
        out[name] = []
        for (k, v), sl in zip(pools, kinds[name], strict=True):
            s, d, n = (ring_src_C, ring_dst_C, pages[1]) if sl else (src_C, dst_C, pages[0])
            out[name].append((one(k, s, d, n), one(v, s, d, n)))
    if cache_sharding is None:
        return out
    leaves, tree = jax.tree.flatten(out)
    return jax.tree.unflatten(tree, [jax.lax.with_sharding_constraint(x, s)
                                     for x, s in zip(leaves, cache_sharding, strict=True)])

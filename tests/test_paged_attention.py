"""Paged attention (`kernels/attention/paged.py`) and the sampler's page bookkeeping
(`sample/pages.py`).

* A sequence fed chunk by chunk into scattered pages (full layers) or a window ring (sliding
  layers, sinks on) attends exactly as the reference `plain_attention` over the whole sequence.
* JAX's Pallas `paged_attention`, run under `pltpu.force_tpu_interpret_mode()`, equals the XLA
  path on the same pages with keys and values rounded to bfloat16 (the kernel reads them so).
* The registry picks the Pallas kernel only for the decode of plain full layers on TPU.
* Page pools under any sequence of new / reserve / fork / copy-on-write / drop (hypothesis):
  every page's count is the number of sequences holding it, nothing leaks.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from gagar_jax import sharding
from gagar_jax.kernels.attention import paged, registry
from gagar_jax.kernels.attention.blockwise import plain_attention
from gagar_jax.sample.pages import Pages, PoolExhausted

B, H, KV, D, T, S = 2, 4, 2, 16, 4, 23      # rows, heads, KV heads, width, page, sequence
CHUNKS = (7, 1, 5, 8, 1, 1)                 # prefill chunks, then decode steps: 23 tokens


@functools.partial(jax.jit, static_argnames=("window", "ring"))
def _step(q, k, v, kp, vp, table, start, n, sinks, *, window, ring):
    o = paged.paged_attention_xla(q, k, v, kp, vp, table, start, n, window=window, ring=ring,
                                  sinks_H=sinks)
    return (o, paged.write(kp, k, table, start, n, ring=ring),
            paged.write(vp, v, table, start, n, ring=ring))


@pytest.mark.parametrize("window,ring_pages", [(0, 0), (6, 2), (5, 1)])
def test_chunks_into_pages_equal_whole_sequence_attention(window, ring_pages):
    r = np.random.default_rng(window)
    q, k, v = (jnp.asarray(r.standard_normal((B, S, n, D)), jnp.float32) for n in (H, KV, KV))
    sinks = jnp.asarray(r.standard_normal(H), jnp.float32) if window else None
    want = plain_attention(q, k, v, jnp.ones((B, S), jnp.int32), window=window, sinks_H=sinks)
    ring = ring_pages > 0
    M = ring_pages or -(-S // T)
    NP = 2 * B * M + 3
    table = jnp.asarray(r.permutation(NP)[:B * M].reshape(B, M), jnp.int32)  # scattered pages
    kp = jnp.asarray(r.standard_normal((KV, NP, T, D)), jnp.float32)        # stale contents
    vp = jnp.asarray(r.standard_normal((KV, NP, T, D)), jnp.float32)
    N, start, got = 8, 0, []
    for c in CHUNKS:          # padded to N: the padding is never a key
        def pad(x, start=start, c=c):
            return jnp.pad(x[:, start:start + c], ((0, 0), (0, N - c), (0, 0), (0, 0)))
        o, kp, vp = _step(pad(q), pad(k), pad(v), kp, vp, table, jnp.full((B,), start),
                          jnp.full((B,), c), sinks, window=window, ring=ring)
        got.append(o[:, :c])
        start += c
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, atol=2e-6)


def test_pallas_decode_in_interpret_mode_equals_the_xla_path():
    r = np.random.default_rng(0)
    Bq, M, NP = 3, 4, 16
    q = jnp.asarray(r.standard_normal((Bq, 1, H, D)), jnp.float32)
    kp = jnp.asarray(r.standard_normal((KV, NP, T, D)), jnp.bfloat16).astype(jnp.float32)
    vp = jnp.asarray(r.standard_normal((KV, NP, T, D)), jnp.bfloat16).astype(jnp.float32)
    table = jnp.asarray(r.permutation(NP)[:Bq * M].reshape(Bq, M), jnp.int32)
    lengths = jnp.asarray([5, 16, 1], jnp.int32)
    with pltpu.force_tpu_interpret_mode():
        got = jax.jit(lambda *a: paged.paged_decode_pallas(*a, pages_per_block=2))(
            q[:, 0], kp, vp, lengths, table)
    # the XLA path: every key cached but the last, which comes as the chunk's own
    last = lengths - 1
    at = jnp.take_along_axis(table, (last // T)[:, None], 1)[:, 0]
    k_new = kp[:, at, last % T].transpose(1, 0, 2)[:, None]
    v_new = vp[:, at, last % T].transpose(1, 0, 2)[:, None]
    want = paged.paged_attention_xla(q, k_new, v_new, kp, vp, table, last,
                                     jnp.ones((Bq,), jnp.int32))
    np.testing.assert_allclose(got, want[:, 0], atol=2e-5)


def test_registry_picks_pallas_only_for_plain_full_decode_on_tpu(monkeypatch):
    plain = dict(window=0, sinks=False, same_dims=True, head_dim=128)
    assert registry.resolve_paged("auto", decode=True, **plain) == "xla"          # CPU
    monkeypatch.setattr(sharding, "device_platform", lambda mesh=None: "tpu")
    assert registry.resolve_paged("auto", decode=True, **plain) == "pallas"
    assert registry.resolve_paged("auto", decode=False, **plain) == "xla"        # prefill
    for other in (dict(window=5), dict(sinks=True), dict(same_dims=False), dict(head_dim=64)):
        assert registry.resolve_paged("auto", decode=True, **{**plain, **other}) == "xla"
    with pytest.raises(ValueError, match="cannot serve this layer"):
        registry.resolve_paged("pallas", decode=True, window=5, sinks=True, same_dims=True)


@given(st.lists(st.tuples(st.sampled_from("nrfpd"), st.integers(0, 40)), max_size=40))
def test_page_counts_equal_holders_under_any_sequence_of_operations(ops):
    pages = Pages(page=4, num_pages=24, ring_pages=2, num_ring_pages=12)
    seqs = []
    for op, x in ops:
        try:
            if op == "n":
                seqs.append(pages.new(f"s{len(seqs)}", [1] * (x % 9 + 1)))
            elif seqs and op == "r":
                pages.reserve(seqs[x % len(seqs)], x)
            elif seqs and op == "f":
                src = seqs[x % len(seqs)]
                src.fed = min(len(src.pages) * 4, x)
                seqs.append(pages.fork(src, f"s{len(seqs)}")[0])
            elif seqs and op == "p":
                s = seqs[x % len(seqs)]
                pages.private(s, min(x, len(s.pages) * 4))
            elif seqs and op == "d":
                pages.drop(seqs.pop(x % len(seqs)))
        except PoolExhausted:
            pass
        for pool, attr in ((pages.full, "pages"), (pages.rings, "ring")):
            held = np.zeros(pool.n, int)
            for s in seqs:
                np.add.at(held, getattr(s, attr), 1)
            assert held.tolist() == pool.refs
            assert sorted(pool.free) == [p for p in range(pool.n) if held[p] == 0]
    for s in seqs:
        pages.drop(s)
    assert pages.full.used == pages.rings.used == 0

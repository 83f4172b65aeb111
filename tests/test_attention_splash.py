"""Splash attention (Pallas TPU kernel, run in interpret mode on CPU) against the reference path
and a NumPy loop: packed rows, GQA, padding, sliding windows and sinks; forward and gradients;
also as the per-shard kernel under the context axis (rows split along S over 2 chips)."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.close import assert_rel_close

from gagar_jax import sharding
from gagar_jax.aot import compile as aot
from gagar_jax.kernels.attention import blockwise as attention
from gagar_jax.kernels.attention import context as attention_context
from gagar_jax.kernels.attention import registry as attention_registry
from gagar_jax.kernels.attention.splash import splash_attention, splash_local_attention

B, S, H, KV, DH = 2, 200, 4, 2, 16   # S not a multiple of the 128-token kernel block


def _segments():
    seg = np.zeros((B, S), np.int32)
    seg[0, :70], seg[0, 70:150], seg[0, 150:] = 1, 2, 3    # three packed trajectories
    seg[1, :190] = 1                                     # one trajectory, then padding (0)
    return jnp.asarray(seg)


SEG = _segments()


@pytest.fixture(scope="module")
def qkv():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, S, H, DH)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, S, KV, DH)), jnp.float32) for _ in range(2))
    return q, k, v


def numpy_attention(q, k, v, seg, window=None, sinks=None):
    """Loop over rows, heads and queries; key j visible iff same segment, j <= i, i - j < window."""
    q, k, v, seg = (np.asarray(a, np.float64) for a in (q, k, v, seg))
    out = np.zeros_like(q)
    g = q.shape[2] // k.shape[2]
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            for i in range(q.shape[1]):
                j = np.arange(i + 1)
                j = j[(seg[b, j] == seg[b, i]) & ((window is None) | (i - j < (window or 1)))]
                s = k[b, j, h // g] @ q[b, i, h] / np.sqrt(q.shape[3])
                m = s.max() if sinks is None else max(s.max(), sinks[h])
                p = np.exp(s - m)
                den = p.sum() + (0.0 if sinks is None else np.exp(sinks[h] - m))
                out[b, i, h] = p @ v[b, j, h // g] / den
    return out


def _loss_and_grads(fn):
    def loss(q, k, v):
        o = fn(q, k, v)
        return jnp.sum(jnp.sin(o)), o
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def test_splash_matches_reference_forward_and_grads_on_packed_rows(qkv):
    want = _loss_and_grads(lambda q, k, v: attention.plain_attention(q, k, v, SEG))(*qkv)
    got = _loss_and_grads(lambda q, k, v: splash_attention(q, k, v, SEG, block=128))(*qkv)
    assert_rel_close(got, want)
    # Through the model's dispatch, and against an independent loop.
    o = attention_registry.attention(*qkv, SEG, impl="splash", block=128)
    assert_rel_close(o, numpy_attention(*qkv, SEG))


def test_splash_per_shard_under_a_mesh(qkv):
    # Rows over data (fsdp=2 does not divide B=2 and is dropped), KV heads over tensor.
    mesh = sharding.make_mesh(types.SimpleNamespace(data=2, fsdp=2, expert=1, tensor=2))
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    with jax.set_mesh(mesh):
        got = jax.jit(lambda q, k, v, s: splash_attention(q, k, v, SEG, window=50, sinks_H=s,
                                                          block=128))(*qkv, sinks)
    assert_rel_close(got, numpy_attention(*qkv, SEG, window=50, sinks=np.asarray(sinks)))


def test_sliding_window_and_sinks_match_numpy_loop(qkv):
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    window = 37
    q, k, v = qkv
    got = jax.jit(lambda q, k, v, s: splash_attention(q, k, v, SEG, window=window, sinks_H=s,
                                                      block=128))(q, k, v, sinks)
    assert_rel_close(got, numpy_attention(q, k, v, SEG, window=window, sinks=np.asarray(sinks)))
    # Each feature matters: without it the output is far from the loop's.
    far = lambda a, b: np.linalg.norm(np.asarray(a) - b) > 1e-2 * np.linalg.norm(b)
    assert far(splash_attention(q, k, v, SEG, sinks_H=sinks, block=128),
               numpy_attention(q, k, v, SEG, window=window, sinks=np.asarray(sinks)))
    assert far(got, numpy_attention(q, k, v, SEG, window=window))


def test_sink_gradient_matches_finite_difference(qkv):
    q, k, v = (a[:1, :64] for a in qkv)
    seg = SEG[:1, :64]
    loss = jax.jit(lambda s: jnp.sum(jnp.sin(splash_attention(q, k, v, seg, sinks_H=s))))
    s0 = jnp.asarray([0.3, -0.2, 1.0, 0.1], jnp.float32)
    g = jax.jit(jax.grad(loss))(s0)
    eps = 1e-2
    for h in range(H):
        e = jnp.zeros((H,)).at[h].set(eps)
        fd = (loss(s0 + e) - loss(s0 - e)) / (2 * eps)
        np.testing.assert_allclose(g[h], fd, rtol=2e-2, atol=1e-4)


def test_auto_resolves_to_splash_for_tpu_devices_only():
    tpu = sharding.make_mesh(types.SimpleNamespace(data=-1, fsdp=1, expert=1, tensor=1),
                             aot.topology_devices("v5p:2x2x1"))
    cpu = sharding.make_mesh(types.SimpleNamespace(data=-1, fsdp=1, expert=1, tensor=1))
    assert attention_registry.resolve("auto", tpu) == "splash"
    axes = types.SimpleNamespace(data=-1, fsdp=1, expert=1, context=2, tensor=1)
    tpu_context = sharding.make_mesh(axes, aot.topology_devices("v5p:2x2x1"))
    assert attention_registry.resolve("auto", tpu_context) == "splash"   # the per-shard kernel
    # Every resolved impl has a per-shard kernel under context parallelism.
    assert set(attention_registry.KERNELS) == set(attention_registry.names()) - {"auto"}
    assert attention_registry.resolve("auto", cpu) == "blockwise"
    assert attention_registry.resolve("auto") == "blockwise"       # no mesh: this CPU process
    assert attention_registry.resolve("plain", tpu) == "plain"      # explicit wins
    with pytest.raises(ValueError, match="attention impl"):
        attention_registry.resolve("flash3")


def test_bad_arguments_name_the_problem(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="window"):
        splash_attention(q, k, v, SEG, window=0)
    with pytest.raises(ValueError, match="sinks_H"):
        splash_attention(q, k, v, SEG, sinks_H=jnp.zeros((3,)))
    with pytest.raises(ValueError, match="segment_ids"):
        splash_attention(q, k, v, SEG[:, :10])
    with pytest.raises(ValueError, match="segment ids"):
        splash_local_attention(q, k, v, SEG, kv_segment_ids_BxK=SEG[:, :10])
    with pytest.raises(ValueError, match="q_offsets"):   # the kernel's masks are static
        jax.jit(lambda d: splash_local_attention(q, k, v, SEG, q_offset=d))(jnp.int32(0))


# ------------------------------------------------------------------ under the context axis
CB, CS, CH, CKV, CDH, CDV, CW = 2, 256, 2, 1, 8, 16, 40   # 128 tokens per chip at context = 2


def _context_rows():
    """Packed rows whose segments cross the chip boundary at 128, with padding (id 0)."""
    seg = np.zeros((CB, CS), np.int32)
    seg[0, :100], seg[0, 100:190], seg[0, 190:] = 1, 2, 3
    seg[1, :200], seg[1, 200:240] = 1, 2
    return jnp.asarray(seg)


def test_splash_per_shard_under_context_equals_one_chip():
    """context = 2, interpret mode: a full layer (all-gathered keys; zig-zag query halves, or
    each chip on its own queries) and a sliding layer (window 40 with sinks, a 39-key halo from
    the other chip) through the splash kernel equal plain attention on one chip, outputs and
    the gradients of q, k, v and the sinks; GQA (2 heads over 1 KV head), Dv != Dh."""
    seg = _context_rows()
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (CB, CS, CH, CDH))
    k = jax.random.normal(ks[1], (CB, CS, CKV, CDH))
    v = jax.random.normal(ks[2], (CB, CS, CKV, CDV))
    sinks = jax.random.normal(ks[3], (CH,))
    probe = jnp.sin(jnp.arange(CB * CS * CH * CDV, dtype=jnp.float32)).reshape(CB, CS, CH, CDV)

    def both(fn):
        def loss(q, k, v, sinks):
            full = fn(q, k, v, seg, window=0, sinks_H=None)
            slide = fn(q, k, v, seg, window=CW, sinks_H=sinks)
            return jnp.sum((full + slide) * probe), (full, slide)
        return jax.device_get(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
            q, k, v, sinks))

    want = both(attention.plain_attention)
    mesh = sharding.make_mesh(types.SimpleNamespace(data=1, fsdp=1, expert=1, context=2,
                                                    tensor=1), jax.devices()[:2])
    with jax.set_mesh(mesh):
        for balance in (True, False):   # traced offsets: lax.switch over static kernels
            got = both(lambda *a, balance=balance, **kw: attention_context.attention(
                *a, impl="splash", block=128, balance=balance, **kw))
            assert_rel_close(got, want, name=f"balance={balance}")


@pytest.mark.parametrize("q_len,kv_len,offset,window,bq,bk", [
    (256, 512, 128, None, 128, 128), (256, 512, 0, 40, 128, 128), (384, 640, 200, 129, 128, 128),
    (128, 1024, 896, None, 128, 256), (512, 300, 17, 5, 128, 100), (256, 256, -50, 300, 64, 64)])
def test_band_masks_answer_every_block_as_the_kernels_masks(q_len, kv_len, offset, window, bq, bk):
    """The masks' fast block answers (wholly visible / hidden blocks) equal the kernel's own
    evaluation on every block, edge blocks and blocks cut by the mask's end included."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    from gagar_jax.kernels.attention import splash as attention_splash

    shape = (q_len, kv_len)
    if window is None:
        fast, base = attention_splash.CausalMask(shape, offset), splash.CausalMask(shape, offset)
    else:
        fast = attention_splash.LocalMask(shape, window - 1, offset)
        base = splash.LocalMask(shape, (window - 1, 0), offset)
    for i in range(-(-q_len // bq)):
        for j in range(-(-kv_len // bk)):
            idx = (slice(i * bq, (i + 1) * bq), slice(j * bk, (j + 1) * bk))
            np.testing.assert_array_equal(fast[idx], base[idx], err_msg=str((i, j)))

"""Transformer building blocks of the Qwen3-MoE layout: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Parameters are stored in `param_dtype` and cast to `compute_dtype` at use; norms, softmax and
RoPE angles run in float32. Parameter leaf names are the keys of `sharding.PARAM_AXES`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gagar_jax import attention
from gagar_jax.sharding import constrain


def normal_init(rngs: nnx.Rngs, shape, fan_in: int, dtype) -> jax.Array:
    """N(0, 1 / fan_in) initial weights, drawn in float32 and stored in `dtype`."""
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in ** -0.5).astype(dtype)


class RMSNorm(nnx.Module):
    """y = x / rms(x) * scale, computed in float32 (as Hugging Face Qwen3 does)."""

    def __init__(self, dim: int, eps: float, param_dtype):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(x.dtype).reshape((1,) * (x.ndim - 1) + (-1,))
        return scale * y.astype(x.dtype)  # HF casts to the input dtype before scaling


def rope(x_BxSxHxD, positions_BxS, theta: float):
    """Rotary embedding, half-split ("rotate_half") convention of Llama/Qwen."""
    d = x_BxSxHxD.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    ang = positions_BxS.astype(jnp.float32)[..., None] * inv_freq[None, None]  # [B, S, D/2]
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    x1, x2 = jnp.split(x_BxSxHxD.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxSxHxD.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention with per-head RMS q/k norm and RoPE, over packed rows."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        D, H, Kv, Dh, pd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.param_dtype
        self.wq = nnx.Param(normal_init(rngs, (D, H, Dh), D, pd))
        self.wk = nnx.Param(normal_init(rngs, (D, Kv, Dh), D, pd))
        self.wv = nnx.Param(normal_init(rngs, (D, Kv, Dh), D, pd))
        self.wo = nnx.Param(normal_init(rngs, (H, Dh, D), H * Dh, pd))
        self.q_norm = RMSNorm(Dh, cfg.rms_norm_eps, pd)
        self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps, pd)
        self.cfg = cfg

    def __call__(self, x_BxSxD, segment_ids_BxS, positions_BxS):
        cfg, dt = self.cfg, x_BxSxD.dtype
        q = jnp.einsum("bsd,dhk->bshk", x_BxSxD, self.wq[...].astype(dt))
        k = jnp.einsum("bsd,dhk->bshk", x_BxSxD, self.wk[...].astype(dt))
        v = jnp.einsum("bsd,dhk->bshk", x_BxSxD, self.wv[...].astype(dt))
        q = constrain(rope(self.q_norm(q), positions_BxS, cfg.rope_theta), "batch", None, "heads", None)
        k = constrain(rope(self.k_norm(k), positions_BxS, cfg.rope_theta), "batch", None, "kv_heads", None)
        v = constrain(v, "batch", None, "kv_heads", None)
        o = attention.attention(q, k, v, segment_ids_BxS, impl=cfg.attention, block=cfg.attn_block)
        return jnp.einsum("bshk,hkd->bsd", o, self.wo[...].astype(dt))


class DenseMLP(nnx.Module):
    """SwiGLU MLP: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        D, I, pd = cfg.hidden_size, cfg.intermediate_size, cfg.param_dtype
        self.mlp_gate = nnx.Param(normal_init(rngs, (D, I), D, pd))
        self.mlp_up = nnx.Param(normal_init(rngs, (D, I), D, pd))
        self.mlp_down = nnx.Param(normal_init(rngs, (I, D), I, pd))

    def __call__(self, x_BxSxD):
        dt = x_BxSxD.dtype
        g = x_BxSxD @ self.mlp_gate[...].astype(dt)
        u = x_BxSxD @ self.mlp_up[...].astype(dt)
        h = constrain(jax.nn.silu(g) * u, "batch", None, "mlp")
        return h @ self.mlp_down[...].astype(dt)

"""Transformer building blocks: RMSNorm, RoPE, GQA attention (full or sliding), SwiGLU MLP.

Parameters are stored in `param_dtype` and cast to `compute_dtype` at use; norms, softmax and
RoPE angles run in float32. Parameter leaf names are the keys of `sharding.PARAM_AXES`.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gagar_jax.kernels.attention import context as attention_context
from gagar_jax.sharding import constrain


def normal_init(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int,
                dtype: jax.typing.DTypeLike) -> jax.Array:
    """N(0, 1 / fan_in) initial weights, drawn in float32 and stored in `dtype`."""
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in ** -0.5).astype(dtype)


class RMSNorm(nnx.Module):
    """y = x / rms(x) * scale, computed in float32 (as Hugging Face Qwen3 does)."""

    def __init__(self, dim: int, eps: float, param_dtype: jax.typing.DTypeLike):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(x.dtype).reshape((1,) * (x.ndim - 1) + (-1,))
        return scale * y.astype(x.dtype)  # HF casts to the input dtype before scaling


def rope(x_BxSxHxD: jax.Array, positions_BxS: jax.Array, theta: float,
         rotary_dim: int = 0) -> jax.Array:
    """Rotary embedding, half-split ("rotate_half") convention of Llama/Qwen.

    With `rotary_dim` d < head width (partial rotary, MiMo), the first d dims rotate with
    frequencies theta^(-2j/d) and the rest pass through, as transformers' `apply_rotary_pos_emb`.
    """
    d = rotary_dim or x_BxSxHxD.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    ang = positions_BxS.astype(jnp.float32)[..., None] * inv_freq[None, None]  # [B, S, d/2]
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    x32 = x_BxSxHxD.astype(jnp.float32)
    x1, x2 = jnp.split(x32[..., :d], 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x32[..., d:]], axis=-1)
    return out.astype(x_BxSxHxD.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE over packed rows: full or sliding-window.

    Optional per-head RMS q/k norm (Qwen3), partial rotary, a value head width and value scale of
    their own and, on sliding layers, KV heads and attention sinks of their own (MiMo-V2-Flash).
    """

    def __init__(self, cfg: Any, sliding: bool = False, *, rngs: nnx.Rngs):
        D, H, Dh, pd = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.param_dtype
        Kv = cfg.sliding_kv_heads if sliding else cfg.num_kv_heads
        Dv = cfg.value_head_dim
        self.wq = nnx.Param(normal_init(rngs, (D, H, Dh), D, pd))
        self.wk = nnx.Param(normal_init(rngs, (D, Kv, Dh), D, pd))
        self.wv = nnx.Param(normal_init(rngs, (D, Kv, Dv), D, pd))
        self.wo = nnx.Param(normal_init(rngs, (H, Dv, D), H * Dv, pd))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(Dh, cfg.rms_norm_eps, pd)
            self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps, pd)
        if sliding and cfg.attention_sinks:  # transformers initializes sinks ~ N(0, 0.02)
            self.sinks = nnx.Param((jax.random.normal(rngs.params(), (H,)) * 0.02).astype(pd))
        self.cfg = cfg
        self.window = cfg.sliding_window if sliding else 0
        self.theta = (cfg.sliding_rope_theta or cfg.rope_theta) if sliding else cfg.rope_theta

    def project_qkv(self, x_BxSxD: jax.Array,
                    positions_BxS: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [B, S, H, Dh], k [B, S, Kv, Dh], v [B, S, Kv, Dv]: projected, q/k-normed, v scaled,
        RoPE applied (also used by the KV-cache sampler)."""
        cfg, dt = self.cfg, x_BxSxD.dtype
        q = jnp.einsum("bsd,dhk->bshk", x_BxSxD, self.wq[...].astype(dt))
        k = jnp.einsum("bsd,dhk->bshk", x_BxSxD, self.wk[...].astype(dt))
        v = jnp.einsum("bsd,dhk->bshk", x_BxSxD, self.wv[...].astype(dt))
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.attention_value_scale != 1.0:
            v = v * jnp.asarray(cfg.attention_value_scale, dt)
        return (rope(q, positions_BxS, self.theta, cfg.rotary_dim),
                rope(k, positions_BxS, self.theta, cfg.rotary_dim), v)

    def sinks_H(self) -> jax.Array | None:
        """The per-head sink logits, or None (full layers, or sinks off)."""
        return self.sinks[...] if hasattr(self, "sinks") else None

    def __call__(self, x_BxSxD: jax.Array, segment_ids_BxS: jax.Array, positions_BxS: jax.Array):
        cfg, dt = self.cfg, x_BxSxD.dtype
        q, k, v = self.project_qkv(x_BxSxD, positions_BxS)
        q = constrain(q, "batch", "seq", "heads", None)
        k = constrain(k, "batch", "seq", "kv_heads", None)
        v = constrain(v, "batch", "seq", "kv_heads", None)
        o = attention_context.attention(q, k, v, segment_ids_BxS, impl=cfg.attention,
                                        block=cfg.attn_block, window=self.window,
                                        sinks_H=self.sinks_H())
        return jnp.einsum("bshk,hkd->bsd", o, self.wo[...].astype(dt))


class DenseMLP(nnx.Module):
    """SwiGLU MLP: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs):
        D, F, pd = cfg.hidden_size, cfg.intermediate_size, cfg.param_dtype
        self.mlp_gate = nnx.Param(normal_init(rngs, (D, F), D, pd))
        self.mlp_up = nnx.Param(normal_init(rngs, (D, F), D, pd))
        self.mlp_down = nnx.Param(normal_init(rngs, (F, D), F, pd))

    def __call__(self, x_BxSxD: jax.Array):
        dt = x_BxSxD.dtype
        g = x_BxSxD @ self.mlp_gate[...].astype(dt)
        u = x_BxSxD @ self.mlp_up[...].astype(dt)
        h = constrain(jax.nn.silu(g) * u, "batch", "seq", "mlp")
        return h @ self.mlp_down[...].astype(dt)

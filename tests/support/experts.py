"""Shared by the expert-backend tests (test_experts.py, test_experts_megablox.py)."""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp

from gagar_jax import sharding
from gagar_jax.kernels.experts import registry as experts_registry

GRAD_ARGS = (0, 1, 2, 3, 5)  # x, gate, up, down, gate weights (not the expert ids)


def loss_and_grads(backend: str, **opts: object):
    """jit(value_and_grad) of sum(sin(expert_ffn(...))) over GRAD_ARGS, the output as aux."""
    def loss(x, g, u, d, idx, w):
        y = experts_registry.expert_ffn(x, g, u, d, idx, w, backend=backend, **opts)
        return jnp.sum(jnp.sin(y)), y
    return jax.jit(jax.value_and_grad(loss, argnums=GRAD_ARGS, has_aux=True))


def expert_mesh(shape: tuple) -> jax.sharding.Mesh:
    """A mesh of (data, fsdp, expert, tensor) sizes; the other axes are 1."""
    return sharding.make_mesh(types.SimpleNamespace(
        **dict(zip(("data", "fsdp", "expert", "tensor"), shape, strict=True))))

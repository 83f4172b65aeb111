"""Weights from outside the checkpoint: `init_from` and the KL reference (`reference_from`).

A fresh run only (a resume restores everything from its checkpoint). Each process reads only
its own shards of a Hugging Face directory, straight into the training sharding.
"""
from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp

from gagar_jax.config import ConfigError, TrainConfig
from gagar_jax.hf import api as hf
from gagar_jax.run.startup import ARCHITECTURE_FIELDS
from gagar_jax.run.step import StepConfig

log = logging.getLogger(__name__)


def _count(params: Any) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))


def load_hf_params(path: str, step_cfg: StepConfig, like: Any, shardings: Any,
                    with_router_bias: bool = False) -> Any:
    """Parameters of a HF checkpoint directory, checked against the configured model, sharded
    (with `with_router_bias`: (params, router bias), the bias on the default device)."""
    model_cfg = step_cfg.model
    # Each process reads only its own shards, straight into the training sharding (hf_load).
    mesh = jax.tree.leaves(shardings)[0].mesh if shardings is not None else None
    model, ckpt_cfg = hf.from_pretrained(path, dtype=model_cfg.param_dtype, mesh=mesh)
    # Same shapes are not enough: a softmax checkpoint must not load into a sigmoid config.
    differ = [f for f in ARCHITECTURE_FIELDS if getattr(ckpt_cfg, f) != getattr(model_cfg, f)]
    if differ:
        raise ConfigError(
            f"{path}: checkpoint architecture does not match the config's model "
            f"section: checkpoint has {', '.join(f'{f}={getattr(ckpt_cfg, f)!r}' for f in differ)}"
        )
    from gagar_jax.run.step import split_model
    _, params, bias = split_model(model)
    want = jax.tree.map(lambda x: (x.shape, x.dtype), like)
    got = jax.tree.map(lambda x: (x.shape, x.dtype), params)
    if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
        raise ConfigError(f"{path}: checkpoint architecture does not match the config's model "
                          "section (set model.* to the checkpoint's shapes)")
    params = jax.device_put(params, shardings)
    return (params, bias) if with_router_bias else params


def own_copy(tree: Any, shardings: Any) -> Any:
    """A copy of `tree` in buffers of its own (the step donates the state: the KL reference
    must never alias the live parameters)."""
    return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings)(tree)


def outside_weights(state: Any, train: TrainConfig, step_cfg: StepConfig, shardings: Any,
                    ) -> Any:
    """A fresh run's state with `init_from` and the KL reference applied.

    The reference (kl_coef > 0) is `reference_from`, else the initial weights; either way it
    gets its own parameter buffers and its own frozen router bias.
    """
    if train.init_from:
        params, bias = load_hf_params(train.init_from, step_cfg, state.params,
                                       shardings.params, with_router_bias=True)
        bias = jax.device_put(bias, shardings.router_bias)  # MiMo: e_score_correction_bias
        state = state.replace(params=params, router_bias=bias)
        log.info("train.init_from: loaded %s (%s parameters)", train.init_from,
                 f"{_count(params):,}")
    if state.ref_params is None or not (train.init_from or train.reference_from):
        return state      # the jitted init gave the reference buffers of its own already
    ref, ref_bias = state.params, state.router_bias
    if train.reference_from:
        ref, ref_bias = load_hf_params(train.reference_from, step_cfg, state.params,
                                        shardings.params, with_router_bias=True)
        log.info("train.reference_from: loaded %s (%s parameters)", train.reference_from,
                 f"{_count(ref):,}")
    return state.replace(ref_params=own_copy(ref, shardings.params),
                         ref_router_bias=own_copy(ref_bias, shardings.router_bias))

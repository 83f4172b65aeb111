"""Weights handed to the sampler in accelerator memory, no files (SPEC section 6, "hand-over").

    state = model_state(graphdef, train_state.params, train_state.router_bias)   # same arrays
    engine.hand_over(state, version)                  # same mesh: the learner's own buffers
    ... sample ...; engine.sampler.release_params()   # before the next (donating) train step
    engine.hand_over(reshard(state, shardings), version)   # or: a copy on the sampler's mesh

Two ways, both measured by `timed_hand_over`:

* **Same mesh** (`mode="same"`): the sampler reads the train state's current parameters, the
  very arrays the learner holds, in the learner's sharding (its steps compile for it once).
  The train step donates its input state, so those buffers are reused by the next step: the
  sampler holds **no reference across a step**. It takes them after a step, samples, and
  drops them (`Sampler.release_params`) before the next step is dispatched; a sampler that
  kept them would find them deleted (JAX raises on a donated array), never silently stale.
  Cost: nothing (no copy, no extra memory). `mode="copy"` copies them on the same devices
  instead (the model's size again in memory) for a sampler that must outlive the step.
* **Resharded** (`mode="reshard"`): `jax.device_put` to the sampler mesh's shardings (the
  learner's logical-axis rules on the sampler's mesh, `sampler_shardings`): the sampler owns
  its copy and may keep it across steps. Between disjoint device sets this is a device-to-
  device transfer, not one compiled program; its bytes per link at pod scale are worked out
  in docs/scaling.md ("Weights to the sampler in memory").
"""
from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gagar_jax import sharding as shd

MODES = ("same", "copy", "reshard")


def model_state(graphdef: nnx.GraphDef, params: nnx.State, router_bias: nnx.State) -> nnx.State:
    """The whole model state (parameters and router biases) of a train state's parts: the same
    arrays, nothing copied."""
    return nnx.state(nnx.merge(graphdef, params, router_bias))


def sampler_shardings(state: Any, mesh: jax.sharding.Mesh) -> Any:
    """The learner's logical-axis rules (`sharding.PARAM_AXES`) on the sampler's mesh."""
    return shd.state_shardings(state, mesh)


def reshard(state: Any, shardings: Any) -> Any:
    """`state` placed with `shardings` (a device-to-device copy; waits until it is there)."""
    return jax.block_until_ready(jax.device_put(state, shardings))


@jax.jit
def _copy(state: Any) -> Any:
    return jax.tree.map(jnp.copy, state)


def state_bytes(state: Any) -> int:
    """Bytes of every leaf of `state` (the whole model, all shards together)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def timed_hand_over(engine: Any, state: Any, version: int, mode: str = "same",
                    shardings: Any = None) -> dict:
    """Hands `state` to `engine` (`JaxEngine.hand_over`) the `mode` way; returns {"mode",
    "bytes", "seconds"} (seconds: the copy or transfer until its arrays are ready; 0 work for
    "same").

    Args:
      engine: a `JaxEngine`.
      state: the learner's model state (`model_state`).
      version: the policy version the parameters are.
      mode: one of `MODES`.
      shardings: the sampler's shardings ("reshard" only: `sampler_shardings`).
    """
    if mode not in MODES:
        raise ValueError(f"hand-over mode must be one of {MODES}, got {mode!r}")
    if (mode == "reshard") != (shardings is not None):
        raise ValueError("shardings are given for mode='reshard', and only then")
    jax.block_until_ready(state)     # the step that computed it is not the hand-over's time
    t0 = time.perf_counter()
    if mode == "copy":
        state = jax.block_until_ready(_copy(state))
    elif mode == "reshard":
        state = reshard(state, shardings)
    seconds = time.perf_counter() - t0
    engine.hand_over(state, version)
    return {"mode": mode, "bytes": state_bytes(state), "seconds": seconds}

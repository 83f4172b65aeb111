"""The pieces of the jitted train step that the one-length step (`step.py`) and the step over
length buckets (`bucket_step.py`) share: the model inputs of a batch's rows, a gradient
accumulated over micro-batches, and the no-gradient forward passes (the learner's pre-update
log-probs, the reference's, routing replay)."""
from __future__ import annotations

from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from gagar_jax.algo import loss as loss_lib
from gagar_jax.algo.step_metrics import RouterStats
from gagar_jax.batch import Batch
from gagar_jax.model.logprobs import token_logprobs
from gagar_jax.model.moe import RouterBias, update_router_bias


@flax.struct.dataclass
class TokenInputs:
    """The model inputs of a batch's rows (leading axes [M, U, ...] once split)."""
    tokens_BxS: jax.Array
    segment_ids_BxS: jax.Array
    positions_BxS: jax.Array
    routed_experts_BxSxLxK: Optional[jax.Array] = None   # routing replay, when the feed has it

    @classmethod
    def from_batch(cls, batch: Batch) -> TokenInputs:
        return cls(batch.tokens_BxS, batch.segment_ids_BxS, batch.positions_BxS,
                   batch.routed_experts_BxSxLxK)


@flax.struct.dataclass
class MiniBatchGrads:
    """One mini-batch's gradient, accumulated over its micro-batches."""
    grads: Any                 # like params
    loss: jax.Array            # sum over micro-batches (each a mini-batch-global weighted sum)
    aux: loss_lib.LossAux             # summed over micro-batches
    router: RouterStats        # averaged over micro-batches (summed, then divided)


def model_logprobs(graphdef: nnx.GraphDef, params: nnx.State, bias: nnx.State,
                   tok: TokenInputs) -> tuple:
    """(log-probs, entropy, MoE aux) of `tok`'s rows under (params, bias)."""
    model = nnx.merge(graphdef, params, bias)
    return token_logprobs(model, tok.tokens_BxS, tok.segment_ids_BxS, tok.positions_BxS,
                          tok.routed_experts_BxSxLxK)


def forward_only(graphdef: nnx.GraphDef, params: nnx.State, bias: nnx.State,
                 tok_MxU: TokenInputs, routes: bool = False) -> Any:
    """Log-probs of the whole batch, chunked like the micro-batches (no gradient).

    With `routes`, also the experts every token used, [M, U, b, S, L, K] like `tok_MxU` (R2)."""
    def body(_: None, t: TokenInputs):
        lp, _, aux = model_logprobs(graphdef, params, bias, t)
        return None, (lp, aux.routed_experts_BxSxLxK if routes else None)
    flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), tok_MxU)
    _, (lp, ids) = jax.lax.scan(body, None, flat)
    lp = jax.lax.stop_gradient(loss_lib.merge_rows(lp.reshape(tok_MxU.tokens_BxS.shape)))
    if not routes:
        return lp
    return lp, ids.reshape(tok_MxU.tokens_BxS.shape + ids.shape[-2:])


def replay_inputs(graphdef: nnx.GraphDef, params: nnx.State, bias: nnx.State,
                  tok_MxU: TokenInputs, cfg: Any,
                  ) -> tuple[jax.Array | None, TokenInputs]:
    """(learner_old or None, TokenInputs for the updates): R2 records the pre-update pass's own
    top-k and replays it in every update (the feed's routed_experts are dropped); R3 replays the
    feed's routed_experts where the batch has them."""
    if not cfg.loss.recompute_old_logprobs:
        return None, tok_MxU
    if cfg.loss.routing_replay == "r2" and cfg.model.num_experts > 0:
        free = tok_MxU.replace(routed_experts_BxSxLxK=None)
        lp, ids = forward_only(graphdef, params, bias, free, routes=True)
        return lp, free.replace(routed_experts_BxSxLxK=ids)
    return forward_only(graphdef, params, bias, tok_MxU), tok_MxU


def run_epochs(state: Any, epoch: Any, *, graphdef: nnx.GraphDef, cfg: Any) -> tuple:
    """The step's `cfg.epochs` passes of `epoch` (a scan body over the optimizer carry
    (params, opt_state, updates, skipped)), then the router bias's aux-loss-free update from the
    step's mean expert load: the end of `step.train_step` and `bucket_step.bucket_train_step`.

    Returns:
      (the new `TrainState`, the stacked update stats, the mean expert load [L, E]).
    """
    carry0 = (state.params, state.opt_state, state.updates, state.skipped)
    (params, opt_state, updates, skipped), stats = jax.lax.scan(epoch, carry0, None,
                                                                length=cfg.epochs)
    load_LxE = jnp.mean(stats.router.expert_load_LxE, axis=(0, 1))
    bias = state.router_bias
    if cfg.model.router == "sigmoid_bias":
        model = nnx.merge(graphdef, params, bias)
        update_router_bias(model, load_LxE, cfg.model.router_bias_update_rate)
        bias = nnx.state(model, RouterBias)
    return (state.replace(step=state.step + 1, updates=updates, skipped=skipped, params=params,
                          opt_state=opt_state, router_bias=bias), stats, load_LxE)

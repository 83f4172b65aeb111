"""The train step over a batch in length buckets (`feed/buckets.py`): one optimizer update from
micro-batches of several row lengths.

`step.train_step` hands a `BucketedBatch` here. Each bucket's rows are micro-batches of
`StepConfig.micro_rows` rows; a step fills only some of a bucket's static micro-batches (the
rest are all padding and skipped by a `lax.cond`, so they cost no compute). The loss is the
same single-shot loss as with one row length: advantages, the rollout correction and every
aggregation denominator are computed once over the whole step's tokens (all buckets flattened
into one [R, C] token array, C = the buckets' greatest common divisor), then each micro-batch's
loss is a weighted sum with those step-global weights, so the gradient does not depend on how
the trajectories were packed or bucketed (`tests/test_bucket_step.py` checks it against the
one-length step). Router losses and the expert load are averaged over the live micro-batches.

One optimizer update per epoch: `train.mini_batches` must be 1 with buckets.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gagar_jax import sharding as shd
from gagar_jax.algo import loss as loss_lib
from gagar_jax.algo.step_metrics import RouterStats, UpdateStats, step_metrics
from gagar_jax.batch import Batch, BucketedBatch
from gagar_jax.run import step_parts as st
from gagar_jax.run.optim import make_optimizer, make_schedule

_TOKEN_FIELDS = ("tokens_BxS", "segment_ids_BxS", "positions_BxS", "traj_index_BxS",
                 "loss_mask_BxS", "old_logprobs_BxS")


def _chunk(buckets: tuple) -> int:
    return functools.reduce(math.gcd, [b.tokens_BxS.shape[1] for b in buckets])


def _flat_constrain(x: jax.Array) -> jax.Array:
    """The flattened [R, C] token arrays split along R over every batch and sequence axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    axes = shd.mesh_axes("batch", mesh) + shd.mesh_axes("seq", mesh)
    n = math.prod(mesh.shape[a] for a in axes)
    if not axes or x.shape[0] % n:
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(axes))


def flatten(batch: BucketedBatch, extra: tuple = ()) -> tuple[Batch, tuple]:
    """The step's tokens as one `Batch` of [R, C] rows (every bucket's rows cut into C-token
    pieces, buckets one after another) with the step's [T] / [G] arrays; `extra` [B_k, S_k]
    arrays per bucket (e.g. log-probs) flattened alike."""
    c = _chunk(batch.buckets)
    cut = lambda x: _flat_constrain(x.reshape(-1, c))
    fields = {f: jnp.concatenate([cut(getattr(b, f)) for b in batch.buckets])
              for f in _TOKEN_FIELDS}
    first = batch.buckets[0]
    flat = first.replace(routed_experts_BxSxLxK=None, **fields)
    return flat, tuple(jnp.concatenate([cut(x) for x in xs]) for xs in extra)


def unflatten(x_RxC: jax.Array, batch: BucketedBatch) -> list[jax.Array]:
    """`flatten`'s [R, C] layout back to each bucket's [B_k, S_k]."""
    c, out, start = _chunk(batch.buckets), [], 0
    for b in batch.buckets:
        rows, s = b.tokens_BxS.shape
        n = rows * s // c
        out.append(x_RxC[start:start + n].reshape(rows, s))
        start += n
    return out


def _bucket_grads(params: nnx.State, bias: nnx.State, toks: list, inputs: list,
                  n_live: jax.Array, *, graphdef: nnx.GraphDef,
                  cfg: Any) -> st.MiniBatchGrads:
    """The step's gradient, accumulated over every bucket's live micro-batches."""
    def loss_fn(p: nnx.State, tok: st.TokenInputs, inp: loss_lib.LossInputs):
        logp, ent, maux = st.model_logprobs(graphdef, p, bias, tok)
        loss, aux = loss_lib.pg_loss(logp, ent, inp, cfg.loss)
        penalty = cfg.loss.router_aux_coef * maux.aux_loss + cfg.loss.router_z_coef * maux.z_loss
        router = RouterStats(aux_loss=maux.aux_loss, z_loss=maux.z_loss,
                             expert_load_LxE=maux.expert_load_LxE)
        return loss + penalty / n_live, (aux, router)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    first = jax.tree.map(lambda x: x[0], (toks[0], inputs[0]))
    aux0, router0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                 jax.eval_shape(loss_fn, params, *first)[1])
    zero = st.MiniBatchGrads(jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32),
                             aux0, router0)

    def body(acc: st.MiniBatchGrads, xs: tuple):
        tok, inp = xs

        def run(_: None) -> st.MiniBatchGrads:
            (loss, (aux, router)), g = grad_fn(params, tok, inp)
            return st.MiniBatchGrads(g, loss, aux, router)

        got = jax.lax.cond(jnp.any(tok.segment_ids_BxS > 0), run, lambda _: zero, None)
        return jax.tree.map(jnp.add, acc, got), None

    acc = zero
    for tok_U, inp_U in zip(toks, inputs, strict=True):
        acc = jax.lax.scan(body, acc, (tok_U, inp_U))[0]
    return acc.replace(router=jax.tree.map(lambda x: x / n_live, acc.router))


def bucket_train_step(state: Any, batch: BucketedBatch, *, graphdef: nnx.GraphDef,
                      cfg: Any) -> tuple[Any, Any]:
    """`step.train_step` for a `BucketedBatch` (module docstring).

    Args:
      state: the `step.TrainState`; batch: the step's buckets; graphdef, cfg (`step.StepConfig`):
        as `step.train_step`.
    Returns:
      (new_state, StepMetrics).
    """
    if cfg.mini_batches != 1 or cfg.micro_rows <= 0:
        raise ValueError("length buckets need train.mini_batches = 1 and feed.bucket_rows > 0, "
                         f"got {cfg.mini_batches} and {cfg.micro_rows}")
    for b in batch.buckets:
        if b.tokens_BxS.shape[0] % cfg.micro_rows:
            raise ValueError(f"a bucket of {b.tokens_BxS.shape[0]} rows does not split into "
                             f"micro-batches of feed.bucket_rows = {cfg.micro_rows} rows")
    micro = [b.tokens_BxS.shape[0] // cfg.micro_rows for b in batch.buckets]
    split = lambda tree, u: jax.tree.map(lambda x: loss_lib.split_rows(x, 1, u), tree)
    toks = [split(st.TokenInputs.from_batch(b), u) for b, u in zip(batch.buckets, micro,
                                                                  strict=True)]
    ref = None
    if cfg.loss.kl_coef > 0:
        ref = [st.forward_only(graphdef, state.ref_params, state.ref_router_bias,
                               t.replace(routed_experts_BxSxLxK=None)
                               if cfg.loss.routing_replay == "r2" else t) for t in toks]
    replayed = [st.replay_inputs(graphdef, state.params, state.router_bias, t, cfg)
                for t in toks]
    toks = [t for _, t in replayed]
    old = [lp for lp, _ in replayed] if cfg.loss.recompute_old_logprobs else None
    extra = tuple(x for x in (old, ref) if x is not None)
    flat, flat_extra = flatten(batch, extra)
    it = iter(flat_extra)
    prep = loss_lib.prepare_batch(flat, cfg.loss, mini_batches=1,
                                  learner_old_logprobs_BxS=next(it) if old else None,
                                  ref_logprobs_BxS=next(it) if ref else None)
    inputs = [split(x, u) for x, u in zip(_split_inputs(prep.inputs, batch), micro,
                                          strict=True)]
    live = sum(jnp.sum(jnp.any(t.segment_ids_BxS > 0, axis=(-2, -1))) for t in toks)
    n_live = jnp.maximum(live, 1).astype(jnp.float32)
    tx = make_optimizer(cfg.optim)

    def epoch(carry: tuple, _: None):
        params, opt_state, updates, skipped = carry
        g = _bucket_grads(params, state.router_bias, [jax.tree.map(lambda x: x[0], t)
                                                      for t in toks],
                          [jax.tree.map(lambda x: x[0], i) for i in inputs], n_live,
                          graphdef=graphdef, cfg=cfg)
        gnorm = optax.tree.norm(g.grads)
        finite = jnp.isfinite(g.loss) & jnp.isfinite(gnorm)
        upd, new_opt = tx.update(g.grads, opt_state, params)
        keep = lambda new, old_: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old_)
        params, opt_state = keep(optax.apply_updates(params, upd), params), keep(new_opt,
                                                                                 opt_state)
        stats = UpdateStats(loss=g.loss, grad_norm=gnorm,
                            learning_rate=make_schedule(cfg.optim)(updates), finite=finite,
                            aux=g.aux, router=g.router)
        fin = finite.astype(jnp.int32)
        stats = jax.tree.map(lambda x: x[None], stats)     # the [mini_batches] axis: one
        return (params, opt_state, updates + fin, skipped + 1 - fin), stats

    new_state, stats, load_LxE = st.run_epochs(state, epoch, graphdef=graphdef, cfg=cfg)
    return new_state, step_metrics(flat, prep.inputs, prep.adv, stats, load_LxE, prep.rollout)


def _split_inputs(inputs: loss_lib.LossInputs, batch: BucketedBatch) -> list:
    """`LossInputs` over the flat [R, C] tokens -> one per bucket, [B_k, S_k]."""
    parts = jax.tree.map(lambda x: unflatten(x, batch), inputs)
    return [jax.tree.map(lambda p, i=i: p[i], parts, is_leaf=lambda x: isinstance(x, list))
            for i in range(len(batch.buckets))]

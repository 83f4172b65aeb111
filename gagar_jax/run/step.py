"""TrainState and the jitted train step: one feed batch -> epochs x mini_batches AdamW updates.

Inside ONE jitted function (see docs/loss.md for the semantics; M mini-batches, U micro-batches):
  1. optionally the learner's pre-update log-probs and the reference log-probs (no gradient);
  2. Gagar advantages, their token broadcast and every mini-batch's loss denominators, once;
  3. `lax.scan` over epochs, `lax.scan` over the M mini-batches (one optimizer update each), \
and inside
     each update a `lax.scan` accumulating gradients over U micro-batches (exactly the single-shot
     gradient, since each micro-batch loss is a weighted sum with mini-batch-global weights);
  4. the aux-loss-free router bias update from the step's expert load (router = sigmoid_bias).
An update whose loss or gradient is non-finite is skipped: parameters and optimizer state stay
as they were, `skipped` counts it. `step` always advances (one step = one feed batch consumed),
so the step counter stays in line with the feed position and the ledger.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Optional

import chex
import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gagar_jax import sharding as shd
from gagar_jax.algo import loss as loss_lib
from gagar_jax.algo.advantage import GroupOutcomes
from gagar_jax.algo.advantage_checks import check_invariants_of
from gagar_jax.algo.step_metrics import RouterStats, UpdateStats, step_metrics
from gagar_jax.batch import Batch, BucketedBatch
from gagar_jax.model.moe import RouterBias
from gagar_jax.model.transformer import ModelConfig, Transformer, resolve_kernels
from gagar_jax.run.bucket_step import bucket_train_step
from gagar_jax.run.optim import OptimConfig, make_optimizer, make_schedule
from gagar_jax.run.step_parts import (
    MiniBatchGrads,
    TokenInputs,
    forward_only,
    model_logprobs,
    replay_inputs,
    run_epochs,
)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Everything the jitted step is specialized on (hashable; static under jit).

    Attributes:
      model, loss, optim: the frozen section configs.
      epochs: passes over each feed batch.
      mini_batches: optimizer updates per epoch (rows split along B).
      micro_batches: gradient-accumulation chunks per mini-batch.
      micro_rows: rows per micro-batch of a batch in length buckets (`feed.bucket_rows`; 0
        without buckets: `run/bucket_step.py`).
      debug_checks: run `advantage_checks.check_invariants_of` inside the step (needs
        `make_train_step`'s chexified wrapper).
    """
    model: ModelConfig
    loss: loss_lib.LossConfig
    optim: OptimConfig
    epochs: int = 1
    mini_batches: int = 1
    micro_batches: int = 1
    debug_checks: bool = False
    micro_rows: int = 0

    def __post_init__(self):
        for name in ("epochs", "mini_batches", "micro_batches"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_config(cls, cfg: Any) -> StepConfig:
        """From a whole config (`model`, `loss`, `optim`, `train` sections, `debug_checks`)."""
        model = ModelConfig.from_config(cfg.model)
        return cls(model=model, loss=loss_lib.LossConfig.from_config(cfg.loss, model=model),
                   optim=OptimConfig.from_config(cfg.optim), epochs=int(cfg.train.epochs),
                   mini_batches=int(cfg.train.mini_batches),
                   micro_batches=int(cfg.train.micro_batches),
                   debug_checks=bool(cfg.debug_checks),
                   micro_rows=int(cfg.feed.get("bucket_rows", 0) or 0)
                   if cfg.feed.get("buckets", ()) else 0)

    def check_batch(self, batch: Batch) -> None:
        """Clear error when B does not split into mini_batches x micro_batches."""
        B = batch.tokens_BxS.shape[0]
        if B % (self.mini_batches * self.micro_batches):
            raise ValueError(
                f"batch rows B={B} must be divisible by train.mini_batches * train.micro_batches "
                f"= {self.mini_batches} * {self.micro_batches}")


@flax.struct.dataclass
class TrainState:
    """The learner's whole state (a pytree; the model graphdef lives outside it).

    step: train steps taken (feed batches consumed). updates / skipped: optimizer updates
    applied / skipped as non-finite. params: nnx.State of the nnx.Param leaves (float32 master
    copy). opt_state: optax state. rng: PRNG key. router_bias: nnx.State of the non-trainable
    RouterBias leaves. ref_params: frozen KL reference parameters (None when kl_coef = 0).
    ref_router_bias: the reference's own frozen copy of the router biases (None when kl_coef =
    0): the reference's routing must not follow the live bias as aux-loss-free balancing moves
    it. Both reference fields are buffers of their own, never aliases of params/router_bias
    (the step donates the state).
    """
    step: jax.Array
    updates: jax.Array
    skipped: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    router_bias: Any
    ref_params: Optional[Any] = None
    ref_router_bias: Optional[Any] = None


def split_model(model: Transformer) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, params, router bias): the trainable and non-trainable parts of a model."""
    graphdef, params, bias = nnx.split(model, nnx.Param, RouterBias)
    return graphdef, params, bias


def _init_state(rng: jax.Array, cfg: StepConfig):
    init_rng, state_rng = jax.random.split(rng)
    _, params, bias = split_model(Transformer(cfg.model, rngs=nnx.Rngs(init_rng)))
    z = jnp.zeros((), jnp.int32)
    kl = cfg.loss.kl_coef > 0
    # Inside jit every output is a buffer of its own: the reference starts equal, not aliased.
    return TrainState(step=z, updates=z, skipped=z, params=params,
                      opt_state=make_optimizer(cfg.optim).init(params), rng=state_rng,
                      router_bias=bias, ref_params=params if kl else None,
                      ref_router_bias=bias if kl else None)


def state_shardings(abstract: TrainState, mesh: jax.sharding.Mesh, cfg: StepConfig) -> TrainState:
    """NamedShardings for a (possibly abstract) TrainState: params by the logical rules, optimizer
    moments like their parameters, everything else replicated."""
    rep = NamedSharding(mesh, P())
    params = shd.state_shardings(abstract.params, mesh)
    opt = optax.tree_utils.tree_map_params(
        make_optimizer(cfg.optim), lambda _, s: s, abstract.opt_state, params,
        transform_non_params=lambda _: rep,
        is_leaf=lambda x: isinstance(x, (NamedSharding, optax.MaskedNode)))
    bias = shd.state_shardings(abstract.router_bias, mesh)
    return TrainState(step=rep, updates=rep, skipped=rep, params=params, opt_state=opt, rng=rep,
                      router_bias=bias,
                      ref_params=None if abstract.ref_params is None else params,
                      ref_router_bias=None if abstract.ref_router_bias is None else bias)


def abstract_train_state(cfg: StepConfig,
                         mesh: jax.sharding.Mesh | None = None) -> tuple[TrainState, nnx.GraphDef]:
    """The TrainState as shapes and dtypes, and the model graphdef; allocates nothing.

    Args:
      cfg: the StepConfig.
      mesh: the mesh the step runs on; "auto" kernel choices are resolved for its devices
        (`transformer.resolve_kernels`, the one place) and fixed in the graphdef.
    Returns:
      (abstract TrainState of jax.ShapeDtypeStruct, graphdef).
    """
    model_cfg = resolve_kernels(cfg.model, mesh)
    graphdef = split_model(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))))[0]
    abstract = jax.eval_shape(functools.partial(_init_state, cfg=cfg), jax.random.PRNGKey(0))
    return abstract, graphdef


def init_train_state(cfg: StepConfig, mesh: jax.sharding.Mesh,
                     rng: jax.Array) -> tuple[TrainState, nnx.GraphDef, TrainState]:
    """Creates a TrainState born sharded: eval_shape -> shardings -> jit(init, out_shardings).

    Returns:
      (state, graphdef, shardings) with `shardings` a TrainState of NamedShardings.
    """
    init, graphdef, shardings = train_state_initializer(cfg, mesh)
    return init(rng), graphdef, shardings


def train_state_initializer(cfg: StepConfig, mesh: jax.sharding.Mesh
                            ) -> tuple[Callable[[jax.Array], TrainState], nnx.GraphDef, TrainState]:
    """`init_train_state` in two parts, for a caller that starts many runs of one config (the
    miniature's arms and seeds): `init(rng)` is jitted once, so a later run neither traces nor
    lowers it again. Returns (init, graphdef, shardings)."""
    abstract, graphdef = abstract_train_state(cfg, mesh)
    shardings = state_shardings(abstract, mesh, cfg)
    jitted = jax.jit(functools.partial(_init_state, cfg=cfg), out_shardings=shardings)

    def init(rng: jax.Array) -> TrainState:
        with jax.set_mesh(mesh):
            return jitted(rng)
    return init, graphdef, shardings


# --------------------------------------------------------------------------- the step
def mini_batch_grads(params: nnx.State, bias: nnx.State, tok_U: TokenInputs,
                     inputs_U: loss_lib.LossInputs, *, graphdef: nnx.GraphDef,
                     cfg: StepConfig) -> MiniBatchGrads:
    """Gradient of one mini-batch, accumulated over its U micro-batches (leading axis U)."""
    n_micro = cfg.micro_batches

    def loss_fn(p: nnx.State, tok: TokenInputs, inp: loss_lib.LossInputs):
        logp, ent, maux = model_logprobs(graphdef, p, bias, tok)
        loss, aux = loss_lib.pg_loss(logp, ent, inp, cfg.loss)
        # Router losses are per-micro-batch means: average them over the micro-batches.
        penalty = cfg.loss.router_aux_coef * maux.aux_loss + cfg.loss.router_z_coef * maux.z_loss
        router = RouterStats(aux_loss=maux.aux_loss, z_loss=maux.z_loss,
                             expert_load_LxE=maux.expert_load_LxE)
        return loss + penalty / n_micro, (aux, router)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def body(acc: MiniBatchGrads, xs: tuple):
        (loss, (aux, router)), g = grad_fn(params, *xs)
        return jax.tree.map(jnp.add, acc, MiniBatchGrads(g, loss, aux, router)), None

    first = jax.tree.map(lambda x: x[0], (tok_U, inputs_U))
    aux0, router0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                 jax.eval_shape(loss_fn, params, *first)[1])
    acc0 = MiniBatchGrads(jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32),
                          aux0, router0)
    acc = jax.lax.scan(body, acc0, (tok_U, inputs_U))[0]
    return acc.replace(router=jax.tree.map(lambda x: x / n_micro, acc.router))


def _optimizer_update(carry: tuple, xs: tuple, *, bias: nnx.State, graphdef: nnx.GraphDef,
                      cfg: StepConfig):
    """One mini-batch: accumulate, then apply AdamW unless the loss or gradient is non-finite."""
    params, opt_state, updates, skipped = carry
    tx = make_optimizer(cfg.optim)
    mb = mini_batch_grads(params, bias, *xs, graphdef=graphdef, cfg=cfg)
    gnorm = optax.tree.norm(mb.grads)
    finite = jnp.isfinite(mb.loss) & jnp.isfinite(gnorm)
    upd, new_opt = tx.update(mb.grads, opt_state, params)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    params, opt_state = keep(optax.apply_updates(params, upd), params), keep(new_opt, opt_state)
    stats = UpdateStats(loss=mb.loss, grad_norm=gnorm,
                        learning_rate=make_schedule(cfg.optim)(updates), finite=finite,
                        aux=mb.aux, router=mb.router)
    fin = finite.astype(jnp.int32)
    return (params, opt_state, updates + fin, skipped + 1 - fin), stats


def train_step(state: TrainState, batch: Batch | BucketedBatch, *, graphdef: nnx.GraphDef,
               cfg: StepConfig) -> tuple[TrainState, Any]:
    """Consumes one feed batch: epochs x mini_batches optimizer updates (see module docstring).

    Args:
      state: the TrainState (donated by `make_train_step`).
      batch: one packed feed batch; B must divide by mini_batches * micro_batches.
      graphdef: the model's nnx graphdef (static).
      cfg: StepConfig (static).
    Returns:
      (new_state, StepMetrics).
    """
    if isinstance(batch, BucketedBatch):     # length buckets: their own step
        return bucket_train_step(state, batch, graphdef=graphdef, cfg=cfg)
    cfg.check_batch(batch)
    n_mini, n_micro = cfg.mini_batches, cfg.micro_batches
    split = lambda tree: jax.tree.map(lambda x: loss_lib.split_rows(x, n_mini, n_micro), tree)
    tok_MxU = split(TokenInputs.from_batch(batch))
    ref = None
    if cfg.loss.kl_coef > 0:
        # The reference routes with its own frozen bias, not the live one (under R2 freely).
        ref_tok = (tok_MxU.replace(routed_experts_BxSxLxK=None)
                   if cfg.loss.routing_replay == "r2" else tok_MxU)
        ref = forward_only(graphdef, state.ref_params, state.ref_router_bias, ref_tok)
    learner_old, tok_MxU = replay_inputs(graphdef, state.params, state.router_bias, tok_MxU, cfg)
    # Advantages, denominators and the rollout correction: once per batch, before the loops.
    prep = loss_lib.prepare_batch(batch, cfg.loss, mini_batches=n_mini,
                                  learner_old_logprobs_BxS=learner_old, ref_logprobs_BxS=ref)
    inputs, adv = prep.inputs, prep.adv
    if cfg.debug_checks:
        check_invariants_of(adv, GroupOutcomes.of_batch(batch), lam_cap=cfg.loss.lam_cap,
                            mode=cfg.loss.mode, std_norm=cfg.loss.norm_adv_by_std,
                            weights=prep.traj_weights_T)
        chex.assert_trees_all_equal(
            jnp.all(jnp.isfinite(inputs.weight_BxS)), jnp.array(True),
            custom_message="loss weights are finite")
    update = functools.partial(
        _optimizer_update, bias=state.router_bias, graphdef=graphdef, cfg=cfg
    )

    def epoch(carry: tuple, _: None):
        return jax.lax.scan(update, carry, (tok_MxU, split(inputs)))

    new_state, stats, load_LxE = run_epochs(state, epoch, graphdef=graphdef, cfg=cfg)
    return new_state, step_metrics(batch, inputs, adv, stats, load_LxE, prep.rollout)


def make_train_step(cfg: StepConfig, mesh: jax.sharding.Mesh, state_shardings_: TrainState,
                    batch_shardings_: Batch, graphdef: nnx.GraphDef
                    ) -> Callable[[TrainState, Batch], tuple[TrainState, Any]]:
    """`train_step` jitted ONCE with in/out shardings and the state donated.

    With `cfg.debug_checks` the jitted step is wrapped in `chex.chexify` (synchronous), so a
    failed conservation check raises on the host after the step.
    Returns:
      step_fn(state, batch) -> (state, StepMetrics); `step_fn.jitted` is the jax.jit object.
    """
    fn = functools.partial(train_step, graphdef=graphdef, cfg=cfg)
    jitted = jax.jit(fn, in_shardings=(state_shardings_, batch_shardings_),
                     out_shardings=(state_shardings_, NamedSharding(mesh, P())),
                     donate_argnames=("state",))
    call = chex.chexify(jitted, async_check=False) if cfg.debug_checks else jitted

    def step_fn(state: TrainState, batch: Batch):
        with jax.set_mesh(mesh):
            return call(state, batch)

    step_fn.jitted = jitted
    return step_fn

"""TrainState and the jitted train step: one feed batch -> epochs x mini_batches AdamW updates.

Inside ONE jitted function (see docs/loss.md for the semantics):
  1. optionally the learner's pre-update log-probs and the reference log-probs (no gradient);
  2. Gagar advantages, their token broadcast and every mini-batch's loss denominators, once;
  3. `lax.scan` over epochs, `lax.scan` over mini-batches (one optimizer update each), and inside
     each update a `lax.scan` accumulating gradients over micro-batches (exactly the single-shot
     gradient, since each micro-batch loss is a weighted sum with mini-batch-global weights);
  4. the aux-loss-free router bias update from the step's expert load (router = sigmoid_bias).
An update whose loss or gradient is non-finite is skipped: parameters and optimizer state stay
as they were, `skipped` counts it. `step` always advances (one step = one feed batch consumed),
so the step counter stays in line with the feed position and the ledger.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import chex
import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from gagar_jax import loss as L
from gagar_jax import sharding as shd
from gagar_jax.advantage import check_invariants
from gagar_jax.batch import Batch
from gagar_jax.logprobs import token_logprobs
from gagar_jax.model import ModelConfig, Transformer
from gagar_jax.moe import RouterBias, update_router_bias
from gagar_jax.optim import OptimConfig, make_optimizer, make_schedule


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Everything the jitted step is specialized on (hashable; static under jit).

    Attributes:
      model, loss, optim: the frozen section configs.
      epochs: passes over each feed batch.
      mini_batches: optimizer updates per epoch (rows split along B).
      micro_batches: gradient-accumulation chunks per mini-batch.
      debug_checks: run `advantage.check_invariants` inside the step (needs `make_train_step`'s
        chexified wrapper).
    """
    model: ModelConfig
    loss: L.LossConfig
    optim: OptimConfig
    epochs: int = 1
    mini_batches: int = 1
    micro_batches: int = 1
    debug_checks: bool = False

    def __post_init__(self):
        for name in ("epochs", "mini_batches", "micro_batches"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_config(cls, cfg) -> "StepConfig":
        """From a whole config (`model`, `loss`, `optim`, `train` sections, `debug_checks`)."""
        model = ModelConfig.from_config(cfg.model)
        return cls(model=model, loss=L.LossConfig.from_config(cfg.loss, model=model),
                   optim=OptimConfig.from_config(cfg.optim), epochs=int(cfg.train.epochs),
                   mini_batches=int(cfg.train.mini_batches),
                   micro_batches=int(cfg.train.micro_batches),
                   debug_checks=bool(cfg.debug_checks))

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
    """
    step: jax.Array
    updates: jax.Array
    skipped: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    router_bias: Any
    ref_params: Optional[Any] = None


def split_model(model):
    """(graphdef, params, router bias): the trainable and non-trainable parts of a model."""
    graphdef, params, bias = nnx.split(model, nnx.Param, RouterBias)
    return graphdef, params, bias


def _init_state(rng, cfg: StepConfig):
    init_rng, state_rng = jax.random.split(rng)
    _, params, bias = split_model(Transformer(cfg.model, rngs=nnx.Rngs(init_rng)))
    z = jnp.zeros((), jnp.int32)
    return TrainState(step=z, updates=z, skipped=z, params=params,
                      opt_state=make_optimizer(cfg.optim).init(params), rng=state_rng,
                      router_bias=bias, ref_params=params if cfg.loss.kl_coef > 0 else None)


def state_shardings(abstract: TrainState, mesh, cfg: StepConfig) -> TrainState:
    """NamedShardings for a (possibly abstract) TrainState: params by the logical rules, optimizer
    moments like their parameters, everything else replicated."""
    rep = NamedSharding(mesh, P())
    params = shd.state_shardings(abstract.params, mesh)
    opt = optax.tree_utils.tree_map_params(
        make_optimizer(cfg.optim), lambda _, s: s, abstract.opt_state, params,
        transform_non_params=lambda _: rep,
        is_leaf=lambda x: isinstance(x, (NamedSharding, optax.MaskedNode)))
    return TrainState(step=rep, updates=rep, skipped=rep, params=params, opt_state=opt, rng=rep,
                      router_bias=shd.state_shardings(abstract.router_bias, mesh),
                      ref_params=None if abstract.ref_params is None else params)


def abstract_train_state(cfg: StepConfig):
    """The TrainState as shapes and dtypes, and the model graphdef; allocates nothing.

    Returns:
      (abstract TrainState of jax.ShapeDtypeStruct, graphdef).
    """
    graphdef = split_model(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))[0]
    abstract = jax.eval_shape(functools.partial(_init_state, cfg=cfg), jax.random.PRNGKey(0))
    return abstract, graphdef


def init_train_state(cfg: StepConfig, mesh, rng):
    """Creates a TrainState born sharded: eval_shape -> shardings -> jit(init, out_shardings).

    Returns:
      (state, graphdef, shardings) with `shardings` a TrainState of NamedShardings.
    """
    abstract, graphdef = abstract_train_state(cfg)
    shardings = state_shardings(abstract, mesh, cfg)
    with jax.set_mesh(mesh):
        state = jax.jit(functools.partial(_init_state, cfg=cfg), out_shardings=shardings)(rng)
    return state, graphdef, shardings


def batch_shardings(batch: Batch, mesh) -> Batch:
    """Token arrays split along B by the logical "batch" rule; per-trajectory/group replicated."""
    def one(path, x):
        name = str(getattr(path[-1], "name", path[-1]))
        if name.endswith("_BxS") or name.endswith("_BxSxLxK"):
            axes = ("batch",) + (None,) * (len(x.shape) - 1)
            return shd.named_sharding(mesh, axes, x.shape)
        return NamedSharding(mesh, P())
    return jax.tree_util.tree_map_with_path(one, batch)


# --------------------------------------------------------------------------- the step
def _logprobs(graphdef, params, bias, tok):
    model = nnx.merge(graphdef, params, bias)
    return token_logprobs(model, tok["tokens"], tok["segment_ids"], tok["positions"],
                          tok.get("routed"))


def _token_tree(batch: Batch) -> dict:
    tok = dict(tokens=batch.tokens_BxS, segment_ids=batch.segment_ids_BxS,
               positions=batch.positions_BxS)
    if batch.routed_experts_BxSxLxK is not None:
        tok["routed"] = batch.routed_experts_BxSxLxK
    return tok


def _forward_only(graphdef, params, bias, tok_KxJ):
    """Log-probs of the whole batch, chunked like the micro-batches (no gradient)."""
    def body(_, t):
        return None, _logprobs(graphdef, params, bias, t)[0]
    flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), tok_KxJ)
    _, lp = jax.lax.scan(body, None, flat)
    lp = lp.reshape(tok_KxJ["tokens"].shape)
    return jax.lax.stop_gradient(L.merge_rows(lp))


def mini_batch_grads(params, bias, tok_J, inputs_J, *, graphdef, cfg: StepConfig):
    """Gradient of one mini-batch, accumulated over its J micro-batches (leading axis J).

    Returns:
      (grads, loss, LossAux summed over micro-batches, ModelAux averaged over micro-batches).
    """
    J = cfg.micro_batches

    def loss_fn(p, tok, inp):
        logp, ent, maux = _logprobs(graphdef, p, bias, tok)
        loss, aux = L.pg_loss(logp, ent, inp, cfg.loss)
        # Router losses are per-micro-batch means: average them over the micro-batches.
        router = cfg.loss.router_aux_coef * maux.aux_loss + cfg.loss.router_z_coef * maux.z_loss
        return loss + router / J, (aux, maux)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731

    def body(carry, xs):
        g_acc, loss_acc, aux_acc, maux_acc = carry
        (loss, (aux, maux)), g = grad_fn(params, *xs)
        return (add(g_acc, g), loss_acc + loss, add(aux_acc, aux), add(maux_acc, maux)), None

    first = jax.tree.map(lambda x: x[0], (tok_J, inputs_J))
    shapes = jax.eval_shape(loss_fn, params, *first)[1]
    zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t)  # noqa: E731
    carry0 = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32), *zeros(shapes))
    (g, loss, aux, maux), _ = jax.lax.scan(body, carry0, (tok_J, inputs_J))
    return g, loss, aux, jax.tree.map(lambda x: x / J, maux)


@flax.struct.dataclass
class _UpdateStats:
    loss: jax.Array
    grad_norm: jax.Array
    learning_rate: jax.Array
    finite: jax.Array
    aux: L.LossAux
    model_aux: Any


def _optimizer_update(carry, xs, *, bias, graphdef, cfg: StepConfig):
    """One mini-batch: accumulate, then apply AdamW unless the loss or gradient is non-finite."""
    params, opt_state, updates, skipped = carry
    tx = make_optimizer(cfg.optim)
    g, loss, aux, maux = mini_batch_grads(params, bias, *xs, graphdef=graphdef, cfg=cfg)
    gnorm = optax.tree.norm(g)
    finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
    upd, new_opt = tx.update(g, opt_state, params)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
    params, opt_state = keep(optax.apply_updates(params, upd), params), keep(new_opt, opt_state)
    stats = _UpdateStats(loss=loss, grad_norm=gnorm, learning_rate=make_schedule(cfg.optim)(updates),
                         finite=finite, aux=aux, model_aux=maux)
    fin = finite.astype(jnp.int32)
    return (params, opt_state, updates + fin, skipped + 1 - fin), stats


def train_step(state: TrainState, batch: Batch, *, graphdef, cfg: StepConfig):
    """Consumes one feed batch: epochs x mini_batches optimizer updates (see module docstring).

    Args:
      state: the TrainState (donated by `make_train_step`).
      batch: one packed feed batch; B must divide by mini_batches * micro_batches.
      graphdef: the model's nnx graphdef (static).
      cfg: StepConfig (static).
    Returns:
      (new_state, StepMetrics).
    """
    cfg.check_batch(batch)
    K, J = cfg.mini_batches, cfg.micro_batches
    tok_KxJ = jax.tree.map(lambda x: L.split_rows(x, K, J), _token_tree(batch))
    learner_old = ref = None
    if cfg.loss.recompute_old_logprobs:
        learner_old = _forward_only(graphdef, state.params, state.router_bias, tok_KxJ)
    if cfg.loss.kl_coef > 0:
        ref = _forward_only(graphdef, state.ref_params, state.router_bias, tok_KxJ)
    # Advantages and denominators: once per batch, before the loops.
    inputs, adv = L.prepare(batch, cfg.loss, mini_batches=K, learner_old_logprobs_BxS=learner_old,
                            ref_logprobs_BxS=ref)
    if cfg.debug_checks:
        check_invariants(adv, batch.rewards_T, batch.group_ids_T, batch.factors_T, batch.valid_T,
                         batch.hacked_T, batch.grading_ok_G, num_groups=batch.num_groups,
                         lam_cap=cfg.loss.lam_cap, mode=cfg.loss.mode)
        chex.assert_trees_all_equal(
            jnp.all(jnp.isfinite(inputs.weight_BxS)), jnp.array(True),
            custom_message="loss weights are finite")
    inputs_KxJ = jax.tree.map(lambda x: L.split_rows(x, K, J), inputs)
    update = functools.partial(_optimizer_update, bias=state.router_bias, graphdef=graphdef, cfg=cfg)

    def epoch(carry, _):
        return jax.lax.scan(update, carry, (tok_KxJ, inputs_KxJ))

    carry0 = (state.params, state.opt_state, state.updates, state.skipped)
    (params, opt_state, updates, skipped), stats = jax.lax.scan(epoch, carry0, None,
                                                                length=cfg.epochs)
    load_LxE = jnp.mean(stats.model_aux.expert_load_LxE, axis=(0, 1))
    bias = state.router_bias
    if cfg.model.router == "sigmoid_bias":
        model = nnx.merge(graphdef, params, bias)
        update_router_bias(model, load_LxE, cfg.model.router_bias_update_rate)
        bias = nnx.state(model, RouterBias)
    new_state = state.replace(step=state.step + 1, updates=updates, skipped=skipped,
                              params=params, opt_state=opt_state, router_bias=bias)
    return new_state, step_metrics(batch, inputs, adv, stats, load_LxE)


def make_train_step(cfg: StepConfig, mesh, state_shardings_: TrainState, batch_shardings_: Batch,
                    graphdef):
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

    def step_fn(state, batch):
        with jax.set_mesh(mesh):
            return call(state, batch)

    step_fn.jitted = jitted
    return step_fn


# --------------------------------------------------------------------------- metrics
@flax.struct.dataclass
class GroupAudit:
    """Per-group / per-trajectory results for `groups.jsonl` and the ledger counts."""
    lam_G: jax.Array
    capped_G: jax.Array
    fallback_G: jax.Array
    mixed_G: jax.Array
    advantages_T: jax.Array
    outcome_advantages_T: jax.Array


@flax.struct.dataclass
class StepMetrics:
    """One train step's metrics (device arrays; `metrics.to_host` flattens them).

    Loss terms and grad_norm average over the step's optimizer updates; clip fractions, approx_kl
    (k3 of KL(old || current)) and entropy are per trained token over all updates; learning_rate
    is the last update's. Credits sum over groups; lam_mean / lam_max are over mixed groups.
    """
    loss: jax.Array
    pg_loss: jax.Array
    kl_loss: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array
    clip_frac_low: jax.Array
    clip_frac_high: jax.Array
    dual_clip_frac: jax.Array
    approx_kl: jax.Array
    entropy: jax.Array
    grad_norm: jax.Array
    learning_rate: jax.Array
    tokens: jax.Array
    trajectories: jax.Array
    groups: jax.Array
    mixed_groups: jax.Array
    lam_mean: jax.Array
    lam_max: jax.Array
    capped_groups: jax.Array
    fallback_groups: jax.Array
    pos_credit_before: jax.Array
    pos_credit_after: jax.Array
    neg_credit: jax.Array
    mean_response_len: jax.Array
    updates: jax.Array
    skipped: jax.Array
    expert_load_LxE: jax.Array
    audit: GroupAudit


def step_metrics(batch: Batch, inputs: L.LossInputs, adv, stats: _UpdateStats, load_LxE):
    """Reduces the per-update stats [epochs, mini_batches] and the advantage output to metrics."""
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    a = stats.aux
    tok = jnp.maximum(jnp.sum(a.tokens), 1.0)
    mixed = adv.mixed
    n_mixed = jnp.sum(mixed)
    tokens_T = jax.ops.segment_sum(inputs.mask_BxS.reshape(-1), batch.traj_index_BxS.reshape(-1),
                                   num_segments=batch.num_trajectories)
    finite = stats.finite.astype(jnp.int32)
    return StepMetrics(
        loss=jnp.mean(stats.loss), pg_loss=jnp.mean(a.pg_loss), kl_loss=jnp.mean(a.kl_loss),
        aux_loss=jnp.mean(stats.model_aux.aux_loss), z_loss=jnp.mean(stats.model_aux.z_loss),
        clip_frac_low=jnp.sum(a.clip_low_count) / tok, clip_frac_high=jnp.sum(a.clip_high_count) / tok,
        dual_clip_frac=jnp.sum(a.dual_clip_count) / tok, approx_kl=jnp.sum(a.approx_kl_sum) / tok,
        entropy=jnp.sum(a.entropy_sum) / tok, grad_norm=jnp.mean(stats.grad_norm),
        learning_rate=stats.learning_rate.reshape(-1)[-1],
        tokens=jnp.sum(inputs.mask_BxS), trajectories=f32(jnp.sum(batch.valid_T)),
        groups=f32(jnp.sum(adv.num_valid > 0)), mixed_groups=f32(n_mixed),
        lam_mean=jnp.sum(jnp.where(mixed, adv.lam, 0.0)) / jnp.maximum(n_mixed, 1),
        lam_max=jnp.max(jnp.where(mixed, adv.lam, 0.0)),
        capped_groups=f32(jnp.sum(adv.capped)), fallback_groups=f32(jnp.sum(adv.fallback)),
        pos_credit_before=jnp.sum(adv.pos_credit_before), pos_credit_after=jnp.sum(adv.pos_credit_after),
        neg_credit=jnp.sum(adv.neg_credit),
        mean_response_len=jnp.sum(tokens_T) / jnp.maximum(jnp.sum(tokens_T > 0), 1),
        updates=f32(jnp.sum(finite)), skipped=f32(jnp.sum(1 - finite)), expert_load_LxE=load_LxE,
        audit=GroupAudit(lam_G=adv.lam, capped_G=adv.capped, fallback_G=adv.fallback, mixed_G=mixed,
                         advantages_T=adv.advantages, outcome_advantages_T=adv.outcome_advantages))

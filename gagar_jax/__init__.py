"""gagar_jax: the learner side of Gagar (Groupwise Agentic Grading and Advantage Redistribution).

Data flows feed -> batch -> algo (advantage, loss) -> run (train step) -> checkpoint and publish
(docs/architecture.md). The public API is importable from here::

    from gagar_jax import gagar_advantages, ModelConfig, Transformer, from_pretrained, Feed

Names are re-exported lazily (a module `__getattr__`): `import gagar_jax` imports no JAX, so the
JAX-free parts (the rollout side) work where JAX is not installed, and module paths may move
while these names stay.
"""
import importlib

__version__ = "0.1.0"

# public name -> module that defines it (one line per name; SPEC.md section 3 keeps them stable)
_EXPORTS = {
    # the Gagar math (algo)
    "gagar_advantages": "gagar_jax.algo.advantage",
    "equivalent_rewards": "gagar_jax.algo.advantage",
    "broadcast_to_tokens": "gagar_jax.algo.advantage",
    "check_invariants": "gagar_jax.algo.advantage_checks",
    "GroupOutcomes": "gagar_jax.algo.advantage",
    "advantages_of": "gagar_jax.algo.advantage",
    "check_invariants_of": "gagar_jax.algo.advantage_checks",
    "AdvantageOutput": "gagar_jax.algo.advantage",
    "FactorTable": "gagar_jax.grading",
    "quality_factors": "gagar_jax.grading",
    "LossConfig": "gagar_jax.algo.loss",
    "policy_loss": "gagar_jax.algo.policy_loss",
    "rollout_correction": "gagar_jax.algo.rollout_correction",
    # shared ground
    "Batch": "gagar_jax.batch",
    "ConfigError": "gagar_jax.config",
    "TrainConfig": "gagar_jax.config",
    "load_config_file": "gagar_jax.config",
    "make_mesh": "gagar_jax.sharding",
    # the feed
    "Feed": "gagar_jax.feed",
    "FeedConfig": "gagar_jax.feed",
    "Group": "gagar_jax.feed",
    "Trajectory": "gagar_jax.feed",
    # the model and its checkpoints
    "ModelConfig": "gagar_jax.model.config",
    "Transformer": "gagar_jax.model.transformer",
    "from_pretrained": "gagar_jax.hf.api",
    "save_pretrained": "gagar_jax.hf.api",
    "read_config": "gagar_jax.hf.api",
    # the run
    "StepConfig": "gagar_jax.run.step",
    "TrainState": "gagar_jax.run.step",
    "init_train_state": "gagar_jax.run.step",
    "make_train_step": "gagar_jax.run.step",
    "Checkpointer": "gagar_jax.run.checkpoint",
    "Publisher": "gagar_jax.run.publish",
    "read_latest": "gagar_jax.run.publish",
    "published_steps": "gagar_jax.run.publish",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gagar_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value   # later look-ups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))

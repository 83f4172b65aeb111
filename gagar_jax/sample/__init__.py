"""The JAX sampler on the learner's own model code: paged KV cache, continuous batching, an engine
behind `gagar_jax.rollout.engine.Engine`, weights handed over in accelerator memory
(docs/sampler.md)."""

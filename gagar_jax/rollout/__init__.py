"""What runs beside a rollout engine, importable without JAX (SPEC section 6, docs/rollout.md).

`engine`: the engine interface the worker talks to (`vllm_engine`: vLLM behind it);
`vllm_extension.GagarWorkerExtension`: a vLLM worker extension that reloads the policy named by
`<workdir>/published/latest` in place and captures the experts each token was routed to;
`read_latest` and `read_manifest`: the pointer and version readers (plain `json`, no
gagar_jax.run import); `worker`: the rollout worker (its engine samples groups, a grader grades
them, the records go into the learner's spool); `feed_writer`: records and atomic spool shards;
`example_task`: the example task and grader.
"""
from gagar_jax.rollout.pointer import read_latest, read_manifest

__all__ = ["read_latest", "read_manifest"]

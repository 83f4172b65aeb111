"""What runs beside a rollout engine, importable without JAX (SPEC section 6, docs/rollout.md).

Built: `vllm_extension.GagarWorkerExtension`, a vLLM worker extension that reloads the policy
named by `<workdir>/published/latest` in place and captures the experts each token was routed
to; `read_latest` and `read_manifest`, the pointer and version readers it uses (plain `json`, no
gagar_jax.run import).
Not built yet: the rollout worker that writes the feed, the example grader.
"""
from gagar_jax.rollout.pointer import read_latest, read_manifest  # noqa: F401

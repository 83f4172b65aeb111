"""Agent environments for multi-turn rollouts (SPEC section 6, "Agents"; docs/rollout.md).

`base`: the environment interface (token ids in, token ids out) and the end reasons;
`tokenizer`: the tokenizer interface observations are encoded through (byte-level here, any
Hugging Face tokenizer through its adapter); `tools`: the one tool-call format (Hermes / Qwen3
`<tool_call>{...}</tool_call>`) and the compact one-token form for tiny models;
`hf_tokenizer`: a Hugging Face tokenizer behind the interface, its chat template applied to
each new turn only.

The repository environment (`--env gagar_jax.rollout.envs.repo:make_env --tasks
gagar_jax.rollout.envs.repo:tasks`): `repo` (the episode), `repo_tasks` (the task directories of
`data/repo_tasks/`), `repo_tools` (list / read / write / patch / run the tests / submit),
`repo_verdict` (held-out tests with the test infrastructure restored, `hacked`), `patch`
(unified diffs), `workspace` (the trajectory's artifacts, confined paths), `sandbox` with
`sandbox_launch` and `cgroups` (how agent code runs: docs/rollout.md, "The sandbox").
Imports no JAX.
"""

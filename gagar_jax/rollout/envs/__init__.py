"""Agent environments for multi-turn rollouts (SPEC section 6, "Agents"; docs/rollout.md).

`base`: the environment interface (token ids in, token ids out) and the end reasons;
`tokenizer`: the tokenizer interface observations are encoded through (byte-level here, any
Hugging Face tokenizer through its adapter); `tools`: the one tool-call format (Hermes / Qwen3
`<tool_call>{...}</tool_call>`) and the compact one-token form for tiny models.
Imports no JAX.
"""

"""Manual vLLM check, step 1 (learner venv, JAX): publish tiny models and the learner's answers.

    PYTHONPATH=. JAX_PLATFORMS=cpu .venv/bin/python scripts/vllm/publish_tiny.py OUT [CONVENTION]

Writes OUT/{qwen,mimo}/published/step_0000000{1,2}/ (fp32, two weight draws), each with ref.json
(the learner's greedy tokens and logprobs for PROMPT), and published/latest -> step 2.
Step 2 (`check_engine.py`, in the vLLM venv) compares vLLM with them. Not part of the test suite.
"""
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gagar_jax.hf import api as hf
from gagar_jax.model.transformer import ModelConfig, Transformer
from gagar_jax.run import publish

PROMPT = [5, 17, 33, 101, 7, 9, 200, 3, 44, 12, 250, 61]
GEN, LEN = 8, 20
BASE = dict(
    vocab_size=256,
    hidden_size=128,
    num_heads=4,
    head_dim=64,
    moe_intermediate_size=64,
    intermediate_size=192,
    num_experts=4,
    top_k=2,
    expert_backend="dense",
    attention="plain",
)
CONFIGS = {
    "qwen": ModelConfig(
        **BASE,
        num_layers=2,
        num_kv_heads=2,
        num_dense_layers=0,
        rope_theta=1e4,
        hf_family="qwen3_moe",
    ),
    # MiMo: sliding window 5 < 20 tokens, sinks, head_dim = v_head_dim = 64 (vLLM CPU needs it)
    "mimo": ModelConfig(
        **BASE,
        num_layers=3,
        num_kv_heads=1,
        num_dense_layers=1,
        router="sigmoid_bias",
        qk_norm=False,
        layer_types=("sliding", "full", "sliding"),
        sliding_window=5,
        sliding_num_kv_heads=2,
        attention_sinks=True,
        v_head_dim=64,
        attention_value_scale=0.707,
        partial_rotary_factor=0.5,
        rope_theta=1e4,
        sliding_rope_theta=100.0,
        n_group=2,
        topk_group=1,
        hf_family="mimo_v2_flash",
    ),
}


def randomize(model, seed):
    """Larger weights than the init (near-uniform logits otherwise)."""
    rng = np.random.default_rng(seed)
    def draw(path, x):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        n = rng.standard_normal(x.shape).astype(np.float32)
        if "norm" in name:
            return jnp.asarray(1.0 + 0.1 * n)
        if "sinks" in name:
            return jnp.asarray(n)
        if "router_bias" in name:
            return jnp.asarray(0.1 * n)
        return jnp.asarray(0.15 * n)
    state = nnx.state(model)
    nnx.update(model, jax.tree_util.tree_map_with_path(draw, state))


@nnx.jit
def _logits(m, tokens):
    return m(tokens)[0]


def answers(model):
    toks = list(PROMPT)
    for _ in range(GEN):
        row = jnp.asarray([toks + [0] * (LEN - len(toks))])
        lp = jax.nn.log_softmax(_logits(model, row)[0], axis=-1)
        toks.append(int(jnp.argmax(lp[len(toks) - 1])))
    lp = np.asarray(jax.nn.log_softmax(_logits(model, jnp.asarray([toks]))[0], axis=-1))
    return {"prompt": PROMPT, "greedy": toks[len(PROMPT):],
            "gen_logprobs": [float(lp[i - 1, toks[i]]) for i in range(len(PROMPT), len(toks))],
            "prompt_logprobs": [float(lp[i - 1, toks[i]]) for i in range(1, len(PROMPT))]}


def main(out, convention="vllm"):
    for name, cfg in CONFIGS.items():
        if cfg.has_sliding:
            cfg = dataclasses.replace(cfg, sliding_window_convention=convention)
        work = os.path.join(out, name)
        for step in (1, 2):
            model = Transformer(cfg, rngs=nnx.Rngs(step))
            randomize(model, step)
            ref = answers(model)
            def save(m, d, ref=ref):
                hf.save_pretrained(m, d)
                with open(os.path.join(d, "ref.json"), "w") as f:
                    json.dump(ref, f)
            final = publish.publish_weights(model, step, work, save)
            print(name, step, final)


if __name__ == "__main__":
    main(*sys.argv[1:3])

"""Tiny MiMo-V2-Flash that vLLM's CPU build runs: every family feature it can express.

A dense first layer; sliding / full / sliding attention with a window (5) shorter than the
sequences, attention sinks and twice the KV heads on sliding layers; head size 64 with
v_head_dim equal to it (vLLM's CPU backend has no kernel for v_head_dim != head_dim); partial
rotary with a theta per layer type; the sigmoid router with its correction bias, group-limited
top-k (4 experts in 2 groups, the best 1 group), and transformers' default
routed_scaling_factor (1.0: vLLM's mimo_v2 ignores the key). The vLLM tests
(tests/test_vllm.py) publish it and compare vLLM with the learner.
Numbers (3 layers, 4 experts top-2): 0.20M total, 0.17M active.

Run:  gagar-train --config configs/tiny_mimo_vllm.py --workdir runs/tiny_mimo_vllm
"""
import pathlib

import ml_collections

from gagar_jax.config import load_config_file


def get_config() -> ml_collections.ConfigDict:
    c = load_config_file(str(pathlib.Path(__file__).with_name("tiny_vllm.py")))
    m = c.model
    m.num_layers = 3
    m.layer_types = ("sliding", "full", "sliding")
    m.num_dense_layers = 1          # layer 0: dense MLP
    m.intermediate_size = 128
    m.num_heads = 2
    m.num_kv_heads = 1              # full layers
    m.sliding_num_kv_heads = 2      # sliding layers: twice the KV heads (MiMo)
    m.sliding_window = 5            # a query sees 5 keys counting itself (vLLM's convention)
    m.sliding_window_convention = "vllm"
    m.attention_sinks = True
    m.head_dim = 64
    m.v_head_dim = 64               # = head_dim: vLLM CPU cannot run v_head_dim != head_dim
    m.attention_value_scale = 0.707
    m.partial_rotary_factor = 0.5
    m.rope_theta = 10_000.0
    m.sliding_rope_theta = 100.0
    m.qk_norm = False
    m.router = "sigmoid_bias"
    m.n_group = 2                   # 4 experts in 2 groups; a token's top-2 from the best group
    m.topk_group = 1
    m.routed_scaling_factor = 1.0   # transformers' default; vLLM ignores the key
    m.router_aux_loss_coef = 0.0
    m.rms_norm_eps = 1e-5
    m.hf_family = "mimo_v2_flash"
    return c

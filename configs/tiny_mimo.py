"""Tiny MiMo-V2-Flash-family config for CPU: every feature of the family at toy size.

A dense first layer, then MoE layers; full and sliding-window attention interleaved (sliding
layers with twice the KV heads and attention sinks); q/k head width 16, value width 8; partial
rotary with a RoPE theta per layer type; sigmoid router with a correction bias, group-limited
top-k and a routed scaling factor. It exports as `mimo_v2_flash` (tests/test_configs.py trains it
for a few steps on the sample feed and publishes it).

Run:  gagar-train --config configs/tiny_mimo.py --workdir runs/tiny_mimo
"""
import pathlib

import ml_collections

from gagar_jax.config import load_config_file


def get_config() -> ml_collections.ConfigDict:
    c = load_config_file(str(pathlib.Path(__file__).with_name("tiny_cpu.py")))
    m = c.model
    m.num_layers = 4
    m.layer_types = ("full", "sliding", "sliding", "full")  # per layer: full | sliding
    m.num_dense_layers = 1          # layer 0: dense MLP
    m.num_kv_heads = 1              # full layers
    m.sliding_num_kv_heads = 2      # sliding layers: twice the KV heads (MiMo)
    m.sliding_window = 32           # a query sees 32 keys counting itself (< feed.seq_len)
    m.attention_sinks = True        # per-head sink logit on sliding layers
    m.head_dim = 16                 # q/k head width
    m.v_head_dim = 8                # value head width
    m.attention_value_scale = 0.707
    m.partial_rotary_factor = 0.5   # RoPE on the first 8 of 16 q/k dims
    m.rope_theta = 1_000_000.0      # full layers
    m.sliding_rope_theta = 10_000.0
    m.qk_norm = False
    m.router = "sigmoid_bias"
    m.n_group = 4                   # 8 experts in 4 groups; tokens choose within the best 2
    m.topk_group = 2
    m.routed_scaling_factor = 2.0
    m.router_aux_loss_coef = 0.0    # balancing by the correction bias instead
    m.rms_norm_eps = 1e-5
    m.hf_family = "mimo_v2_flash"   # refuse at build time anything the family cannot express
    return c

"""Small MoE (~102M parameters, ~47M active): trains on CPU, slowly; a quick GPU/TPU smoke run.

Same schema as `configs/tiny_cpu.py` (derived from it; only the differences are set here).

Run:  gagar-train --config configs/small.py --workdir runs/small --config.feed.path=FEED.jsonl
Numbers (gagar_jax/aot/flops.py, checked by tests/test_configs.py): 102M total, 47M active params.
"""
import pathlib

import ml_collections

from gagar_jax.config import load_config_file


def get_config() -> ml_collections.ConfigDict:
    c = load_config_file(str(pathlib.Path(__file__).with_name("tiny_cpu.py")))

    m = c.model
    m.vocab_size = 32_000             # a 32k BPE vocabulary
    m.hidden_size = 512               # D
    m.num_layers = 8
    m.num_heads = 8
    m.num_kv_heads = 4                # GQA
    m.head_dim = 64
    m.moe_intermediate_size = 320     # F, per expert
    m.intermediate_size = 1536        # dense-layer MLP width (unused: no dense layers)
    m.num_experts = 16                # E
    m.top_k = 2                       # K
    m.param_dtype = "float32"
    m.compute_dtype = "float32"       # CPU: bf16 matmuls are slower than f32 there
    m.remat = "none"
    m.attn_block = 256
    m.expert_backend = "grouped"
    m.logprob_vocab_chunk = 1_000     # 32 chunks over V = 32000 (XLA:CPU matmuls run best here)
    m.logprob_keep_logits_mib = 1_024 # backward reuses the logits up to 1 GiB (4k tokens x 32k)

    c.train.steps = 200
    c.train.checkpoint_every = 50
    c.train.micro_batches = 4         # 4 rows per micro-batch

    c.optim.learning_rate = 3e-4
    c.optim.warmup_steps = 20
    c.optim.decay_steps = 1_000

    c.loss.max_response_len = 1_024

    f = c.feed
    f.rows_per_batch = 16             # B
    f.seq_len = 1_024                 # S
    f.max_trajectories = 64           # T
    f.groups_per_batch = 8            # G
    f.max_traj_tokens = 1_024
    return c

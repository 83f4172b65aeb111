"""Qwen3-30B-A3B shapes (30.5B total, 3.35B active) for a TPU v5p-128 slice (64 chips).

Matches the Hugging Face `Qwen/Qwen3-30B-A3B` config (48 layers, D=2048, 32 query / 4 KV heads of
128, 128 experts of F=768, top-8 with renormalized gates, vocab 151936, rope_theta 1e6), so
`train.init_from` can point at that checkpoint. Derived from `configs/tiny_cpu.py`.

Run:  gagar-train --config configs/qwen3_30b_a3b.py --workdir gs://BUCKET/runs/q30b \
        --config.train.init_from=/path/to/Qwen3-30B-A3B --config.feed.spool_dir=gs://BUCKET/spool
AOT:  JAX_PLATFORMS=cpu python scripts/aot_compile.py --config configs/qwen3_30b_a3b.py \
--topology v5p:4x4x4
Numbers (gagar_jax/aot/flops.py, checked by tests/test_configs.py): 30.53B total, 3.35B active
params; 23.1 GFLOPs per trained token at S = 4k (fwd + bwd, no remat).
"""
import pathlib

import ml_collections

from gagar_jax.config import load_config_file


def get_config() -> ml_collections.ConfigDict:
    c = load_config_file(str(pathlib.Path(__file__).with_name("tiny_cpu.py")))

    m = c.model
    m.vocab_size = 151_936
    m.hidden_size = 2_048             # D
    m.num_layers = 48
    m.num_heads = 32
    m.num_kv_heads = 4
    m.head_dim = 128
    m.moe_intermediate_size = 768     # F, per expert
    m.intermediate_size = 6_144       # HF config value; unused (every layer is MoE)
    m.num_dense_layers = 0
    m.num_experts = 128               # E
    m.top_k = 8                       # K
    m.norm_topk_prob = True
    m.router = "softmax"
    m.rope_theta = 1_000_000.0
    m.rms_norm_eps = 1e-6
    m.tie_embeddings = False
    m.param_dtype = "float32"         # f32 master weights; Adam moments f32
    m.compute_dtype = "bfloat16"
    m.remat = "full"                  # keep only layer inputs; recompute the rest in backward
    m.attention = "blockwise"         # [S, S] scores are out of the question at 32k
    m.attn_block = 512
    m.expert_backend = "ep"           # shard_map dispatch: tokens stay on their chip (see mesh)
    m.logprob_vocab_chunk = 151_936 // 8
    m.router_aux_loss_coef = 1e-3

    # 64 chips, plain FSDP: rows split 64 ways (one 32k row per chip and micro-batch), every
    # weight split 64 ways on D; each layer's experts are gathered for the chip's tokens.
    c.mesh.data = 1
    c.mesh.fsdp = 64
    c.mesh.expert = 1
    c.mesh.tensor = 1

    c.train.steps = 1_000
    c.train.checkpoint_every = 20
    c.train.publish_every = 1         # rollout engines want every policy version
    c.train.micro_batches = 2         # 64 rows per micro-batch: one 32k row per chip

    c.optim.learning_rate = 1e-6
    c.optim.warmup_steps = 10
    c.optim.decay_steps = 1_000
    c.optim.schedule = "constant"     # constant after warmup (RL fine-tuning)

    c.loss.max_response_len = 32_768

    f = c.feed
    f.path = ""
    f.rows_per_batch = 128            # B
    f.seq_len = 32_768                # S
    f.max_trajectories = 512          # T
    f.groups_per_batch = 32           # G
    f.max_traj_tokens = 32_768
    f.max_record_bytes = 400_000_000
    return c

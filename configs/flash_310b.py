"""MiMo-V2-Flash architecture (the paper's MiMo-V2.6-Flash family: 308.8B total, 15.4B active) on a
TPU v5p-1024 slice (512 chips).

The paper gives only 310B total / 15B active. The shapes are transformers' `MiMoV2FlashConfig`
defaults (the public XiaomiMiMo/MiMo-V2-Flash release): 48 layers, D = 4096, the first layer
dense (MLP width 16384), 47 MoE layers of 256 experts (F = 2048), top-8 with sigmoid scores and
an `e_score_correction_bias` (aux-loss-free balancing), 64 query heads of q/k width 192 and value
width 128 (values scaled by 0.707), partial rotary over 64 dims; full attention (4 KV heads,
rope_theta 5e6) at layer 0 and every 6th layer, sliding-window attention (window 128 + the query,
8 KV heads, attention sinks, rope_theta 1e4) in the other 39; vocab 152576. It exports as
`mimo_v2_flash` (docs/model.md). The multi-token-prediction head is not trained (RL does not
use it); its weights are carried from `init_from` into published directories.

Run:  gagar-train --config configs/flash_310b.py --workdir gs://BUCKET/runs/flash \
        --config.feed.spool_dir=gs://BUCKET/spool --config.train.init_from=/ckpt/MiMo-V2-Flash
AOT:  JAX_PLATFORMS=cpu python scripts/aot_compile.py --config configs/flash_310b.py \
--topology v5p:8x8x8
Numbers (gagar_jax/aot/flops.py, checked by tests/test_configs.py): 308.8B total, 15.4B active
params. Global batch: 256 rows x 32768 tokens = 8.4M tokens, two micro-batches of 128 rows.
Compiled for v5p:8x8x8 (fsdp 16 x expert 8 x tensor 4, `ep_a2a` with megablox over 16 chunks):
34.3 GiB per chip (docs/aot/flash_310b_v5p_8x8x8.json; 44.9 before issue 29's dense-weight
and residual sharding, 53.6 before issue 29, docs/scaling.md), 107.7
model GFLOPs per token (docs/aot/flash_310b_mimo_v5p_8x8x8.json, docs/scaling.md; the former
global-attention stand-in: 38.9 GiB, 184.0 GFLOPs, docs/aot/flash_310b_ep_a2a_v5p_8x8x8.json).
"""
import pathlib

import ml_collections

from gagar_jax.config import load_config_file


def get_config() -> ml_collections.ConfigDict:
    c = load_config_file(str(pathlib.Path(__file__).with_name("tiny_cpu.py")))

    m = c.model
    m.vocab_size = 152_576
    m.hidden_size = 4_096             # D
    m.num_layers = 48
    # MiMo-V2-Flash attention: full at layer 0 and every 6th layer, sliding (window 128 + 1)
    # elsewhere: 9 full + 39 sliding layers.
    m.layer_types = tuple("full" if i == 0 or (i + 1) % 6 == 0 else "sliding" for i in range(48))
    m.sliding_window = 129            # a query sees 128 previous tokens and itself
    # ... which is how transformers 5.24 / the SGLang reference read the Hub checkpoint's
    # sliding_window_size=128; vLLM 0.32 reads it as 128 keys counting the query. This config
    # keeps the former meaning (W=129, init_from the Hub checkpoint); to train for vLLM
    # rollouts set sliding_window=128 and sliding_window_convention="vllm" (docs/model.md).
    m.sliding_window_convention = "transformers"
    m.num_heads = 64
    m.num_kv_heads = 4                # full layers
    m.sliding_num_kv_heads = 8        # sliding layers: twice the KV heads
    m.attention_sinks = True          # per-head sink logit on sliding layers
    m.head_dim = 192                  # q/k head width
    m.v_head_dim = 128                # value head width
    m.attention_value_scale = 0.707
    m.partial_rotary_factor = 0.334   # RoPE on the first 64 of 192 q/k dims
    m.sliding_rope_theta = 10_000.0   # full layers: rope_theta below
    m.qk_norm = False
    m.n_group = 1                     # MiMo-V2-Flash does not group-limit its routing
    m.topk_group = 1
    m.routed_scaling_factor = 1.0
    m.hf_family = "mimo_v2_flash"     # refuse at build time anything the family cannot express
    m.moe_intermediate_size = 2_048   # F, per expert
    m.intermediate_size = 16_384      # the dense first layer's MLP width
    m.num_dense_layers = 1
    m.num_experts = 256               # E
    m.top_k = 8                       # K
    m.norm_topk_prob = True
    m.router = "sigmoid_bias"         # sigmoid scores + bias, aux-loss-free balancing
    m.rope_theta = 5_000_000.0        # full layers
    m.rms_norm_eps = 1e-5
    m.tie_embeddings = False
    m.param_dtype = "float32"         # f32 master weights; Adam moments f32
    m.compute_dtype = "bfloat16"
    m.remat = "full"                  # keep only each layer's input for the backward pass
    m.attention = "blockwise"         # flash-style; [S, S] scores are ruled out at 32k
    m.attn_block = 512
    m.expert_backend = "ep_a2a"       # ragged all-to-all dispatch to the expert owners (TPU)
    # Its per-chip FFN: the megablox TPU kernels, over 16 chunks of 2048 tokens (1 GiB dropless
    # receive buffers): 44.9 GiB per chip (34.3 with the sharding of 3e90e06); 8 chunks: 53.4;
    # grouped (8 chunks): 45.9
    # (docs/scaling.md "Every GiB and every byte").
    m.ep_local_ffn = "megablox"
    m.ep_chunks = 16
    # megablox row tiles of 256: an expert gets ~512 rows per chunk, which 512-row tiles at a
    # random offset cover with two tiles (1.96x the matmul work); 256 rows: 1.48x, and the
    # kernel stays compute-bound on v5p (docs/scaling.md, "Hardware FLOPs as compiled").
    m.ep_row_tile = 256
    m.logprob_vocab_chunk = 152_576 // 8
    m.router_aux_loss_coef = 0.0      # balancing comes from the router bias instead
    m.router_bias_update_rate = 1e-3

    # 512 chips = fsdp 16 x expert 8 x tensor 4. Rows split 128 ways over fsdp x expert (one 32k
    # row per chip and micro-batch, shared by the 4 tensor chips). Expert weights: E over expert
    # (32 experts per chip), D over fsdp, F over tensor; other weights over fsdp x tensor. The
    # `ep_a2a` backend sends each routed row only to the chip owning its expert
    # (ragged_all_to_all), in 8 chunks so the dropless buffers stay at 32k x top-8 rows; the
    # all_gather `ep` backend or `ragged` at expert = 8 do not fit (docs/scaling.md).
    c.mesh.data = 1
    c.mesh.fsdp = 16
    c.mesh.expert = 8
    c.mesh.tensor = 4

    c.train.steps = 100
    c.train.checkpoint_every = 5
    c.train.publish_every = 1         # rollout engines want every policy version
    c.train.micro_batches = 2         # 128 rows per micro-batch: one 32k row per batch shard

    c.optim.learning_rate = 1e-6
    c.optim.warmup_steps = 5
    c.optim.decay_steps = 100
    c.optim.schedule = "constant"     # constant after warmup (RL fine-tuning)

    c.loss.max_response_len = 32_768

    f = c.feed
    f.path = ""
    f.rows_per_batch = 256            # B
    f.seq_len = 32_768                # S
    f.max_trajectories = 1_024        # T
    f.groups_per_batch = 64           # G
    f.max_traj_tokens = 32_768
    f.max_record_bytes = 400_000_000
    return c

"""`flash_310b` on rows of 256k tokens: context parallelism for the paper's \
long agentic trajectories.

The paper's code-agent trajectories average 173k-192k tokens. Rows of 262144 tokens hold one such
trajectory (or several shorter ones) whole; each row is split along the sequence over a
`context` axis of 8 chips (32768 tokens per chip, today's per-chip load), attention exchanges
keys and values across it (all-gather on the 9 full layers, the 128 preceding tokens on the 39
sliding ones; gagar_jax/kernels/attention/context.py). Same model, optimizer and chips as
`configs/flash_310b.py`; at least its tokens per step (32 rows x 262144 = 8.4M).

Run:  gagar-train --config configs/flash_310b_256k.py --workdir gs://BUCKET/runs/flash_long \
        --config.feed.spool_dir=gs://BUCKET/spool --config.train.init_from=/ckpt/MiMo-V2-Flash
AOT:  JAX_PLATFORMS=cpu python scripts/aot_compile.py --config configs/flash_310b_256k.py \
--topology v5p:8x8x8
Numbers (gagar_jax/aot/flops.py, checked by tests/test_configs.py): 308.8B total, 15.4B active
params (the model of flash_310b). Compiled for v5p:8x8x8: 45.5 GiB per chip (fits 95.7; 54.4
before issue 29), 234.5 model GFLOPs per token at 256k rows \
(docs/aot/flash_310b_256k_megablox16_0242300_v5p_8x8x8.json, docs/scaling.md).
"""
import pathlib

import ml_collections

from gagar_jax.config import load_config_file


def get_config() -> ml_collections.ConfigDict:
    c = load_config_file(str(pathlib.Path(__file__).with_name("flash_310b.py")))

    # 512 chips = fsdp 2 x expert 8 x context 8 x tensor 4. Rows split 16 ways over fsdp x expert
    # (one 256k row per 8 chips and micro-batch), each row 8 ways along S over context. Parameters
    # are stored over fsdp x context (16 ways, as flash_310b's fsdp 16) and tensor; experts as
    # flash_310b (E over expert, `ep_a2a` over the 32k tokens of each chip).
    c.mesh.data = 1
    c.mesh.fsdp = 2
    c.mesh.expert = 8
    c.mesh.context = 8
    c.mesh.tensor = 4

    c.train.micro_batches = 2         # 16 rows per micro-batch: one row per batch shard

    c.loss.max_response_len = 262_144

    f = c.feed
    f.rows_per_batch = 32             # B: 32 x 262144 = 8.4M tokens per step
    f.seq_len = 262_144               # S
    f.max_traj_tokens = 262_144       # one trajectory may fill a row; longer ones are rejected
    f.max_trajectories = 256          # T: long trajectories, few per row
    f.groups_per_batch = 32           # G
    return c

"""`flash_310b` on long rows with context parallelism, training an RL batch of 32 groups x 8
trajectories of the paper's length per step.

The paper's code-agent trajectories average 173k-192k tokens. Rows of 196608 tokens (192k) hold
one such trajectory whole (~8% padding at 180k; 256k rows would pad ~31%); each row is split
along the sequence over a `context` axis of 8 chips (24576 tokens per chip), attention exchanges
keys and values across it (all-gather on the 9 full layers, the 128 preceding tokens on the 39
sliding ones; gagar_jax/kernels/attention/context.py). A step is 256 rows (32 groups x 8, 50.3M
token slots, ~46M real tokens) accumulated over 16 micro-batches of 16 rows, one row per 32
chips, so per-chip activations stay below the 32k configs' (docs/scaling.md, "An RL batch").
Rows of 262144 are one override away (`--config.feed.seq_len=262144
--config.feed.max_traj_tokens=262144 --config.loss.max_response_len=262144`). Same model,
optimizer and chips as `configs/flash_310b.py`.

Run:  gagar-train --config configs/flash_310b_256k.py --workdir gs://BUCKET/runs/flash_long \
        --config.feed.spool_dir=gs://BUCKET/spool --config.train.init_from=/ckpt/MiMo-V2-Flash
AOT:  JAX_PLATFORMS=cpu python scripts/aot_compile.py --config configs/flash_310b_256k.py \
--topology v5p:8x8x8
Numbers (gagar_jax/aot/flops.py, checked by tests/test_configs.py): 308.8B total, 15.4B active
params (the model of flash_310b). Compiled for v5p:8x8x8: 30.2 GiB per chip (fits 95.7; 45.5 for
the former 32 rows of 262144 tokens), 198.3 model GFLOPs per token slot, a compute-bound step of
66.9 s at peak (docs/aot/flash_310b_256k_v5p_8x8x8.json, docs/scaling.md).
"""
import pathlib

import ml_collections

from gagar_jax.config import load_config_file


def get_config() -> ml_collections.ConfigDict:
    c = load_config_file(str(pathlib.Path(__file__).with_name("flash_310b.py")))

    # 512 chips = fsdp 2 x expert 8 x context 8 x tensor 4. Rows split 16 ways over fsdp x expert
    # (one 192k row per 32 chips and micro-batch), each row 8 ways along S over context. Parameters
    # are stored over fsdp x context (16 ways, as flash_310b's fsdp 16) and tensor; experts as
    # flash_310b (E over expert, `ep_a2a` over the 32k tokens of each chip).
    c.mesh.data = 1
    c.mesh.fsdp = 2
    c.mesh.expert = 8
    c.mesh.context = 8
    c.mesh.tensor = 4

    c.train.micro_batches = 16        # 16 rows per micro-batch: one row per batch shard

    c.loss.max_response_len = 196_608

    f = c.feed
    f.rows_per_batch = 256            # B: 256 x 196608 = 50.3M token slots per step
    f.seq_len = 196_608               # S: one ~180k trajectory per row (~8% padding)
    f.max_traj_tokens = 196_608       # longer trajectories are rejected (dead-lettered)
    f.max_trajectories = 256          # T: 32 groups x 8
    f.groups_per_batch = 32           # G: the RL batch (docs/scaling.md, "An RL batch")
    return c

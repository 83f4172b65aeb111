"""`flash_310b` on long rows with context parallelism, training an RL batch of 32 groups x 8
trajectories of the paper's length per step.

The paper's code-agent trajectories average 173k-192k tokens. A step is micro-batches of 16 rows
(one row per batch shard) in five length buckets (64k, 128k, 192k, 256k, 320k; `feed.buckets`,
docs/feed.md), 50.3M token slots in all: with trajectories of 180k +- 20% (log-normal) 99.8% of
groups are trained whole at 13% padding, against 6% whole with one row length of 192k
(scripts/bench_feed.py --only-buckets, docs/scaling.md "Long agent trajectories kept"). Each row
is split along the sequence over a `context` axis of 8 chips (24576 tokens per chip at 192k,
40960 at 320k), attention exchanges keys and values across it (all-gather on the 9 full layers,
the 128 preceding tokens on the 39 sliding ones; gagar_jax/kernels/attention/context.py). Same
model, optimizer and chips as `configs/flash_310b.py`.

Run:  gagar-train --config configs/flash_310b_256k.py --workdir gs://BUCKET/runs/flash_long \
        --config.feed.spool_dir=gs://BUCKET/spool --config.train.init_from=/ckpt/MiMo-V2-Flash
AOT:  JAX_PLATFORMS=cpu python scripts/aot_compile.py --config configs/flash_310b_256k.py \
--topology v5p:8x8x8
Numbers (gagar_jax/aot/flops.py, checked by tests/test_configs.py): 308.8B total, 15.4B active
params (the model of flash_310b). Compiled for v5p:8x8x8 with the five buckets: 41.25 GiB per
chip, code included (fits 95.7; docs/aot/flash_310b_256k_v5p_8x8x8.json), its mean step under
180k-token trajectories bound at 24.0% MFU (docs/scaling.md "The 256k configs' reports, with a
mean step"). With one row length of 196608 (before the buckets, issue 29): 30.2 GiB per chip,
198.3 model GFLOPs per token slot, a compute-bound step of 66.9 s at peak (docs/scaling.md).
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

    c.train.micro_batches = 16        # unused with feed.buckets: the packing forms micro-batches

    c.loss.max_response_len = 327_680

    f = c.feed
    # Length buckets (docs/feed.md, docs/scaling.md "Long agent trajectories kept"): micro-batches
    # of 16 rows (one per batch shard) of one of five compiled row lengths, within today's
    # 50.3M token slots per step. A 180k +- 20% trajectory over 192k no longer rejects its group
    # (one row of 192k did: 7% of groups trained whole), and short ones pack several to a row.
    # scripts/bench_feed.py: 100% whole, 13% padding (log-normal, mean 180k); 100%, 8% (47k ->
    # 114k growth).
    f.buckets = (65_536, 131_072, 196_608, 262_144, 327_680)
    f.bucket_rows = 16
    f.tokens_per_batch = 16 * 16 * 196_608   # 50.3M token slots per step
    f.rows_per_batch = 0              # resolved from the buckets (their static arrays)
    f.seq_len = 327_680               # the largest bucket
    f.max_traj_tokens = 327_680       # longer ones follow feed.overlong (reject: quarantined)
    f.max_trajectories = 256          # T: 32 groups x 8
    f.groups_per_batch = 32           # G: the RL batch (docs/scaling.md, "An RL batch")
    return c

"""`pro_1t` on long rows with context parallelism: 32 groups x 8 trajectories of ~180k tokens
per step in micro-batches of 16 rows in five length buckets up to 327680 tokens (see
configs/flash_310b_256k.py).

Run:  gagar-train --config configs/pro_1t_256k.py --workdir gs://BUCKET/runs/pro_long \
        --config.feed.spool_dir=gs://BUCKET/spool
AOT:  JAX_PLATFORMS=cpu python scripts/aot_compile.py --config configs/pro_1t_256k.py \
--topology v5p:8x8x16
Numbers (gagar_jax/aot/flops.py, checked by tests/test_configs.py): 1022.3B total, 43.0B active
params (the model of pro_1t). Compiled for v5p:8x8x16 with the five buckets: 53.5 GiB per chip
(fits 95.7), and its mean step under 180k-token trajectories bound at 12.2% MFU by the ragged
all-to-alls (docs/aot/pro_1t_256k_v5p_8x8x16.json; docs/scaling.md "The 256k configs' reports,
with a mean step"). With one row length of 196608 (before the buckets): 41.5 GiB per chip (75.1
for the former 32 rows of 262144 tokens).
"""
import pathlib

import ml_collections

from gagar_jax.config import load_config_file


def get_config() -> ml_collections.ConfigDict:
    c = load_config_file(str(pathlib.Path(__file__).with_name("pro_1t.py")))

    # 1024 chips = fsdp 2 x expert 8 x context 8 x tensor 8: rows split 16 ways over fsdp x
    # expert, each 8 ways along S (24576 tokens per chip); parameters over fsdp x context x tensor.
    c.mesh.data = 1
    c.mesh.fsdp = 2
    c.mesh.expert = 8
    c.mesh.context = 8
    c.mesh.tensor = 8

    # The RL batch and its length buckets are flash_310b_256k's (written once, in its feed section).
    long = load_config_file(str(pathlib.Path(__file__).with_name("flash_310b_256k.py")))
    c.feed = long.feed
    c.loss.max_response_len = long.loss.max_response_len
    c.train.micro_batches = long.train.micro_batches
    return c

"""MiMo-V2-Flash architecture scaled to the paper's MiMo-V2.6-Pro size (1022.3B total, 43.0B active)
on a TPU v5p-2048 slice (1024 chips).

The paper gives only 1.02T total / 42B active. Public descriptions of the family's Pro model give
70 layers and 384 routed experts, top-8, no shared expert. Assumed (chosen to land on the
paper's totals with Flash's layout scaled up): D = 6144, expert F = 2048, the first layer dense
(MLP width 24576), 128 query heads of q/k width 192 and value width 128, 8 KV heads on full
layers and 16 on sliding ones, Flash's 5:1 sliding/full interleave (window 129, sinks), partial
rotary, rope thetas, value scale and sigmoid router with correction bias, vocab 152576. It
exports as `mimo_v2_flash`. See docs/scaling.md. Derived from `configs/flash_310b.py`.

Run:  gagar-train --config configs/pro_1t.py --workdir gs://BUCKET/runs/pro \
        --config.feed.spool_dir=gs://BUCKET/spool
AOT:  JAX_PLATFORMS=cpu python scripts/aot_compile.py --config configs/pro_1t.py \
--topology v5p:8x8x16
Numbers (gagar_jax/aot/flops.py, checked by tests/test_configs.py): 1022.3B total, 43.0B active
params. Global batch (Flash's): 256 rows x 32768 tokens = 8.4M tokens, two micro-batches of 128
rows. Compiled for v5p:8x8x16 (fsdp 16 x expert 8 x tensor 8, `ep_a2a`, megablox over 16
chunks): 46.0 GiB per chip (docs/aot/pro_1t_v5p_8x8x16.json; 74.4 before issue 29's
dense-weight and residual sharding, 82.3 before issue 29),
302.3 model GFLOPs per token (docs/aot/pro_1t_mimo_v5p_8x8x16.json, docs/scaling.md; the former
global-attention stand-in: 68.5 GiB, 527.2 GFLOPs, docs/aot/pro_1t_ep_a2a_v5p_8x8x16.json).
"""
import pathlib

import ml_collections

from gagar_jax.config import load_config_file


def get_config() -> ml_collections.ConfigDict:
    c = load_config_file(str(pathlib.Path(__file__).with_name("flash_310b.py")))

    m = c.model
    m.hidden_size = 6_144             # D
    m.num_layers = 70
    # Flash's pattern: full at layer 0 and every 6th layer (12 full, 58 sliding).
    m.layer_types = tuple("full" if i == 0 or (i + 1) % 6 == 0 else "sliding" for i in range(70))
    m.num_heads = 128                 # q/k width 192, value width 128 (Flash's)
    m.num_kv_heads = 8                # full layers
    m.sliding_num_kv_heads = 16       # sliding layers: twice the KV heads
    m.intermediate_size = 24_576      # the dense first layer's MLP width
    m.num_experts = 384               # E

    # 1024 chips = fsdp 16 x expert 8 x tensor 8: rows split 128 ways over fsdp x expert (one
    # 32k row per chip and micro-batch); experts as Flash (`ep_a2a`, E over expert: 48 per chip).
    c.mesh.fsdp = 16
    c.mesh.expert = 8
    c.mesh.tensor = 8
    return c

"""Tiny Qwen3-MoE for the closed loop with vLLM's CPU build (`make loop`, docs/rollout.md).

The learner trains on the rollout worker's spool and publishes every step; the worker
(`gagar_jax.rollout.worker`, in .venv-vllm) reloads `latest` between groups. The shapes are
ones vLLM's CPU backend runs: head size 64 (its attention supports 64, 128, ...; not 16).
Numbers (2 layers, 4 experts top-2): 0.13M total, 0.11M active.

Run:  make loop    (or: python scripts/loop.py --workdir runs/loop --seed 0)
"""
import pathlib

import ml_collections

from gagar_jax.config import load_config_file


def get_config() -> ml_collections.ConfigDict:
    c = load_config_file(str(pathlib.Path(__file__).with_name("tiny_cpu.py")))
    m = c.model
    m.hidden_size = 64
    m.num_layers = 2
    m.num_heads = 2
    m.num_kv_heads = 1
    m.head_dim = 64                 # vLLM CPU attention: 64, 128, ...
    m.moe_intermediate_size = 32
    m.num_experts = 4
    m.top_k = 2
    m.attention = "plain"
    m.expert_backend = "dense"      # 4 experts: the dense path is the cheapest to compile
    m.hf_family = "qwen3_moe"

    t = c.train
    t.steps = 40
    t.checkpoint_every = 0          # only the final save
    t.publish_every = 1             # every step: the worker reloads between groups
    t.keep_published = 3
    t.publish_dtype = "bfloat16"    # what an engine is served in production (docs/rollout.md)
    t.micro_batches = 1

    lo = c.loss
    lo.recompute_old_logprobs = True  # the ratio's denominator is the learner's own (bf16 mismatch)
    lo.rollout_is = "token"         # ... and the engine's log-probs enter as a truncated IS weight
    lo.max_response_len = 8         # the example task's completions (Dr. GRPO normalizer)

    o = c.optim
    o.learning_rate = 3e-3
    o.warmup_steps = 0
    o.schedule = "constant"

    f = c.feed
    f.path = ""
    f.spool_dir = ""                # set by the loop: <workdir>/spool
    f.spool_poll_s = 0.1
    f.spool_settle_s = 0.0          # the worker renames complete shards (docs/feed.md)
    f.spool_timeout_s = 600.0
    f.rows_per_batch = 8            # 4 trajectories of the example task (24 tokens) per row:
    f.seq_len = 96                  # 32 trajectories = 4 groups of 8 per batch
    f.max_traj_tokens = 96
    f.max_trajectories = 32
    f.groups_per_batch = 4
    f.max_staleness = 4
    f.routing_replay = True         # R3: the worker sends the engine's routing
    return c

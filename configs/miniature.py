"""The miniature closed loop (docs/miniature.md): the tiny MoE policy on a synthetic code-edit task.

Derived from configs/tiny_cpu.py; only what differs is set here. One feed batch is one RL step:
up to 16 mixed groups x 8 rollouts of <= 64 tokens (the task's longest episode is 61 tokens),
packed into 64 rows of 128 tokens (fits even 128 trajectories of the maximum length), with the
sampler's routed experts replayed by the learner.

Experiment (three advantage modes x seeds, one process, plots and table):
  JAX_PLATFORMS=cpu python scripts/miniature.py
Two processes, the real path (a producer writing spool shards, `gagar-train` consuming them and
publishing weights every step):
  JAX_PLATFORMS=cpu python scripts/miniature.py --closed-loop --workdir runs/miniature_loop
which warm-starts, publishes policy version 0, and runs next to the producer process
  gagar-train --config configs/miniature.py --workdir W --config.feed.spool_dir=W/spool \
      --config.train.init_from=W/published/step_00000000 --config.train.steps=5
"""
import pathlib

import ml_collections

from gagar_jax.config import load_config_file


def get_config() -> ml_collections.ConfigDict:
    c = load_config_file(str(pathlib.Path(__file__).with_name("tiny_cpu.py")))
    c.seed = 0

    t = c.train
    t.steps = 30                    # RL steps (the feed may end sooner: the spool's _DONE)
    t.checkpoint_every = 10
    t.publish_every = 1             # the producer samples with the newest published weights
    t.keep_published = 3
    t.publish_dtype = "float32"     # the producer samples exactly the learner's weights
    t.micro_batches = 1

    c.loss.mode = "sum_preserving"  # sum_preserving | downweight_only | binary
    c.loss.max_response_len = 32    # Dr. GRPO constant normalizer: 3 turns x 10 tokens + slack

    o = c.optim
    o.learning_rate = 1e-3
    o.warmup_steps = 0
    o.schedule = "constant"

    f = c.feed
    f.path = ""
    f.spool_dir = ""                # the closed loop sets W/spool
    f.spool_poll_s = 0.2
    f.spool_timeout_s = 0.0         # the producer's _DONE marker ends the feed
    f.spool_log_every_s = 30.0
    f.spool_settle_s = 0.0          # our producer publishes by rename: no need to wait
    f.rows_per_batch = 64           # B
    f.seq_len = 128                 # S
    f.max_trajectories = 128        # T = 16 groups x 8 rollouts
    f.groups_per_batch = 16         # G
    f.max_traj_tokens = 64
    f.max_group_trajectories = 8
    f.max_staleness = 2
    f.routing_replay = True
    return c

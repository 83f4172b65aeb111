"""The miniature closed loop (docs/miniature.md): the tiny MoE policy on a synthetic code-edit task.

Derived from configs/tiny_cpu.py; only what differs is set here. One feed batch is one RL step:
up to 16 mixed groups x 8 rollouts of <= 448 tokens (round two's hard task: up to 10 turns of
32 tokens; vocabulary 1024 for its note words), packed into rows of 512 tokens, with the
sampler's routed experts replayed by the learner, and two optimizer updates per step.
`scripts/miniature.py` sets the feed's row count and shapes for its task and batch size.

Experiment (four arms x seeds, one process, resumable; plots, tables and criteria):
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
    c.model.vocab_size = 1024       # round two's task: words of the note language from 128

    t = c.train
    t.steps = 30                    # RL steps (the feed may end sooner: the spool's _DONE)
    t.checkpoint_every = 10
    t.publish_every = 1             # the producer samples with the newest published weights
    t.keep_published = 3
    t.publish_dtype = "float32"     # the producer samples exactly the learner's weights
    t.micro_batches = 1
    t.mini_batches = 2              # two optimizer updates per RL step (clip 0.2 / 0.28 can act)

    c.loss.mode = "sum_preserving"  # sum_preserving | downweight_only | binary
    c.loss.max_response_len = 320   # Dr. GRPO constant normalizer: 10 turns x 32 tokens

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
    f.seq_len = 512                 # S (the hard task's longest episode is 448 tokens)
    f.max_trajectories = 128        # T = 16 groups x 8 rollouts
    f.groups_per_batch = 16         # G
    f.max_traj_tokens = 448
    f.max_group_trajectories = 8
    f.max_staleness = 2             # the sweep trains with staleness 1
    f.routing_replay = True
    return c

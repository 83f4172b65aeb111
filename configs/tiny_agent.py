"""Tiny Qwen3-MoE for the closed agent loop (`make agent_loop`, docs/rollout.md): the lookup task
(gagar_jax/rollout/envs/lookup.py), three turns per trajectory, vLLM's CPU build as the engine.

configs/tiny_vllm.py with the task's nine-token vocabulary, trajectories of at most 19 tokens
(3 prompt + 3 turns of 4 + 2 observations of 2), binary credit (the environment's verdict, no
grader) and partial rollouts: the worker moves to each new version between turns, so a
trajectory's turns may come from two versions; the learner judges staleness on its oldest token.

Run:  make agent_loop   (or: python scripts/agent_loop.py --workdir runs/agent_loop --seeds 0)
"""
import pathlib

import ml_collections

from gagar_jax.config import load_config_file


def get_config() -> ml_collections.ConfigDict:
    c = load_config_file(str(pathlib.Path(__file__).with_name("tiny_vllm.py")))
    c.model.vocab_size = 9          # the lookup task's symbols (envs/lookup.py)

    lo = c.loss
    lo.mode = "binary"              # the environment's verdict alone: plain Dr. GRPO credit
    lo.max_response_len = 12        # 3 turns of at most 4 generated tokens (Dr. GRPO normalizer)
    # The worker samples without routing capture (`--no-routing`): on vLLM's CPU build capture
    # serialises every request (16 turns: 1.0 s against 0.12 s batched), so the learner routes
    # itself (R2); R3 across turns is checked in tests/test_agent_vllm.py.
    lo.routing_replay = "r2"

    # Adam at 1e-3, not tiny_vllm's 3e-3: at 3e-3 the policy learned to look, then answered one
    # digit for every code within 30 steps and never copied (the calibration, docs/rollout.md)
    c.optim.learning_rate = 1e-3

    f = c.feed
    f.routing_replay = False
    f.overlong = "drop"             # a trajectory cut by a limit stays in its group's statistics
    f.staleness_from = "oldest"     # partial rollouts: judged on their oldest token
    return c

"""The miniature's rollout producer: sample groups with the policy, grade them, write feed shards.

The closed loop runs as two processes sharing a work directory:
  producer  loop: `load_latest_policy(workdir)` -> `sample_groups(...)` -> `write_spool_shard(...)`
  trainer   `gagar-train` with a spool feed on the same directory; publishes weights (and the
            policy version) every `publish_every` steps, which the producer picks up next round.
The in-process experiment calls `sample_groups` directly and hands the groups to the batcher.
"""
from __future__ import annotations

import collections
import dataclasses
import os
from typing import Optional

import jax

from gagar_jax import sampler
from gagar_jax.sim import grader
from gagar_jax.sim import task as T


def cache_len(task_cfg: T.TaskConfig) -> int:
    """KV-cache length for the task family: its longest episode, rounded up to 8."""
    return -(-task_cfg.max_episode_tokens // 8) * 8


@dataclasses.dataclass(frozen=True)
class RolloutStats:
    """What a batch of graded groups looked like.

    pass_rate: share of rollouts whose tests passed and that are not hacks; hacked: hack count;
    tiers: tier -> count among clean passes; strong_share: strong / clean passes (nan if none);
    mean_generated: mean model-generated tokens per rollout; mixed_groups: groups with at least
    one clean pass and one non-pass (the only ones the learner trains on).
    """
    groups: int
    rollouts: int
    pass_rate: float
    hacked: int
    tiers: dict
    strong_share: float
    mean_generated: float
    mixed_groups: int


def summarize(episode_groups, assessment_groups) -> RolloutStats:
    """Stats over groups of finished episodes and their `grader.grade_group` verdicts."""
    tiers, passes, hacked, gen, n, mixed = collections.Counter(), 0, 0, 0, 0, 0
    for eps, ass in zip(episode_groups, assessment_groups):
        clean = [a.outcome == "pass" and not a.hacked for a in ass]
        mixed += 0 < sum(clean) < len(clean)
        for ep, a, ok in zip(eps, ass, clean):
            n += 1
            gen += sum(ep.loss_mask)
            hacked += a.hacked
            passes += ok
            if ok:
                tiers[a.tier] += 1
    return RolloutStats(
        groups=len(episode_groups), rollouts=n, pass_rate=passes / max(n, 1), hacked=hacked,
        tiers={t: tiers[t] for t in (grader.STRONG, grader.INTERMEDIATE, grader.DEFECTIVE)},
        strong_share=tiers[grader.STRONG] / passes if passes else float("nan"),
        mean_generated=gen / max(n, 1), mixed_groups=mixed)


def sample_groups(model, tasks, task_cfg: T.TaskConfig, key, *, group_size: int,
                  policy_version: int, temperature: float = 1.0, group_prefix: str = "g"):
    """Rolls out `group_size` episodes per task in one batch, grades each group, builds records.

    Args:
      model: the policy (`Transformer`).
      tasks: `sim.task.Task`s, one group each.
      task_cfg: the task family's settings.
      key: PRNG key.
      group_size: rollouts per group.
      policy_version: the learner step whose weights `model` holds (written into the records).
      temperature: sampling temperature.
      group_prefix: group ids are f"{group_prefix}-{policy_version}-{task_id}".
    Returns:
      (records, stats): a list of `feed.schema.Group` and the `RolloutStats`.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    episodes = [T.Episode(t, task_cfg) for t in tasks for _ in range(group_size)]
    rolls = sampler.rollout(model, episodes, key, cache_len=cache_len(task_cfg),
                            max_turns=task_cfg.max_turns, max_turn_tokens=task_cfg.max_turn_tokens,
                            temperature=temperature, stop_tokens=T.STOP_TOKENS)
    has_moe = model.cfg.num_moe_layers > 0
    records, ep_groups, as_groups = [], [], []
    for g, t in enumerate(tasks):
        group = rolls[g * group_size:(g + 1) * group_size]
        eps = [r.episode for r in group]
        verdicts = grader.grade_group(t, eps)
        records.append(grader.group_record(
            t, eps, verdicts, group_id=f"{group_prefix}-{policy_version}-{t.task_id}",
            policy_version=policy_version, logprobs=[r.logprobs for r in group],
            routed_experts=[r.experts.tolist() for r in group] if has_moe else None))
        ep_groups.append(eps)
        as_groups.append(verdicts)
    return records, summarize(ep_groups, as_groups)


def write_spool_shard(spool_dir: str, records, *, policy_version: int, index: int) -> str:
    """Atomically publishes records as one JSONL shard in the trainer's spool directory.

    Shard names sort by (policy_version, index), the order the spool source reads them.
    """
    from gagar_jax.feed import convert  # the feed's atomic writer (temp file + rename)
    os.makedirs(spool_dir, exist_ok=True)
    path = os.path.join(spool_dir, f"shard-{policy_version:08d}-{index:06d}.jsonl")
    convert.write_groups(path, records)
    return path


def load_latest_policy(workdir: str, **overrides) -> Optional[tuple]:
    """The newest weights the trainer published under `workdir`, or None if none yet.

    Returns:
      (model, policy_version). `overrides` go to `hf.from_pretrained` (e.g. expert_backend).
    """
    from gagar_jax import hf, publish
    latest = publish.read_latest(workdir)
    if latest is None:
        return None
    model, _ = hf.from_pretrained(latest["path"], **overrides)
    return model, int(latest["policy_version"])


def producer_step(model, policy_version: int, tasks, task_cfg: T.TaskConfig, spool_dir: str,
                  key, *, group_size: int, index: int, temperature: float = 1.0) -> RolloutStats:
    """One producer round: sample and grade one group per task, write one spool shard."""
    records, stats = sample_groups(model, tasks, task_cfg, key, group_size=group_size,
                                   policy_version=policy_version, temperature=temperature,
                                   group_prefix=f"r{index}")
    write_spool_shard(spool_dir, records, policy_version=policy_version, index=index)
    return stats


def task_batches(task_cfg: T.TaskConfig, seed: int, groups_per_round: int):
    """Endless fresh training tasks, `groups_per_round` per round (round r uses seed+r)."""
    r = 0
    while True:
        yield T.make_tasks(task_cfg, seed * 1_000_003 + r, groups_per_round, prefix="train")
        r += 1


def producer_key(seed: int, index: int) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), index)


def tier_mix(model, tasks, task_cfg: T.TaskConfig, key, *, group_size: int,
             temperature: float = 1.0) -> RolloutStats:
    """Samples and grades groups without writing them (e.g. the warm start's step-0 report)."""
    return sample_groups(model, tasks, task_cfg, key, group_size=group_size, policy_version=0,
                         temperature=temperature)[1]

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
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Optional

import jax
import numpy as np

from gagar_jax.sim import difficulty, grader, sampler
from gagar_jax.sim import task as task_lib

if TYPE_CHECKING:
    from gagar_jax.feed import schema
    from gagar_jax.model.transformer import ModelConfig, Transformer


def cache_len(task_cfg: task_lib.TaskConfig) -> int:
    """KV-cache length for the task family: its longest episode, rounded up to 8."""
    return -(-task_cfg.max_episode_tokens // 8) * 8


@dataclasses.dataclass(frozen=True)
class RolloutStats:
    """What a batch of graded groups looked like.

    pass_rate: share of rollouts whose tests passed and that are not hacks; hacked: hack count;
    tiers: tier -> count among clean passes; strong_share: strong / clean passes (nan if none);
    mean_generated: mean model-generated tokens per rollout; mixed_groups: groups with at least
    one clean pass and one non-pass (the only ones the learner trains on); p90_generated: 90th
    percentile of generated tokens; mean_turns; timeout_rate: share of rollouts that ran out of
    turns without submitting; entropy / entropy_note / entropy_action: mean untempered entropy of
    the sampling distribution over generated tokens, all / note tokens (NOTE and words) / the
    rest (nan without `entropy_groups` or without such tokens); note_share: note tokens /
    generated tokens; true_pass_rate: the pass rate before a flaky runner (`sim/difficulty.py`)
    reported some passes as failures (= pass_rate without one); flaked: passes so reported.
    """
    groups: int
    rollouts: int
    pass_rate: float
    hacked: int
    tiers: dict
    strong_share: float
    mean_generated: float
    mixed_groups: int
    p90_generated: float = float("nan")
    mean_turns: float = float("nan")
    timeout_rate: float = float("nan")
    entropy: float = float("nan")
    entropy_note: float = float("nan")
    entropy_action: float = float("nan")
    note_share: float = float("nan")
    true_pass_rate: float = float("nan")
    flaked: int = 0


def _mean(x: Sequence[float]) -> float:
    return float(np.mean(x)) if len(x) else float("nan")


def summarize(episode_groups: Sequence[Sequence[task_lib.Episode]],
              assessment_groups: Sequence[Sequence[grader.Assessment]],
              entropy_groups: Optional[Sequence[Sequence[Sequence[float]]]] = None) -> RolloutStats:
    """Stats over groups of finished episodes and their `grader.grade_group` verdicts
    (`entropy_groups`: per episode, the per-token sampling entropy, see `sampler.Rollout`)."""
    tiers, passes, hacked, n, mixed = collections.Counter(), 0, 0, 0, 0
    gens, turns, timeouts, ent_note, ent_act = [], [], 0, [], []
    for g, (eps, ass) in enumerate(zip(episode_groups, assessment_groups, strict=False)):
        clean = [a.outcome == "pass" and not a.hacked for a in ass]
        mixed += 0 < sum(clean) < len(clean)
        for j, (ep, a, ok) in enumerate(zip(eps, ass, clean, strict=False)):
            n += 1
            gens.append(sum(ep.loss_mask))
            turns.append(len(ep.turns))
            timeouts += getattr(ep, "end_reason", None) == "timeout"
            hacked += a.hacked
            passes += ok
            if ok:
                tiers[a.tier] += 1
            if entropy_groups is not None:
                tok, m = np.asarray(ep.tokens), np.asarray(ep.loss_mask) > 0
                e = np.asarray(entropy_groups[g][j])
                note = m & ((tok == task_lib.NOTE) | (tok >= task_lib.WORD_BASE))
                ent_note += e[note].tolist()
                ent_act += e[m & ~note].tolist()
    tot = len(ent_note) + len(ent_act)
    return RolloutStats(
        groups=len(episode_groups), rollouts=n, pass_rate=passes / max(n, 1), hacked=hacked,
        tiers={t: tiers[t] for t in (grader.STRONG, grader.INTERMEDIATE, grader.DEFECTIVE)},
        strong_share=tiers[grader.STRONG] / passes if passes else float("nan"),
        mean_generated=_mean(gens), mixed_groups=mixed,
        p90_generated=float(np.percentile(gens, 90)) if gens else float("nan"),
        mean_turns=_mean(turns), timeout_rate=timeouts / max(n, 1),
        entropy=_mean(ent_note + ent_act), entropy_note=_mean(ent_note),
        entropy_action=_mean(ent_act), note_share=len(ent_note) / tot if tot else float("nan"))


def sample_groups(model: Transformer, tasks: Sequence[task_lib.Task], task_cfg: task_lib.TaskConfig,
                  key: jax.Array, *, group_size: int, policy_version: int, temperature: float = 1.0,
                  group_prefix: str = "g", top_p: float = 1.0, flake_prob: float = 0.0,
                  flake_seed: int = 0) -> tuple[list[schema.Group], RolloutStats]:
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
      top_p: nucleus sampling (1 = off; see `sampler.rollout`).
      flake_prob, flake_seed: a flaky test runner (`difficulty.flake`) reports each pass as a
        failure with this probability before grading (0 = off).
    Returns:
      (records, stats): a list of `feed.schema.Group` and the `RolloutStats`.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    episodes = [task_lib.Episode(t, task_cfg) for t in tasks for _ in range(group_size)]
    rolls = sampler.rollout(model, episodes, key, cache_len=cache_len(task_cfg),
                            max_turns=task_cfg.max_turns, max_turn_tokens=task_cfg.max_turn_tokens,
                            temperature=temperature, stop_tokens=task_lib.STOP_TOKENS, top_p=top_p)
    flaked = difficulty.flake([r.episode for r in rolls], flake_prob, flake_seed)
    has_moe = model.cfg.num_moe_layers > 0
    records, ep_groups, as_groups, ent_groups = [], [], [], []
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
        ent_groups.append([r.entropy for r in group])
    stats = summarize(ep_groups, as_groups, ent_groups)
    # A flaked episode is a true pass unless it was a hack (the grader's flag ignores outcomes).
    hacked = np.array([a.hacked for ass in as_groups for a in ass], bool)
    true_pass = stats.pass_rate + float(np.sum(flaked & ~hacked)) / max(len(rolls), 1)
    return records, dataclasses.replace(stats, true_pass_rate=true_pass,
                                        flaked=int(flaked.sum()))


def write_spool_shard(spool_dir: str, records: Sequence[schema.Group], *, policy_version: int,
                      index: int) -> str:
    """Atomically publishes records as one JSONL shard in the trainer's spool directory.

    Shard names sort by (policy_version, index), the order the spool source reads them.
    """
    from gagar_jax.feed import convert  # the feed's atomic writer (temp file + rename)
    os.makedirs(spool_dir, exist_ok=True)
    path = os.path.join(spool_dir, f"shard-{policy_version:08d}-{index:06d}.jsonl")
    convert.write_groups(path, records)
    return path


def load_latest_policy(workdir: str, model_cfg: Optional[ModelConfig] = None) -> Optional[tuple]:
    """The newest weights the trainer published under `workdir`, or None if none yet.

    Args:
      workdir: the trainer's work directory (its `published/latest` pointer).
      model_cfg: the run's `ModelConfig`; its runtime-only fields (expert backend, attention,
        dtypes, ...) are not in the HF config.json and are applied on load. None: HF defaults.
    Returns:
      (model, policy_version).
    """
    from gagar_jax.hf import api as hf
    from gagar_jax.run import publish
    latest = publish.read_latest(workdir)
    if latest is None:
        return None
    overrides = {} if model_cfg is None else dataclasses.asdict(model_cfg)
    model, _ = hf.from_pretrained(latest["path"], **overrides)
    return model, int(latest["policy_version"])


def producer_step(model: Transformer, policy_version: int, tasks: Sequence[task_lib.Task],
                  task_cfg: task_lib.TaskConfig, spool_dir: str, key: jax.Array, *, group_size: int,
                  index: int, temperature: float = 1.0) -> RolloutStats:
    """One producer round: sample and grade one group per task, write one spool shard."""
    records, stats = sample_groups(model, tasks, task_cfg, key, group_size=group_size,
                                   policy_version=policy_version, temperature=temperature,
                                   group_prefix=f"r{index}")
    write_spool_shard(spool_dir, records, policy_version=policy_version, index=index)
    return stats


def run_producer(workdir: str, spool_dir: str, task_cfg: task_lib.TaskConfig, *, rounds: int,
                 groups_per_round: int, group_size: int, seed: int,
                 model_cfg: Optional[ModelConfig] = None, max_ahead: int = 2, wait_s: float = 30.0,
                 poll_s: float = 0.5, start_index: int = 0, temperature: float = 1.0,
                 log: Callable[[str], None] = print) -> list:
    """The producer process's loop: newest published policy -> sample -> grade -> spool shard.

    Weights are reloaded whenever `latest` names another directory (a newer policy version, or
    the same step published again by a resumed trainer). At most
    `max_ahead` rounds are produced per version; then the producer waits for the next version,
    but never longer than `wait_s` (the trainer may need more mixed groups before it can take a
    step), so the two processes cannot deadlock; the feed's `max_staleness` is the hard bound.
    After the last round it writes the spool's `_DONE` marker, which ends the trainer's feed.

    Args:
      workdir: the trainer's work directory (published weights).
      spool_dir: the trainer's `feed.spool_dir`.
      task_cfg: task family. rounds: shards to write. groups_per_round: tasks (groups) per
        shard. group_size: rollouts per group. seed: task and sampling seed.
      model_cfg: the run's `ModelConfig` (see `load_latest_policy`).
      max_ahead, wait_s, poll_s: back-pressure (see above). start_index: first round index.
      temperature: sampling temperature. log: progress lines.
    Returns:
      The `RolloutStats` of every round.
    """
    import time

    from gagar_jax.feed.sources import DONE_MARKER
    from gagar_jax.run import publish
    tasks = task_batches(task_cfg, seed, groups_per_round)
    for _ in range(start_index):
        next(tasks)
    model, version, at_version, waited_since, out = None, None, 0, None, []
    loaded = None   # the directory: a resumed trainer may publish a version again elsewhere
    for index in range(start_index, start_index + rounds):
        while True:
            latest = publish.read_latest(workdir)
            if latest is not None and latest["path"] != loaded:
                model, version = load_latest_policy(workdir, model_cfg)
                loaded, at_version, waited_since = latest["path"], 0, None
                break
            if model is not None and at_version < max_ahead:
                break
            if waited_since is None and model is None:
                log(f"producer: waiting for published weights under {workdir}")
            waited_since = waited_since or time.monotonic()
            if model is not None and time.monotonic() - waited_since >= wait_s:
                log(f"producer: no new policy after {wait_s:.0f} s; one more round at v{version}")
                waited_since = None
                break
            time.sleep(poll_s)
        stats = producer_step(model, version, next(tasks), task_cfg, spool_dir,
                              producer_key(seed, index), group_size=group_size, index=index,
                              temperature=temperature)
        at_version += 1
        out.append(stats)
        log(f"producer: round {index} v{version} pass_rate={stats.pass_rate:.3f} "
            f"strong_share={stats.strong_share:.3f} mixed={stats.mixed_groups}")
    open(os.path.join(spool_dir, DONE_MARKER), "w").close()
    return out


def task_batches(task_cfg: task_lib.TaskConfig, seed: int,
                 groups_per_round: int) -> Iterator[list[task_lib.Task]]:
    """Endless fresh training tasks, `groups_per_round` per round (round r uses seed+r)."""
    r = 0
    while True:
        yield task_lib.make_tasks(task_cfg, seed * 1_000_003 + r, groups_per_round, prefix="train")
        r += 1


def producer_key(seed: int, index: int) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), index)

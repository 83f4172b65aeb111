"""The run's closing block: what a person reads when `gagar-train` ends.

    print(summary_block(summary, workdir))

`summary` is the dict `train.run` returns (also `<workdir>/summary.json`, the machine-readable
record); the block says in plain lines how the run ended, what the feed's groups became, the
throughput (steady, and with compilation), and where the outputs are.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def _num(x: Any, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _how_it_ended(summary: Mapping[str, Any]) -> str:
    steps, this_run = summary["steps"], summary["steps_this_run"]
    stop = summary.get("signal")
    if stop:
        return (f"stopped by {stop} at step {steps} ({this_run} this run): checkpoint written; "
                "the same command resumes")
    return f"done: {steps} steps ({this_run} this run)"


def summary_block(summary: Mapping[str, Any], workdir: str) -> str:
    """The plain-text end-of-run block.

    Args:
      summary: the run summary (`train.run`'s return value).
      workdir: the run directory as the user gave it.
    Returns:
      Lines joined by newlines, starting with "gagar-train: ".
    """
    led = summary["ledger"]
    wd = str(workdir)
    join = (lambda *p: "/".join(p)) if "://" in wd else os.path.join
    lines = [
        f"gagar-train: {_how_it_ended(summary)}",
        f"  groups     received {led['received']}: trained {led['trained']}, uniform "
        f"{led['filtered_uniform']}, stale {led['filtered_stale']}, quarantined "
        f"{led['quarantined']} (dead-lettered {summary.get('dead_lettered', led['quarantined'])}"
        f"), left over {led['leftover']}; ledger {'balanced' if led['balanced'] else 'UNBALANCED'}",
        f"  tokens/s   {_num(summary.get('tokens_per_s_steady'), ',.0f')} steady, "
        f"{_num(summary.get('tokens_per_s'), ',.0f')} with compilation ({summary['wall_s']:.1f} s)",
        f"  loss       final {_num(summary.get('final_loss'), '.4g')}; lambda mean "
        f"{_num(summary.get('lam_mean'), '.3f')}, max {_num(summary.get('lam_max'), '.3f')}; "
        f"skipped updates {summary.get('skipped_updates', 0)}",
        f"  workdir    {wd} (summary.json, ledger.json, checkpoints/)",
        f"  metrics    {join(wd, 'metrics.jsonl')}, {join(wd, 'groups.jsonl')}",
    ]
    if "://" not in wd:
        lines.append(f"  TensorBoard  tensorboard --logdir {join(wd, 'tensorboard')}  "
                     "(pip install tensorboard)")
    published = summary.get("published_latest")
    lines.append(f"  published  {published}" if published
                 else "  published  none (train.publish_every = 0)")
    if led.get("quarantined"):
        lines.append(f"  dead letters  {join(wd, 'dead_letter.jsonl')}")
    return "\n".join(lines)

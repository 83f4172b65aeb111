"""Tables and plots of a miniature sweep (`scripts/miniature.py`): runs -> Markdown and PNGs.

`runs` maps "mode/seed" to the per-step rows of `experiment.run_loop`.
"""
from __future__ import annotations

import collections
import math
import os
import warnings

import numpy as np

# (row key, label, format) in table order.
METRICS = (
    ("heldout_pass_rate", "held-out pass rate", "{:.3f}"),
    ("heldout_strong_share", "strong share of passes", "{:.3f}"),
    ("heldout_len", "response length (tokens)", "{:.2f}"),
    ("entropy", "policy entropy (nats/token)", "{:.3f}"),
    ("strong_credit_share", "strong passes' share of + credit", "{:.3f}"),
    ("pos_credit_after", "positive credit", "{:.2f}"),
    ("neg_credit", "negative credit", "{:.2f}"),
    ("net_credit", "net credit", "{:.2f}"),
    ("lam_mean", "mean lambda", "{:.3f}"),
    ("capped_groups", "capped groups / step", "{:.2f}"),
)
MODE_COLORS = {"binary": "tab:gray", "downweight_only": "tab:red", "sum_preserving": "tab:blue"}


def by_mode(runs: dict) -> dict:
    """mode -> list of per-seed row lists (seed order as given)."""
    out = collections.OrderedDict()
    for name, rows in runs.items():
        out.setdefault(name.split("/")[0], []).append(rows)
    return out


def series(rows: list, key: str) -> np.ndarray:
    """Per-step values of `key` (net_credit derived); NaN where a step has none."""
    def one(r):
        if key == "net_credit":
            return r.get("pos_credit_after", math.nan) + r.get("neg_credit", math.nan)
        v = r.get(key, math.nan)
        return math.nan if v is None else float(v)
    return np.array([one(r) for r in rows], np.float64)


def window(values: np.ndarray, start: bool, width: int) -> float:
    """Step 0's value, or the mean of the last `width` finite values."""
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return math.nan
    return float(finite[0] if start else np.mean(finite[-width:]))


def markdown_table(runs: dict, width: int = 5) -> str:
    """Mean +- sample std across seeds at step 0 and over the last `width` steps, per mode."""
    modes = by_mode(runs)
    head = "| metric | mode | step 0 | final (last %d steps) | change |" % width
    lines = [head, "|---|---|---|---|---|"]
    for key, label, fmt in METRICS:
        for mode, seeds in modes.items():
            cells = []
            vals = {}
            for start in (True, False):
                v = np.array([window(series(rows, key), start, width) for rows in seeds])
                vals[start] = v
                cells.append(_pm(v, fmt))
            cells.append(_pm(vals[False] - vals[True], "{:+" + fmt[2:]))
            lines.append(f"| {label} | {mode} | " + " | ".join(cells) + " |")
    n = len(next(iter(modes.values())))
    lines.append("")
    lines.append(f"Mean ± sample standard deviation across {n} seeds.")
    return "\n".join(lines) + "\n"


def paired_table(runs: dict, *, baseline: str = "binary", first: int = 1, last: int = 10,
                 keys=("heldout_strong_share", "strong_credit_share", "heldout_pass_rate",
                       "entropy", "heldout_len")) -> str:
    """Per-seed differences to `baseline` (same seed: same tasks and sampling keys at step 0),
    averaged over steps first..last, as mean ± sample std across seeds."""
    modes = by_mode(runs)
    labels = {k: (label, fmt) for k, label, fmt in METRICS}
    lines = [f"| metric | mode − {baseline}, steps {first}–{last} |", "|---|---|"]
    base = modes[baseline]
    for key in keys:
        label, fmt = labels[key]
        for mode, seeds in modes.items():
            if mode == baseline:
                continue
            diffs = np.array([np.nanmean(series(r, key)[first:last + 1])
                              - np.nanmean(series(b, key)[first:last + 1])
                              for r, b in zip(seeds, base)])
            lines.append(f"| {label} | {mode}: {_pm(diffs, '{:+' + fmt[2:])} |")
    return "\n".join(lines) + "\n"


def _pm(v: np.ndarray, fmt: str) -> str:
    v = v[np.isfinite(v)]
    if v.size == 0:
        return "n/a"
    sd = float(np.std(v, ddof=1)) if v.size > 1 else 0.0
    return f"{fmt.format(float(np.mean(v)))} ± {fmt.format(sd).lstrip('+')}"


def plot(runs: dict, out_dir: str) -> list:
    """Two PNGs (outcomes, credit), one line per mode (seed mean) and the seeds' min-max band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = {"outcomes.png": METRICS[:4], "credit.png": METRICS[4:]}  # 4 + 6 panels
    paths = []
    for name, metrics in panels.items():
        fig, axes = plt.subplots(1, len(metrics), figsize=(3.6 * len(metrics), 3.0), dpi=80)
        for ax, (key, label, _) in zip(np.atleast_1d(axes), metrics):
            for mode, seeds in by_mode(runs).items():
                ys = np.stack([series(rows, key) for rows in seeds])
                x = np.arange(ys.shape[1])
                with warnings.catch_warnings():   # all-NaN steps (nothing trained) stay NaN
                    warnings.simplefilter("ignore", RuntimeWarning)
                    mean = np.nanmean(ys, axis=0)
                    lo, hi = np.nanmin(ys, axis=0), np.nanmax(ys, axis=0)
                color = MODE_COLORS.get(mode)
                ax.plot(x, mean, color=color, label=mode, lw=1.6)
                ax.fill_between(x, lo, hi, color=color, alpha=0.18, lw=0)
            ax.set_title(label, fontsize=10)
            ax.set_xlabel("RL step")
            ax.grid(alpha=0.3)
        np.atleast_1d(axes)[0].legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths

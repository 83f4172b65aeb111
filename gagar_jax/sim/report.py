"""Tables, plots and the pre-registered criteria of a miniature sweep (`scripts/miniature.py`).

`runs` maps "arm/seed" to the per-step rows of `experiment.run_loop`. `write_all(runs, out)`
writes `out/table.md`, `out/steps.csv`, `out/curves.png` and `out/criteria.md` (the outcome
against the criteria committed in docs/miniature.md before the sweep ran).
"""
from __future__ import annotations

import collections
import csv
import math
import os
import warnings
from collections.abc import Callable, Iterable

import numpy as np

# (row key, label, format): what table.md and steps.csv report.
METRICS = (
    ("train_entropy", "entropy, own samples (nats/token)", "{:.3f}"),
    ("train_entropy_note", "  note tokens", "{:.3f}"),
    ("train_entropy_action", "  action tokens", "{:.3f}"),
    ("probe_entropy", "entropy, teacher-forced probe set", "{:.3f}"),
    ("train_mean_generated", "mean length (generated tokens)", "{:.1f}"),
    ("train_p90_generated", "p90 length", "{:.1f}"),
    ("train_mean_turns", "turns", "{:.2f}"),
    ("train_timeout_rate", "timeout rate", "{:.3f}"),
    ("train_note_share", "note share of generated tokens", "{:.3f}"),
    ("train_pass_rate", "pass rate (own samples)", "{:.3f}"),
    ("heldout_pass_rate", "held-out pass rate", "{:.3f}"),
    ("heldout_strong_share", "held-out strong share", "{:.3f}"),
    ("net_credit_per_seq", "net credit per sequence", "{:.4f}"),
    ("net_credit_tokens", "net credit, token-weighted (sum A L)", "{:.1f}"),
    ("fbar", "mean pass factor f_bar", "{:.3f}"),
    ("cap_rate", "lambda-cap rate (capped / mixed)", "{:.3f}"),
    ("kl_ref", "KL to warm start (k3, per token)", "{:.4f}"),
    ("clip_frac_low", "clip fraction (low)", "{:.4f}"),
    ("clip_frac_high", "clip fraction (high)", "{:.4f}"),
)
ARM_COLORS = {"binary": "tab:gray", "downweight_only": "tab:red", "sum_preserving": "tab:blue",
              "control": "tab:orange", "length_aware": "tab:green"}
WINDOW = 10          # "the last 10 steps"


def by_arm(runs: dict) -> dict:
    """arm -> {seed: rows}."""
    out = collections.OrderedDict()
    for name, rows in runs.items():
        arm, seed = name.split("/")
        out.setdefault(arm, {})[int(seed)] = rows
    return out


def series(rows: list, key: str) -> np.ndarray:
    """Per-step values of `key`; NaN where a step has none."""
    out = []
    for r in rows:
        v = r.get(key)
        out.append(math.nan if v is None or isinstance(v, dict) else float(v))
    return np.array(out, np.float64)


def last_window(rows: list, key: str, width: int = WINDOW) -> float:
    """Mean of `key` over the last `width` RL steps: the rows of steps S-width .. S-1, where S,
    the last row's step, is the run's step count (NaN-skipping).

    Row S is the final evaluation, after the last update; it is left out so that every metric
    averages the same `width` rows (held-out metrics and the KL: the evaluations those rows
    hold, e.g. steps 30 and 35 of a 40-step run). Round two's first report included row S, so
    its held-out and KL windows spanned 11 rows.
    """
    end = rows[-1]["step"]
    v = np.array([series([r], key)[0] for r in rows if end - width <= r["step"] < end])
    v = v[np.isfinite(v)]
    return float(v.mean()) if v.size else math.nan


def t_ci(x: Iterable[float]) -> tuple:
    """(mean, lower, upper) of the two-sided 95% t interval of the mean of `x`."""
    from scipy import stats
    x = np.asarray([v for v in x if np.isfinite(v)], np.float64)
    if x.size < 2:
        return (float(x.mean()) if x.size else math.nan, math.nan, math.nan)
    h = stats.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size)
    return float(x.mean()), float(x.mean() - h), float(x.mean() + h)


def _paired(arms: dict, a: str, b: str, key: str, fn: Callable[[list, str], float]) -> dict:
    seeds = sorted(set(arms.get(a, {})) & set(arms.get(b, {})))
    return {s: fn(arms[a][s], key) - fn(arms[b][s], key) for s in seeds}


def criteria(runs: dict) -> list:
    """The pre-registered checks (docs/miniature.md): list of (name, passed, evidence)."""
    arms = by_arm(runs)
    out = []
    step0 = lambda rows, key: series(rows, key)[0]
    for arm in ("downweight_only", "control"):
        if arm not in arms or "sum_preserving" not in arms:
            out.append((f"{arm}: runs present", False, "missing runs"))
            continue
        seeds = sorted(set(arms[arm]) & set(arms["sum_preserving"]))
        e_last = np.array([last_window(arms[arm][s], "train_entropy") for s in seeds])
        e0 = np.array([step0(arms[arm][s], "train_entropy") for s in seeds])
        out.append((f"{arm}: entropy (last {WINDOW} steps) >= 1.5x step 0",
                    bool(e_last.mean() >= 1.5 * e0.mean()),
                    f"{e_last.mean():.3f} vs 1.5 x {e0.mean():.3f} = {1.5 * e0.mean():.3f}"))
        d = _paired(arms, arm, "sum_preserving", "train_entropy", last_window)
        m, lo, hi = t_ci(list(d.values()))
        pos = sum(v > 0 for v in d.values())
        need = math.ceil(5 / 6 * len(d))
        out.append((f"{arm}: entropy - sum_preserving >= 0.15, 95% CI > 0, same sign in "
                    f">= 5/6 seeds", bool(m >= 0.15 and lo > 0 and pos >= need),
                    f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}], {pos}/{len(d)} seeds > 0"))
        la = np.mean([last_window(arms[arm][s], "train_mean_generated") for s in seeds])
        lb = np.mean([last_window(arms["sum_preserving"][s], "train_mean_generated")
                      for s in seeds])
        out.append((f"{arm}: mean length >= 1.3x sum_preserving's", bool(la >= 1.3 * lb),
                    f"{la:.1f} vs 1.3 x {lb:.1f} = {1.3 * lb:.1f}"))
    if "sum_preserving" in arms and "binary" in arms:
        d = _paired(arms, "sum_preserving", "binary", "train_entropy", last_window)
        m, lo, hi = t_ci(list(d.values()))
        out.append(("sum_preserving: entropy within +-0.05 of binary", bool(abs(m) <= 0.05),
                    f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]"))
        d = _paired(arms, "sum_preserving", "binary", "heldout_strong_share", last_window)
        m, lo, hi = t_ci(list(d.values()))
        out.append(("sum_preserving: held-out strong share - binary >= 0.05", bool(m >= 0.05),
                    f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]"))
    return out


# Paired contrasts that separate the two things criteria 2 and 3e mix (not pre-registered):
# (a, b, key, what a - b isolates).
CONTRASTS = (
    ("control", "binary", "train_entropy", "net-negative credit alone (no quality signal in "
     "either arm)"),
    ("downweight_only", "sum_preserving", "heldout_strong_share", "the rescale, at equal "
     "quality signal"),
    ("control", "binary", "heldout_strong_share", "net-negative credit alone"),
)


def contrasts(runs: dict) -> list:
    """(a - b, key, mean, lo, hi, seeds, what it isolates) for `CONTRASTS` present in runs."""
    arms = by_arm(runs)
    out = []
    for a, b, key, what in CONTRASTS:
        if a in arms and b in arms:
            d = _paired(arms, a, b, key, last_window)
            out.append((f"{a} - {b}", key, *t_ci(list(d.values())), len(d), what))
    return out


def criteria_markdown(runs: dict) -> str:
    arms = by_arm(runs)
    lines = ["| criterion | met | evidence (mean over seeds; paired 95% t-CI) |", "|---|---|---|"]
    lines += [f"| {n} | {'yes' if ok else 'no'} | {ev} |" for n, ok, ev in criteria(runs)]
    counts = ", ".join(f"{a}: {len(s)} seeds" for a, s in arms.items())
    text = "\n".join(lines) + f"\n\nRuns: {counts}.\n"
    rows = contrasts(runs)
    if rows:
        text += ("\nContrasts (not pre-registered; last 10 steps, paired 95% t-CI):\n\n"
                 "| contrast | metric | mean [CI] | seeds | isolates |\n|---|---|---|---|---|\n")
        text += "".join(f"| {c} | {k} | {m:+.4f} [{lo:+.4f}, {hi:+.4f}] | {n} | {w} |\n"
                        for c, k, m, lo, hi, n, w in rows)
    return text


def markdown_table(runs: dict) -> str:
    """Per arm: step 0 and the last-10-steps mean of every metric, mean and 95% t-CI."""
    arms = by_arm(runs)
    lines = ["| metric | arm | step 0 | last 10 steps | final row | vs sum_preserving (paired) |",
             "|---|---|---|---|---|---|"]
    for key, label, fmt in METRICS:
        for arm, seeds in arms.items():
            first = [series(r, key)[0] for r in seeds.values()]
            last = [last_window(r, key) for r in seeds.values()]
            final = [series(r, key)[-1] for r in seeds.values()]
            cell = lambda x, fmt=fmt: _ci(t_ci(x), fmt)
            diff = ""
            if arm != "sum_preserving" and "sum_preserving" in arms:
                diff = cell(list(_paired(arms, arm, "sum_preserving", key, last_window).values()))
            lines.append(f"| {label} | {arm} | {cell(first)} | {cell(last)} | {cell(final)} "
                         f"| {diff} |")
    return "\n".join(lines) + (
        "\n\nMean over seeds [95% t-interval]; n/a = not measured. \"last 10 steps\" = the rows "
        "of steps S-10 .. S-1 (S = the run's steps; held-out metrics and the KL: the evaluations "
        "among them); \"final row\" = row S, the evaluation after the last update (held-out, "
        "KL and probe metrics only).\n")


def _ci(t: tuple[float, float, float], fmt: str) -> str:
    m, lo, hi = t
    if not np.isfinite(m):
        return "n/a"
    if not np.isfinite(lo):
        return fmt.format(m)
    return f"{fmt.format(m)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def write_csv(runs: dict, path: str) -> None:
    keys = [k for k, _, _ in METRICS] + ["entropy", "approx_kl", "lam_mean", "mixed_groups"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "seed", "step"] + keys)
        for arm, seeds in by_arm(runs).items():
            for seed, rows in seeds.items():
                for r in rows:
                    w.writerow([arm, seed, r["step"]] + [
                        "" if r.get(k) is None or isinstance(r.get(k), dict)
                        else f"{float(r[k]):.4g}" for k in keys])


PANELS = (("train_entropy", "entropy, own samples"), ("train_entropy_note", "note-token entropy"),
          ("train_mean_generated", "mean length (tokens)"), ("train_timeout_rate", "timeout rate"),
          ("net_credit_per_seq", "net credit per sequence"),
          ("heldout_strong_share", "held-out strong share"))
# Round four's B-long: entropy, credit per trajectory and per token, length, the factors.
LONG_PANELS = (("train_entropy", "entropy, own samples"),
               ("train_entropy_note", "note-token entropy"),
               ("train_mean_generated", "mean length (tokens)"),
               ("net_credit_per_traj", "net credit per trajectory"),
               ("token_net_frac", "net credit per token (token_net_frac)"),
               ("fbar", "mean pass factor f_bar"))


def plot(runs: dict, out_dir: str, panels: tuple = PANELS) -> list:
    """curves.png: per arm the mean over seeds (line) and the seed range (band), one panel per
    (row key, title) of `panels` (six)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    arms = by_arm(runs)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, title) in zip(axes.flat, panels, strict=False):
        for arm, seeds in arms.items():
            ys = np.stack([series(r, key) for r in seeds.values()])
            x = np.arange(ys.shape[1])
            ok = np.isfinite(ys).any(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                mean, lo, hi = np.nanmean(ys, 0), np.nanmin(ys, 0), np.nanmax(ys, 0)
            c = ARM_COLORS.get(arm)
            ax.plot(x[ok], mean[ok], color=c, label=arm, marker="." if ok.sum() < 15 else None)
            ax.fill_between(x[ok], lo[ok], hi[ok], color=c, alpha=0.15)
        ax.set_title(title)
        ax.set_xlabel("RL step")
    axes.flat[0].legend()
    fig.tight_layout()
    path = os.path.join(out_dir, "curves.png")
    fig.savefig(path, dpi=64)
    plt.close(fig)
    return [path]


def write_all(runs: dict, out: str, with_criteria: bool = True, panels: tuple = PANELS) -> str:
    """table.md, steps.csv, curves.png (`panels`) and (`with_criteria`: round two's)
    criteria.md."""
    os.makedirs(out, exist_ok=True)
    table, crit = markdown_table(runs), criteria_markdown(runs) if with_criteria else ""
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table)
    if with_criteria:
        with open(os.path.join(out, "criteria.md"), "w") as f:
            f.write(crit)
    write_csv(runs, os.path.join(out, "steps.csv"))
    plot(runs, out, panels)
    return table + "\n" + crit


def criteria_b(topp: dict, exact: dict) -> list:
    """Round three's Design B checks (docs/miniature.md): `topp` and `exact` are the runs of the
    top-p sweep and of the pair without top-p; list of (name, met, evidence). A check whose runs
    are missing is reported as not met with the evidence "missing runs"."""
    key = "train_entropy_note"
    t, e = by_arm(topp), by_arm(exact)
    out = []
    if {"downweight_only", "sum_preserving"} <= set(t):
        d = _paired(t, "downweight_only", "sum_preserving", key, last_window)
        m, lo, hi = t_ci(list(d.values()))
        out.append(("B1 top-p: downweight_only - sum_preserving note entropy >= +0.05, CI > 0",
                    bool(m >= 0.05 and lo > 0), f"{m:+.4f} [{lo:+.4f}, {hi:+.4f}], {len(d)} seeds"))
    else:
        out.append(("B1 top-p: downweight_only - sum_preserving", False, "missing runs"))
    if {"downweight_only", "sum_preserving"} <= set(e):
        d = _paired(e, "downweight_only", "sum_preserving", key, last_window)
        m = float(np.mean(list(d.values())))
        out.append(("B2 no top-p: |downweight_only - sum_preserving| note entropy <= 0.02",
                    bool(abs(m) <= 0.02), f"{m:+.4f}, {len(d)} seed(s)"))
    else:
        out.append(("B2 no top-p: downweight_only - sum_preserving", False, "missing runs"))
    if {"downweight_only", "sum_preserving", "control"} <= set(t):
        dc = _paired(t, "control", "sum_preserving", key, last_window)
        dd = _paired(t, "downweight_only", "sum_preserving", key, last_window)
        mc, lo, hi = t_ci(list(dc.values()))
        md = float(np.mean(list(dd.values())))
        out.append(("B3 top-p: control - sum_preserving note entropy >= +0.05 and within half of "
                    "downweight_only's", bool(mc >= 0.05 and abs(mc - md) <= 0.5 * abs(md)),
                    f"{mc:+.4f} [{lo:+.4f}, {hi:+.4f}] vs downweight_only {md:+.4f}"))
    else:
        out.append(("B3 top-p: control - sum_preserving", False, "missing runs"))
    return out


def _window_change(rows: list, key: str) -> float:
    """`key` over the last-10-steps window minus its step-0 value."""
    return last_window(rows, key) - series(rows, key)[0]


def _credit_equal(rows: list, tol: float = 1e-3) -> bool:
    """Whether the token-weighted credit equals the outcome advantages' at every trained step
    (INV-1W), within `tol` relative to the outcome credit's size (at least 1)."""
    a, b = series(rows, "token_net_credit"), series(rows, "token_outcome_credit")
    ok = np.isfinite(a) & np.isfinite(b)
    return bool(ok.any() and np.all(np.abs(a[ok] - b[ok]) <= tol * np.maximum(1, np.abs(b[ok]))))


def criteria_long(topp: dict, exact: dict) -> list:
    """Round four's B-long predictions L1-L5 (docs/miniature.md, pre-registered): `topp` and
    `exact` are the runs with top-p 0.9 and untruncated. List of (name, verdict, evidence),
    verdict "yes", "no", "not tested" (L3, when its net-credit condition does not hold) or
    "missing runs"."""
    e, dw, sp, la = "train_entropy_note", "downweight_only", "sum_preserving", "length_aware"
    t, x = by_arm(topp), by_arm(exact)
    yes = lambda ok: "yes" if ok else "no"
    ci = lambda m, lo, hi: f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]"
    out = []
    have = {dw, sp} <= set(t)
    if have:
        d = _paired(t, dw, sp, e, last_window)
        m, lo, hi = t_ci(d.values())
        out.append(("L1 top-p: downweight_only - sum_preserving E_note >= +0.3, CI above 0",
                    yes(m >= 0.3 and lo > 0), f"{ci(m, lo, hi)}, {len(d)} seeds"))
    if {dw, sp} <= set(x):
        d = _paired(x, dw, sp, e, last_window)
        m, lo, hi = t_ci(d.values())
        out.append(("L2 untruncated: downweight_only - sum_preserving E_note <= +0.05",
                    yes(m <= 0.05), f"{ci(m, lo, hi)}, {len(d)} seeds"))
    if have:
        rise = np.mean([_window_change(r, e) for r in t[dw].values()])
        rise_sp = np.mean([_window_change(r, e) for r in t[sp].values()])
        net = np.mean([last_window(r, "net_credit_per_traj") for r in t[dw].values()])
        verdict = ("not tested" if not net <= -0.05
                   else yes(rise >= 0.1 and rise_sp < 0.1))
        out.append(("L3 top-p: downweight_only E_note window - step 0 >= +0.1 with net credit "
                    "<= -0.05; sum_preserving's < +0.1", verdict,
                    f"downweight_only {rise:+.3f}, sum_preserving {rise_sp:+.3f}; net credit "
                    f"per trajectory over the window {net:+.4f}"))
        ev, ok = [], True
        for key in ("train_mean_generated", "train_mean_turns"):
            m, lo, hi = t_ci(_paired(t, dw, sp, key, last_window).values())
            ok &= bool(m > 0 and lo > 0)
            ev.append(f"{key} {ci(m, lo, hi)}")
        out.append(("L4 top-p: downweight_only - sum_preserving length (tokens and turns) > 0, "
                    "CI above 0", yes(ok), "; ".join(ev)))
    if {la, sp} <= set(t):
        inv = all(_credit_equal(r) for r in t[la].values())
        sp_differs = any(not _credit_equal(r) for r in t[sp].values())
        m, lo, hi = t_ci(_paired(t, la, sp, e, last_window).values())
        final = lambda rows, key: series(rows, key)[-1]
        p = np.mean(list(_paired(t, la, sp, "heldout_true_pass_rate", final).values()))
        out.append(("L5 length_aware: token credit = outcome credit every step (sum_preserving's "
                    "differs); E_note - sum_preserving in [-0.05, +0.1]; held-out true pass rate "
                    "at the last step within +-0.05", yes(inv and sp_differs and -0.05 <= m <= 0.1
                                                          and abs(p) <= 0.05),
                    f"INV-1W {'holds' if inv else 'broken'}, sum_preserving "
                    f"{'differs' if sp_differs else 'equal'}; E_note {ci(m, lo, hi)}; "
                    f"pass rate {p:+.3f}"))
    if not out:
        out.append(("L1-L5", "missing runs", "no pair of arms present"))
    return out

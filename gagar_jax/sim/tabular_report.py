"""Design A's report: per-step CSV, summary table, paired contrasts, criteria and plots.

`results` maps an optimizer name to `tabular.run`'s output. `write_all(results, out, cfg)`
writes `out/steps.csv.gz` (every optimizer, sampler, arm, seed and step), `out/table.md`,
`out/criteria.md` (the checks pre-registered in docs/miniature.md, round three) and the plots
`entropy.png`, `net_credit.png`, `is_weights.png`. `load_steps` reads the CSV back, so the
report can be rebuilt from the committed file alone (`scripts/miniature_tabular.py --report`).
"""
from __future__ import annotations

import csv
import gzip
import io
import os

import numpy as np

from gagar_jax.sim import report
from gagar_jax.sim.tabular import ARM_NAMES, SAMPLERS

COLUMNS = ("entropy_filler", "entropy_answer", "top_filler", "unproposed_filler",
           "unproposed_answer", "nucleus_filler", "log_is_seq", "is_token_filler",
           "is_token_answer", "unsampled_gain_filler", "pass_rate", "pass_prob", "strong_share",
           "mixed_groups", "fbar", "net_credit_per_seq", "lam_mean", "cap_rate", "grad_norm")
WINDOW = 10
COLORS = {"binary": "tab:gray", "sum_preserving": "tab:blue", "sum_preserving_cap": "tab:cyan",
          "downweight_only": "tab:red", "control": "tab:orange"}


def to_table(results: dict) -> dict:
    """(optimizer, sampler, arm) -> {seed: {column: f64[steps]}}, plus the final entropies as
    the columns' row `steps` (the policy after the last update) under "final_*"."""
    out = {}
    for opt, res in results.items():
        idx, m = res["index"], res["metrics"]
        for r in range(idx["arm"].size):
            key = (opt, SAMPLERS[idx["sampler"][r]], ARM_NAMES[idx["arm"][r]])
            row = {c: np.asarray(m[c][r], np.float64) for c in COLUMNS}
            row["final_entropy_filler"] = float(res["final_entropy_filler"][r])
            row["final_entropy_answer"] = float(res["final_entropy_answer"][r])
            out.setdefault(key, {})[int(idx["seed"][r])] = row
    return out


def write_csv(table: dict, path: str) -> None:
    """steps.csv.gz: one row per (optimizer, sampler, arm, seed, step); step = S holds the final
    policy's entropies only."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["optimizer", "sampler", "arm", "seed", "step"] + list(COLUMNS))
    for (opt, smp, arm), seeds in sorted(table.items()):
        for seed, row in sorted(seeds.items()):
            S = row[COLUMNS[0]].size
            for t in range(S):
                w.writerow([opt, smp, arm, seed, t] + [f"{row[c][t]:.5g}" for c in COLUMNS])
            w.writerow([opt, smp, arm, seed, S, f"{row['final_entropy_filler']:.5g}",
                        f"{row['final_entropy_answer']:.5g}"] + [""] * (len(COLUMNS) - 2))
    # mtime 0: the same runs give the same bytes
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(buf.getvalue().encode())


def load_steps(path: str) -> dict:
    """The table `to_table` builds, read back from steps.csv.gz."""
    rows: dict = {}
    with gzip.open(path, "rt", newline="") as f:
        for r in csv.DictReader(f):
            key = (r["optimizer"], r["sampler"], r["arm"])
            rows.setdefault(key, {}).setdefault(int(r["seed"]), []).append(r)
    out = {}
    for key, seeds in rows.items():
        for seed, rs in seeds.items():
            body, final = rs[:-1], rs[-1]
            row = {c: np.array([float(x[c]) for x in body]) for c in COLUMNS}
            row["final_entropy_filler"] = float(final["entropy_filler"])
            row["final_entropy_answer"] = float(final["entropy_answer"])
            out.setdefault(key, {})[seed] = row
    return out


def window(row: dict, col: str) -> float:
    """Mean over the last `WINDOW` steps (the policies that sampled steps S-10 .. S-1)."""
    return float(np.mean(row[col][-WINDOW:]))


def paired(table: dict, opt: str, smp: str, a: str, b: str, col: str) -> dict:
    A, B = table.get((opt, smp, a), {}), table.get((opt, smp, b), {})
    return {s: window(A[s], col) - window(B[s], col) for s in sorted(set(A) & set(B))}


def _fmt(t: tuple) -> str:
    m, lo, hi = t
    return f"{m:+.4f} [{lo:+.4f}, {hi:+.4f}]" if np.isfinite(lo) else f"{m:+.4f}"


def markdown_table(table: dict) -> str:
    """Per optimizer x sampler x arm: step 0, last-10 mean and change of the key metrics."""
    cols = (("entropy_filler", "filler entropy"), ("entropy_answer", "answer entropy"),
            ("unproposed_filler", "filler mass outside nucleus"),
            ("pass_prob", "pass prob."), ("strong_share", "strong share"),
            ("net_credit_per_seq", "net credit / seq"), ("fbar", "f_bar"),
            ("cap_rate", "cap rate"))
    head = "| optimizer | sampler | arm | " + " | ".join(
        f"{lab} (step 0 -> last {WINDOW})" for _, lab in cols) + " | filler entropy, final |"
    lines = [head, "|" + "---|" * (len(cols) + 4)]
    for (opt, smp, arm), seeds in sorted(table.items()):
        cells = []
        for c, _ in cols:
            first = np.mean([r[c][0] for r in seeds.values()])
            last = np.mean([window(r, c) for r in seeds.values()])
            cells.append(f"{first:.4f} -> {last:.4f}")
        fin = np.mean([r["final_entropy_filler"] for r in seeds.values()])
        lines.append(f"| {opt} | {smp} | {arm} | " + " | ".join(cells) + f" | {fin:.4f} |")
    lines += ["", f"Means over {len(next(iter(table.values())))} seeds. Filler entropy: mean "
              "over the filler positions of the exact entropy of the policy's row (nats)."]
    lines += ["", "Paired differences to sum_preserving (cap off), last 10 steps, 95% t-CI:", "",
              "| optimizer | sampler | arm | filler entropy | answer entropy | seeds > 0 "
              "(filler) |", "|---|---|---|---|---|---|"]
    for opt in sorted({k[0] for k in table}):
        for smp in SAMPLERS:
            for arm in ARM_NAMES:
                if arm == "sum_preserving" or (opt, smp, arm) not in table:
                    continue
                d = paired(table, opt, smp, arm, "sum_preserving", "entropy_filler")
                e = paired(table, opt, smp, arm, "sum_preserving", "entropy_answer")
                pos = sum(v > 0 for v in d.values())
                lines.append(f"| {opt} | {smp} | {arm} | {_fmt(report.t_ci(d.values()))} | "
                             f"{_fmt(report.t_ci(e.values()))} | {pos}/{len(d)} |")
    return "\n".join(lines) + "\n"


def criteria(table: dict) -> list:
    """The checks pre-registered for Design A: list of (name, met, evidence)."""
    out = []
    opts = sorted({k[0] for k in table})
    for opt in opts:
        for arm in ("binary", "sum_preserving", "sum_preserving_cap"):
            rows = table[(opt, "top_p", arm)].values()
            dh = np.mean([window(r, "entropy_filler") - r["entropy_filler"][0] for r in rows])
            out.append((f"A1 {opt}: {arm} filler entropy flat under top-p (|change| <= 0.01)",
                        bool(abs(dh) <= 0.01), f"{dh:+.4f}"))
        for arm in ("downweight_only", "control"):
            d = paired(table, opt, "top_p", arm, "sum_preserving", "entropy_filler")
            m, lo, hi = report.t_ci(d.values())
            pos = sum(v > 0 for v in d.values())
            out.append((f"A2 {opt}: top-p {arm} - sum_preserving filler entropy >= +0.1, CI > 0, "
                        "every seed > 0", bool(m >= 0.1 and lo > 0 and pos == len(d)),
                        f"{_fmt((m, lo, hi))}, {pos}/{len(d)} seeds > 0"))
        d = paired(table, opt, "exact", "downweight_only", "sum_preserving", "entropy_filler")
        m, lo, hi = report.t_ci(d.values())
        tag = "A3" if opt == "sgd" else "A4 (second channel if not met)"
        out.append((f"{tag} {opt}: exact downweight_only - sum_preserving filler entropy within "
                    "+-0.02", bool(abs(m) <= 0.02), _fmt((m, lo, hi))))
        dw = paired(table, opt, "top_p", "downweight_only", "sum_preserving", "entropy_filler")
        dc = paired(table, opt, "top_p", "control", "downweight_only", "entropy_filler")
        mdw, mc = np.mean(list(dw.values())), np.mean(list(dc.values()))
        out.append((f"A5 {opt}: top-p control matches downweight_only (|control - dw| <= 0.25 x "
                    "(dw - sp))", bool(abs(mc) <= 0.25 * abs(mdw)),
                    f"control - dw {_fmt(report.t_ci(dc.values()))} vs dw - sp {mdw:+.4f}"))
        d = paired(table, opt, "top_p", "sum_preserving_cap", "sum_preserving", "entropy_filler")
        m, lo, hi = report.t_ci(d.values())
        out.append((f"A6 {opt}: top-p sum_preserving cap 1.5 - cap off filler entropy within "
                    "+-0.01", bool(abs(m) <= 0.01), _fmt((m, lo, hi))))
    return out


def criteria_markdown(table: dict) -> str:
    lines = ["| criterion | met | evidence (mean over seeds [paired 95% t-CI]) |", "|---|---|---|"]
    lines += [f"| {n} | {'yes' if ok else 'no'} | {ev} |" for n, ok, ev in criteria(table)]
    return "\n".join(lines) + "\n"


def _mean_curve(seeds: dict, col: str) -> np.ndarray:
    return np.mean(np.stack([r[col] for r in seeds.values()]), 0)


def plot(table: dict, out: str) -> list:
    """entropy.png (filler and answer, per optimizer x sampler), net_credit.png, is_weights.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    opts = sorted({k[0] for k in table})
    paths = []
    fig, axes = plt.subplots(2, 2 * len(opts), figsize=(5 * 2 * len(opts), 8), squeeze=False)
    for j, (opt, smp) in enumerate((o, s) for o in opts for s in SAMPLERS):
        for i, col in enumerate(("entropy_filler", "entropy_answer")):
            ax = axes[i, j]
            for arm in ARM_NAMES:
                if (opt, smp, arm) in table:
                    seeds = table[(opt, smp, arm)]
                    ys = np.stack([r[col] for r in seeds.values()])
                    x = np.arange(ys.shape[1])
                    ax.plot(x, ys.mean(0), color=COLORS[arm], label=arm)
                    ax.fill_between(x, ys.min(0), ys.max(0), color=COLORS[arm], alpha=0.15)
            ax.set_title(f"{opt}, {smp}: {col.replace('_', ' ')}")
            ax.set_xlabel("step")
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out, "entropy.png"))
    fig.savefig(paths[-1], dpi=60)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2 * len(opts), figsize=(5 * 2 * len(opts), 4), squeeze=False)
    for j, (opt, smp) in enumerate((o, s) for o in opts for s in SAMPLERS):
        ax = axes[0, j]
        for arm in ARM_NAMES:
            if (opt, smp, arm) in table:
                ax.plot(_mean_curve(table[(opt, smp, arm)], "net_credit_per_seq"),
                        color=COLORS[arm], label=arm)
        ax.set_title(f"{opt}, {smp}: net credit per trajectory")
        ax.set_xlabel("step")
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out, "net_credit.png"))
    fig.savefig(paths[-1], dpi=60)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for opt, ls in zip(opts, ("-", "--"), strict=False):
        for arm in ARM_NAMES:
            if (opt, "top_p", arm) in table:
                seeds = table[(opt, "top_p", arm)]
                axes[0].plot(np.exp(_mean_curve(seeds, "log_is_seq")), color=COLORS[arm], ls=ls,
                             label=f"{arm} ({opt})")
                w = np.concatenate([np.concatenate([r["is_token_filler"], r["is_token_answer"]])
                                    for r in seeds.values()])
                axes[1].hist(w, bins=40, histtype="step", color=COLORS[arm], ls=ls,
                             label=f"{arm} ({opt})")
    axes[0].set_title("top-p: sequence IS weight pi/q (every sequence of a step)")
    axes[0].set_xlabel("step")
    axes[1].set_title("top-p: per-token IS weight pi/q (filler mean, answer; all steps)")
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    paths.append(os.path.join(out, "is_weights.png"))
    fig.savefig(paths[-1], dpi=60)
    plt.close(fig)
    return paths


def write_all(table: dict, out: str, *, csv_too: bool = True, plots: bool = True) -> str:
    """OUT's steps.csv.gz (with `csv_too`), table.md, criteria.md and (with `plots`) the PNGs;
    returns the table and criteria text."""
    os.makedirs(out, exist_ok=True)
    if csv_too:
        write_csv(table, os.path.join(out, "steps.csv.gz"))
    text, crit = markdown_table(table), criteria_markdown(table)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "criteria.md"), "w") as f:
        f.write(crit)
    if plots:
        plot(table, out)
    return text + "\n" + crit

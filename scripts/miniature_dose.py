"""Round four's tabular dose-response (`gagar_jax/sim/dose.py`; docs/miniature.md, round four).

    JAX_PLATFORMS=cpu python scripts/miniature_dose.py            # docs/miniature/round4/dose
    JAX_PLATFORMS=cpu python scripts/miniature_dose.py --quick --out /tmp/dose   # the suite's

Each (optimizer, parameterisation) program's effects are saved to OUT/parts/ (a rerun skips
it). Writes OUT/effects.csv (every optimizer, parameterisation, sampler, shift and seed: the
filler entropy over the last 10 steps minus binary's, paired), OUT/table.md (means, 95% t-intervals,
seeds positive, the criteria D1-D4), OUT/dose.png and OUT/meta.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(REPO, "docs", "miniature", "round4", "dose"))
    p.add_argument("--quick", action="store_true", help="DoseConfig.quick()")
    p.add_argument("--optimizers", default="adam,sgd")
    p.add_argument("--params", default="table,factor")
    return p.parse_args(argv)


def _ci(x: np.ndarray) -> tuple:
    from scipy import stats
    m = float(np.mean(x))
    if len(x) < 2:
        return m, float("nan"), float("nan")
    h = float(stats.t.ppf(0.975, len(x) - 1) * np.std(x, ddof=1) / np.sqrt(len(x)))
    return m, m - h, m + h


def criteria(eff: dict) -> list:
    """D1-D4 of the pre-registration from {(opt, param, sampler, c): f32[seeds]}: rows of
    (name, met, evidence)."""
    def mean(o, p, s, c):
        return float(np.mean(eff[(o, p, s, c)]))

    def ratio(o, p, s):
        return mean(o, p, s, -0.2) / mean(o, p, s, -0.025)
    out = []
    for p in ("table", "factor"):
        r = ratio("sgd", p, "top_p")
        ms = [mean("sgd", p, "top_p", c) for c in (-0.025, -0.05, -0.1, -0.2)]
        mono = all(a < b for a, b in zip(ms[:-1], ms[1:], strict=True))
        out.append((f"D1 SGD, top-p, {p}: effect linear in abs(c) (ratio c=-0.2 / c=-0.025 in "
                    "[6, 10], increasing)", 6 <= r <= 10 and mono, f"ratio {r:.2f}; " +
                    ", ".join(f"{m:+.4f}" for m in ms)))
        r = ratio("adam", p, "top_p")
        out.append((f"D2 Adam, top-p, {p}: nearly flat in abs(c) (ratio in [0.5, 2])",
                    0.5 <= r <= 2, f"ratio {r:.2f}; " + ", ".join(
                        f"{mean('adam', p, 'top_p', c):+.4f}" for c in (-0.025, -0.05, -0.1,
                                                                       -0.2))))
    for p in ("table", "factor"):
        x = eff[("adam", p, "exact", -0.1)]
        m, lo, hi = _ci(x)
        out.append((f"D3 Adam, exact, {p}, c=-0.1: drift > 0 (CI above 0, every seed)",
                    lo > 0 and bool(np.all(x > 0)),
                    f"{m:+.4f} [{lo:+.4f}, {hi:+.4f}], {int(np.sum(x > 0))}/{len(x)}"))
    x = eff[("sgd", "table", "exact", -0.1)]
    m, lo, hi = _ci(x)
    out.append(("D4 SGD, exact, table, c=-0.1: within +-0.002", abs(m) <= 0.002,
                f"{m:+.5f} [{lo:+.5f}, {hi:+.5f}]"))
    return out


def main(argv=None) -> int:
    a = _args(argv)
    from gagar_jax.sim import dose
    cfg = dose.DoseConfig.quick() if a.quick else dose.DoseConfig()
    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    eff, seconds, lines = {}, {}, ["optimizer,param,sampler,shift,seed,effect"]
    for o in a.optimizers.split(","):
        for p in a.params.split(","):
            part = os.path.join(a.out, "parts", f"{o}-{p}.json")   # one program: resumable
            if not os.path.exists(part):
                res = dose.run(cfg, o, p, log=lambda s: print(s, flush=True))
                done = {"seconds": res["seconds"], "effects": [
                    [s, c, x.tolist()] for (s, c), x in dose.window_effects(cfg, res).items()]}
                os.makedirs(os.path.dirname(part), exist_ok=True)
                with open(part, "w") as f:
                    json.dump(done, f)
            with open(part) as f:
                done = json.load(f)
            seconds[f"{o}/{p}"] = round(done["seconds"], 1)
            for s, c, x in done["effects"]:
                x = np.asarray(x)
                eff[(o, p, s, c)] = x
                lines += [f"{o},{p},{s},{c:g},{i},{v:.6f}" for i, v in enumerate(x)]
    with open(os.path.join(a.out, "effects.csv"), "w") as f:
        f.write("\n".join(lines) + "\n")
    md = ["| optimizer | param | sampler | " + " | ".join(f"c = {c:g}" for c in cfg.shifts)
          + " |", "|---|---|---|" + "---|" * len(cfg.shifts)]
    for (o, p, s) in sorted({k[:3] for k in eff}):
        cells = []
        for c in cfg.shifts:
            x = eff[(o, p, s, c)]
            m, lo, hi = _ci(x)
            cells.append(f"{m:+.4f} [{lo:+.4f}, {hi:+.4f}] {int(np.sum(x > 0))}/{len(x)}")
        md.append(f"| {o} | {p} | {s} | " + " | ".join(cells) + " |")
    full = {(o, p) for o, p, _, _ in eff} >= {(o, p) for o in ("adam", "sgd")
                                              for p in ("table", "factor")}
    if full:
        md += ["", "| criterion (pre-registered) | met | evidence |", "|---|---|---|"]
        md += [f"| {n} | {'yes' if ok else 'no'} | {e} |" for n, ok, e in criteria(eff)]
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write("Filler entropy over the last 10 steps, shift c minus binary, paired over seeds "
                "[95% t-CI], seeds positive\n\n" + "\n".join(md) + "\n")
    _plot(cfg, eff, os.path.join(a.out, "dose.png"))
    meta = {"command": "python scripts/miniature_dose.py " + " ".join(
        sys.argv[1:] if argv is None else argv), "config": dataclasses.asdict(cfg),
        "seconds": seconds, "wall_seconds": round(time.perf_counter() - t0, 1)}
    with open(os.path.join(a.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1, default=str)
    print("\n".join(md), flush=True)
    print(f"dose-response: {meta['wall_seconds']:.0f} s", flush=True)
    return 0


def _plot(cfg, eff: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = sorted({k[:3] for k in eff})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, o in zip(axes, ("adam", "sgd"), strict=True):
        for (oo, p, s) in keys:
            if oo != o:
                continue
            cs = np.array([-c for c in cfg.shifts])
            ms = [float(np.mean(eff[(o, p, s, c)])) for c in cfg.shifts]
            ax.plot(cs, ms, "o-" if s == "top_p" else "s--", label=f"{p}, {s}")
        ax.set_xscale("log")
        ax.set_xlabel("|c| (net credit per trajectory)")
        ax.set_ylabel("filler entropy, shift - binary (last 10 steps)")
        ax.set_title(o)
        ax.axhline(0, color="grey", lw=0.5)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

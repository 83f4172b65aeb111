"""Round three, Design A: the tabular policy (gagar_jax/sim/tabular.py; docs/miniature.md).

  JAX_PLATFORMS=cpu python scripts/miniature_tabular.py                 # the full design
  JAX_PLATFORMS=cpu python scripts/miniature_tabular.py --quick         # smoke test (seconds)
  python scripts/miniature_tabular.py --report                          # tables and plots again
  python scripts/miniature_tabular.py --report --no-plots               # tables only

Every arm x sampler x seed of one optimizer runs as one vmapped program; each optimizer's state
is saved to WORKDIR/tabular-<optimizer>.npz after every chunk of steps and a rerun resumes
there. OUT gets steps.csv.gz (every run and step), table.md, criteria.md, entropy.png,
net_credit.png, is_weights.png and meta.json; `--report` rebuilds all but meta.json from
OUT/steps.csv.gz.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(REPO, "docs", "miniature", "round3", "A"))
    p.add_argument("--workdir", default=os.path.join(REPO, "runs", "round3-A"))
    p.add_argument("--quick", action="store_true", help="TabularConfig.quick(), a temp workdir")
    p.add_argument("--report", action="store_true", help="rebuild OUT's report from its CSV")
    p.add_argument("--no-plots", action="store_true",
                   help="with --report: the tables only (no matplotlib: seconds faster)")
    p.add_argument("--optimizers", default="adam,sgd")
    p.add_argument("--seeds", type=int, default=None, help="override the config's seed count")
    p.add_argument("--steps", type=int, default=None, help="override the config's step count")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = _args(argv)
    from gagar_jax.sim import tabular, tabular_report
    if a.report:
        table = tabular_report.load_steps(os.path.join(a.out, "steps.csv.gz"))
        print(tabular_report.write_all(table, a.out, csv_too=False, plots=not a.no_plots))
        return 0
    cfg = tabular.TabularConfig.quick() if a.quick else tabular.TabularConfig()
    over = {k: v for k, v in (("seeds", a.seeds), ("steps", a.steps)) if v is not None}
    cfg = dataclasses.replace(cfg, **over)
    opts = a.optimizers.split(",")
    bad = [o for o in opts if o not in tabular.OPTIMIZERS]
    if bad:
        print(f"error: --optimizers: unknown {bad}; known: {tabular.OPTIMIZERS}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = os.path.join(tmp, "work") if a.quick else a.workdir
        results = {o: tabular.run(cfg, o, work, log=lambda s: print(s, flush=True))
                   for o in opts}
    table = tabular_report.to_table(results)
    print(tabular_report.write_all(table, a.out), flush=True)
    meta = {"command": "python scripts/miniature_tabular.py " + " ".join(sys.argv[1:] if argv
                                                                          is None else argv),
            "config": dataclasses.asdict(cfg), "step0": tabular.step0_report(cfg),
            "seconds": {o: round(r["seconds"], 1) for o, r in results.items()},
            "wall_seconds": round(time.perf_counter() - t0, 1)}
    with open(os.path.join(a.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"design A: {meta['wall_seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

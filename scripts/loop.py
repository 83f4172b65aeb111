"""The closed loop: learner + vLLM rollout worker on CPU, on the example task (docs/rollout.md).

    python scripts/loop.py --workdir runs/loop --seeds 0 1 2 --control     # = make loop

For each seed: a fresh `<workdir>/seed<S>` (and `control<S>` with learning rate 0), the learner
and the worker run until `--steps` steps; prints per step the staleness and the learner-vs-engine
log-prob mismatch, then the pass rate early (version 0, the initial policy) and late (the last
5 versions), and writes `<workdir>/summary.json`.
"""
import argparse
import json
import os
import shutil

from gagar_jax.run.loop import LoopPaths, format_version, run_loop

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="runs/loop")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--control", action="store_true", help="also run each seed with lr 0")
    args = p.parse_args()
    runs = [(f"seed{s}", s, None) for s in args.seeds]
    if args.control:
        runs += [(f"control{s}", s, 0.0) for s in args.seeds]
    results = {}
    for name, seed, lr in runs:
        wd = os.path.abspath(os.path.join(args.workdir, name))
        shutil.rmtree(wd, ignore_errors=True)
        print(f"== {name}", flush=True)
        r = results[name] = run_loop(wd, LoopPaths.of_checkout(REPO), seed=seed,
                                     steps=args.steps, learning_rate=lr,
                                     on_version=lambda v: print(format_version(v), flush=True))
        print(f"== {name}: {r['wall_s']} s, {r['groups_sampled']} groups sampled")
        print("step  staleness(mean/max)  |dlogp| learner-vs-engine (mean/max)  loss")
        for m in r["per_step"]:
            print(f"{m['step']:4d}  {m.get('feed/staleness_mean', 0):.2f}/"
                  f"{m.get('feed/staleness_max', 0):.0f}"
                  f"               {m.get('rollout/logp_abs_diff_mean', 0):.4f}/"
                  f"{m.get('rollout/logp_abs_diff_max', 0):.4f}"
                  f"                      {m.get('loss', 0):+.4f}")
        # A learning seed should rise beyond noise; the lr-0 control should stay within it.
        noise = "within noise" if r["within_noise"] else "beyond noise"
        print(f"pass rate early {r['early']:.3f} (n={r['n_early']}) -> late {r['late']:.3f} "
              f"(n={r['n_late']}): rise {r['rise']:+.3f}, {noise} (3 se = {3 * r['se']:.3f}); "
              f"doubled and rose >= 0.3: {r['doubled_and_rose']}; ledger balanced: "
              f"{r['ledger_balanced']}")
    summary = {k: {f: v[f] for f in ("seed", "learning_rate", "early", "late", "rise",
                                     "doubled_and_rose", "within_noise", "ledger_balanced",
                                     "groups_sampled", "wall_s")} for k, v in results.items()}
    os.makedirs(args.workdir, exist_ok=True)
    with open(os.path.join(args.workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

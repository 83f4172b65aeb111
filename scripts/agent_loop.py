"""The closed agent loop: learner + vLLM rollout worker in agent mode on the lookup task, on CPU
(`make agent_loop`; docs/rollout.md, "The agent loop, closed").

    python scripts/agent_loop.py --workdir runs/agent_loop --calibrate 100 101 --steps 100
    python scripts/agent_loop.py --workdir runs/agent_loop --seeds 0 1 2 --control --steps N

Each run is `gagar-loop --env gagar_jax.rollout.envs.lookup:make_env` on configs/tiny_agent.py
(`run_loop`, the library under `gagar-loop`) in a fresh `<workdir>/<name>`; a run whose
loop_report.json exists is not run again (`--only NAME` runs one: each run is one chunk of a
few minutes). `--calibrate SEEDS` runs only the learning (binary) arm on seeds of its own, to
fix the number of steps before the seeds run. Per run it prints the pass rate per version, the
trajectories that span two versions, the ledger; at the end the table and `<workdir>/summary.json`:
per seed, the rise over its frozen control = late(seed) - late(control), late = the pass rate of
the groups sampled from the last 5 versions; the criterion is a rise >= 0.2 in every seed.
"""
import argparse
import json
import os
import shutil

from gagar_jax.run.loop import LoopPaths, format_version, run_loop

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = "gagar_jax.rollout.envs.lookup"
# After gagar-loop's own worker flags, so these win: 4 tokens per turn (not the learner's
# max_response_len), and up to 48 groups per version (not 16): near the end most groups of a
# learning run are all-pass, and the learner still needs 4 mixed ones per step.
WORKER_ARGS = (f"--env={ENV}:make_env", f"--tokenizer={ENV}:tokenizer", "--max-turns=3",
               "--max-tokens=4", "--max-model-len=64", "--no-routing", "--concurrent-groups=2",
               "--max-version-lag=3", "--groups-per-version=48")
RISE = 0.2


def worker_rows(wd: str) -> list:
    path = os.path.join(wd, "rollout", "worker0.jsonl")
    return [r for r in map(json.loads, open(path)) if "group_id" in r]


def one(name: str, wd: str, seed: int, steps: int, lr: float | None,
        learner_args: tuple = ()) -> dict:
    """One loop run (or its saved report); adds the spanning trajectories to the report."""
    done = os.path.join(wd, "loop_report.json")
    if not os.path.exists(done):
        shutil.rmtree(wd, ignore_errors=True)
        print(f"== {name}", flush=True)
        run_loop(wd, LoopPaths.of_checkout(REPO, os.path.join("configs", "tiny_agent.py")),
                 seed=seed, steps=steps, learning_rate=lr, worker_args=WORKER_ARGS,
                 learner_args=learner_args,
                 timeout_s=1800, on_version=lambda v: print(format_version(v), flush=True))
    r = json.load(open(done))
    rows = worker_rows(wd)
    r["spanning"] = sum(x["spanning"] for x in rows)
    r["trajectories"] = sum(x["valid"] for x in rows)
    r["turns_per_trajectory"] = sum(x["turns"] for x in rows) / max(8 * len(rows), 1)
    return r


def line(name: str, r: dict) -> str:
    led = r["ledger"]
    return (f"{name:10s} steps {r['steps_trained']:3d}  early {r['early']:.3f} (n={r['n_early']})"
            f"  late {r['late']:.3f} (n={r['n_late']})  spanning {r['spanning']:4d} of "
            f"{r['trajectories']}  turns/traj {r['turns_per_trajectory']:.2f}  ledger "
            f"{led['received']} = {led['trained']} + {led['filtered_uniform']} + "
            f"{led['filtered_stale']} + {led['quarantined']} + {led['leftover']} "
            f"({'balanced' if r['ledger_balanced'] else 'UNBALANCED'})  {r['wall_s']} s")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="runs/agent_loop")
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--control", action="store_true", help="also each seed with lr 0")
    p.add_argument("--calibrate", type=int, nargs="*", default=None,
                   help="run only the learning arm on these seeds (the calibration)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--only", default="", help="run only this one (seed<S>, control<S>, calib<S>)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a learner config override (--config.KEY=VALUE), repeatable")
    args = p.parse_args()
    if args.calibrate is not None:
        runs = [(f"calib{s}", s, None) for s in args.calibrate]
    else:
        runs = [(f"seed{s}", s, None) for s in args.seeds]
        runs += [(f"control{s}", s, 0.0) for s in args.seeds] if args.control else []
    results, sets = {}, tuple(f"--config.{x}" for x in args.set)
    for name, seed, lr in runs:
        wd = os.path.abspath(os.path.join(args.workdir, name))
        if args.only and name != args.only:
            if os.path.exists(os.path.join(wd, "loop_report.json")):
                results[name] = one(name, wd, seed, args.steps, lr, sets)
            continue
        results[name] = r = one(name, wd, seed, args.steps, lr, sets)
        print(" ".join(f"v{v}:{x:.2f}" for v, x in r["pass_rate_by_version"].items()))
    print()
    for name, r in results.items():
        print(line(name, r))
    summary = {k: {f: v[f] for f in ("seed", "learning_rate", "steps_trained", "early", "late",
                                     "n_early", "n_late", "spanning", "trajectories",
                                     "turns_per_trajectory", "ledger_balanced", "wall_s",
                                     "pass_rate_by_version")} for k, v in results.items()}
    for s in args.seeds if args.calibrate is None else []:
        a, c = results.get(f"seed{s}"), results.get(f"control{s}")
        if a and c:
            rise = a["late"] - c["late"]
            summary[f"seed{s}"]["rise_over_control"] = rise
            ok = rise >= RISE and a["spanning"] >= 1 and a["ledger_balanced"]
            summary[f"seed{s}"]["criterion"] = ok
            print(f"seed {s}: late {a['late']:.3f} - control {c['late']:.3f} = {rise:+.3f} "
                  f"(>= {RISE}: {rise >= RISE}); spanning {a['spanning']}; ledger balanced "
                  f"{a['ledger_balanced'] and c['ledger_balanced']} -> {'PASS' if ok else 'FAIL'}")
    os.makedirs(args.workdir, exist_ok=True)
    out = "calibration.json" if args.calibrate is not None else "summary.json"
    with open(os.path.join(args.workdir, out), "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()

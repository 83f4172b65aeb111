"""The miniature study: four arms x seeds, each from a calibrated warm start; plots, tables and
the pre-registered criteria (docs/miniature.md).

  JAX_PLATFORMS=cpu python scripts/miniature.py --out docs/miniature/round2   # the sweep
  JAX_PLATFORMS=cpu python scripts/miniature.py --quick                       # smoke test
  JAX_PLATFORMS=cpu python scripts/miniature.py --quick-b   # smoke test of round three's Design B
  JAX_PLATFORMS=cpu python scripts/miniature.py --calibrate --sft-steps 2000  # warm start only
  python scripts/miniature.py --report --out docs/miniature/round2            # tables again
  JAX_PLATFORMS=cpu python scripts/miniature.py --closed-loop --workdir runs/loop   # two processes
  python scripts/miniature.py --producer --workdir W --rounds N      # the producer process alone

The sweep runs in one process through the product's feed and train step
(`gagar_jax/sim/experiment.py`). Each arm x seed run is saved to OUT/runs/<arm>-s<seed>.json
as it finishes; a rerun with the same OUT skips finished runs (and reuses the cached warm start
under --workdir). `--closed-loop` warm-starts, publishes policy version 0, then runs a producer
subprocess (sampling with the newest published weights, writing spool shards) next to a
`gagar-train` subprocess (configs/miniature.py, publishing weights every step).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(REPO, ".cache", "jax"))

CONFIG = os.path.join(REPO, "configs", "miniature.py")
_DEFAULT_OUT = os.path.join(REPO, "docs", "miniature")


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--closed-loop", action="store_true", help="two-process run (see docstring)")
    p.add_argument("--producer", action="store_true", help="run only the producer process")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: every arm, 1 seed, 2 steps, tiny shapes (the test suite's)")
    p.add_argument("--quick-b", action="store_true",
                   help="--quick with round three's Design B settings: its note language "
                        "(on the easy task), harsh factor table, top-p 0.9, 4 mini-batches")
    p.add_argument("--quick-long", action="store_true",
                   help="--quick-b with round four's B-long additions: the flaky runner, the "
                        "length_aware arm, and a check that a run cut by its deadline and "
                        "resumed gives the rows of the uninterrupted run (the suite's)")
    p.add_argument("--report", action="store_true",
                   help="rewrite tables, plots and the criteria from OUT/runs/*.json (no runs)")
    p.add_argument("--criteria-b", default="", metavar="EXACT_OUT",
                   help="with --report on Design B's top-p OUT: also write OUT/criteria_b.md "
                        "(round three's B1-B3) using the pair without top-p in EXACT_OUT")
    p.add_argument("--criteria-long", default="", metavar="EXACT_OUT",
                   help="with --report on B-long's top-p OUT: write OUT/criteria_long.md "
                        "(round four's L1-L5) using the untruncated runs in EXACT_OUT, and no "
                        "round-two criteria.md")
    p.add_argument("--workdir", default=os.path.join(REPO, "runs", "miniature"))
    p.add_argument("--out", default=os.path.join(REPO, "docs", "miniature"), help="sweep output")
    p.add_argument("--task", default="hard", choices=("hard", "easy", "easy-notes"),
                   help="hard: round two's task (TaskConfig.hard()); easy: round one's; "
                        "easy-notes: round one's with notes (Design B's smoke test)")
    p.add_argument("--factor-table", default="default",
                   help="the feed's tier/rank -> factor table: default, harsh (Design B: strong "
                        "1.0/0.8, intermediate 0.6->0.3, defective 0.1) or KEY=V,... overrides "
                        "of grading.FactorTable")
    p.add_argument("--arms", default="binary,downweight_only,sum_preserving,control")
    p.add_argument("--seeds", default="0,1,2,3,4,5")
    p.add_argument("--independent-warm", action="store_true",
                   help="one warm start per seed (warm seed = seed) instead of --warm-seed's")
    p.add_argument("--warm-mod", type=int, default=0,
                   help="with --independent-warm: seed s uses warm start s mod N (N warm starts)")
    p.add_argument("--flaky-target", type=float, default=0.0,
                   help="adaptive difficulty (sim/difficulty.py): a flaky test runner keeps the "
                        "training batches' reported pass rate near this target (0 = off)")
    p.add_argument("--max-minutes", type=float, default=0.0,
                   help="stop after about this many minutes, saving progress (exit 3); a rerun "
                        "resumes (0 = no limit)")
    p.add_argument("--steps", type=int, default=45, help="RL steps per run")
    p.add_argument("--groups", type=int, default=16, help="groups (tasks) per step / round")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--eval-tasks", type=int, default=16, help="held-out tasks (x group size)")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--probe-size", type=int, default=64, help="teacher-forced probe episodes")
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--sft-batch", type=int, default=32, help="demonstrations per SFT step")
    p.add_argument("--demos", type=int, default=4000, help="demonstrations in the SFT set")
    p.add_argument("--recipe", default="calibrated", choices=("calibrated", "round2", "round3b"),
                   help="demonstration recipe (sim.demos.RECIPES); the flags below override it")
    p.add_argument("--demo-mix", default="",
                   help="demonstration styles, e.g. clean=0.1,thrash=0.3 (default: the recipe's)")
    p.add_argument("--note-prob", type=float, default=None, help="demo turns with a note")
    p.add_argument("--note-mean", type=float, default=None, help="demo note length (words)")
    p.add_argument("--read-prob", type=float, default=None, help="demo looks with READ")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="probe: nucleus sampling of training batches (log-probs stay untruncated)")
    p.add_argument("--warm-seed", type=int, default=0)
    p.add_argument("--calibrate", action="store_true",
                   help="warm start and step-0 report only (binary calibration)")
    p.add_argument("--rounds", type=int, default=12, help="producer rounds (two-process run)")
    p.add_argument("--train-steps", type=int, default=5, help="trainer steps (two-process run)")
    p.add_argument("--max-ahead", type=int, default=2)
    p.add_argument("--wait-s", type=float, default=30.0)
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices of the trainer")
    p.add_argument("--set", action="append", default=[],
                   help="extra --config.KEY=VALUE overrides for the trainer (and sweep)")
    a = p.parse_args(argv)
    a.quick_b = a.quick_b or a.quick_long
    if a.quick or a.quick_b:   # the easy task, so an 80-step warm start already passes some
        # (2 of 32 rollouts of the first batch, one strong and one intermediate: step 0 trains
        # on a net-negative credit in downweight_only). The probe has the
        # held-out evaluation's 32 rows, so both share one compiled teacher-forced program.
        a.arms, a.seeds, a.steps, a.groups, a.group_size = ",".join(_ARMS), "0", 2, 4, 8
        a.eval_tasks, a.eval_every, a.probe_size, a.sft_steps, a.sft_lr = 4, 2, 32, 80, 1e-2
        a.task, a.recipe = "easy", "round2"
    if a.quick_b:  # Design B's channel on the easy task with Design B's note language
        a.quick, a.task, a.factor_table, a.top_p = True, "easy-notes", "harsh", 0.9
        a.note_mean = 3.0       # every arm (binary too: the suite's one smoke test of the loop)
        a.set = a.set + ["train.mini_batches=4", "optim.learning_rate=5e-4"]
    if a.quick_long:
        a.arms, a.flaky_target = ",".join(_ARMS + ("length_aware",)), 0.5
    return a


# --quick: the train steps (one per advantage mode, each run a few times) compile at -O0, 2-3x
# faster than at -O1 (5 s vs 13 s each, Zen 1, 2026-12-05); the sampler and the warm start, run
# far more often, keep the process's level.
QUICK_STEP_OPTIONS = {"xla_backend_optimization_level": 0}

HARSH_TABLE = dict(strong_best=1.0, strong_other=0.8, intermediate_best=0.6,
                   intermediate_worst=0.3, defective=0.1)


def _table(a):
    """The feed's factor table (`--factor-table`); exits 2 on a bad value."""
    from gagar_jax import grading
    if a.factor_table == "default":
        return grading.FactorTable()
    if a.factor_table == "harsh":
        return grading.FactorTable(**HARSH_TABLE)
    try:
        over = {k: float(v) for k, v in (i.split("=") for i in a.factor_table.split(","))}
        return grading.FactorTable.from_config(over)
    except (ValueError, TypeError) as e:
        print(f"error: --factor-table {a.factor_table!r}: {e}", file=sys.stderr)
        raise SystemExit(2) from None


_ARMS = ("binary", "downweight_only", "sum_preserving", "control")


def _task(a):
    from gagar_jax.sim import task as task_lib
    if a.task == "easy-notes":
        return task_lib.TaskConfig(note_words=300, max_turn_tokens=16)
    return task_lib.TaskConfig.hard() if a.task == "hard" else task_lib.TaskConfig()


def _config(overrides):
    from gagar_jax.config import load_config_file
    cfg = load_config_file(CONFIG)
    for item in overrides:
        key, value = item.split("=", 1)
        node = cfg
        *path, last = key.split(".")
        for name in path:
            node = node[name]
        old = node[last]
        if isinstance(old, bool):
            node[last] = value.lower() in ("1", "true", "yes")
        elif isinstance(old, (int, float)) and old is not None:
            node[last] = type(old)(value)
        else:
            node[last] = value
    return cfg


def _recipe(a):
    """The demonstration recipe: `--recipe`, with the flags that override it."""
    from gagar_jax.sim import demos
    over = {k: v for k, v in (("note_prob", a.note_prob), ("note_mean", a.note_mean),
                              ("read_prob", a.read_prob)) if v is not None}
    if a.quick_b:   # round two's styles (they fit the easy task), Design B's note language
        over["note_probs"] = demos.ROUND3B_RECIPE.note_probs
    if a.demo_mix:
        over["mix"] = {k: float(v) for k, v in (i.split("=") for i in a.demo_mix.split(","))}
    return dataclasses.replace(demos.RECIPES[a.recipe], **over)


def _feed_overrides(a) -> list:
    """Feed shapes for `groups` groups of `group_size` rollouts (rows for about 4 average
    rollouts each, and room for the task's longest episode)."""
    from gagar_jax.sim import producer
    n = a.groups * a.group_size
    longest = producer.cache_len(_task(a))
    seq = max(128, -(-longest // 128) * 128)
    return [f"feed.groups_per_batch={a.groups}", f"feed.max_trajectories={n}",
            f"feed.rows_per_batch={max(8, -(-n // 4))}", f"feed.seq_len={seq}",
            f"feed.max_traj_tokens={longest}", f"feed.max_group_trajectories={a.group_size}"]


def _warm(a, cfg, task_cfg, warm_seed: int):
    """The warm start of `warm_seed`, cached under the workdir (a resumed sweep reuses it; an
    SFT phase cut by --max-minutes resumes from its snapshot there)."""
    from gagar_jax.sim import experiment as X
    from gagar_jax.sim import resume
    path = os.path.join(a.workdir, f"warm-{warm_seed}.pkl")
    warm = resume.load_pickle(path)
    if warm is not None:
        return warm
    snapshot = os.path.join(a.workdir, f"warm-{warm_seed}.sft.pkl")
    warm = X.warm_start(cfg, task_cfg, seed=warm_seed, sft_steps=a.sft_steps, lr=a.sft_lr,
                        batch_size=a.sft_batch, num_demos=a.demos, recipe=_recipe(a),
                        eval_tasks=a.eval_tasks, group_size=a.group_size,
                        lam_cap=float(cfg.loss.lam_cap), table=_table(a), snapshot=snapshot,
                        deadline=a.deadline)
    resume.save_pickle(path, warm)
    if os.path.exists(snapshot):
        os.remove(snapshot)
    return warm


def _run_workdir(a, arm: str, seed: int) -> str:
    """A run's feed ledgers and resume file (top-p in the name: B and B-exact share --workdir)."""
    return os.path.join(a.workdir, f"{arm}-{seed}" + (f"-p{a.top_p:g}" if a.top_p < 1 else ""))


def _warm_seed(a, seed: int) -> int:
    if not a.independent_warm:
        return a.warm_seed
    return seed % a.warm_mod if a.warm_mod > 0 else seed


def sweep(a) -> None:
    """Every arm x seed, each saved to OUT/runs/<arm>-s<seed>.json as it finishes; runs whose
    file exists are skipped (a rerun resumes)."""
    from gagar_jax.sim import difficulty, measure
    from gagar_jax.sim import experiment as X
    t_start = time.perf_counter()
    cfg = _config(_feed_overrides(a) + a.set)
    task_cfg = _task(a)
    runs_dir = os.path.join(a.out, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    learner = X.Learner(cfg, _table(a), compiler_options=QUICK_STEP_OPTIONS if a.quick else None)
    probe = measure.ProbeSet(task_cfg, a.probe_size, _recipe(a))
    meta_path = os.path.join(a.out, "meta.json")
    meta = {"command": "python scripts/miniature.py " + " ".join(sys.argv[1:]),
            "args": {k: v for k, v in vars(a).items() if k not in ("workdir", "out", "deadline")},
            "warm": {}}
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta["warm"] = json.load(f).get("warm", {})
    ran = 0
    for seed in [int(s) for s in a.seeds.split(",")]:
        warm_seed = _warm_seed(a, seed)
        for arm in a.arms.split(","):
            path = os.path.join(runs_dir, f"{arm}-s{seed}.json")
            if os.path.exists(path):
                print(f"skip {arm} seed {seed}: {path} exists", flush=True)
                continue
            warm = _warm(a, cfg, task_cfg, warm_seed)
            meta["warm"][str(warm_seed)] = {"stats": warm.stats.__dict__,
                                            "sft_final_loss": (warm.sft_losses or [None])[-1],
                                            "fbar": warm.extra,
                                            "seconds": warm.seconds}
            rows = X.run_loop(learner, arm, warm, task_cfg, seed=seed, rl_steps=a.steps,
                              workdir=_run_workdir(a, arm, seed), groups=a.groups,
                              group_size=a.group_size, eval_tasks=a.eval_tasks,
                              eval_every=a.eval_every, probe=probe, top_p=a.top_p,
                              flaky=(difficulty.FlakyRunner(target=a.flaky_target)
                                     if a.flaky_target > 0 else None),
                              deadline=a.deadline, log=lambda s: print(s, flush=True))
            # A resumed run's processes each timed their own steps: the total is their sum.
            out = {"arm": arm, "seed": seed, "warm_seed": warm_seed,
                   "seconds": sum(r.get("seconds", 0.0) for r in rows), "rows": rows}
            with open(path + ".tmp", "w") as f:
                json.dump(_rounded(out), f, separators=(",", ":"))
            os.replace(path + ".tmp", path)
            with open(meta_path, "w") as f:
                json.dump(_rounded(meta), f, indent=1)
            print(f"saved {path} ({out['seconds']:.0f} s)", flush=True)
            ran += 1
    if a.quick_long and ran:    # a rerun that only rewrites the report checks nothing new
        _resume_check(a, cfg, learner, task_cfg, probe, runs_dir)
    print(f"sweep: {(time.perf_counter() - t_start) / 60:.1f} min", flush=True)
    print(write_report(a.out), flush=True)


def _resume_check(a, cfg, learner, task_cfg, probe, runs_dir: str) -> None:
    """--quick-long: the first seed's downweight_only run again, cut by a deadline after its
    first step and resumed in this process; its rows must equal the sweep's (but for seconds)."""
    from gagar_jax.sim import difficulty, resume
    from gagar_jax.sim import experiment as X
    seed = int(a.seeds.split(",")[0])
    warm = _warm(a, cfg, task_cfg, _warm_seed(a, seed))
    looks = iter(range(10**6))
    cut = resume.Deadline(0.5, clock=lambda: 60.0 * next(looks))   # passes at step 1's look
    kw = dict(seed=seed, rl_steps=a.steps, workdir=os.path.join(a.workdir, "resume-check"),
              groups=a.groups, group_size=a.group_size, eval_tasks=a.eval_tasks,
              eval_every=a.eval_every, probe=probe, top_p=a.top_p, save_every=10**6,
              log=lambda s: None)
    runner = lambda: difficulty.FlakyRunner(target=a.flaky_target)
    try:
        X.run_loop(learner, "downweight_only", warm, task_cfg, flaky=runner(), deadline=cut, **kw)
        raise SystemExit("resume check: the deadline did not cut the run")
    except resume.OutOfTime as e:
        print(f"resume check: {e}", flush=True)
    rows = X.run_loop(learner, "downweight_only", warm, task_cfg, flaky=runner(), **kw)
    with open(os.path.join(runs_dir, f"downweight_only-s{seed}.json")) as f:
        want = json.load(f)["rows"]
    strip = lambda rs: [{k: v for k, v in r.items() if k != "seconds"} for r in rs]
    if strip(_rounded(rows)) != strip(want):
        raise SystemExit("resume check: the resumed run's rows differ from the sweep's")
    print(f"resume check: a run cut at step 1 and resumed gave the sweep's {len(rows)} rows",
          flush=True)


def calibrate(a) -> None:
    """Warm start only: step-0 entropy, pass rate, strong share, f_bar on held-out groups."""
    from gagar_jax.sim import experiment as X
    cfg = _config(_feed_overrides(a) + a.set)
    warm = _warm(a, cfg, _task(a), a.warm_seed)
    print(json.dumps(_rounded({"sft_final_loss": warm.sft_losses[-1], "seconds": warm.seconds,
                               **warm.stats.__dict__, **warm.extra}), indent=1), flush=True)
    del X


def _rounded(obj):
    """JSON-ready copy with floats to 4 significant digits (small committed results)."""
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_rounded(v) for v in obj]
    if isinstance(obj, (int, str, bool)) or obj is None:
        return obj
    x = float(obj)
    return None if x != x else float(f"{x:.4g}")


def load_runs(out: str) -> dict:
    """"arm/seed" -> rows, from OUT/runs/*.json."""
    import glob
    runs = {}
    for path in sorted(glob.glob(os.path.join(out, "runs", "*.json"))):
        with open(path) as f:
            r = json.load(f)
        runs[f"{r['arm']}/{r['seed']}"] = r["rows"]
    return runs


def write_report(out: str, with_criteria: bool = True) -> str:
    """table.md, per-step CSV, PNGs and (round two's) criteria.md from OUT/runs/*.json; without
    the criteria (B-long), the plots are round four's panels (credit per token among them)."""
    from gagar_jax.sim import report
    runs = load_runs(out)
    if not runs:
        return "no finished runs"
    panels = report.PANELS if with_criteria else report.LONG_PANELS
    return report.write_all(runs, out, with_criteria, panels)


def write_criteria_long(out: str, exact_out: str) -> str:
    """OUT/criteria_long.md: round four's B-long predictions L1-L5 from OUT (top-p) and
    EXACT_OUT (untruncated) runs."""
    from gagar_jax.sim import report
    return _write_checks(os.path.join(out, "criteria_long.md"),
                         "| prediction | met | evidence (steps 110-119 unless named; mean over "
                         "seeds, paired 95% t-CI) |",
                         report.criteria_long(load_runs(out), load_runs(exact_out)))


def write_criteria_b(out: str, exact_out: str) -> str:
    """OUT/criteria_b.md: Design B's checks from OUT (top-p) and EXACT_OUT (no top-p) runs."""
    from gagar_jax.sim import report
    rows = [(n, "yes" if ok else "no", ev)
            for n, ok, ev in report.criteria_b(load_runs(out), load_runs(exact_out))]
    return _write_checks(os.path.join(out, "criteria_b.md"),
                         "| criterion | met | evidence (steps 30-39; paired 95% t-CI) |", rows)


def _write_checks(path: str, header: str, rows: list) -> str:
    """A markdown table of (check, verdict, evidence) rows under `header`, written to `path`."""
    text = header + "\n|---|---|---|\n" + "".join(f"| {n} | {v} | {ev} |\n" for n, v, ev in rows)
    with open(path, "w") as f:
        f.write(text)
    return text


def produce(a) -> None:
    from gagar_jax.model.config import ModelConfig
    from gagar_jax.sim import producer
    cfg = _config(_feed_overrides(a) + a.set)
    producer.run_producer(a.workdir, os.path.join(a.workdir, "spool"), _task(a),
                          rounds=a.rounds, groups_per_round=a.groups, group_size=a.group_size,
                          seed=a.warm_seed + 1, model_cfg=ModelConfig.from_config(cfg.model),
                          max_ahead=a.max_ahead, wait_s=a.wait_s,
                          log=lambda s: print(s, flush=True))


def publish_warm_start(a) -> dict:
    """Warm start, publish it as policy version 0 under the workdir; returns the step-0 stats."""
    import jax
    from flax import nnx

    from gagar_jax.hf import api as hf
    from gagar_jax.model.config import ModelConfig, Transformer
    from gagar_jax.run import publish
    from gagar_jax.sim import experiment as X
    cfg = _config(_feed_overrides(a) + a.set)
    warm = X.warm_start(cfg, _task(a), seed=a.warm_seed, sft_steps=a.sft_steps,
                        lr=a.sft_lr, batch_size=a.sft_batch, num_demos=a.demos,
                        recipe=_recipe(a), eval_tasks=a.groups, group_size=a.group_size)
    model = Transformer(ModelConfig.from_config(cfg.model), rngs=nnx.Rngs(0))
    nnx.update(model, jax.device_put(warm.params), jax.device_put(warm.router_bias))
    path = publish.publish_weights(model, 0, a.workdir, hf.save_pretrained)
    return {"path": path, "stats": warm.stats.__dict__}


def closed_loop(a) -> int:
    """Warm start + version 0, then a producer subprocess and a `gagar-train` subprocess."""
    os.makedirs(a.workdir, exist_ok=True)
    v0 = publish_warm_start(a)
    print(f"published version 0 at {v0['path']}; step-0 stats {v0['stats']}", flush=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={a.devices}")
    me = [sys.executable, os.path.abspath(__file__), "--producer", "--workdir", a.workdir,
          "--rounds", str(a.rounds), "--groups", str(a.groups), "--group-size",
          str(a.group_size), "--warm-seed", str(a.warm_seed), "--max-ahead", str(a.max_ahead),
          "--wait-s", str(a.wait_s), "--task", a.task] + [x for s in a.set for x in ("--set", s)]
    overrides = _feed_overrides(a) + a.set + [
        f"feed.spool_dir={os.path.join(a.workdir, 'spool')}", "feed.spool_create=true",
        f"train.steps={a.train_steps}",
        f"train.init_from={v0['path']}",
        "train.publish_initial=false"]      # version 0 is the warm start published above
    trainer = [sys.executable, "-m", "gagar_jax.run.cli", "--config", CONFIG, "--workdir", a.workdir
               ] + [f"--config.{o}" for o in overrides]
    prod = subprocess.Popen(me, cwd=REPO, env=dict(env, XLA_FLAGS=""))
    train = subprocess.Popen(trainer, cwd=REPO, env=env)
    rc_train = train.wait()
    if prod.poll() is None:     # the trainer is done: the producer's remaining rounds are moot
        prod.terminate()
    rc_prod = prod.wait()
    print(f"trainer exit {rc_train}, producer exit {rc_prod}", flush=True)
    return rc_train


def main(argv=None) -> int:
    a = _args(argv)
    _table(a)     # a bad --factor-table fails before any work
    from gagar_jax.sim import resume
    a.deadline = resume.Deadline(a.max_minutes)
    try:
        return _main(a)
    except resume.OutOfTime as e:
        print(f"out of time ({a.max_minutes:g} min): {e}; rerun the command to resume",
              flush=True)
        return resume.EXIT_UNFINISHED


def _main(a) -> int:
    if a.producer:
        produce(a)
        return 0
    if a.closed_loop:
        return closed_loop(a)
    if a.report:
        print(write_report(a.out, with_criteria=not a.criteria_long))
        if a.criteria_b:
            print(write_criteria_b(a.out, a.criteria_b))
        if a.criteria_long:
            print(write_criteria_long(a.out, a.criteria_long))
        return 0
    if a.calibrate:
        calibrate(a)
        return 0
    if a.quick:
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            a.out, a.workdir = (a.out if a.out != _DEFAULT_OUT else os.path.join(tmp, "out"),
                                os.path.join(tmp, "work"))
            sweep(a)
        return 0
    sweep(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())

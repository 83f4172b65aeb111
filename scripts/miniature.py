"""The miniature study: three advantage modes x seeds from one warm start, plots and a table.

  JAX_PLATFORMS=cpu python scripts/miniature.py                      # the sweep (docs/miniature.md)
  JAX_PLATFORMS=cpu python scripts/miniature.py --steps 3 --seeds 0  # a quick look
  JAX_PLATFORMS=cpu python scripts/miniature.py --closed-loop --workdir runs/loop   # two processes
  python scripts/miniature.py --producer --workdir W --rounds N      # the producer process alone

The sweep runs in one process through the product's feed and train step
(`gagar_jax/sim/experiment.py`) and writes `docs/miniature/*.png`, `results.json` and
`table.md`. `--closed-loop` warm-starts, publishes policy version 0, then runs a producer
subprocess (sampling with the newest published weights, writing spool shards) next to a
`gagar-train` subprocess (configs/miniature.py, publishing weights every step).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(REPO, ".cache", "jax"))

CONFIG = os.path.join(REPO, "configs", "miniature.py")


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--closed-loop", action="store_true", help="two-process run (see docstring)")
    p.add_argument("--producer", action="store_true", help="run only the producer process")
    p.add_argument("--replot", action="store_true",
                   help="rewrite table.md and the PNGs from OUT/results.json (no runs)")
    p.add_argument("--workdir", default=os.path.join(REPO, "runs", "miniature"))
    p.add_argument("--out", default=os.path.join(REPO, "docs", "miniature"), help="sweep output")
    p.add_argument("--modes", default="binary,downweight_only,sum_preserving")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--steps", type=int, default=30, help="RL steps per run")
    p.add_argument("--groups", type=int, default=16, help="groups (tasks) per step / round")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--eval-tasks", type=int, default=32, help="held-out tasks (x group size)")
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--demo-mix", default="",
                   help="demonstration styles, e.g. clean=0.1,thrash=0.3 (default: sim.demos mix)")
    p.add_argument("--warm-seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=12, help="producer rounds (two-process run)")
    p.add_argument("--train-steps", type=int, default=5, help="trainer steps (two-process run)")
    p.add_argument("--max-ahead", type=int, default=2)
    p.add_argument("--wait-s", type=float, default=30.0)
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices of the trainer")
    p.add_argument("--set", action="append", default=[],
                   help="extra --config.KEY=VALUE overrides for the trainer (and sweep)")
    return p.parse_args(argv)


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


def _mix(a):
    if not a.demo_mix:
        return None
    return {k: float(v) for k, v in (item.split("=") for item in a.demo_mix.split(","))}


def _feed_overrides(a) -> list:
    """Feed shapes for `groups` groups of `group_size` rollouts of <= 64 tokens."""
    n = a.groups * a.group_size
    return [f"feed.groups_per_batch={a.groups}", f"feed.max_trajectories={n}",
            f"feed.rows_per_batch={max(8, -(-n // 2))}",
            f"feed.max_group_trajectories={a.group_size}"]


def sweep(a) -> None:
    from gagar_jax.sim import experiment as X
    from gagar_jax.sim import task as T
    t_start = time.perf_counter()
    cfg = _config(_feed_overrides(a) + a.set)
    task_cfg = T.TaskConfig()
    warm = X.warm_start(cfg, task_cfg, seed=a.warm_seed, sft_steps=a.sft_steps,
                        lr=a.sft_lr, mix=_mix(a), eval_tasks=a.eval_tasks, group_size=a.group_size)
    print(f"warm start: {a.sft_steps} SFT steps in {warm.seconds:.0f} s; step-0 tier mix "
          f"{warm.stats}", flush=True)
    learner = X.Learner(cfg)
    runs = {}
    for mode in a.modes.split(","):
        for seed in [int(s) for s in a.seeds.split(",")]:
            runs[f"{mode}/{seed}"] = X.run_loop(
                learner, mode, warm, task_cfg, seed=seed, rl_steps=a.steps,
                workdir=os.path.join(a.workdir, f"{mode}-{seed}"), groups=a.groups,
                group_size=a.group_size, eval_tasks=a.eval_tasks,
                log=lambda s: print(s, flush=True))
    seconds = time.perf_counter() - t_start
    command = "python scripts/miniature.py " + " ".join(sys.argv[1:])
    os.makedirs(a.out, exist_ok=True)
    meta = {"command": command.strip(), "seconds": seconds, "sft_steps": a.sft_steps,
            "demo_mix": _mix(a),
            "warm_stats": warm.stats.__dict__, "sft_final_loss": (warm.sft_losses or [None])[-1],
            "groups": a.groups, "group_size": a.group_size, "eval_tasks": a.eval_tasks}
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(_rounded({"meta": meta, "runs": runs}), f)
    print(write_report(runs, a.out, a.steps))
    print(f"total {seconds / 60:.1f} min", flush=True)


def _rounded(obj):
    """JSON-ready copy with floats to 5 significant digits (a small results.json)."""
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_rounded(v) for v in obj]
    if isinstance(obj, (int, str, bool)) or obj is None:
        return obj
    return float(f"{float(obj):.5g}")


def write_report(runs: dict, out: str, steps: int) -> str:
    """table.md (table at step 0 / final, paired differences to binary early and late), PNGs."""
    from gagar_jax.sim import report
    table = "\n".join([report.markdown_table(runs),
                       report.paired_table(runs, first=1, last=min(10, steps)),
                       report.paired_table(runs, first=max(steps - 9, 1), last=steps)])
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table)
    report.plot(runs, out)
    return table


def replot(a) -> None:
    with open(os.path.join(a.out, "results.json")) as f:
        runs = json.load(f)["runs"]
    steps = len(next(iter(runs.values()))) - 1
    print(write_report(runs, a.out, steps))


def produce(a) -> None:
    from gagar_jax.model import ModelConfig
    from gagar_jax.sim import producer
    from gagar_jax.sim import task as T
    cfg = _config(_feed_overrides(a) + a.set)
    producer.run_producer(a.workdir, os.path.join(a.workdir, "spool"), T.TaskConfig(),
                          rounds=a.rounds, groups_per_round=a.groups, group_size=a.group_size,
                          seed=a.warm_seed + 1, model_cfg=ModelConfig.from_config(cfg.model),
                          max_ahead=a.max_ahead, wait_s=a.wait_s,
                          log=lambda s: print(s, flush=True))


def publish_warm_start(a) -> dict:
    """Warm start, publish it as policy version 0 under the workdir; returns the step-0 stats."""
    import jax
    from flax import nnx

    from gagar_jax import hf, publish
    from gagar_jax.model import ModelConfig, Transformer
    from gagar_jax.sim import experiment as X
    from gagar_jax.sim import task as T
    cfg = _config(_feed_overrides(a) + a.set)
    warm = X.warm_start(cfg, T.TaskConfig(), seed=a.warm_seed, sft_steps=a.sft_steps,
                        lr=a.sft_lr, mix=_mix(a), eval_tasks=a.groups, group_size=a.group_size)
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
          "--wait-s", str(a.wait_s)] + [x for s in a.set for x in ("--set", s)]
    overrides = _feed_overrides(a) + a.set + [
        f"feed.spool_dir={os.path.join(a.workdir, 'spool')}", f"train.steps={a.train_steps}",
        f"train.init_from={v0['path']}"]
    trainer = [sys.executable, "-m", "gagar_jax.cli", "--config", CONFIG, "--workdir", a.workdir
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
    if a.producer:
        produce(a)
        return 0
    if a.closed_loop:
        return closed_loop(a)
    if a.replot:
        replot(a)
        return 0
    sweep(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())

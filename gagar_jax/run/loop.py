"""The closed loop on one machine: the learner and a vLLM rollout worker as two processes.

    paths = LoopPaths.of_checkout(repo)                 # config, .venv-vllm, the source root
    report = run_loop(workdir, paths, seed=0, steps=40) # `make loop`, scripts/loop.py

A library: every path comes from the caller (`LoopPaths`), none from this file's location.

1. The initial policy: a Transformer from the config's model section with `seed`, saved in
   float32 as `<workdir>/init` (the learner's `train.init_from`) and published as version 0
   (`publish.publish_weights`, in `train.publish_dtype`), so the worker has a `latest` to serve.
2. The learner (`python -m gagar_jax`, .venv) trains on `<workdir>/spool` and publishes every
   step; the worker (`python -m gagar_jax.rollout.worker`, .venv-vllm) samples and grades groups
   of the example task into the spool, reloading `latest` between groups.
3. When the learner has run `steps` steps it exits; the worker is stopped (SIGTERM), and the
   report is read from the worker's per-group log (pass rate per policy version) and the
   learner's metrics.jsonl (staleness, learner-vs-engine log-prob mismatch) and ledger.json.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from typing import Any

STEP_KEYS = ("loss", "feed/staleness_mean", "feed/staleness_max", "rollout/logp_abs_diff_mean",
             "rollout/logp_abs_diff_max", "rollout/kl", "rollout/is_weight_mean", "groups")


@dataclasses.dataclass(frozen=True)
class LoopPaths:
    """Where the loop's pieces live.

    Attributes:
      config: the learner's config file (its model section also builds the initial policy).
      vllm_python: the interpreter of the vLLM environment (`make vllm`), which runs the worker.
      source_root: the directory holding the `gagar_jax` package: both processes run there and
        import it from there (the vLLM environment does not install the package).
    """

    config: str
    vllm_python: str
    source_root: str

    @classmethod
    def of_checkout(cls, root: str, config: str = os.path.join("configs", "tiny_vllm.py")
                    ) -> LoopPaths:
        """The paths of a source checkout at `root` (`config` relative to it unless absolute)."""
        root = os.path.abspath(root)
        return cls(config=os.path.join(root, config),
                   vllm_python=os.path.join(root, ".venv-vllm", "bin", "python"),
                   source_root=root)


def publish_initial(cfg: Any, workdir: str, seed: int) -> str:
    """Saves the initial policy as `<workdir>/init` (float32) and publishes it as version 0."""
    from flax import nnx

    from gagar_jax.hf import api as hf
    from gagar_jax.model.transformer import ModelConfig, Transformer
    from gagar_jax.run import publish
    model = Transformer(ModelConfig.from_config(cfg.model), rngs=nnx.Rngs(seed))
    init = os.path.join(workdir, "init")
    hf.save_pretrained(model, init)
    publish.publish_weights(model, 0, workdir, publish.hf_save_fn(dtype=cfg.train.publish_dtype),
                            keep=cfg.train.keep_published)
    return init


def _env(source_root: str, extra: dict) -> dict:
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = source_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                       else "")
    return env


def run_loop(workdir: str, paths: LoopPaths, *, seed: int = 0, steps: int = 40,
             learning_rate: float | None = None, worker_args: tuple = (),
             learner_args: tuple = (), timeout_s: float = 1800.0) -> dict:
    """Runs learner and worker until the learner has trained `steps` steps; returns the report.

    Args:
      workdir: a fresh directory (the learner's workdir; the spool and the worker's log inside).
      paths: the config, the vLLM interpreter and the source root (`LoopPaths`).
      learning_rate: overrides optim.learning_rate (0: the frozen-policy control).
      worker_args, learner_args: extra flags for the worker / `--config.KEY=VALUE` overrides.
      timeout_s: the learner is killed after this long.
    Returns:
      `report(workdir, steps)` plus seed, learning_rate and wall_s (also loop_report.json).
    """
    from gagar_jax.config import load_config_file
    config = paths.config
    if not os.access(paths.vllm_python, os.X_OK):
        raise FileNotFoundError(f"{paths.vllm_python} is missing: run `make vllm`")
    os.makedirs(workdir, exist_ok=True)
    cfg = load_config_file(config)
    init = publish_initial(cfg, workdir, seed)
    spool = os.path.join(workdir, "spool")
    os.makedirs(spool, exist_ok=True)   # the learner refuses a spool that does not exist
    logs = {name: open(os.path.join(workdir, f"{name}.log"), "w") for name in ("learner", "worker")}
    learner_cmd = [sys.executable, "-m", "gagar_jax", f"--config={config}",
                   f"--workdir={workdir}", f"--config.seed={seed}",
                   f"--config.train.steps={steps}", f"--config.train.init_from={init}",
                   f"--config.feed.spool_dir={spool}", *learner_args]
    if learning_rate is not None:
        learner_cmd.append(f"--config.optim.learning_rate={learning_rate}")
    worker_cmd = [paths.vllm_python, "-m", "gagar_jax.rollout.worker", f"--workdir={workdir}",
                  f"--spool={spool}", f"--seed={seed}",
                  f"--mixed-per-version={2 * cfg.feed.groups_per_batch}",
                  f"--groups-per-version={4 * cfg.feed.groups_per_batch}", "--stall-s=20",
                  f"--max-tokens={cfg.loss.max_response_len}", *worker_args]
    t0 = time.perf_counter()
    root = paths.source_root
    worker_env = _env(root, {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                             # beside the learner: no thread pinned to one core
                             "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})
    worker = subprocess.Popen(worker_cmd, cwd=root, stdout=logs["worker"],
                              stderr=subprocess.STDOUT, env=worker_env)
    learner = subprocess.Popen(learner_cmd, cwd=root, stdout=logs["learner"],
                               stderr=subprocess.STDOUT, env=_env(root, {"JAX_PLATFORMS": "cpu"}))
    try:
        rc = learner.wait(timeout=timeout_s)
    finally:
        if learner.poll() is None:
            learner.kill()
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
        for f in logs.values():
            f.close()
    wall = time.perf_counter() - t0
    if rc != 0:
        tail = open(os.path.join(workdir, "learner.log")).read()[-3000:]
        raise RuntimeError(f"the learner exited {rc}:\n{tail}")
    rep = report(workdir, steps)
    rep.update(seed=seed, learning_rate=learning_rate, wall_s=round(wall, 1))
    with open(os.path.join(workdir, "loop_report.json"), "w") as f:
        json.dump(rep, f, indent=2)
    return rep


def _read_jsonl(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def report(workdir: str, steps: int, window: int = 5) -> dict:
    """Pass rate per policy version (worker log), per-step learner metrics, the ledger.

    `early` = the pass rate of the groups sampled from version 0 (the initial policy), `late` =
    from the last `window` versions sampled; `doubled_and_rose` = late >= 2 early and
    late - early >= 0.3; `within_noise` = |late - early| < 3 standard errors (two proportions).
    """
    groups = [r for r in _read_jsonl(os.path.join(workdir, "rollout", "worker0.jsonl"))
              if "group_id" in r]
    by_v: dict = {}
    for r in groups:
        p, n = by_v.get(r["policy_version"], (0, 0))
        by_v[r["policy_version"]] = (p + r["passes"], n + r["valid"])
    versions = sorted(by_v)

    def rate(vs: list) -> tuple:
        p = sum(by_v[v][0] for v in vs)
        n = sum(by_v[v][1] for v in vs)
        return (p / n if n else float("nan")), n
    early, n_early = rate([v for v in versions if v == 0])
    late, n_late = rate(versions[-window:])
    # Two-proportion standard error: "within noise" = |late - early| < 3 se.
    se = math.sqrt(sum(x * (1 - x) / max(n, 1) for x, n in ((early, n_early), (late, n_late))))
    per_step = [{"step": m["step"], **{k: m.get(k) for k in STEP_KEYS if k in m}}
                for m in _read_jsonl(os.path.join(workdir, "metrics.jsonl"))]
    with open(os.path.join(workdir, "ledger.json")) as f:
        ledger = json.load(f)
    return {"steps": steps, "steps_trained": len(per_step), "groups_sampled": len(groups),
            "pass_rate_by_version": {v: round(by_v[v][0] / by_v[v][1], 4) for v in versions},
            "early": early, "late": late, "n_early": n_early, "n_late": n_late,
            "rise": late - early, "se": se, "within_noise": abs(late - early) < 3 * se,
            "doubled_and_rose": late >= 2 * early and late - early >= 0.3,
            "per_step": per_step, "ledger": ledger, "ledger_balanced": bool(ledger["balanced"])}

"""The closed loop on one machine: the learner and vLLM rollout workers as processes.

    paths = LoopPaths.of_checkout(repo)                 # config, .venv-vllm, the source root
    report = run_loop(workdir, paths, seed=0, steps=40) # `gagar-loop`, `make loop`

A library: every path comes from the caller (`LoopPaths`), none from this file's location.

1. The initial policy: a Transformer from the config's model section with `seed`, saved in
   float32 as `<workdir>/init` (the learner's `train.init_from`), or the caller's own weights
   (`init_from`: an SFT checkpoint in Hugging Face format, as `save_pretrained` writes it). The
   learner publishes it as version 0 before its first step (`train.publish_initial`), so the
   workers have a `latest`.
2. The learner (`python -m gagar_jax`, .venv) trains on `<workdir>/spool` and publishes every
   step; each worker (`python -m gagar_jax.rollout.worker`, .venv-vllm, `worker<i>`) samples
   and grades groups of the tasks into the spool, reloading `latest` between groups.
3. While they run, `on_version` gets one summary per policy version the workers have moved
   past (`VersionWatch`). When the learner has run `steps` steps it exits; the workers are
   stopped (SIGTERM), and the report is read from the workers' per-group logs (pass rate per
   policy version) and the learner's metrics.jsonl (staleness, learner-vs-engine log-prob
   mismatch) and ledger.json.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, Optional

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


def save_initial(cfg: Any, workdir: str, seed: int) -> str:
    """Saves the initial policy as `<workdir>/init` (float32); returns the directory."""
    from flax import nnx

    from gagar_jax.hf import api as hf
    from gagar_jax.model.transformer import ModelConfig, Transformer
    model = Transformer(ModelConfig.from_config(cfg.model), rngs=nnx.Rngs(seed))
    init = os.path.join(workdir, "init")
    hf.save_pretrained(model, init)
    return init


def check_init_from(path: str) -> str:
    """`path` made absolute if it holds Hugging Face weights (config.json); FileNotFoundError
    naming it otherwise. Whether they fit the config's model is the learner's check."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"init_from {path!r}: no config.json there (a directory of "
                                "Hugging Face weights, as save_pretrained writes it)")
    return os.path.abspath(path)


def _env(source_root: str, extra: dict) -> dict:
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = source_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                       else "")
    return env


def _stop(procs: list) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


ENGINES = {"vllm": "gagar_jax.rollout.vllm_engine:make", "jax": "gagar_jax.sample.engine:make"}


def run_loop(workdir: str, paths: LoopPaths, *, seed: int = 0, steps: int = 40,
             learning_rate: float | None = None, workers: int = 1, tasks: str = "",
             grader: str = "", worker_args: tuple = (), learner_args: tuple = (),
             timeout_s: float = 1800.0, on_version: Optional[Callable[[dict], None]] = None,
             poll_s: float = 2.0, engine: str = "vllm", init_from: str = "") -> dict:
    """Runs learner and workers until the learner has trained `steps` steps; returns the report.

    Args:
      workdir: a fresh directory (the learner's workdir; the spool and the workers' logs inside).
      paths: the config, the vLLM interpreter and the source root (`LoopPaths`).
      learning_rate: overrides optim.learning_rate (0: the frozen-policy control).
      workers: rollout worker processes (`worker0` ... each its own seed and per-group log).
      tasks, grader: the workers' `--tasks` / `--grader` (`module:factory`; "" = the example task).
      worker_args, learner_args: extra flags for the workers / `--config.KEY=VALUE` overrides.
      timeout_s: the learner is killed after this long.
      on_version: called with `VersionWatch`'s summary of each policy version as it closes.
      poll_s: how often the logs are read for `on_version`.
      engine: the workers' engine, "vllm" (in the vLLM environment) or "jax" (the JAX sampler,
        `gagar_jax.sample.engine`, in this interpreter's environment, reading the published
        files; for the in-memory hand-over see `run/colocated.py`).
      init_from: the policy to start from, a directory of Hugging Face weights for the config's
        model (config.json and safetensors, e.g. an SFT checkpoint); "" = a fresh init of
        `seed` saved as `<workdir>/init`. No config.json there raises FileNotFoundError before
        any process starts (`check_init_from`); weights of another architecture fail in the
        learner (`train.init_from`).
    Returns:
      `report(workdir, steps)` plus seed, learning_rate and wall_s (also loop_report.json).
    """
    from gagar_jax.config import load_config_file
    config = paths.config
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {sorted(ENGINES)}, got {engine!r}")
    if engine == "vllm" and not os.access(paths.vllm_python, os.X_OK):
        raise FileNotFoundError(f"{paths.vllm_python} is missing: run `make vllm`")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    init = check_init_from(init_from) if init_from else ""
    os.makedirs(workdir, exist_ok=True)
    cfg = load_config_file(config)
    init = init or save_initial(cfg, workdir, seed)
    spool = os.path.join(workdir, "spool")
    os.makedirs(spool, exist_ok=True)   # the learner refuses a spool that does not exist
    names = ["learner"] + [f"worker{i}" for i in range(workers)]
    logs = {name: open(os.path.join(workdir, f"{name}.log"), "w") for name in names}
    learner_cmd = [sys.executable, "-m", "gagar_jax", f"--config={config}",
                   f"--workdir={workdir}", f"--config.seed={seed}",
                   f"--config.train.steps={steps}", f"--config.train.init_from={init}",
                   "--config.train.publish_initial=true",
                   f"--config.feed.spool_dir={spool}", *learner_args]
    if learning_rate is not None:
        learner_cmd.append(f"--config.optim.learning_rate={learning_rate}")
    choice = [*([f"--tasks={tasks}"] if tasks else []), *([f"--grader={grader}"] if grader else [])]
    root = paths.source_root
    worker_env = _env(root, {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                             # beside the learner: no thread pinned to one core
                             "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
                      if engine == "vllm" else {"JAX_PLATFORMS": "cpu"})
    worker_python = paths.vllm_python if engine == "vllm" else sys.executable
    t0 = time.perf_counter()
    procs = []
    for i in range(workers):
        cmd = [worker_python, "-m", "gagar_jax.rollout.worker", f"--workdir={workdir}",
               f"--engine={ENGINES[engine]}",
               f"--spool={spool}", f"--seed={seed + 1000 * i}", f"--writer-id=worker{i}",
               f"--mixed-per-version={2 * cfg.feed.groups_per_batch}",
               f"--groups-per-version={4 * cfg.feed.groups_per_batch}", "--stall-s=20",
               f"--max-tokens={cfg.loss.max_response_len}", *choice, *worker_args]
        procs.append(subprocess.Popen(cmd, cwd=root, stdout=logs[f"worker{i}"],
                                      stderr=subprocess.STDOUT, env=worker_env))
    learner = subprocess.Popen(learner_cmd, cwd=root, stdout=logs["learner"],
                               stderr=subprocess.STDOUT, env=_env(root, {"JAX_PLATFORMS": "cpu"}))
    watch = VersionWatch(workdir)
    try:
        deadline = time.monotonic() + timeout_s
        while learner.poll() is None and time.monotonic() < deadline:
            time.sleep(poll_s)
            for line in watch.closed():
                if on_version is not None:
                    on_version(line)
        rc = learner.poll()
    finally:
        if learner.poll() is None:
            learner.kill()
        _stop(procs)
        for f in logs.values():
            f.close()
    for line in watch.closed(final=True):
        if on_version is not None:
            on_version(line)
    wall = time.perf_counter() - t0
    if rc != 0:
        tail = open(os.path.join(workdir, "learner.log")).read()[-3000:]
        raise RuntimeError(f"the learner exited {rc}" + (" (timed out)" if rc is None else "")
                           + f":\n{tail}")
    rep = report(workdir, steps)
    rep.update(seed=seed, learning_rate=learning_rate, workers=workers, wall_s=round(wall, 1))
    with open(os.path.join(workdir, "loop_report.json"), "w") as f:
        json.dump(rep, f, indent=2)
    return rep


class VersionWatch:
    """Reads the workers' per-group logs and the learner's metrics as they grow, and summarises
    each policy version once the workers have moved past it.

    Args:
      workdir: the loop's workdir.
    """

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.done: set = set()

    def closed(self, final: bool = False) -> list:
        """Summaries of the versions closed since the last call (all remaining ones if `final`):
        {"version", "groups", "samples", "pass_rate", "staleness_mean", "staleness_max"}; the
        staleness is that of the learner step trained next after the version was published
        (None until it has run)."""
        by_v: dict = {}
        for r in _worker_groups(self.workdir):
            p, n, g = by_v.get(r["policy_version"], (0, 0, 0))
            by_v[r["policy_version"]] = (p + r["passes"], n + r["valid"], g + 1)
        metrics = {m["step"]: m for m in _read_jsonl(os.path.join(self.workdir, "metrics.jsonl"))}
        newest = max(by_v, default=-1)
        out = []
        for v in sorted(by_v):
            if v in self.done or (v == newest and not final):
                continue
            self.done.add(v)
            p, n, g = by_v[v]
            m = metrics.get(v + 1, {})
            out.append({"version": v, "groups": g, "samples": n,
                        "pass_rate": p / n if n else float("nan"),
                        "staleness_mean": m.get("feed/staleness_mean"),
                        "staleness_max": m.get("feed/staleness_max")})
        return out


def format_version(line: dict) -> str:
    """One line per policy version, as `gagar-loop` prints it."""
    stale = ("" if line["staleness_mean"] is None else
             f"; step {line['version'] + 1} trained at staleness mean "
             f"{line['staleness_mean']:.2f} max {line['staleness_max']:.0f}")
    return (f"version {line['version']:3d}: pass rate {line['pass_rate']:.3f} over "
            f"{line['groups']} groups ({line['samples']} samples){stale}")


def _worker_groups(workdir: str) -> list:
    """Every worker's per-group log lines (the groups, not the start-up lines)."""
    rows = []
    for path in sorted(glob.glob(os.path.join(workdir, "rollout", "worker*.jsonl"))):
        rows += [r for r in _read_jsonl(path) if "group_id" in r]
    return rows


def _read_jsonl(path: str) -> list:
    """The complete lines of a JSONL file that may still be growing (a last line without its
    newline is being written: left for the next read)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


def report(workdir: str, steps: int, window: int = 5) -> dict:
    """Pass rate per policy version (worker log), per-step learner metrics, the ledger.

    `early` = the pass rate of the groups sampled from version 0 (the initial policy), `late` =
    from the last `window` versions sampled; `doubled_and_rose` = late >= 2 early and
    late - early >= 0.3; `within_noise` = |late - early| < 3 standard errors (two proportions).
    """
    groups = _worker_groups(workdir)
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

"""The LLM grader against vLLM's OpenAI-compatible server on 127.0.0.1 (issue 40's vLLM check).

    .venv/bin/python scripts/check_grader_server.py [--tasks 3] [--orderings 3] [--port 8431]

A tiny Qwen3-MoE (configs/tiny_vllm.py with the byte tokenizer's 257 ids, random weights) is
published with the local byte-level tokenizer beside it (`gagar_jax/hf/byte_tokenizer.py`);
`vllm serve` (.venv-vllm) starts on it on 127.0.0.1 with structured outputs (xgrammar, no free
whitespace). Then, on planted groups of the repository tasks (reference fix, sprawling fix,
special-cased fix, all graded as passes, plus a failure; `tests/support/planted.py`):
  1. the LLM grader (`HTTPJudge`, k orderings) grades each: every one of the k answers must
     parse on the first ask into a valid {tier, rank} per candidate (structured outputs on);
  2. the prompt sent holds each candidate's diff and test log, or the cut marker;
  3. the server is killed while a request is in flight: the group's grading is status failed
     with the reason.
Prints the server's start time, per group the status, tiers and Kendall's tau, and the checks;
exits 1 if a check fails. Runs ~2-3 minutes on two CPU cores (most of it the server's start).
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]      # this checkout first


def publish_judge(directory: str) -> None:
    """The tiny random judge: weights (float32) and the byte tokenizer, in `directory`."""
    from support.vllm_served import random_model

    from gagar_jax.config import load_config_file
    from gagar_jax.hf import api as hf
    from gagar_jax.hf import byte_tokenizer
    from gagar_jax.model.transformer import ModelConfig
    cfg = load_config_file(os.path.join(REPO, "configs", "tiny_vllm.py"))
    cfg.model.vocab_size = byte_tokenizer.END_ID + 1
    # random weights drawn in NumPy: the model's eager init compiles ~30 small programs (~5 s)
    hf.save_pretrained(random_model(ModelConfig.from_config(cfg.model), 0), directory,
                       min_positions=16384)
    byte_tokenizer.save(directory)


def start_server(directory: str, port: int, log_path: str) -> tuple:
    """`vllm serve` on 127.0.0.1:port; returns (process, seconds until /health answered)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    # VLLM_ENABLE_V1_MULTIPROCESSING=0 with "uni" below: the model runs in the engine core's
    # process, not in a third one that imports vLLM and torch again (vLLM's CPU build keeps that
    # worker process without either; /health after 28-31 s instead of 44-73 s on two idle CPU
    # cores, 2026-12-05).
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=REPO)
    cmd = [os.path.join(REPO, ".venv-vllm", "bin", "python"), "-m",
           "vllm.entrypoints.openai.api_server", "--model", directory,
           "--served-model-name", "judge", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--max-model-len", "16384",
           "--distributed-executor-backend", "uni",
           "--structured-outputs-config",
           json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited {proc.returncode}:\n"
                               + open(log_path).read()[-4000:])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, time.monotonic() - t0
        except OSError:
            pass
        if time.monotonic() - t0 > 600:
            proc.kill()
            raise RuntimeError("vllm serve did not answer /health within 600 s")
        time.sleep(0.25)


class Recording:
    """An HTTPJudge that keeps every prompt it sent and every raw answer."""

    def __init__(self, judge):
        self.judge, self.count, self.sent, self.answers = judge, judge.count, [], []
        self.asking = threading.Event()     # set when the first request is on its way

    def ask(self, messages, schema):
        self.sent.append(messages)
        self.asking.set()
        out = self.judge.ask(messages, schema)
        self.answers.append(out)
        return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=3)
    p.add_argument("--orderings", type=int, default=3)
    p.add_argument("--budget", type=int, default=8000)
    p.add_argument("--port", type=int, default=8431)
    p.add_argument("--workdir", default="")
    args = p.parse_args(argv)
    result = run_checks(args.tasks, args.orderings, args.budget, args.port, args.workdir)
    failures = result["failures"]
    print("checks: " + ("all passed" if not failures else "FAILED: " + "; ".join(failures)))
    return 1 if failures else 0


def run_checks(tasks: int, orderings: int, budget: int, port: int, workdir: str = "") -> dict:
    """Publishes the judge, starts the server, runs the three checks (printing as it goes) and
    stops the server. Returns {"start_s", "groups": [{"task", "status", "valid", "answers",
    "cuts"}], "killed": {"status", "error"}, "failures": [what failed]}."""
    from support import planted

    from gagar_jax.rollout.envs import repo_tasks
    from gagar_jax.rollout.grading import answer, llm, prompt
    from gagar_jax.rollout.grading.base import grade_workspace
    from gagar_jax.rollout.grading.workspace import GroupWorkspace

    root = workdir or tempfile.mkdtemp(prefix="grader_server_")
    judge_dir = os.path.join(root, "judge")
    publish_judge(judge_dir)
    proc, start_s = start_server(judge_dir, port, os.path.join(root, "server.log"))
    print(f"vllm serve: /health after {start_s:.1f} s (tiny Qwen3-MoE, byte tokenizer, "
          f"xgrammar)", flush=True)
    failures = []
    result = {"start_s": start_s, "groups": [], "killed": None, "failures": failures}
    url = f"http://127.0.0.1:{port}/v1"
    count = lambda text: len(text.encode())          # one token per byte
    kinds = (("minimal", "pass"), ("sprawling", "pass"), ("special_case", "pass"),
             ("nothing", "fail"))
    try:
        for task in repo_tasks.load_tasks()[:tasks]:
            t, views = planted.group(task, os.path.join(root, "ws"), kinds)
            os.makedirs(os.path.join(views[0]["workspace"], "tests"), exist_ok=True)
            with open(os.path.join(views[0]["workspace"], "tests", "run_001.log"), "w") as f:
                f.write("visible tests\n" + "ok\n" * 4000 + "3 passed")   # a long log: cut
            ws = GroupWorkspace.from_views(t, views)
            judge = Recording(llm.HTTPJudge(url, "judge", max_tokens=256, timeout_s=300,
                                            count=count))
            grader = llm.LLMGrader(judge, orderings=orderings, retries=2, budget=budget)
            t0 = time.monotonic()
            out = grade_workspace(grader, ws)
            ev = out["evidence"].get("detail", out["evidence"])
            ids = [c.trajectory_id for c in ws.passing()]
            valid = 0
            for raw in judge.answers:
                try:
                    answer.parse_answer(raw, ids, renumber=True)
                    valid += 1
                except ValueError as e:
                    print(f"  invalid answer: {e}: {raw[:200]!r}")
            print(f"{task.task_id}: status {out['status']} in {time.monotonic() - t0:.1f} s; "
                  f"{valid} of {len(judge.answers)} answers valid; tiers "
                  f"{[v.get('quality') for v in out['verdicts']]}; tau to Borda "
                  f"{ev.get('kendall_tau_to_borda')}; prompt tokens "
                  f"{[o['tokens'] for o in ev.get('orderings', [])]}; cuts "
                  f"{[(c['section'], c['trajectory_id']) for c in ev['orderings'][0]['cuts']]}"
                  if out["status"] == "ok" else f"{task.task_id}: status {out['status']}: {ev}",
                  flush=True)
            result["groups"].append({
                "task": task.task_id, "status": out["status"], "valid": valid,
                "answers": len(judge.answers),
                "cuts": [(c["section"], c["trajectory_id"]) for c in ev["orderings"][0]["cuts"]]
                if out["status"] == "ok" else []})
            if out["status"] != "ok" or valid != orderings or len(judge.answers) != valid:
                failures.append(f"{task.task_id}: not every answer valid on the first ask")
                continue
            for messages in judge.sent:
                user = messages[1]["content"]
                for c in ws.passing():
                    if c.diff not in user and prompt.CUT.split("{")[0] not in user:
                        failures.append(f"{task.task_id}: {c.trajectory_id}'s diff missing")
                    log = c.test_logs[-1][1] if c.test_logs else "never run"
                    if log not in user and not any(
                            x["section"] == "tests" and x["trajectory_id"] == c.trajectory_id
                            for x in ev["orderings"][0]["cuts"]):
                        failures.append(f"{task.task_id}: {c.trajectory_id}'s test log missing")
                if prompt.CUT.split("{")[0] not in user:
                    failures.append(f"{task.task_id}: the long log was not cut with the marker")
        # the server stopped mid-request: many orderings keep requests going; kill it in flight
        judge = Recording(llm.HTTPJudge(url, "judge", max_tokens=256, timeout_s=300,
                                        count=count))
        grader = llm.LLMGrader(judge, orderings=50, retries=2, budget=budget)
        box = {}
        th = threading.Thread(target=lambda: box.update(out=grade_workspace(grader, ws)))
        th.start()
        # kill once the first request has been sent and the server is generating its answer
        # (an answer of up to 256 tokens takes ~0.8 s here); was a fixed 3 s sleep
        if not judge.asking.wait(60):
            failures.append("the grader sent no request to kill the server under")
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGKILL)
        th.join(120)
        out = box.get("out")
        result["killed"] = out and {"status": out["status"],
                                    "error": out["evidence"].get("error", "")}
        print(f"server killed mid-request: status {out and out['status']}; reason "
              f"{out and out['evidence'].get('error')}", flush=True)
        if not out or out["status"] != "failed" or "JudgeHTTPError" not in out["evidence"]["error"]:
            failures.append("a server stopped mid-request did not give status failed")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return result


if __name__ == "__main__":
    sys.exit(main())

"""Grading overlapped with rollouts (issue 40 item 4): the agent loop's wall time for the same
groups with grading in line, grading in the environment threads holding the group's slot (the
loop without `--grader-workers`), and a grader pool (`--grader-workers N`).

A scripted engine (tests/support/agent_fakes.py) that sleeps `--engine-s` per generate call,
3-turn episodes, groups of `--n`, and a grader that sleeps `--grade-s` per group. CPU only.

    .venv/bin/python scripts/bench_grader_overlap.py --groups 16 --grade-s 0.5
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]     # this checkout's package, the fakes
from support import agent_fakes as F  # noqa: E402

from gagar_jax.rollout.agent_loop import AgentLoop, AgentOptions  # noqa: E402
from gagar_jax.rollout.engine import SamplingSpec  # noqa: E402


class SlowEngine(F.ScriptedEngine):
    def __init__(self, engine_s):
        super().__init__(version=0)
        self.engine_s = engine_s

    def generate(self, requests):
        time.sleep(self.engine_s)
        return super().generate(requests)


def run(args, threads, workers):
    def grader(task, views):
        time.sleep(args.grade_s)
        return [{"quality": {"tier": "strong", "rank": 0}} for _ in views]
    opts = AgentOptions(n=args.n, max_turns=8, threads=threads,
                        concurrent_groups=args.concurrent_groups)
    loop = AgentLoop(SlowEngine(args.engine_s), F.make_env, F.Tok(), SamplingSpec(max_tokens=4),
                     opts, grader=grader, grader_name="sleep", grader_workers=workers)
    out, started = [], 0
    loop.emit = lambda rec, info: out.append(info)
    t0 = time.perf_counter()
    while len(out) < args.groups:
        while loop.room > 0 and started < args.groups:
            loop.start({"task_id": f"b{workers}-{threads}-{started}", "turns": 3, "obs": 2,
                        "n": args.n, "pass": [True] + [False] * (args.n - 1)})
            started += 1
        loop.tick(0.005)
    wall = time.perf_counter() - t0
    loop.close()
    lat = [i["grade_s"] for i in out if i.get("grade_s") is not None]
    return wall, (sum(lat) / len(lat) if lat else None)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--concurrent-groups", type=int, default=2)
    p.add_argument("--engine-s", type=float, default=0.05)
    p.add_argument("--grade-s", type=float, default=0.5)
    p.add_argument("--workers", type=int, default=4)
    args = p.parse_args()
    inline, _ = run(args, threads=False, workers=0)
    held, _ = run(args, threads=True, workers=0)
    pooled, lat = run(args, threads=True, workers=args.workers)
    print(f"{args.groups} groups of {args.n}, {args.concurrent_groups} concurrent, engine "
          f"{args.engine_s} s/call, grading {args.grade_s} s/group")
    print(f"grading in line (no overlap):          {inline:7.2f} s")
    print(f"grading in env threads, slot held:     {held:7.2f} s")
    print(f"grader pool, {args.workers} workers:                {pooled:7.2f} s "
          f"(mean latency submit->answer {lat:.2f} s)")
    print(f"ratio no overlap / pool: {inline / pooled:.2f}x; slot held / pool: "
          f"{held / pooled:.2f}x")


if __name__ == "__main__":
    main()

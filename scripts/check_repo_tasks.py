"""Checks repository tasks the way episodes judge them (docs/rollout.md, "Adding tasks"): the
repository as shipped fails, the reference fix passes with exactly `expected_tests` test cases,
a special-cased fix (special_case.diff, optional) fails the held-out tests.

    .venv/bin/python scripts/check_repo_tasks.py                  # the shipped tasks
    .venv/bin/python scripts/check_repo_tasks.py my_tasks/ other/ # task roots of your own

Exits 1 when a task has a problem (one line each).
"""
import argparse
import sys
import time

from gagar_jax.rollout.envs import repo_tasks, repo_verdict, sandbox


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("roots", nargs="*", help="task roots (default: $GAGAR_REPO_TASKS or the "
                                             "shipped data/repo_tasks)")
    args = ap.parse_args(argv)
    config = sandbox.SandboxConfig()
    broken = sandbox.check_interpreter(config)
    if broken:
        print(broken, file=sys.stderr)
        return 2
    bad = 0
    for task in repo_tasks.load_tasks(args.roots or None):
        t0 = time.monotonic()
        problems = repo_verdict.check_task(task, config)
        bad += bool(problems)
        status = "ok" if not problems else "PROBLEM"
        print(f"{task.task_id:24s} {task.bug_class:18s} {status} ({time.monotonic() - t0:.1f} s)")
        for p in problems:
            print(f"  {p}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""A minimal feed producer: publishes one spool shard of graded groups, atomically.

Any language works the same way: write the shard under a temporary name that the learner
ignores (leading "." or trailing ".tmp"), then rename it to its final *.jsonl name.

Usage:
  python scripts/example_producer.py --spool /tmp/spool --policy-version 0
"""
import argparse
import json
import os
import time


def group(i, policy_version):
    def traj(j, outcome, quality=None):
        tokens = [1, 17, 42, 9, 77, 78, 79, 5, 3, 80, 81]          # prompt | model | tool | model
        mask = [0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
        t = {"trajectory_id": f"g{i}-t{j}", "tokens": tokens, "loss_mask": mask,
             "logprobs": [-0.5 if m else 0.0 for m in mask], "outcome": outcome, "hacked": False}
        return t | ({"quality": quality} if quality else {})

    return {
        "schema_version": 1,
        "group_id": f"example-{time.time_ns()}-{i}",
        "task_id": f"task-{i}",
        "policy_version": policy_version,
        "grading": {"status": "ok", "grader": "example"},
        "trajectories": [
            traj(0, "pass", {"tier": "strong", "rank": 1}),
            traj(1, "pass", {"tier": "intermediate", "rank": 2}),
            traj(2, "fail"),
            traj(3, "infra_error"),
        ],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spool", required=True)
    p.add_argument("--policy-version", type=int, default=0)
    p.add_argument("--groups", type=int, default=8)
    args = p.parse_args()
    os.makedirs(args.spool, exist_ok=True)
    name = f"{time.time_ns():020d}-{os.getpid()}.jsonl"       # names sort by publish time
    tmp = os.path.join(args.spool, "." + name + ".tmp")
    with open(tmp, "w") as f:
        for i in range(args.groups):
            f.write(json.dumps(group(i, args.policy_version)) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, os.path.join(args.spool, name))            # atomic publish
    print(f"published {args.groups} groups as {name}")


if __name__ == "__main__":
    main()

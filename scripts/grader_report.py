"""Grader report (issue 40 item 5): tier stability across candidate orderings, agreement between
two graders, and the factor table's sensitivity on the learner's own advantage math.

    .venv/bin/python scripts/grader_report.py [--grader-b module:name] [--orderings 4]
    GAGAR_JUDGE_URL=http://127.0.0.1:8000/v1 GAGAR_JUDGE_MODEL=judge .venv/bin/python \
        scripts/grader_report.py --grader-b gagar_jax.rollout.grading.llm:grader --tasks 5

The groups: the 20 repository tasks' planted groups (`tests/support/planted.py`: the reference
fix, a sprawling fix, the special-cased fix, all graded as passes, and one failure), in real
workspaces. Grader A is `--grader-a` (default the heuristic); grader B (`--grader-b`, e.g. the
LLM grader's `module:grader`) is optional.

- Stability: each group graded under `--orderings` permutations of its candidates (ids kept);
  the share of candidates whose tier is the same in every ordering, and the mean Kendall's tau
  between each ordering's ranking and the first.
- Agreement (with B, e.g. the LLM grader and the heuristic): per group both rankings and their
  Kendall's tau-b (`answer.kendall_tau`, ties allowed), then the share of candidates both put in
  the same tier and the mean tau over the groups both graded; B's failed groups are listed.
- Sensitivity: each factor of the table (`gagar_jax.grading.FactorTable`) moved by -0.1 and
  +0.1 (clipped into (0, 1]); per move, the mean |change| of lambda, the cap rate, and the mean
  |change| of the passes' advantages, from `gagar_jax.algo.advantage.gagar_advantages`; lambda
  is checked against NumPy (k / sum f, capped) on every move.
"""
import argparse
import dataclasses
import importlib
import os
import random
import sys
import tempfile

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]     # this checkout's package, the fakes
from support import planted  # noqa: E402

from gagar_jax import grading  # noqa: E402
from gagar_jax.algo.advantage import gagar_advantages  # noqa: E402
from gagar_jax.rollout.envs import repo_tasks  # noqa: E402
from gagar_jax.rollout.grading import answer as judge_answer  # noqa: E402

KINDS = (("minimal", "pass"), ("sprawling", "pass"), ("special_case", "pass"), ("nothing", "fail"))


def load(spec):
    mod, _, name = spec.partition(":")
    return getattr(importlib.import_module(mod), name)


def kendall_tau(a, b):
    """Kendall's tau between two orders of the same items (lists of ids, best first): the
    judge answer's tau-b (`answer.kendall_tau`) on one tier ranked 0, 1, ... (no ties: tau-a)."""
    as_ranking = lambda order: [{"trajectory_id": x, "tier": "strong", "rank": i}
                                for i, x in enumerate(order)]
    return judge_answer.kendall_tau(as_ranking(a), as_ranking(b))


def ranked(answer):
    """(order best first, {id: tier}) of an adapter answer."""
    ev = answer["evidence"]["ranking"]
    order = [r["trajectory_id"] for r in sorted(
        ev, key=lambda r: (grading.tier_code(r["tier"]), r["rank"], r["trajectory_id"]))]
    return order, {r["trajectory_id"]: r["tier"] for r in ev}


def describe(answer):
    """A ranking as `t0:strong/0 t2:intermediate/0 ...`, best first."""
    order, _ = ranked(answer)
    by = {r["trajectory_id"]: r for r in answer["evidence"]["ranking"]}
    return " ".join(f"{t}:{by[t]['tier'][:3]}/{by[t]['rank']}" for t in order)


def numpy_lambda(k, f_sum, cap):
    return np.minimum(k / f_sum, cap)


def sensitivity(groups, lam_cap=1.5):
    """Rows (factor, delta, mean |d lambda|, cap rate, mean |d advantage| of passes)."""
    tiers_T = np.concatenate([g["tiers"] for g in groups])
    ranks_T = np.concatenate([g["ranks"] for g in groups])
    gid_T = np.concatenate([np.full(len(g["tiers"]), i) for i, g in enumerate(groups)])
    rewards_T = np.concatenate([g["rewards"] for g in groups]).astype(np.float32)
    G, T = len(groups), len(tiers_T)

    def run(table):
        f = grading.quality_factors(tiers_T, ranks_T, gid_T, table=table, num_groups=G)
        f = np.where(rewards_T > 0.5, f, 1.0).astype(np.float32)
        out = gagar_advantages(rewards_T, gid_T.astype(np.int32), f, np.ones(T, bool),
                               np.zeros(T, bool), np.ones(G, bool), num_groups=G,
                               lam_cap=lam_cap)
        k = np.bincount(gid_T, rewards_T, G)
        fs = np.bincount(gid_T, np.where(rewards_T > 0.5, f, 0.0), G)
        lam_np = numpy_lambda(k, fs, lam_cap)
        np.testing.assert_allclose(np.asarray(out.lam), lam_np, rtol=1e-5)
        return np.asarray(out.lam), np.asarray(out.capped), np.asarray(out.advantages)

    base = grading.FactorTable()
    lam0, cap0, adv0 = run(base)
    rows = [("(base table)", 0.0, float("nan"), 0.0, float(cap0.mean()), 0.0)]
    for field in dataclasses.fields(base):
        for d in (-0.1, 0.1):
            v = float(np.clip(getattr(base, field.name) + d, 1e-3, 1.0))
            lam, capped, adv = run(dataclasses.replace(base, **{field.name: v}))
            passes = rewards_T > 0.5
            rows.append((field.name, d, v, float(np.abs(lam - lam0).mean()),
                         float(capped.mean()), float(np.abs(adv - adv0)[passes].mean())))
    return lam0, rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grader-a", default="gagar_jax.rollout.grading.heuristic:grader")
    p.add_argument("--grader-b", default="")
    p.add_argument("--orderings", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tasks", type=int, default=0, help="the first N tasks only (0 = all 20)")
    args = p.parse_args()
    ga = load(args.grader_a)
    gb = load(args.grader_b) if args.grader_b else None
    rng = random.Random(args.seed)
    same_tier, taus, agree, agree_tau, groups, failed_b = [], [], [], [], [], []
    with tempfile.TemporaryDirectory() as root:
        for task in repo_tasks.load_tasks()[:args.tasks or None]:
            t, views = planted.group(task, root, KINDS)
            first_order, first_tiers, tiers_seen = None, None, []
            for o in range(args.orderings):
                vs = list(views)
                if o:
                    rng.shuffle(vs)
                order, tiers = ranked(ga(t, vs))
                tiers_seen.append(tiers)
                if first_order is None:
                    first_order, first_tiers = order, tiers
                else:
                    taus.append(kendall_tau(first_order, order))
            same_tier += [all(ts[c] == first_tiers[c] for ts in tiers_seen) for c in first_tiers]
            if gb is not None:
                a, b = ga(t, views), gb(t, views)
                if b["status"] != "ok":
                    failed_b.append(f"{task.task_id}: {b['evidence'].get('error')}")
                else:
                    tiers_b = ranked(b)[1]
                    agree += [tiers_b.get(c) == first_tiers[c] for c in first_tiers]
                    tau = judge_answer.kendall_tau(a["evidence"]["ranking"],
                                                   b["evidence"]["ranking"])
                    agree_tau.append(tau)
                    print(f"  {task.task_id:22s} A {describe(a)}  B {describe(b)}  "
                          f"tau-b {tau:+.3f}", flush=True)
            ids = [v["trajectory_id"] for v in views]
            rank_of = {}
            for r in ga(t, views)["evidence"]["ranking"]:
                rank_of[r["trajectory_id"]] = (grading.tier_code(r["tier"]), r["rank"])
            groups.append({"tiers": np.array([rank_of.get(i, (-2, 0))[0] for i in ids]),
                           "ranks": np.array([rank_of.get(i, (-2, 0))[1] for i in ids]),
                           "rewards": np.array([v["outcome"] == "pass" for v in views])})
    print(f"groups: {len(groups)} (planted: reference, sprawling, special-cased, failure)")
    print(f"stability over {args.orderings} orderings: same tier {np.mean(same_tier):.3f} of "
          f"candidates; mean Kendall tau vs the first ordering "
          f"{np.mean(taus) if taus else float('nan'):.3f}")
    if gb is not None:
        print(f"agreement A vs B over {len(agree_tau)} groups graded by both: same tier "
              f"{np.mean(agree) if agree else float('nan'):.3f} of candidates; Kendall tau-b "
              f"per group above, mean {np.mean(agree_tau) if agree_tau else float('nan'):.3f}; "
              f"B failed on {len(failed_b)} groups")
        for line in failed_b:
            print(f"  B failed: {line}")
    lam0, rows = sensitivity(groups)
    print(f"base table: mean lambda {lam0.mean():.4f}")
    print(f"{'factor':20s} {'delta':>6s} {'value':>6s} {'|d lambda|':>11s} {'cap rate':>9s} "
          f"{'|d adv| passes':>15s}")
    for name, d, v, dl, cap, da in rows:
        print(f"{name:20s} {d:+6.1f} {v:6.2f} {dl:11.4f} {cap:9.3f} {da:15.4f}")


if __name__ == "__main__":
    main()

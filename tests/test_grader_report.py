"""scripts/grader_report.py's measures, checked by hand: Kendall's tau and the factor table's
sensitivity on the learner's advantages (lambda = min(k / sum f, cap))."""
import grader_report  # scripts/grader_report.py (pytest puts scripts/ on the path)
import numpy as np
import pytest


@pytest.fixture(scope="module")
def report():
    return grader_report


def test_kendall_tau_by_hand(report):
    assert report.kendall_tau(list("abc"), list("abc")) == 1.0
    assert report.kendall_tau(list("abc"), list("cba")) == -1.0
    assert report.kendall_tau(list("abc"), list("bac")) == pytest.approx(1 / 3)  # 2 of 3 agree


def test_sensitivity_moves_lambda_and_the_cap_as_computed_by_hand(report):
    # one group: strong, intermediate, defective passes and a failure; k = 3
    groups = [{"tiers": np.array([0, 1, 2, -2]), "ranks": np.array([0, 0, 0, 0]),
               "rewards": np.array([True, True, True, False])}]
    lam0, rows = report.sensitivity(groups, lam_cap=1.5)
    assert lam0[0] == pytest.approx(3 / (1.0 + 0.85 + 0.2), rel=1e-5)       # 1.463, uncapped
    by = {(r[0], r[1]): r for r in rows}
    _, _, v, dlam, cap, dadv = by[("defective", -0.1)]
    assert v == pytest.approx(0.1) and cap == 1.0                           # 3 / 1.95 > 1.5
    assert dlam == pytest.approx(1.5 - 3 / 2.05, rel=1e-4) and dadv > 0
    _, _, _, dlam, cap, _ = by[("defective", 0.1)]
    assert cap == 0.0 and dlam == pytest.approx(3 / 2.05 - 3 / 2.15, rel=1e-4)
    assert by[("strong_best", 0.1)][3] == 0.0          # clipped at 1.0: nothing moves



def tau_b_by_hand(key_a, key_b):
    """Kendall's tau-b from {id: (tier code, rank)} keys, pair by pair."""
    ids = sorted(key_a)
    sign = [((key_a[x] > key_a[y]) - (key_a[x] < key_a[y]),
             (key_b[x] > key_b[y]) - (key_b[x] < key_b[y]))
            for i, x in enumerate(ids) for y in ids[i + 1:]]
    conc = sum(a * b > 0 for a, b in sign)
    disc = sum(a * b < 0 for a, b in sign)
    ta = sum(a == 0 and b != 0 for a, b in sign)
    tb = sum(b == 0 and a != 0 for a, b in sign)
    return (conc - disc) / np.sqrt((conc + disc + ta) * (conc + disc + tb))


def test_agreement_per_group_and_mean(report, monkeypatch, capsys, tmp_path):
    """Grader B = A: tau 1 and the same tiers. B = an LLM grader whose scripted judge puts
    every candidate in "strong", ranked by id: each group's tau-b against the heuristic equals
    a pair-by-pair count, and the mean is theirs."""
    import json
    import sys
    import types

    from support import planted

    from gagar_jax import grading
    from gagar_jax.rollout.envs import repo_tasks
    from gagar_jax.rollout.grading import heuristic, llm, prompt
    from gagar_jax.rollout.grading.base import as_grader_fn

    class ById:
        count = staticmethod(prompt.approx_tokens)

        def ask(self, messages, schema):
            ids = [e["properties"]["trajectory_id"]["const"]
                   for e in schema["properties"]["ranking"]["prefixItems"]]
            return json.dumps({"ranking": [{"trajectory_id": t, "tier": "strong", "rank": i}
                                           for i, t in enumerate(sorted(ids))]})

    fake = types.ModuleType("fake_llm_b")
    fake.grader = as_grader_fn(llm.LLMGrader(ById(), orderings=2))
    monkeypatch.setitem(sys.modules, "fake_llm_b", fake)
    a = "gagar_jax.rollout.grading.heuristic:grader"
    results = {}
    for b in (a, "fake_llm_b:grader"):
        monkeypatch.setattr("sys.argv", ["grader_report.py", "--grader-b", b, "--tasks", "2",
                                         "--orderings", "2"])
        report.main()
        out = capsys.readouterr().out
        lines = [x for x in out.splitlines() if "tau-b" in x and x.startswith("  ")]
        assert len(lines) == 2, out
        taus = [float(x.split()[-1]) for x in lines]
        mean = float(out.split("per group above, mean ")[1].split(";")[0])
        assert mean == pytest.approx(np.mean(taus), abs=1e-3)
        results[b] = (taus, out)
    assert results[a][0] == [1.0, 1.0] and "same tier 1.000" in results[a][1]
    for task, tau in zip(repo_tasks.load_tasks()[:2], results["fake_llm_b:grader"][0],
                         strict=True):
        t, views = planted.group(task, str(tmp_path / task.task_id), report.KINDS)
        key_h = {r["trajectory_id"]: (grading.tier_code(r["tier"]), r["rank"])
                 for r in heuristic.grader(t, views)["evidence"]["ranking"]}
        key_b = {tid: (0, i) for i, tid in enumerate(sorted(key_h))}
        assert tau == pytest.approx(tau_b_by_hand(key_h, key_b), abs=1e-3), task.task_id

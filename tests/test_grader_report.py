"""scripts/grader_report.py's measures, checked by hand: Kendall's tau and the factor table's
sensitivity on the learner's advantages (lambda = min(k / sum f, cap))."""
import importlib.util
import os

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location(
        "grader_report", os.path.join(REPO, "scripts", "grader_report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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

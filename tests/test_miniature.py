"""The miniature's smoke test (`scripts/miniature.py --quick`: every arm through the product's
feed and train step, saved per run, resumed, reported) and its report and measurement helpers
checked by hand.
"""
import glob
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace as NS

import miniature  # scripts/miniature.py (pytest puts scripts/ on the path)
import numpy as np
from support.paths import REPO
from support.xla_flags import cpu_flags

from gagar_jax.sim import measure, report

ARMS = ("binary", "downweight_only", "sum_preserving", "control", "length_aware")


def _env():
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    # One CPU device: the smoke test checks the sweep's logic, not sharding (the sharded step
    # has its own tests), and single-device programs compile much faster. -O1, as for every
    # subprocess: the warm start and the sampler run many times (--quick compiles the train
    # steps, run only a few times, at -O0: the script's QUICK_STEP_OPTIONS).
    env["XLA_FLAGS"] = cpu_flags(1)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(REPO, ".cache", "jax"))
    # The script imports this checkout's gagar_jax (an editable install may point elsewhere).
    env["PYTHONPATH"] = REPO
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


def _quick(out):
    # --quick-long: --quick's shapes and arms with round three's Design B settings (its note
    # language, harsh factor table, top-p 0.9, 4 mini-batches) and round four's B-long
    # additions (the flaky runner, the length_aware arm, a cut-and-resumed run compared with
    # the uninterrupted one): one smoke test covers all three.
    cmd = [sys.executable, os.path.join(REPO, "scripts", "miniature.py"), "--quick-long", "--out",
           out]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_quick_sweep_runs_every_arm_saves_and_resumes(tmp_path, capsys):
    out = str(tmp_path / "out")
    stdout = _quick(out)
    files = sorted(glob.glob(os.path.join(out, "runs", "*.json")))
    assert [os.path.basename(f) for f in files] == sorted(f"{a}-s0.json" for a in ARMS)
    runs = {}
    for f in files:
        with open(f) as fh:
            r = json.load(fh)
        rows = r["rows"]
        assert [x["step"] for x in rows] == [0, 1, 2]
        runs[r["arm"]] = rows
        trained = [x for x in rows[:-1] if x.get("loss") is not None]
        assert trained, f"{r['arm']}: no step trained"
        for x in rows[:-1]:
            assert 0 <= x["train_pass_rate"] <= 1 and x["train_mean_generated"] > 0
            assert x["probe_entropy"] > 0 and x["train_entropy"] > 0
        assert rows[0]["kl_ref"] is not None and abs(rows[0]["kl_ref"]) < 1e-3  # step 0 = warm
    # Common random numbers: step 0 samples the same batch with the same policy in every arm.
    for key in ("train_pass_rate", "train_mean_generated", "train_entropy", "probe_entropy"):
        assert len({runs[a][0][key] for a in ARMS}) == 1, key
    # Credit: binary and sum-preserving are net-zero; downweight-only and the control have the
    # same net credit at step 0 (the same batch, the same factors), and it is negative.
    assert abs(runs["binary"][0]["net_credit_per_seq"]) < 1e-5
    assert abs(runs["sum_preserving"][0]["net_credit_per_seq"]) < 1e-5
    dw, ctl = runs["downweight_only"][0], runs["control"][0]
    assert dw["net_credit_per_seq"] <= 0
    assert math.isclose(dw["net_credit_per_seq"], ctl["net_credit_per_seq"], rel_tol=1e-3,
                        abs_tol=1e-5)
    for name in ("table.md", "criteria.md", "steps.csv", "curves.png"):
        assert os.path.exists(os.path.join(out, name)), name
    # Design B's settings reached the sweep: notes were sampled, the harsh table set the factors
    # (no default-table factor is below 0.2 or between 0.9 and 1), top-p is recorded.
    with open(os.path.join(out, "meta.json")) as f:
        args = json.load(f)["args"]
    assert args["top_p"] == 0.9 and args["factor_table"] == "harsh"
    assert "train.mini_batches=4" in args["set"]
    assert runs["binary"][0]["train_note_share"] > 0
    assert math.isfinite(runs["binary"][0]["train_entropy_note"])
    # The flaky runner: no estimate before the first batch (q = 0), then q = 1 - 0.5 / p_hat
    # once the true pass rate is above the target; flaked passes are reported as failures.
    assert args["flaky_target"] == 0.5
    for rows in runs.values():
        assert rows[0]["flake_prob"] == 0.0
        for x in rows[:-1]:
            assert x["train_true_pass_rate"] >= x["train_pass_rate"]
            assert x["train_flaked"] == 0 or x["flake_prob"] > 0
    # The learner's credit metrics reach the rows: zero-sum per trajectory in binary,
    # sum_preserving and length_aware only if all lengths are equal, so just finite there.
    for arm in ("binary", "sum_preserving"):
        assert abs(runs[arm][0]["net_credit_per_traj"]) < 1e-5
    for arm in ARMS:
        assert -1 <= runs[arm][0]["token_net_frac"] <= 1
    assert runs["downweight_only"][0]["net_credit_per_traj"] < 0
    assert "resume check: a run cut at step 1 and resumed gave the sweep's 3 rows" in stdout
    # A rerun skips every finished run (and the resume check) and only rewrites the report. It
    # runs in this process: skipping compiles nothing, so a second subprocess would only add an
    # interpreter and a JAX start.
    os.remove(os.path.join(out, "table.md"))
    capsys.readouterr()
    assert miniature.main(["--quick-long", "--out", out]) == 0
    stdout = capsys.readouterr().out
    assert stdout.count("skip ") == len(ARMS) and "saved " not in stdout
    assert "resume check" not in stdout and os.path.exists(os.path.join(out, "table.md"))


def _row(step, **kw):
    return {"step": step, **kw}


def test_criteria_by_hand():
    # 6 seeds, 12 steps; entropy: step 0 = 0.4 everywhere; last 10 steps (rows 2..11; row 12
    # is the final evaluation) constant per arm and seed.
    def run(e_last, length, strong=0.5):
        rows = [_row(0, train_entropy=0.4, train_mean_generated=10.0)]
        rows += [_row(t, train_entropy=e_last, train_mean_generated=length,
                      heldout_strong_share=strong) for t in range(1, 13)]
        return rows
    runs = {}
    for s in range(6):
        runs[f"downweight_only/{s}"] = run(0.9 + 0.01 * s, 20.0)
        runs[f"control/{s}"] = run(0.5 if s < 3 else 0.3, 20.0)
        runs[f"sum_preserving/{s}"] = run(0.45, 12.0, strong=0.6)
        runs[f"binary/{s}"] = run(0.43, 12.0, strong=0.5)
    got = {name: ok for name, ok, _ in report.criteria(runs)}
    names = list(got)
    assert [got[n] for n in names] == [True, True, True,      # downweight-only: all three
                                       False, False, True,    # control: 0.4 < 0.6; CI; length
                                       True, True]            # sum-preserving
    # The paired CI by hand: differences 0.45..0.50 vs sum_preserving.
    d = [0.9 + 0.01 * s - 0.45 for s in range(6)]
    m, lo, hi = report.t_ci(d)
    h = 2.570582 * np.std(d, ddof=1) / math.sqrt(6)
    assert math.isclose(m, np.mean(d)) and math.isclose(hi - m, h, rel_tol=1e-5)
    assert "| downweight_only: entropy (last 10 steps) >= 1.5x step 0 | yes |" in \
        report.criteria_markdown(runs)


def test_credit_metrics_by_hand():
    W, N = 200, 14      # a note word, NOTE; 99 an action token
    def traj(tid, gen):     # 3 prompt tokens, then the generated ones
        return NS(trajectory_id=tid, tokens=[1, 2, 3] + gen, loss_mask=[0] * 3 + [1] * len(gen))
    records = [NS(trajectories=[traj("a", [N, W, W, 99]), traj("b", [99] * 10)]),
               NS(trajectories=[traj("c", [N, W])])]
    info = NS(trajectory_ids=(("a", "b"), ("c",)), traj_slots=((2, 0), (1,)))
    adv_T = np.array([-0.5, 0.25, 0.4])     # b = -0.5, c = 0.25, a = 0.4
    out_T = np.array([-0.5, 0.5, 0.5])
    m = measure.credit_metrics(records, info, adv_T, out_T)
    assert math.isclose(m["net_credit_per_seq"], (0.4 - 0.5 + 0.25) / 3)
    assert math.isclose(m["net_credit_tokens"], 0.4 * 4 - 0.5 * 10 + 0.25 * 2)
    assert math.isclose(m["net_credit_per_token"], (1.6 - 5.0 + 0.5) / 16)
    # note tokens: a has 3 (NOTE and two words), c has 2, b none
    assert math.isclose(m["net_credit_per_note_token"], (0.4 * 3 + 0.25 * 2) / 5)
    assert math.isclose(m["outcome_credit_per_token"], (0.5 * 4 - 0.5 * 10 + 0.5 * 2) / 16)
    assert "outcome_credit_per_token" not in measure.credit_metrics(records, info, adv_T)


def test_strong_credit_share_by_hand():
    from gagar_jax.sim.experiment import strong_credit_share

    def traj(tid, tier):
        return NS(trajectory_id=tid, quality=NS(tier=tier) if tier else None)
    records = [NS(trajectories=[traj("a", "strong"), traj("b", "intermediate"), traj("c", None)]),
               NS(trajectories=[traj("d", "strong"), traj("e", None)])]
    # Slots are not in record order: the batch maps trajectory ids to slots.
    info = NS(trajectory_ids=(("a", "b", "c"), ("d", "e")), traj_slots=((3, 0, 1), (2, 4)))
    adv_T = np.array([0.3, -0.9, 0.5, 0.6, -0.5])   # b=0.3, c=-0.9, d=0.5, a=0.6, e=-0.5
    assert math.isclose(strong_credit_share(records, info, adv_T), (0.6 + 0.5) / (0.6 + 0.3 + 0.5))
    assert math.isnan(strong_credit_share(records, info, -np.abs(adv_T)))


def test_last_window_averages_the_last_10_steps_without_the_final_evaluation():
    # 40 RL steps: train metrics on rows 0..39, evaluations every 5 steps and at row 40.
    rows = [_row(t, train_entropy=float(t), **({"kl_ref": float(t)} if t % 5 == 0 else {}))
            for t in range(40)] + [_row(40, kl_ref=40.0)]
    assert report.last_window(rows, "train_entropy") == np.mean(np.arange(30, 40))
    assert report.last_window(rows, "kl_ref") == 32.5           # steps 30 and 35, not 40
    table = report.markdown_table({"binary/0": rows, "binary/1": rows})
    kl = next(line for line in table.splitlines() if line.startswith("| KL to warm start"))
    assert kl.split(" | ")[3:5] == ["32.5000 [32.5000, 32.5000]", "40.0000 [40.0000, 40.0000]"]


def test_bad_factor_table_is_one_clear_error(capsys):
    mod = miniature
    for bad in ("defective=2", "bogus=0.5", "strong_best"):
        try:
            mod.main(["--factor-table", bad, "--report", "--out", "/nonexistent"])
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"--factor-table {bad} accepted")
        err = capsys.readouterr().err
        assert err.startswith("error: --factor-table") and err.count("\n") == 1, err
    assert mod._table(mod._args(["--factor-table", "harsh"])).defective == 0.1


def test_design_b_criteria_by_hand():
    def run(note):
        return [_row(t, train_entropy_note=note) for t in range(40)] + [_row(40)]
    topp, exact = {}, {}
    for s in range(3):
        topp[f"sum_preserving/{s}"] = run(0.5)
        topp[f"downweight_only/{s}"] = run(0.56 + 0.01 * s)
        topp[f"control/{s}"] = run(0.58)
    exact["sum_preserving/0"], exact["downweight_only/0"] = run(0.5), run(0.53)
    got = report.criteria_b(topp, exact)
    assert [ok for _, ok, _ in got] == [True, False, True]
    assert got[1][2] == "+0.0300, 1 seed(s)"
    assert [ok for _, ok, _ in report.criteria_b({}, {})] == [False, False, False]


def test_criteria_long_by_hand():
    """Round four's L1-L5 on runs built by hand: 3 seeds, 120 steps, the window = steps 110-119
    (row 120 is the final evaluation)."""
    def run(e_win, net=-0.1, tokens=18.0, turns=2.0, credit=(1.0, 1.0), final_pass=0.6):
        rows = [_row(0, train_entropy_note=1.0, net_credit_per_traj=net, train_mean_generated=10.0,
                     train_mean_turns=2.0, token_net_credit=credit[0],
                     token_outcome_credit=credit[1])]
        rows += [_row(t, train_entropy_note=1.0 if t < 110 else e_win, net_credit_per_traj=net,
                      train_mean_generated=tokens, train_mean_turns=turns,
                      token_net_credit=credit[0], token_outcome_credit=credit[1])
                 for t in range(1, 120)]
        return rows + [_row(120, heldout_true_pass_rate=final_pass)]

    def runs(**arms):
        return {f"{a}/{s}": rows for a, per_seed in arms.items() for s, rows in enumerate(per_seed)}
    topp = runs(downweight_only=[run(1.45, tokens=20.0), run(1.5, tokens=20.5),
                                 run(1.55, tokens=21.0)],
                sum_preserving=[run(1.0, credit=(1.4, 1.0), final_pass=0.62)] * 3,
                length_aware=[run(1.02, final_pass=0.6)] * 3)
    exact = runs(downweight_only=[run(1.02)] * 3, sum_preserving=[run(1.0)] * 3)
    got = {name[:2]: (v, ev) for name, v, ev in report.criteria_long(topp, exact)}
    # L1: differences 0.45, 0.5, 0.55: mean 0.5, t-interval 0.5 +- 4.303 x 0.05 / sqrt(3).
    assert got["L1"][0] == "yes" and "+0.500 [+0.376, +0.624]" in got["L1"][1]
    assert got["L2"][0] == "yes" and got["L2"][1].startswith("+0.020")
    assert got["L3"][0] == "yes" and "downweight_only +0.500, sum_preserving +0.000" in got["L3"][1]
    # L4: tokens +2.5 [CI above 0] but turns equal: not met.
    assert got["L4"][0] == "no" and "train_mean_generated +2.500" in got["L4"][1]
    assert got["L5"][0] == "yes" and "INV-1W holds, sum_preserving differs" in got["L5"][1]
    assert "pass rate -0.020" in got["L5"][1]
    # L3's condition: a net credit above -0.05 over the window makes it "not tested".
    topp["downweight_only/0"] = run(1.45, net=0.0)
    topp["downweight_only/1"] = run(1.5, net=0.0)
    got = {name[:2]: v for name, v, _ in report.criteria_long(topp, exact)}
    assert got["L3"] == "not tested"
    # A broken INV-1W in length_aware fails L5; missing arms are reported, not guessed.
    topp["length_aware/1"] = run(1.02, credit=(1.1, 1.0))
    assert [v for n, v, _ in report.criteria_long(topp, exact) if n.startswith("L5")] == ["no"]
    assert report.criteria_long({}, {})[0][1] == "missing runs"

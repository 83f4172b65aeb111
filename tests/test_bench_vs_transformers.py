"""scripts/bench_vs_transformers.py end to end on the tiny config: gagar_jax in this process,
transformers in its worker subprocess, same weights (their losses must agree, or the script
exits), every case timed in turns."""

import bench_vs_transformers
from support.paths import TINY_CONFIG


def test_tiny_run_in_two_processes(capsys):
    out = bench_vs_transformers.main([
        "--config", TINY_CONFIG, "--rows", "2", "--seq", "32",
        "--reps", "2", "--warm", "1", "--breakdown"])
    assert out["gagar_s"] > 0 and out["transformers_s"] > 0
    assert len(out["pair_ratios"]) == 2 and all(r > 0 for r in out["pair_ratios"])
    assert abs(out["ratio"] - sorted(out["pair_ratios"])[0] * 0.5
               - sorted(out["pair_ratios"])[1] * 0.5) < 1e-12     # the pairs' median
    assert out["cpu"] and "cores" in out["cpu"] and out["realtime"] is False
    assert set(out) >= {"trunk", "head"} and all(t > 0 for t in out["trunk"] + out["head"])
    text = capsys.readouterr().out
    assert "separate processes, warm 1" in text and "faults" in text and "rel diff" in text
    assert "pair ratio" in text and "median of 2 pairs" in text and "machine: " in text

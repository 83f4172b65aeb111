"""scripts/bench_device.py: runs on CPU with tiny shapes, and its import chain stays inside what
an accelerator image offers (no ml_collections, grain or msgspec)."""
import json
import os
import subprocess
import sys

import bench_device
import numpy as np
from support.paths import REPO

# Imported in a fresh interpreter with these packages made unimportable.
BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"ml_collections", "grain", "msgspec"}:
            raise ImportError("bench_device must not import " + name)
sys.meta_path.insert(0, Block())
sys.path.insert(0, %r)
import bench_device
print("ok")
"""


def test_import_chain_needs_no_config_or_feed_packages():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", BLOCKER % os.path.join(REPO, "scripts")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_bench_model_state_fits_in_60_gb():
    counts = bench_device.flops.param_counts(bench_device.BENCH)
    # fp32 params + grads + two Adam moments: 16 bytes per parameter.
    assert 16 * counts.total < 60e9 / 2           # half of 60 GB left for activations
    assert bench_device.BENCH.compute_dtype == "bfloat16"


def test_tiny_run_on_cpu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    # The quickest paths to compile (the CPU defaults, blockwise x grouped, take 2-3x longer).
    rows = bench_device.main(["--tiny", "--steps", "1", "--json", str(out),
                              "--attention", "plain", "--experts", "dense"])
    assert [(r["attention"], r["experts"]) for r in rows] == [("plain", "dense")]
    r = rows[0]
    assert r["finite"] and r["step_s"] > 0 and 0 < r["mfu"] < 1
    np.testing.assert_allclose(r["tokens_per_s"], 4 * 64 / r["step_s"])
    report = json.loads(out.read_text())
    assert report["platform"] == "cpu" and report["rows"][0]["tokens_per_s"] == r["tokens_per_s"]
    assert "| plain | dense |" in capsys.readouterr().out

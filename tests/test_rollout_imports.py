"""gagar_jax.rollout runs beside a rollout engine: importable without JAX (and without vLLM)."""
import json
import os
import subprocess
import sys

from support.paths import REPO


def test_rollout_package_imports_without_jax(tmp_path):
    fake = tmp_path / "fakejax"
    (fake / "jax").mkdir(parents=True)
    (fake / "jax" / "__init__.py").write_text(
        "raise ImportError('jax must not be imported here')\n")
    # The worker, its engine wrapper, the feed writer (with the learner's record schema), the
    # example task and the delta reader: everything the vLLM environment runs.
    code = ("import sys, gagar_jax.rollout, gagar_jax.rollout.vllm_extension as v, "
            "gagar_jax.rollout.delta as d, gagar_jax.rollout.vllm_fast_apply as f, "
            "gagar_jax.rollout.vllm_reload, gagar_jax.rollout.vllm_patch as p, "
            "gagar_jax.rollout.vllm_tiles; "
            "import gagar_jax.rollout.worker, gagar_jax.rollout.engine, "
            "gagar_jax.rollout.feed_writer, gagar_jax.rollout.example_task, gagar_jax.feed.schema; "
            "assert not {'jax', 'vllm'} & set(sys.modules), sorted(sys.modules); "
            "assert callable(v.GagarWorkerExtension.gagar_reload_latest); "
            "assert callable(v.GagarWorkerExtension.gagar_apply_version); "
            "assert callable(d.materialize) and callable(f.fast_apply) and callable(p.patch); "
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{REPO}"},
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_pointer_and_weight_files(tmp_path):
    from gagar_jax.rollout import read_latest, read_manifest
    from gagar_jax.rollout.delta import weight_files
    assert callable(read_manifest)   # the package's documented re-exports (its __all__)
    assert read_latest(str(tmp_path)) is None
    step = tmp_path / "published" / "step_00000004"
    step.mkdir(parents=True)
    (tmp_path / "published" / "latest").write_text(
        json.dumps({"step": 4, "policy_version": 4, "path": str(step)}))
    assert read_latest(str(tmp_path)) == {"step": 4, "policy_version": 4, "path": str(step)}
    assert weight_files(str(step)) == [str(step / "model.safetensors")]
    (step / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
        "c": "model-00001-of-00002.safetensors"}}))
    assert weight_files(str(step)) == [str(step / "model-00001-of-00002.safetensors"),
                                           str(step / "model-00002-of-00002.safetensors")]

"""gagar_jax.rollout runs beside a rollout engine: importable without JAX (and without vLLM)."""
import json
import os
import subprocess
import sys

import pytest
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
            "gagar_jax.rollout.vllm_tiles, gagar_jax.rollout.vllm_engine as e, "
            "gagar_jax.rollout.vllm_internals, gagar_jax.rollout.vllm_plans; "
            "import gagar_jax.rollout.worker, gagar_jax.rollout.engine, "
            "gagar_jax.rollout.feed_writer, gagar_jax.rollout.example_task, gagar_jax.feed.schema; "
            "assert not {'jax', 'vllm'} & set(sys.modules), sorted(sys.modules); "
            "assert callable(v.GagarWorkerExtension.gagar_reload_latest); "
            "assert callable(v.GagarWorkerExtension.gagar_apply_version); "
            "assert callable(d.materialize) and callable(f.fast_apply) and callable(p.patch); "
            "assert callable(e.make) and callable(e.VLLMEngine.generate); "
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{REPO}"},
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_worker_imports_the_engine_interface_only():
    """The worker and the interface load no vLLM module and no vLLM engine of ours: the engine
    comes from `--engine module:factory`."""
    code = ("import sys, gagar_jax.rollout.worker as w, gagar_jax.rollout.engine as e; "
            "bad = sorted(m for m in sys.modules if 'vllm' in m or m == 'torch'); "
            "assert not bad, bad; "
            "assert w.DEFAULT_ENGINE == 'gagar_jax.rollout.vllm_engine:make'; "
            "assert callable(w.load_callable(w.DEFAULT_ENGINE, '--engine')); "
            "assert 'gagar_jax.rollout.vllm_engine' in sys.modules; "
            "assert not any('vllm.' in m or m == 'vllm' for m in sys.modules); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": REPO}, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_vllm_engine_implements_the_interface():
    from gagar_jax.rollout.engine import Engine, EngineOptions, check_engine
    from gagar_jax.rollout.vllm_engine import VLLMEngine
    engine = VLLMEngine(llm=None, path="/nonexistent", options=EngineOptions())
    assert isinstance(engine, Engine) and check_engine(engine, "x:y") is engine
    with pytest.raises(TypeError, match="'x:y' returned a object, which lacks name, version"):
        check_engine(object(), "x:y")


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


def test_private_torch_and_vllm_apis_only_in_vllm_internals():
    """A vLLM upgrade touches one file: outside `rollout/vllm_internals.py` no module of
    rollout/ imports a vLLM submodule (only `from vllm import LLM, SamplingParams`) or a private
    torch module, or reads an underscored attribute of anything but `self`."""
    import ast
    import glob

    found = []
    for path in sorted(glob.glob(os.path.join(REPO, "gagar_jax", "rollout", "**", "*.py"),
                                 recursive=True)):
        if path.endswith("vllm_internals.py"):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            mods = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                    [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for m in mods:
                if m.startswith("vllm.") or m.startswith(("torch._", "torch.utils._")):
                    found.append(f"{os.path.basename(path)}:{node.lineno} imports {m}")
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and \
                    not node.attr.startswith("__") and not (
                        isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.append(f"{os.path.basename(path)}:{node.lineno} reads .{node.attr}")
    assert not found, found

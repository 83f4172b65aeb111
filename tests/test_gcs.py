"""The object-store paths on the real GCS client stack, against a local fake-gcs-server
(tests/support/gcs_emulator.py): gcsfs through etils.epath (audit files, ledger, spool, published
weights, HF checkpoints), tensorstore and google-cloud-storage through orbax (checkpoints).

Every gs:// test of the suite lives in this file, so one pytest-xdist worker starts the emulator.
Run it alone with `.venv/bin/python -m pytest -n 0 tests/test_gcs.py` (docs/reliability.md).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.parse
import urllib.request

import numpy as np
import pytest
from support.gcs_emulator import clear_client_caches
from support.paths import REPO
from support.paths import load_tiny_config as tiny_config
from support.trainer_runs import cmd, env, ledger_adds_up, shared_reference

SAMPLE = os.path.join(REPO, "data", "sample_feed.jsonl")


@pytest.fixture(scope="module")
def gcs(gcs_emulator):
    """This process's clients pointed at the emulator for the module (env, fsspec config)."""
    mp = pytest.MonkeyPatch()
    gcs_emulator.use(mp)
    yield gcs_emulator
    mp.undo()


@pytest.fixture
def prefix(gcs, request) -> str:
    """A gs:// prefix of this test's own (the emulator is shared by the session)."""
    clear_client_caches()
    return f"gs://{gcs.bucket}/{request.node.name}"


def _upload(gcs, uri: str, data: bytes) -> None:
    """One object written by a client other than ours (a producer on another machine): the
    JSON API's single-request upload, straight to the emulator."""
    bucket, name = uri.removeprefix("gs://").split("/", 1)
    url = (f"{gcs.url}/upload/storage/v1/b/{bucket}/o?uploadType=media&name="
           f"{urllib.parse.quote(name, safe='')}")
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/octet-stream"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


def _exists(uri: str) -> bool:
    """Whether an object exists now (our listing caches dropped first)."""
    from etils import epath
    clear_client_caches()
    return epath.Path(uri).exists()


def _read_json(uri: str):
    from etils import epath
    clear_client_caches()
    return json.loads(epath.Path(uri).read_text())


def _audit(uri: str) -> list:
    from gagar_jax.audit_file import read_lines
    clear_client_caches()
    return [json.loads(line) for line in read_lines(uri)]


def test_a_gcs_spool_sees_shards_that_another_process_uploads(gcs, prefix):
    """The spool lists the bucket afresh at every poll: gcsfs caches listings forever, so a
    shard uploaded after the first listing used to stay invisible (the feed waited forever)."""
    from gagar_jax.feed.sources import SpoolSource

    with open(SAMPLE, "rb") as f:
        lines = f.readlines()[:5]
    spool = f"{prefix}/spool"
    _upload(gcs, f"{spool}/a.jsonl", b"".join(lines[:3]))
    src = SpoolSource(spool, poll_s=0.05, timeout_s=2.0)
    first = [src.next_record() for _ in range(3)]          # listed once: a.jsonl only
    _upload(gcs, f"{spool}/b.jsonl", b"".join(lines[3:]))  # uploaded after that listing
    rest = [src.next_record() for _ in range(2)]
    assert None not in rest, "a shard uploaded after the first listing was never seen"
    assert [r.payload for r in first + rest] == lines
    assert [r.origin.rsplit("/", 1)[-1] for r in rest] == ["b.jsonl:0", "b.jsonl:1"]
    _upload(gcs, f"{spool}/_DONE", b"")
    t0 = time.monotonic()
    assert src.next_record() is None and time.monotonic() - t0 < 2    # ended by _DONE
    assert src.state()["consumed"].keys() == {"a.jsonl", "b.jsonl"}


def test_init_from_a_block_fp8_checkpoint_in_a_bucket(gcs, prefix, tmp_path):
    """A fresh run's `init_from` on gs:// (block-FP8 e4m3, 32 x 32 scale blocks, two safetensors
    files and an index): the start-up check reads its config.json, and the trainer's weight load
    (`init_weights.outside_weights`) gives exactly the dequantized weights, as from a local copy."""
    import jax
    import ml_dtypes
    from etils import epath
    from flax import nnx

    from gagar_jax.feed.config import FeedConfig
    from gagar_jax.hf import api as hf
    from gagar_jax.run import init_weights, train
    from gagar_jax.run.startup import check_hf_dir
    from gagar_jax.run.step import StepConfig, init_train_state
    from gagar_jax.sharding import make_mesh

    cfg = tiny_config()
    step_cfg = StepConfig.from_config(cfg)
    state, graphdef, shardings = init_train_state(step_cfg, make_mesh(cfg.mesh),
                                                  jax.random.PRNGKey(7))
    src = tmp_path / "src"
    hf.save_pretrained(nnx.merge(graphdef, state.params, state.router_bias), str(src))
    tensors = hf._reader(str(src))
    fp8, deq = {}, {}
    for name in sorted(tensors.names):
        w = tensors(name)
        if not (name.endswith("proj.weight") and w.ndim == 2):
            fp8[name] = deq[name] = w
            continue
        blocks = w.reshape(w.shape[0] // 32, 32, w.shape[1] // 32, 32)
        scale = (np.abs(blocks).max(axis=(1, 3)) / 448.0).astype(np.float32)
        q8 = (blocks / scale[:, None, :, None]).reshape(w.shape).astype(ml_dtypes.float8_e4m3fn)
        fp8[name], fp8[name + "_scale_inv"] = q8, scale
        deq[name] = (q8.astype(np.float32).reshape(blocks.shape)
                     * scale[:, None, :, None]).reshape(w.shape)
    config = json.loads((src / "config.json").read_text())
    bucket_dir = epath.Path(f"{prefix}/fp8")
    names = sorted(fp8)
    files = {"model-00001-of-00002.safetensors": names[::2],
             "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in files.items():
        hf.write_safetensors(str(bucket_dir / file), {n: fp8[n] for n in part})
    (bucket_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in files.items() for n in part}}))
    (bucket_dir / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32],
        "activation_scheme": "dynamic"}}))
    local = tmp_path / "dequantized"
    local.mkdir()
    hf.write_safetensors(str(local / "model.safetensors"), deq)
    (local / "config.json").write_text(json.dumps(config))

    with cfg.unlocked():
        cfg.train.init_from = str(bucket_dir)
    check_hf_dir(str(bucket_dir), "train.init_from", step_cfg.model,
                 FeedConfig.from_config(cfg.feed))
    rc = train.RunConfig.from_config(cfg)
    started = init_weights.outside_weights(state, rc.train, rc.step, shardings)
    want = init_weights.load_hf_params(str(local), step_cfg, state.params, shardings.params)
    got_leaves, want_leaves = jax.tree.leaves(started.params), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for a, b in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    q = "model.layers.1.self_attn.q_proj.weight"
    assert not np.array_equal(deq[q], tensors(q))       # really rounded: e4m3 lost bits
    assert not os.path.exists(os.path.join(REPO, "gs:")) and not os.path.exists("gs:")


def _stderr_has(path, needle: str) -> bool:
    with open(path) as f:
        return needle in f.read()


def _wait(proc, what: str, done, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited {proc.returncode} before {what}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"trainer: no {what} within {timeout:.0f} s")
        time.sleep(0.2)


def test_gcs_workdir_and_spool_survive_sigkill_and_resume_bit_exactly(
        gcs, prefix, tmp_path, tmp_path_factory):
    """A gs:// workdir fed by a gs:// spool trains, checkpoints (orbax on tensorstore),
    publishes (fp32) and writes its audit segments; SIGKILLed while idle after step 3 (the
    last checkpoint at step 2, step 3 published), it resumes, sees a shard uploaded while it
    waits, and ends bit-identical to the uninterrupted local reference run: the same
    params_sha256, the same group records once each, and published weights that hash alike."""
    ref_dir, ref = shared_reference(tmp_path_factory)
    from gagar_jax.audit_file import read_lines
    ref_groups = [json.loads(x) for x in read_lines(str(ref_dir / "groups.jsonl"))]
    ref_metrics = [json.loads(x) for x in read_lines(str(ref_dir / "metrics.jsonl"))]
    with open(SAMPLE, "rb") as f:
        lines = f.readlines()
    line_of = {json.loads(x)["group_id"]: i for i, x in enumerate(lines)}
    # Shard a holds the records of steps 1-3 exactly: the trainer then waits for more.
    n = 1 + max(line_of[g["group_id"]] for g in ref_groups if g["step"] <= 3)
    assert any(line_of[g["group_id"]] >= n for g in ref_groups if g["step"] == 4)

    spool, work = f"{prefix}/spool", f"{prefix}/work"
    _upload(gcs, f"{spool}/a.jsonl", b"".join(lines[:n]))
    args = cmd(work, "--config.feed.path=", f"--config.feed.spool_dir={spool}",
               "--config.feed.spool_poll_s=0.1", "--config.feed.spool_log_every_s=0.2",
               "--config.train.checkpoint_every=2", "--config.train.publish_every=1",
               "--config.train.publish_dtype=float32")
    run_env = {**env(), **gcs.env}

    err1 = tmp_path / "first.err"
    with open(err1, "w") as err:
        first = subprocess.Popen(args, cwd=REPO, env=run_env, stdout=subprocess.DEVNULL,
                                 stderr=err)
    try:
        _wait(first, "idle wait after step 3", lambda: (
            _stderr_has(err1, "waiting for the feed")
            and _exists(f"{work}/checkpoints/2/commit_success.txt")
            and (_read_json(f"{work}/published/latest")["step"] == 3
                 if _exists(f"{work}/published/latest") else False)))
        assert [m["step"] for m in _audit(f"{work}/metrics.jsonl")] == [1, 2, 3]
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert first.returncode == -signal.SIGKILL
    assert not _exists(f"{work}/summary.json")

    err2 = tmp_path / "resumed.err"
    with open(err2, "w") as err:
        resumed = subprocess.Popen(args, cwd=REPO, env=run_env, stdout=subprocess.DEVNULL,
                                   stderr=err)
    try:
        # Restored step 2, trained step 3 again, listed the spool and waits: then shard b.
        _wait(resumed, "idle wait after the resume",
              lambda: _stderr_has(err2, "waiting for the feed"))
        _upload(gcs, f"{spool}/b.jsonl", b"".join(lines[n:]))
        try:
            resumed.wait(120)
        except subprocess.TimeoutExpired:
            raise AssertionError("the resumed trainer never read the shard uploaded while it "
                                 "waited (stale spool listing?)") from None
    finally:
        if resumed.poll() is None:
            resumed.kill()
            resumed.wait()
    with open(err2) as f:
        assert resumed.returncode == 0, f.read()[-3000:]

    summary = _read_json(f"{work}/summary.json")
    assert summary["steps"] == 4 and summary["steps_this_run"] == 2
    assert summary["params_sha256"] == ref["params_sha256"]
    ledger_adds_up(summary["ledger"])
    assert summary["ledger"]["trained"] == ref["ledger"]["trained"]
    assert _read_json(f"{work}/ledger.json")["trained"] == ref["ledger"]["trained"]
    # Each audit line once, step 3's cut back from the checkpointed segment and written again.
    metrics = _audit(f"{work}/metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["loss"] for m in metrics] == [m["loss"] for m in ref_metrics]
    assert _audit(f"{work}/groups.jsonl") == ref_groups
    # Orbax committed step 2 (first run) and 4 (end of the resumed run) in the bucket.
    assert _exists(f"{work}/checkpoints/4/commit_success.txt")
    # The weights `latest` names are complete and are the final parameters, bit for bit.
    latest = _read_json(f"{work}/published/latest")
    assert latest["step"] == 4 and _exists(f"{latest['path']}/gagar_publish.json")
    from gagar_jax.hf import api as hf
    from gagar_jax.run.fingerprint import params_sha256
    from gagar_jax.run.step import split_model
    model, _ = hf.from_pretrained(latest["path"])
    assert params_sha256(split_model(model)[1]) == ref["params_sha256"]
    assert not os.path.exists(os.path.join(REPO, "gs:"))   # nothing local named after the URI

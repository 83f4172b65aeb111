"""Metrics: delayed host transfer, parameter fingerprints, JSONL/TensorBoard and audit logs."""
import glob
import hashlib
import io
import json
import os
import struct
import subprocess
import sys

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gagar_jax.algo.advantage import GroupOutcomes
from gagar_jax.algo.step_metrics import GroupAudit
from gagar_jax.feed.batcher import BatchInfo
from gagar_jax.run import metrics


def _params_np():
    rng = np.random.default_rng(1)
    return {
        "layers": {"0": {"w_DxF": rng.standard_normal((16, 8)).astype(np.float32)},
                   "1": {"w_DxF": rng.standard_normal((16, 8)).astype(np.float32)}},
        "emb_VxD": rng.standard_normal((8, 16)).astype(jnp.bfloat16),
        "norm_D": rng.standard_normal((16,)).astype(np.float32),
    }


def _put(params, mesh, spec_2d):
    def put(x):
        spec = spec_2d if x.ndim == 2 else P()
        return jax.device_put(x, NamedSharding(mesh, spec))
    return jax.tree.map(put, params)


# -- params_sha256 / params_l2 ------------------------------------------------------------------

def test_sha256_is_sharding_and_order_independent(devices):
    params = _params_np()
    reference = metrics.params_sha256(params)
    mesh8 = Mesh(np.array(devices).reshape(8), ("x",))
    mesh4 = Mesh(np.array(devices[:4]).reshape(2, 2), ("x", "y"))
    one = jax.sharding.SingleDeviceSharding(devices[3])
    assert metrics.params_sha256(_put(params, mesh8, P("x", None))) == reference
    assert metrics.params_sha256(_put(params, mesh8, P(None, "x"))) == reference
    assert metrics.params_sha256(_put(params, mesh4, P("y", "x"))) == reference
    assert metrics.params_sha256(jax.device_put(params, one)) == reference
    reordered = {"norm_D": params["norm_D"], "emb_VxD": params["emb_VxD"],
                 "layers": {"1": params["layers"]["1"], "0": params["layers"]["0"]}}
    assert metrics.params_sha256(reordered) == reference


def test_sha256_matches_independent_definition():
    # Not model parameters: one unit per row of the first axis; 0-d arrays are one unit.
    params = {"b": np.arange(3, dtype=np.float32), "a": np.ones((2, 2), np.int32),
              "c": np.float32(2.5)}
    h, total = hashlib.sha256(), 0.0
    for name, arr in (("['a']", params["a"]), ("['b']", params["b"]), ("['c']", params["c"])):
        units = [arr] if arr.ndim == 0 else list(arr)
        for u, unit in enumerate(units):
            header = json.dumps([name, arr.dtype.name, list(arr.shape), u]).encode()
            body = hashlib.sha256(
                np.asarray(unit).astype("<" + arr.dtype.str[1:]).tobytes()
            ).digest()
            h.update(struct.pack("<Q", len(header)) + header + body)
            total += float(np.sum(np.asarray(unit, np.float64) ** 2))
    assert metrics.params_sha256(params) == h.hexdigest()
    assert metrics.params_l2(params) == np.sqrt(total)   # 1+1+1+1 + 0+1+4 + 6.25


def test_sha256_changes_on_one_ulp_name_dtype_or_shape():
    params = _params_np()
    reference = metrics.params_sha256(params)
    bumped = jax.tree.map(np.copy, params)
    w = bumped["layers"]["1"]["w_DxF"]
    w[5, 3] = np.nextafter(w[5, 3], np.float32(np.inf))
    assert metrics.params_sha256(bumped) != reference
    renamed = {**params, "norm2_D": params["norm_D"]}
    del renamed["norm_D"]
    assert metrics.params_sha256(renamed) != reference
    recast = {**params, "emb_VxD": params["emb_VxD"].astype(np.float32)}
    assert metrics.params_sha256(recast) != reference
    reshaped = {**params, "norm_D": params["norm_D"].reshape(4, 4)}
    assert metrics.params_sha256(reshaped) != reference


@given(st.lists(st.sampled_from(["f32", "bf16", "i32"]), min_size=1, max_size=4),
       st.integers(0, 2**31 - 1))
def test_sha256_any_single_bit_flip_changes_it(dtypes, seed):
    rng = np.random.default_rng(seed)
    kinds = {"f32": np.float32, "bf16": jnp.bfloat16, "i32": np.int32}
    params = {f"p{i}": (rng.standard_normal(int(rng.integers(1, 6))) * 100).astype(kinds[d])
              for i, d in enumerate(dtypes)}
    reference = metrics.params_sha256(params)
    assert metrics.params_sha256(dict(reversed(list(params.items())))) == reference
    name = f"p{int(rng.integers(len(dtypes)))}"
    flipped = params[name].copy()
    raw = flipped.reshape(-1).view(np.uint8)
    bit = int(rng.integers(raw.size * 8))
    raw[bit // 8] ^= np.uint8(1 << (bit % 8))
    assert metrics.params_sha256({**params, name: flipped}) != reference


def test_params_l2_matches_numpy(devices):
    params = _params_np()
    expected = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(params)))
    mesh8 = Mesh(np.array(devices).reshape(8), ("x",))
    np.testing.assert_allclose(metrics.params_l2(params), expected, rtol=1e-6)
    np.testing.assert_allclose(metrics.params_l2(_put(params, mesh8, P("x", None))), expected,
                               rtol=1e-6)
    np.testing.assert_allclose(metrics.params_l2({"a": np.array([3.0, 4.0])}), 5.0, rtol=0)


# -- delayed metrics ----------------------------------------------------------------------------

@jax.jit
def _fake_step(x):
    return {"loss": jnp.mean(x), "lam": {"mean": jnp.max(x)}, "lam_G": x[:3],
            "bad": jnp.log(jnp.min(x))}


def test_to_host_classifies_scalars_arrays_and_nonfinite():
    prev = metrics.to_host(1, _fake_step(jnp.array([1.0, 2.0, 3.0, 4.0])))
    assert prev.step == 1
    assert prev.scalars == {"loss": 2.5, "lam/mean": 4.0, "bad": 0.0}
    assert isinstance(prev.scalars["loss"], float)
    np.testing.assert_array_equal(prev.arrays["lam_G"], [1.0, 2.0, 3.0])
    assert prev.finite
    last = metrics.to_host(2, _fake_step(jnp.array([0.0, 2.0, 4.0, 6.0])))
    assert last.step == 2 and last.scalars["loss"] == 3.0
    assert last.nonfinite == ("bad",) and not last.finite  # log(0) = -inf


@flax.struct.dataclass
class _Audit:
    lam_G: jax.Array


@flax.struct.dataclass
class _StepMetrics:
    loss: jax.Array
    audit: _Audit


def test_to_host_names_struct_fields():
    host = metrics.to_host(1, _StepMetrics(loss=jnp.float32(0.5), audit=_Audit(jnp.ones(3))))
    assert host.scalars == {"loss": 0.5}
    assert list(host.arrays) == ["audit/lam_G"]


def test_to_host_reports_nan():
    host = metrics.to_host(3, {"a": jnp.float32(np.nan), "b": np.float64(1.5), "c": 2})
    assert host.nonfinite == ("a",)
    assert host.scalars["b"] == 1.5 and host.scalars["c"] == 2.0


# -- group audit records ------------------------------------------------------------------------

def _info(group_ids, ids_T, group_index_T, infra_ids=None) -> BatchInfo:
    """A BatchInfo whose groups hold the slots t with ids_T[t] not None, in slot order."""
    G = len(group_ids)
    slots = [tuple(t for t, i in enumerate(ids_T) if i is not None and group_index_T[t] == g)
             for g in range(G)]
    return BatchInfo(
        group_ids=tuple(group_ids), task_ids=("task",) * G, policy_versions=(0,) * G,
        trajectory_ids=tuple(tuple(ids_T[t] for t in s) for s in slots),
        infra_ids=tuple(tuple(x) for x in (infra_ids or [()] * G)), traj_slots=tuple(slots),
        num_infra=(0,) * G, num_groups=G, num_trajectories=sum(map(len, slots)), num_tokens=0,
        num_generated_tokens=0, rows_used=0, packing_efficiency=0.0, counts={})


def _audit_inputs(rewards_T=None, hacked_T=None, infra_ids=None,
                  outcome_advantages_T=None, mixed_G=None):
    # G = 3 slots (2 real groups), T = 6 slots (5 real trajectories, slot 5 is padding).
    group_index_T = np.array([0, 1, 0, 1, 0, 0], np.int32)
    T = 6
    outcomes = GroupOutcomes(
        rewards_T=np.zeros(T, np.float32) if rewards_T is None else rewards_T,
        group_ids_T=group_index_T,
        factors_T=np.array([1.0, 0.4, 0.85, 1.0, 1.0, 1.0], np.float32),
        valid_T=np.array([True, True, True, True, False, False]),
        hacked_T=np.zeros(T, bool) if hacked_T is None else hacked_T,
        grading_ok_G=np.ones(3, bool))
    audit = GroupAudit(
        lam_G=np.array([1.25, 1.5, 1.0], np.float32),
        capped_G=np.array([False, True, False]), fallback_G=np.array([False, False, False]),
        mixed_G=np.zeros(3, bool) if mixed_G is None else mixed_G,
        advantages_T=np.array([0.5, -0.25, 0.125, 0.75, -1.0, 0.0], np.float32),
        outcome_advantages_T=(np.zeros(T, np.float32) if outcome_advantages_T is None
                              else outcome_advantages_T))
    info = _info(["task-a/0", "task-b/3"], ["a1", "b1", "a2", "b2", "a3", None], group_index_T,
                 infra_ids)
    return dict(step=7, info=info, outcomes=outcomes, audit=audit)


_FAIL = {"hacked": False, "outcome": "fail", "reward": 0.0, "outcome_advantage": 0.0}
EXPECTED_GROUPS = [
    {"step": 7, "group_id": "task-a/0", "lam": 1.25, "capped": False, "fallback": False,
     "mixed": False, "trajectories": [
         {"id": "a1", "factor": 1.0, "advantage": 0.5, "valid": True, **_FAIL},
         {"id": "a2", "factor": float(np.float32(0.85)), "advantage": 0.125, "valid": True,
          **_FAIL},
         {"id": "a3", "factor": 1.0, "advantage": -1.0, "valid": False, **_FAIL}]},
    {"step": 7, "group_id": "task-b/3", "lam": 1.5, "capped": True, "fallback": False,
     "mixed": False, "trajectories": [
         {"id": "b1", "factor": float(np.float32(0.4)), "advantage": -0.25, "valid": True,
          **_FAIL},
         {"id": "b2", "factor": 1.0, "advantage": 0.75, "valid": True, **_FAIL}]},
]


@given(st.integers(1, 6), st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_group_records_partition_trajectories(G, T, seed):
    """Every real trajectory appears exactly once, under its own group, in slot order."""
    rng = np.random.default_rng(seed)
    n_real_groups = int(rng.integers(0, G + 1))
    group_index_T = rng.integers(0, G, T).astype(np.int32)
    ids = [None if rng.random() < 0.2 else f"t{t}" for t in range(T)]
    outcomes = GroupOutcomes(rewards_T=rng.integers(0, 2, T).astype(np.float32),
                             group_ids_T=group_index_T, factors_T=rng.random(T),
                             valid_T=rng.random(T) < 0.8, hacked_T=np.zeros(T, bool),
                             grading_ok_G=np.ones(G, bool))
    audit = GroupAudit(lam_G=rng.random(G), capped_G=rng.random(G) < 0.5,
                       fallback_G=rng.random(G) < 0.5, mixed_G=rng.random(G) < 0.5,
                       advantages_T=rng.standard_normal(T), outcome_advantages_T=np.zeros(T))
    info = _info([f"g{g}" for g in range(n_real_groups)], ids, group_index_T)
    records = metrics.group_records(0, info, outcomes, audit)
    listed = [(r["group_id"], t["id"], t["advantage"]) for r in records for t in r["trajectories"]]
    expected = sorted(((f"g{group_index_T[t]}", ids[t]) for t in range(T)
                       if ids[t] is not None and group_index_T[t] < n_real_groups),
                      key=lambda x: (int(x[0][1:]), int(x[1][1:])))
    assert [(g, i) for g, i, _ in listed] == expected
    assert len(records) == n_real_groups


def test_group_records_contents():
    assert metrics.group_records(**_audit_inputs()) == EXPECTED_GROUPS
    extra = metrics.group_records(**_audit_inputs(
        mixed_G=np.array([True, False, False]),
        rewards_T=np.array([1, 0, 1, 1, 0, 0], np.float32),
        outcome_advantages_T=np.array([0.4, -0.5, 0.4, 0.5, -0.6, 0.0], np.float32)))
    assert [r["mixed"] for r in extra] == [True, False]
    assert extra[0]["trajectories"][1] == {
        **EXPECTED_GROUPS[0]["trajectories"][1], "reward": 1.0, "outcome": "pass",
        "outcome_advantage": float(np.float32(0.4))}
    assert [t["reward"] for t in extra[1]["trajectories"]] == [0.0, 1.0]
    # A hacked pass: outcome "pass", hacked true, effective reward 0; infra errors listed.
    hacked = metrics.group_records(**_audit_inputs(
        rewards_T=np.array([1, 0, 1, 1, 0, 0], np.float32),
        hacked_T=np.array([False, False, True, False, False, False]),
        infra_ids=[["a9"], []]))
    t = hacked[0]["trajectories"]
    assert [(x["id"], x["outcome"], x.get("hacked"), x.get("reward")) for x in t] == [
        ("a1", "pass", False, 1.0), ("a2", "pass", True, 0.0), ("a3", "fail", False, 0.0),
        ("a9", "infra_error", None, None)]
    assert t[-1] == {"id": "a9", "outcome": "infra_error", "valid": False, "advantage": 0.0}
    assert all(x["id"] != "a9" for x in hacked[1]["trajectories"])
    bad = _audit_inputs()
    with pytest.raises(ValueError, match="advantage"):
        metrics.group_records(**{**bad, "audit": bad["audit"].replace(advantages_T=np.zeros(5))})
    with pytest.raises(ValueError, match="group_ids"):
        metrics.group_records(**{**bad, "info": _info(["a", "b", "c", "d"], [None] * 6,
                                                      np.zeros(6, int))})


# -- writers ------------------------------------------------------------------------------------

def _read_tb_scalars(logdir):
    """Decodes TFRecord event files (length, crc, data, crc) into {tag: [(step, value)]}."""
    from tensorboardX.proto import event_pb2
    out = {}
    for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
        data = open(path, "rb").read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_tensorboard_writer_leaves_torch_unimported_and_importable(tmp_path):
    """tensorboardX would import torch (2.5 s per trainer start) to accept torch tensors; the
    writer loads it without, and a later `import torch` still works."""
    code = ("import sys; from gagar_jax.run import metrics; "
            f"w = metrics.MetricsWriter({str(tmp_path)!r}, enabled=True); "
            "w.write(0, {'loss': 1.5}); w.close(); "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "import importlib.util; assert importlib.util.find_spec('torch') is not None")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _read_tb_scalars(tmp_path / "tensorboard") == {"loss": [(0, 1.5)]}


def test_writer_jsonl_tensorboard_and_groups(tmp_path):
    writer = metrics.MetricsWriter(tmp_path)
    writer.write(1, {"loss": 0.5, "lam/mean": 1.25}, wall_time=100.0)
    host = metrics.to_host(2, {"loss": jnp.float32(np.inf), "lam/mean": jnp.float32(1.0)})
    writer.write(host.step, {**host.scalars, "tokens_per_s": 1000.0})
    writer.write_groups(metrics.group_records(**_audit_inputs()))
    writer.close()

    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert lines[0] == {"step": 1, "time": 100.0, "loss": 0.5, "lam/mean": 1.25}
    assert lines[1]["step"] == 2 and lines[1]["loss"] is None
    assert lines[1]["nonfinite"] == ["loss"] and lines[1]["tokens_per_s"] == 1000.0
    assert [json.loads(line) for line in open(tmp_path / "groups.jsonl")] == EXPECTED_GROUPS
    tb = _read_tb_scalars(tmp_path / "tensorboard")
    assert tb["loss"] == [(1, 0.5)]  # the inf is not sent to TensorBoard
    assert tb["lam/mean"] == [(1, 1.25), (2, 1.0)]
    assert tb["tokens_per_s"] == [(2, 1000.0)]

    # A resumed run appends to the same files.
    writer = metrics.MetricsWriter(tmp_path, tensorboard=False)
    writer.write(3, {"loss": 0.25})
    writer.close()
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_writer_disabled_writes_nothing(tmp_path):
    writer = metrics.MetricsWriter(tmp_path / "w", enabled=False)
    writer.write(1, {"loss": 1.0})
    writer.write_groups(EXPECTED_GROUPS)
    writer.close()
    assert not os.path.exists(tmp_path / "w")


def test_progress_line():
    text = metrics.progress_postfix(tokens_per_s=12345.6, loss=0.123456, lam=1.0625, groups=32)
    assert text == "tok/s=12,346 loss=0.1235 λ=1.062 groups=32"
    stream = io.StringIO()
    bar = metrics.Progress(total=10, initial=4, enabled=True, file=stream)
    bar.update(2, tokens_per_s=1.0, loss=0.5, lam=1.0, groups=3)
    bar.close()
    assert bar.n == 6
    assert "6/10" in stream.getvalue() and "loss=0.5 λ=1.000 groups=3" in stream.getvalue()
    quiet = io.StringIO()
    off = metrics.Progress(total=10, enabled=False, file=quiet)
    off.update(1, tokens_per_s=1.0, loss=0.5, lam=1.0, groups=3)
    off.close()
    assert quiet.getvalue() == ""


def test_audit_files_are_cut_back_to_checkpointed_positions(tmp_path, caplog, monkeypatch):
    seen = {}

    class FakeTB:
        def __init__(self, **kw):
            seen.update(kw)

        def add_scalar(self, *a, **k):
            pass

        flush = close = lambda self: None

    import tensorboardX
    monkeypatch.setattr(tensorboardX, "SummaryWriter", FakeTB)
    w = metrics.MetricsWriter(tmp_path, enabled=True)
    w.write(1, {"loss": 1.0})
    w.write_groups([{"step": 1, "group_id": "a"}])
    positions = {k: metrics.AuditPosition.from_json(v) for k, v in w.sync().items()}
    assert positions["metrics.jsonl"].length == os.path.getsize(tmp_path / "metrics.jsonl")
    w.write(2, {"loss": float("nan")})
    w.write_groups([{"step": 2, "group_id": "b", "factor": float("inf")}])
    w.close()
    kept = (tmp_path / "metrics.jsonl").read_text()
    # No positions (an old checkpoint): append, never cut.
    metrics.MetricsWriter(tmp_path, enabled=True, resume=None).close()
    assert (tmp_path / "metrics.jsonl").read_text() == kept
    assert json.loads(kept.splitlines()[1])["loss"] is None
    # Positions: everything after them goes; TensorBoard purges from the next step.
    metrics.MetricsWriter(tmp_path, enabled=True, resume=positions, purge_step=2).close()
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [1]
    assert [json.loads(x)["group_id"] for x in open(tmp_path / "groups.jsonl")] == ["a"]
    assert seen["purge_step"] == 2
    # A file shorter than its position is logged and never extended.
    os.truncate(tmp_path / "groups.jsonl", 3)
    with caplog.at_level("WARNING"):
        metrics.MetricsWriter(tmp_path, enabled=True, tensorboard=False, resume=positions).close()
    assert os.path.getsize(tmp_path / "groups.jsonl") == 3
    assert "shorter than the checkpointed" in caplog.text


def test_a_broken_destination_is_named_at_once(tmp_path):
    os.symlink("/dev/full", tmp_path / "groups.jsonl")
    w = metrics.MetricsWriter(tmp_path, enabled=True, tensorboard=False)
    w.write_groups([{"step": 1, "group_id": "a"}])
    with pytest.raises(OSError) as info:
        w.flush()
    assert info.value.errno == 28 and info.value.filename == str(tmp_path / "groups.jsonl")

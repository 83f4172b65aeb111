"""Checkpoints (state + feed + config together), fallback, resharding, and weight publishing."""
import json
import logging
import os
import threading
import time
from types import SimpleNamespace

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gagar_jax.run import checkpoint as ckpt
from gagar_jax.run import publish

# A failed orbax read (the corrupt-checkpoint tests) can leave tensorstore callbacks aimed at
# orbax's already-closed asyncio loop; Python reports them at garbage collection, possibly during
# a later test, as "Event loop is closed". Harmless: the failed read was already handled.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@flax.struct.dataclass
class FakeTrainState:
    """Same kinds of leaves as the trainer's TrainState."""
    step: jax.Array
    params: dict
    opt_state: optax.OptState
    rng: jax.Array
    router_bias: jax.Array
    skipped: jax.Array


def _mesh(devices, n):
    return Mesh(np.array(devices[:n]).reshape(n, 1), ("data", "fsdp"))


def _specs():
    """Per-leaf PartitionSpecs (params and the matching Adam moments)."""
    return {"w_DxF": P("data", None), "b_F": P("data"), "emb_VxD": P(None, "data")}


def _make_state(mesh):
    rng = np.random.default_rng(0)
    params = {
        "w_DxF": rng.standard_normal((16, 8)).astype(np.float32),
        "b_F": rng.standard_normal((8,)).astype(np.float32),
        "emb_VxD": rng.standard_normal((8, 16)).astype(jnp.bfloat16),
    }
    params = {k: jax.device_put(v, NamedSharding(mesh, _specs()[k])) for k, v in params.items()}
    opt_state = optax.adam(1e-3).init(params)
    # Non-trivial moments, so a restore that mixed leaves up would show.
    opt_state = jax.tree.map(lambda x: x + 0.5 if x.dtype != jnp.int32 else x + 3, opt_state)
    rep = NamedSharding(mesh, P())
    return FakeTrainState(
        step=jax.device_put(jnp.int32(7), rep), params=params, opt_state=opt_state,
        rng=jax.device_put(jax.random.key(42), rep),
        router_bias=jax.device_put(jnp.arange(8, dtype=jnp.float32) / 3, rep),
        skipped=jax.device_put(jnp.int32(1), rep))


def _abstract(state, mesh, transpose=False):
    """Abstract target on `mesh`; `transpose` swaps the sharded axis to exercise resharding."""
    def leaf(x):
        spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()
        if transpose and len(spec) == 2:
            spec = P(spec[1], spec[0])
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
    return jax.tree.map(leaf, state)


def _assert_bit_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb, strict=False):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(
            np.asarray(x).reshape(-1).view(np.uint8), np.asarray(y).reshape(-1).view(np.uint8)
        )


FEED = {"source": "jsonl", "files": ["a.jsonl", "b.jsonl"], "offset": 12345, "epoch": 1,
        "ledger": {"received": 40, "trained": 32, "quarantined": {"bad_tokens": 2}},
        "buffered": [0.25, 1e-300], "np_int": np.int64(9)}
CONFIG = {"seed": 0, "train": {"steps": 10, "checkpoint_every": 2}, "model": {"hidden_size": 64}}


@pytest.fixture(scope="module")
def mesh8(devices):
    return _mesh(devices, 8)


@pytest.fixture(scope="module")
def state8(mesh8):
    return _make_state(mesh8)


def _save_steps(directory, state, steps, *, interval=2, keep=3):
    mgr = ckpt.Checkpointer(directory, save_interval_steps=interval, max_to_keep=keep)
    written = [s for s in steps if mgr.save(s, state, {**FEED, "offset": s}, CONFIG)]
    mgr.wait_until_finished()
    return mgr, written


def test_round_trip_bit_exact(tmp_path, state8, mesh8):
    mgr, written = _save_steps(tmp_path, state8, [1, 2])
    assert written == [2]
    mgr.close()
    mgr = ckpt.Checkpointer(tmp_path, save_interval_steps=2)  # a fresh process would do this
    assert mgr.latest_step() == 2
    out = mgr.restore(_abstract(state8, mesh8))
    assert out.step == 2
    _assert_bit_equal(out.state, state8)
    assert out.state.params["w_DxF"].sharding == state8.params["w_DxF"].sharding
    assert out.feed == {**json.loads(json.dumps({**FEED, "np_int": 9})), "offset": 2}
    assert out.config == CONFIG
    assert sorted(os.listdir(tmp_path / "2")) == sorted(
        ["_CHECKPOINT_METADATA", "commit_success.txt", "state", "feed", "config"])
    assert out.audit is None        # saved without audit positions: resume does not truncate
    # With positions: stored as their own item, restored as saved.
    positions = {"metrics.jsonl": {"segment": "", "length": 123}}
    assert mgr.save(4, state8, FEED, CONFIG, audit=positions)
    mgr.wait_until_finished()
    out = mgr.restore(_abstract(state8, mesh8))
    assert out.step == 4 and out.audit == positions
    mgr.close()


def test_interval_keep_last_k_and_force(tmp_path, state8):
    mgr, written = _save_steps(tmp_path, state8, range(1, 10), interval=2, keep=2)
    assert written == [2, 4, 6, 8]
    assert mgr.all_steps() == [6, 8]
    # Preemption at an off-interval step: forced, synchronous once waited on.
    assert mgr.save(9, state8, FEED, CONFIG, force=True)
    mgr.wait_until_finished()
    assert mgr.all_steps() == [8, 9]
    assert not mgr.save(9, state8, FEED, CONFIG, force=True)  # never overwrites
    assert sorted(p for p in os.listdir(tmp_path) if p.isdigit()) == ["8", "9"]
    mgr.close()


def test_interval_zero_saves_only_when_forced(tmp_path, state8, mesh8):
    mgr, written = _save_steps(tmp_path, state8, range(1, 5), interval=0)
    assert written == [] and mgr.latest_step() is None
    # Config given as a ConfigDict (a JSON string works too); odd values are kept as text.
    config = ml_collections.ConfigDict({**CONFIG, "dtype": jnp.bfloat16})
    assert mgr.save(4, state8, FEED, config, force=True)
    mgr.wait_until_finished()
    assert mgr.all_steps() == [4]
    assert mgr.restore(_abstract(state8, mesh8)).config == {**CONFIG, "dtype": str(jnp.bfloat16)}
    mgr.close()


def test_async_save_survives_buffer_donation(tmp_path, state8, mesh8):
    """The loop donates the state to the next step right after `save` returns."""
    copy = jax.tree.map(lambda x: x.copy(), state8)
    mgr = ckpt.Checkpointer(tmp_path, save_interval_steps=1)
    assert mgr.save(1, copy, FEED, CONFIG)
    for leaf in jax.tree.leaves(copy):
        leaf.delete()  # what donation does to the old buffers
    mgr.wait_until_finished()
    _assert_bit_equal(mgr.restore(_abstract(state8, mesh8)).state, state8)
    mgr.close()


def test_reshard_8_to_4_devices(tmp_path, state8, devices):
    mgr, _ = _save_steps(tmp_path, state8, [2])
    mesh4 = _mesh(devices[4:], 4)  # 4 *other* devices, other axis sharded
    out = mgr.restore(_abstract(state8, mesh4, transpose=True))
    _assert_bit_equal(out.state, state8)
    w = out.state.params["w_DxF"]
    assert w.sharding.mesh.devices.size == 4 and w.sharding.spec == P(None, "data")
    assert {d.id for d in w.devices()} == {d.id for d in devices[4:]}
    assert w.addressable_shards[0].data.shape == (16, 2)
    mgr.close()


def _truncate_state(step_dir):
    for root, _, files in os.walk(step_dir / "state"):
        for name in files:
            if "ocdbt" in root or name.startswith("manifest"):
                with open(os.path.join(root, name), "r+b") as f:
                    f.truncate(3)


def _delete_feed(step_dir):
    os.remove(step_dir / "feed" / "metadata")


def _bad_json(step_dir):
    (step_dir / "config" / "metadata").write_text('{"seed": ')


def _delete_metadata(step_dir):
    os.remove(step_dir / "_CHECKPOINT_METADATA")


@pytest.mark.parametrize("corrupt", [_truncate_state, _delete_feed, _bad_json, _delete_metadata])
def test_corrupt_latest_falls_back_with_warning(tmp_path, state8, mesh8, caplog, corrupt):
    mgr, _ = _save_steps(tmp_path, state8, [2, 4])
    corrupt(tmp_path / "4")
    with caplog.at_level(logging.WARNING, logger="gagar_jax.run.checkpoint"):
        out = mgr.restore(_abstract(state8, mesh8))
    assert out.step == 2 and out.feed["offset"] == 2
    _assert_bit_equal(out.state, state8)
    assert any("step 4" in r.getMessage() and "falling back" in r.getMessage()
               for r in caplog.records)
    # The bad step is moved aside, so the run can write step 4 again after resuming at 2.
    assert mgr.latest_step() == 2
    assert any(p.startswith("4.corrupt-") for p in os.listdir(tmp_path))
    assert mgr.save(4, state8, FEED, CONFIG)
    mgr.wait_until_finished()
    assert mgr.restore(_abstract(state8, mesh8)).step == 4
    mgr.close()


def test_unfinalized_tmp_dir_is_ignored(tmp_path, state8, mesh8):
    mgr, _ = _save_steps(tmp_path, state8, [2, 4])
    mgr.close()
    # A save killed before its rename leaves only a tmp dir (no finalized step).
    os.rename(tmp_path / "4", tmp_path / "4.orbax-checkpoint-tmp-1700000000")
    mgr = ckpt.Checkpointer(tmp_path, save_interval_steps=2)
    assert mgr.latest_step() == 2
    assert mgr.restore(_abstract(state8, mesh8)).step == 2
    mgr.wait_until_finished()
    # Cleaned up at start, by orbax's background thread (which wait_until_finished does not
    # join): give a loaded machine a few seconds.
    deadline = time.monotonic() + 20
    while [p for p in os.listdir(tmp_path) if "tmp" in p] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in os.listdir(tmp_path) if "tmp" in p]
    mgr.close()


def test_restore_errors(tmp_path, state8, mesh8):
    mgr = ckpt.Checkpointer(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        mgr.restore(_abstract(state8, mesh8))
    no_sharding = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state8)
    with pytest.raises(ValueError, match="abstract_state"):
        mgr.restore(no_sharding)
    with pytest.raises(TypeError, match="feed"):
        mgr.save(1, state8, {"x": object()}, CONFIG, force=True)
    with pytest.raises(ValueError, match="save_interval_steps"):
        ckpt.Checkpointer(tmp_path / "y", save_interval_steps=-1)
    with pytest.raises(ValueError, match="max_to_keep"):
        ckpt.Checkpointer(tmp_path / "x", max_to_keep=0)
    mgr.close()


# -- weight publishing --------------------------------------------------------------------------

def _fake_save(payload_bytes=4096):
    """A stand-in for hf.save_pretrained: several files, the weights file written in chunks."""
    def save_fn(model, path):
        assert os.path.isdir(path) and not os.listdir(path)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"step": model}, f)
        with open(os.path.join(path, "model.safetensors"), "wb") as f:
            for _ in range(4):
                f.write(bytes([model % 256]) * (payload_bytes // 4))
    return save_fn


def _complete(path, step, payload_bytes=4096):
    files = set(os.listdir(path))
    if files != {"config.json", "model.safetensors", publish.MANIFEST}:
        return False
    with open(os.path.join(path, "model.safetensors"), "rb") as f:
        data = f.read()
    with open(os.path.join(path, publish.MANIFEST)) as f:
        marker = json.load(f)
    return data == bytes([step % 256]) * payload_bytes and (marker["step"], marker[
        "policy_version"], marker["kind"], marker["files"]) == (
        step, step, "full", ["config.json", "model.safetensors"])


def test_publish_pointer_and_keep(tmp_path):
    assert publish.read_latest(tmp_path) is None
    for step in (10, 20, 30, 40):
        path = publish.publish_weights(step, step, tmp_path, _fake_save(), keep=2)
        latest = publish.read_latest(tmp_path)
        assert latest == {"step": step, "policy_version": step, "path": path}
        assert _complete(path, step)
    assert publish.published_steps(tmp_path) == [30, 40]
    assert os.path.basename(path) == "step_00000040"


def test_publish_failure_keeps_previous_pointer(tmp_path):
    publish.publish_weights(1, 1, tmp_path, _fake_save())

    def crashing(model, path):
        _fake_save()(model, path)
        raise OSError("disk full")

    with pytest.raises(OSError):
        publish.publish_weights(2, 2, tmp_path, crashing)
    latest = publish.read_latest(tmp_path)
    assert latest["step"] == 1 and _complete(latest["path"], 1)
    assert publish.published_steps(tmp_path) == [1]
    # The next publish of that step clears the leftover temp dir.
    path = publish.publish_weights(2, 2, tmp_path, _fake_save())
    assert _complete(path, 2)
    assert not [p for p in os.listdir(tmp_path / "published") if p.startswith(".")]


def test_publish_republish_same_step_writes_a_new_directory(tmp_path):
    first = publish.publish_weights(5, 5, tmp_path, _fake_save())
    path = publish.publish_weights(5 + 256, 5, tmp_path, _fake_save())  # other bytes, step 5
    assert os.path.basename(path) == "step_00000005.a1"
    assert publish.read_latest(tmp_path)["path"] == path
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f) == {"step": 261}
    assert _complete(first, 5)          # the version `latest` named before: untouched, kept
    assert publish.published_steps(tmp_path) == [5]


def test_publish_pointer_always_names_complete_dir(tmp_path):
    """A reader polling `latest` while the learner publishes never sees a partial snapshot."""
    steps = list(range(1, 41))
    stop = threading.Event()
    seen, errors = [], []

    def reader():
        while not stop.is_set():
            latest = publish.read_latest(tmp_path)
            if latest is not None:
                if not _complete(latest["path"], latest["step"], 1 << 16):
                    errors.append(latest)
                seen.append(latest["step"])
            # Leave the GIL to the writer between looks: a reader spinning on it made each of
            # the 40 publishes wait out switch intervals (59 s in a loaded suite, 2.5 s with
            # this; still several looks per publish, every one of them checked).
            time.sleep(0.001)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for step in steps:  # keep all: pruning a dir a reader holds is documented, not tested
            publish.publish_weights(step, step, tmp_path, _fake_save(1 << 16), keep=len(steps))
    finally:
        stop.set()
        thread.join()
    assert not errors
    assert len(set(seen)) > 1 and seen == sorted(seen)  # it did watch the pointer move
    assert publish.read_latest(tmp_path)["step"] == steps[-1]


def test_a_state_of_another_shape_is_refused_and_never_moved(tmp_path, state8, mesh8):
    """A readable step whose saved tree differs from the configured state is a config mistake:
    `StateMismatch` (a ConfigError, exit 2) naming the leaf, and no step is moved aside."""
    mgr, _ = _save_steps(tmp_path, state8, [2, 4])
    before = sorted(os.listdir(tmp_path))
    wide = _abstract(state8, mesh8)
    wide = wide.replace(params={**wide.params, "w_DxF": jax.ShapeDtypeStruct(
        (16, 16), jnp.float32, sharding=wide.params["w_DxF"].sharding)})
    with pytest.raises(ckpt.StateMismatch, match=r"w_DxF: checkpoint \(16, 8\) float32, "
                                                 r"config \(16, 16\) float32"):
        mgr.restore(wide)
    extra = _abstract(state8, mesh8)
    extra = extra.replace(params={**extra.params, "new_F": extra.params["b_F"]})
    with pytest.raises(ckpt.StateMismatch, match="new_F missing from the checkpoint"):
        mgr.restore(extra)
    assert sorted(os.listdir(tmp_path)) == before and mgr.latest_step() == 4
    assert mgr.restore(_abstract(state8, mesh8)).step == 4     # the right config still resumes
    mgr.close()


def test_two_quarantines_of_a_step_in_one_second_never_collide(tmp_path, state8, mesh8,
                                                              monkeypatch):
    """Issue 36 item 5: step 4 damaged, moved aside, written again and damaged again within
    one second (the clock stands still): two `4.corrupt-<t>` directories, the first intact."""
    # The checkpoint module's clock only: freezing `time.time` for the whole process froze
    # orbax's clock too, and the test took 12.5 s instead of 0.5 s.
    monkeypatch.setattr(ckpt, "time", SimpleNamespace(time=lambda: 1_700_000_000.5))
    mgr, _ = _save_steps(tmp_path, state8, [2, 4])
    for _ in range(2):
        _truncate_state(tmp_path / "4")
        assert mgr.restore(_abstract(state8, mesh8)).step == 2
        assert mgr.save(4, state8, FEED, CONFIG)
        mgr.wait_until_finished()
    mgr.close()
    aside = sorted(p for p in os.listdir(tmp_path) if p.startswith("4.corrupt-"))
    assert aside == ["4.corrupt-1700000000", "4.corrupt-1700000000.1"], aside
    assert all((tmp_path / p / "state").is_dir() for p in aside)

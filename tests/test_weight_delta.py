"""Delta publishing (gagar_jax/hf/delta.py, gagar_jax/rollout/delta.py; docs/checkpoints.md
"Delta publishing"): a chain of a full version and deltas materializes to exactly the bytes a
full publish of the same step writes; the encodings, the multi-process layout, chain resolution
and what an engine holding an older version applies."""
from __future__ import annotations

import os

import numpy as np
import pytest
from support.delta_models import model_and_states, raw, set_state

from gagar_jax.hf import delta as hf_delta
from gagar_jax.rollout import delta, pointer
from gagar_jax.run import publish, published

STEPS = 7


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 7 weight states published twice: every publish full, and a full version every
    3 publishes with deltas between. Returns (full workdir, delta workdir, delta publisher's
    stats per step, full version per step as raw tensors)."""
    model, states = model_and_states(STEPS)
    full_wd, delta_wd = tmp_path_factory.mktemp("full"), tmp_path_factory.mktemp("delta")
    full = publish.Publisher(full_wd, keep=STEPS, dtype="bfloat16")
    deltas = publish.Publisher(delta_wd, keep=STEPS, dtype="bfloat16", full_every=3)
    stats, reference = {}, {}
    for step in range(1, STEPS + 1):
        set_state(model, states[step])
        full.publish(model, step)
        deltas.publish(model, step)
        full.wait()
        deltas.wait()
        stats[step] = deltas.last_delta
        reference[step] = raw(delta.load_full(publish.read_latest(full_wd)["path"]))
    return full_wd, delta_wd, stats, reference


def test_base_plus_deltas_equals_a_full_publish_bit_for_bit(runs):
    full_wd, delta_wd, stats, reference = runs
    root = published.root_of(delta_wd)
    kinds = {}
    for step in range(1, STEPS + 1):
        path = os.fspath(root / published.step_dir_name(step))
        m = pointer.read_manifest(path)
        kinds[step] = m["kind"]
        assert raw(delta.materialize(path)) == reference[step], step
        if m["kind"] == "delta":   # chained to the version before it
            assert m["base"] == published.step_dir_name(step - 1) == m["previous"]
            assert all(f.startswith("delta-") or f == "config.json" for f in m["files"])
            assert "model.safetensors" not in os.listdir(path)
    assert kinds == {1: "full", 2: "delta", 3: "delta", 4: "full", 5: "delta", 6: "delta",
                     7: "full"}
    assert delta.chain(os.fspath(root / "step_00000006")) == [
        os.fspath(root / n) for n in ("step_00000004", "step_00000005", "step_00000006")]
    s = stats[2]   # sparse for the slightly moved leaves, dense embedding + fp32 router tensors
    assert s.sparse > 0 and s.dense > 0 and s.unchanged > 0
    assert 0 < s.changed < s.elements and s.bytes < 0.6 * s.full_bytes
    assert stats[1] is None and stats[4] is None     # full versions


def test_encode_picks_sparse_dense_or_nothing_bitwise():
    prev = np.arange(100, dtype=np.float32)
    cur = prev.copy()
    assert hf_delta.encode("w", prev, cur) == {}
    cur[[3, 70]] = [-1.0, 0.5]
    e = hf_delta.encode("w", prev, cur)
    assert sorted(e) == ["w:idx", "w:val"] and e["w:idx"].tolist() == [3, 70]
    assert e["w:idx"].dtype == np.int32 and e["w:val"].tolist() == [-1.0, 0.5]
    z = prev.copy()
    z[0] = -0.0    # equal as floats, other bits: a change (the bytes must match a full publish)
    assert hf_delta.encode("w", prev, z)["w:idx"].tolist() == [0]
    cur[:60] += 1   # 61 changes x 8 bytes >= 400 bytes: the whole tensor is smaller
    assert list(hf_delta.encode("w", prev, cur)) == ["w"]


def test_shares_of_several_processes_and_applying_only_what_an_engine_lacks(tmp_path):
    """Each process writes its own delta files (its own share against its own previous one);
    an engine holding an older version of the chain applies only the deltas after it, writing
    every entry (dense ones too) into the arrays it holds, views included."""
    root = tmp_path / "published"
    rng = np.random.default_rng(1)
    v0 = {f"t{i}": rng.standard_normal((8, 16)).astype(np.float32) for i in range(6)}
    (root / "step_00000001").mkdir(parents=True)
    from gagar_jax.hf.safetensors import write_safetensors
    write_safetensors(root / "step_00000001" / "model.safetensors", v0)
    published.commit(root, "step_00000001", 1, keep=5)
    v1 = {n: a.copy() for n, a in v0.items()}
    v1["t0"][2, 3] = 7.0
    v1["t4"][:] = 1.0
    name = published.new_name(root, 2)
    (root / name).mkdir()
    shares = [["t0", "t1", "t2"], ["t3", "t4", "t5"]]   # process 0's and process 1's tensors
    for p, names in enumerate(shares):
        entries, _ = hf_delta.encode_share({n: v0[n] for n in names}, {n: v1[n] for n in names})
        hf_delta.write_delta_share(entries, root / name, p, max_shard_bytes=64)
    published.commit(root, name, 2, keep=5, kind="delta", base="step_00000001")
    files = pointer.read_manifest(os.fspath(root / name))["files"]
    assert files == ["delta-00000-00000.safetensors", "delta-00001-00000.safetensors"]
    got = delta.materialize(os.fspath(root / name))
    assert sorted(got) == sorted(v1)
    for n in v1:
        np.testing.assert_array_equal(got[n].array, v1[n])
    v0_path, v1_path = os.fspath(root / "step_00000001"), os.fspath(root / name)
    assert delta.pending(v0_path, v1_path) == [v1_path]
    assert delta.pending(v1_path, v1_path) == []
    assert delta.pending(os.fspath(tmp_path / "elsewhere"), v1_path) is None
    held = delta.load_full(v0_path)     # an engine's host copy: views into one flat array
    flat = np.concatenate([held[n].array.reshape(-1) for n in sorted(held)])
    for i, n in enumerate(sorted(held)):
        held[n].array = flat[i * 128:(i + 1) * 128].reshape(8, 16)
    assert sorted(delta.apply_delta(held, v1_path)) == ["t0", "t4"]    # sparse, dense
    np.testing.assert_array_equal(flat, np.concatenate([v1[n].reshape(-1) for n in sorted(v1)]))
    # what an engine that patches its own tensors gets: every entry, in order; the sparse
    # entries of `defer` names are not written into the host copy
    held, touched = delta.load_full(v0_path), {}
    assert sorted(delta.apply_delta(held, v1_path, touched, defer={"t0"})) == ["t0", "t4"]
    assert touched["t4"] is None and [i.tolist() for i, _ in touched["t0"]] == [[2 * 16 + 3]]
    assert touched["t0"][0][1].array.tolist() == [7.0]
    np.testing.assert_array_equal(held["t0"].array, v0["t0"])         # left to the engine
    np.testing.assert_array_equal(held["t4"].array, v1["t4"])
    with pytest.raises(published.BrokenChain, match="version step_00000009 has no manifest"):
        published.commit(root, name, 3, keep=5, kind="delta", base="step_00000009")
    (root / "step_00000001" / publish.MANIFEST).unlink()
    with pytest.raises(delta.ChainError, match="step_00000001: no manifest"):
        delta.chain(v1_path)


def _chain_root(tmp_path):
    """published/ with a full step 1 (two tensors and a config.json) and a delta step 2 on
    it, committed (digests computed by `commit`, as for files process 0 wrote)."""
    from gagar_jax.hf.safetensors import write_safetensors
    root = tmp_path / "published"
    rng = np.random.default_rng(3)
    v0 = {f"t{i}": rng.standard_normal((4, 8)).astype(np.float32) for i in range(2)}
    for step, tensors in ((1, v0), (3, {n: a + 1 for n, a in v0.items()})):
        name = f"step_{step:08d}"
        (root / name).mkdir(parents=True)
        write_safetensors(root / name / "model.safetensors", tensors)
        (root / name / "config.json").write_text("{}")
        published.commit(root, name, step, keep=5)
    v1 = {n: a.copy() for n, a in v0.items()}
    v1["t1"][0, 0] = 5.0
    (root / "step_00000002").mkdir()
    entries, _ = hf_delta.encode_share(v0, v1)
    hf_delta.write_delta_share(entries, root / "step_00000002", 0, max_shard_bytes=1 << 20)
    published.commit(root, "step_00000002", 2, keep=5, kind="delta", base="step_00000001")
    return root, v1


def test_a_materialized_chain_is_verified_and_errors_name_the_file(tmp_path):
    """Issue 36 item 7: the manifest holds every file's sha256 and the delta its base
    manifest's; a flipped value bit, a base swapped for another full version, a truncated,
    missing or malformed file each raise ChainError naming the file (today: wrong weights,
    or a bare JSONDecodeError / struct.error / FileNotFoundError)."""
    import shutil
    root, v1 = _chain_root(tmp_path)
    path = os.fspath(root / "step_00000002")
    m = pointer.read_manifest(path)
    assert sorted(m["digests"]) == ["delta-00000-00000.safetensors"] and m["base_sha256"]
    assert sorted(pointer.read_manifest(os.fspath(root / "step_00000001"))["digests"]) == [
        "config.json", "model.safetensors"]
    got = delta.materialize(path)
    assert all(np.array_equal(got[n].array, v1[n]) for n in v1)
    base = root / "step_00000001" / "model.safetensors"
    good = base.read_bytes()

    def broken(data, match, where=base):
        where.write_bytes(data)
        with pytest.raises(delta.ChainError, match=match):
            delta.materialize(path)
        where.write_bytes(good if where == base else original)

    original = good
    flipped = bytearray(good)
    flipped[-1] ^= 0x01                                          # one value bit
    broken(bytes(flipped), r"step_00000001/model\.safetensors: its sha256 is not the manifest")
    broken(good[:3], r"model\.safetensors: 3 bytes, too short")  # was struct.error
    broken(good[:8] + b"{not json" + good[17:], r"model\.safetensors: a malformed header")
    manifest = root / "step_00000001" / publish.MANIFEST
    original = manifest.read_bytes()
    broken(b"{trunc", r"step_00000001/gagar_publish\.json: not JSON", manifest)
    os.remove(base)
    with pytest.raises(delta.ChainError, match=r"model\.safetensors: missing"):
        delta.materialize(path)
    base.write_bytes(good)
    # another full version (step 3, consistent in itself) copied over the base's directory
    shutil.rmtree(root / "step_00000001")
    shutil.copytree(root / "step_00000003", root / "step_00000001")
    with pytest.raises(delta.ChainError, match="base_sha256 differs"):
        delta.materialize(path)


def test_an_engine_apply_of_a_changed_delta_fails_and_leaves_its_weights(tmp_path):
    """The engine's apply (`apply_delta`, which the vLLM extension calls) verifies the delta's
    files before writing into the weights it holds."""
    root, _ = _chain_root(tmp_path)
    held = delta.load_full(os.fspath(root / "step_00000001"))
    before = {n: t.array.copy() for n, t in held.items()}
    f = root / "step_00000002" / "delta-00000-00000.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x80
    f.write_bytes(bytes(data))
    with pytest.raises(delta.ChainError, match="delta-00000-00000.safetensors: its sha256"):
        delta.apply_delta(held, os.fspath(root / "step_00000002"))
    assert all(np.array_equal(held[n].array, before[n]) for n in held)

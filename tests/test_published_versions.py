"""The version model of `published/` (gagar_jax/run/published.py, docs/checkpoints.md "Versions
and collection"): a resumed trainer re-publishing a step never touches the directory `latest`
names, while a thread polls `latest`; a kill at every point of a publish followed by a restart
keeps `latest` complete and collects only what no kept version needs; a delta's base chain is
kept while a kept version needs it."""
from __future__ import annotations

import json
import os
import shutil
import threading
import time

import pytest
from support.delta_models import applicable, model_and_states, raw, set_state
from support.paths import load_tiny_config as tiny_config
from support.warm_steps import share_train_steps

from gagar_jax import publish_format
from gagar_jax.hf import delta as hf_delta
from gagar_jax.hf import safetensors as st
from gagar_jax.hf import save as hf_save
from gagar_jax.rollout import delta, pointer
from gagar_jax.run import publish, published, train


def _complete_hf(path: str) -> str:
    """'' if `path` is a complete published HF directory (manifest, config, every safetensors
    file the index names, each as long as its header says), else what is wrong."""
    try:
        names = set(os.listdir(path))
        manifest = json.load(open(os.path.join(path, pointer.MANIFEST)))
        json.load(open(os.path.join(path, "config.json")))
        index = os.path.join(path, st.INDEX_FILE)
        files = (sorted(set(json.load(open(index))["weight_map"].values()))
                 if os.path.exists(index) else ["model.safetensors"])
        for f in files:
            header, start = st.read_header(os.path.join(path, f))
            end = start + max(e["data_offsets"][1] for e in header.values())
            if os.path.getsize(os.path.join(path, f)) != end:
                return f"{f}: {os.path.getsize(os.path.join(path, f))} bytes, header says {end}"
    except (OSError, ValueError, KeyError) as e:
        return repr(e)
    if sorted(names - {pointer.MANIFEST}) != manifest.get("files", sorted(names - {
            pointer.MANIFEST})):
        return f"files {sorted(names)} vs manifest {manifest['files']}"
    return ""


class Poller:
    """A thread reading `latest` in a loop (the JAX-free reader engines use), recording every
    pointer it sees and every one that named an incomplete directory."""

    def __init__(self, workdir, complete):
        self.workdir, self.complete = str(workdir), complete
        self.seen, self.bad, self._stop = [], [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            self._poll()
        except Exception as e:  # a dead poller fails the test, not silently
            self.bad.append(("the poller died", repr(e)))

    def _poll(self):
        while not self._stop.is_set():
            ptr = pointer.read_latest(self.workdir)
            if ptr is None:
                continue
            if not self.seen or self.seen[-1] != ptr["path"]:
                self.seen.append(ptr["path"])
            why = self.complete(ptr)
            # A failure counts while `latest` still names the directory (a reader slower than
            # `keep` publishes may see an old one collected: documented, not a broken promise).
            if why and pointer.read_latest(self.workdir)["path"] == ptr["path"]:
                self.bad.append((ptr["path"], why))
            time.sleep(0.002)   # leave the GIL to the writer between looks

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def test_a_resume_republishes_into_a_new_directory_while_latest_stays_complete(tmp_path,
                                                                                monkeypatch):
    cfg = tiny_config(train__steps=3, train__checkpoint_every=2, train__publish_every=3,
                      train__keep_published=2, train__publish_dtype="float32")
    share_train_steps(monkeypatch)          # the resume reuses the first run's traced step
    train.run(cfg, str(tmp_path))
    pub = tmp_path / "published"
    first3 = pointer.read_latest(str(tmp_path))["path"]
    assert os.path.basename(first3) == "step_00000003"
    # train.publish_initial (on by default with publish_every > 0): the initial policy was
    # published as version 0 before step 1 of the fresh run
    assert sorted(os.listdir(pub)) == ["latest", "step_00000000", "step_00000003"]
    assert pointer.read_manifest(str(pub / "step_00000000"))["seq"] == 1
    before = {f: open(os.path.join(first3, f), "rb").read() for f in os.listdir(first3)}
    # A SIGKILL after step 3 was published, before checkpoint 3: the resume trains step 3 again.
    shutil.rmtree(tmp_path / "checkpoints" / "3")
    real = hf_save.write_share

    def slow_write(*a, **k):   # a big model's write: the old code's window without files
        time.sleep(0.5)
        return real(*a, **k)
    monkeypatch.setattr(hf_save, "write_share", slow_write)
    with Poller(tmp_path, lambda ptr: _complete_hf(ptr["path"])) as poll:
        train.run(cfg, str(tmp_path))
    assert not poll.bad, poll.bad[:3]
    again = pointer.read_latest(str(tmp_path))
    assert again["step"] == 3 and os.path.basename(again["path"]) == "step_00000003.a1"
    assert poll.seen == [first3, again["path"]]           # it did watch the pointer move
    # The version `latest` named before the switch is untouched and kept (keep 2); the CPU step
    # is deterministic, so the re-published weights are the same bytes.
    assert {f: open(os.path.join(first3, f), "rb").read() for f in os.listdir(first3)} == before
    manifest = pointer.read_manifest(again["path"])
    assert manifest["previous"] == "step_00000003" and manifest["seq"] == 3
    for f in before:
        if f != publish.MANIFEST:
            assert open(os.path.join(again["path"], f), "rb").read() == before[f], f
    # the resume did not publish version 0 again (no step_00000000.a1); keep 2 collected it
    assert sorted(os.listdir(pub)) == ["latest", "step_00000003", "step_00000003.a1"]


# -- every kill point, with a fake save ----------------------------------------------------------

def _fake_save(model, path):
    assert os.path.isdir(path) and not os.listdir(path)   # a new, empty directory every time
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"step": model}, f)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        for _ in range(8):
            f.write(bytes([model % 256]) * 8192)


def _complete_fake(ptr) -> str:
    path = ptr["path"]
    try:
        if sorted(os.listdir(path)) != ["config.json", "gagar_publish.json", "model.safetensors"]:
            return f"files {sorted(os.listdir(path))}"
        data = open(os.path.join(path, "model.safetensors"), "rb").read()
        if data != bytes([data[:1][0] if data else 0]) * 65536:
            return "torn weights"
    except (OSError, IndexError) as e:
        return repr(e)
    return ""


class Kill(BaseException):
    """A kill at one point of the protocol (not an Exception: nothing may catch it)."""


def _kill_at(monkeypatch, point):
    """Patches the protocol to die at `point` ("writing" dies in the save itself)."""
    def die(*a, **k):
        raise Kill(point)

    def half_removed(directory):   # the manifest is gone, the directory not yet
        (directory / publish.MANIFEST).unlink(missing_ok=True)
        raise Kill(point)
    patch = {"manifest": ("write_pointer", die), "pointer": ("collect", die),
             "collecting": ("remove_version", half_removed)}.get(point)
    if patch is not None:
        monkeypatch.setattr(published, *patch)


def _save_for(point):
    if point != "writing":
        return _fake_save

    def half(model, path):
        with open(os.path.join(path, "config.json"), "w") as f:
            f.write("{")
        raise Kill(point)
    return half


@pytest.mark.parametrize("point", ["writing", "manifest", "pointer", "collecting"])
def test_a_kill_at_any_point_then_a_restart_keeps_latest_complete(tmp_path, monkeypatch, point):
    with Poller(tmp_path, _complete_fake) as poll:
        for step in (1, 2):
            publish.publish_weights(step, step, tmp_path, _fake_save, keep=2)
        with monkeypatch.context() as m:
            _kill_at(m, point)
            with pytest.raises(Kill):
                publish.publish_weights(3, 3, tmp_path, _save_for(point), keep=2)
        named = os.path.basename(publish.read_latest(tmp_path)["path"])
        assert named == ("step_00000003" if point in ("pointer", "collecting") else
                         "step_00000002")
        if point == "manifest":   # committed, never named: collected, its name free again
            assert pointer.read_manifest(str(tmp_path / "published" / "step_00000003"))
        # The restart: the run resumed from an older checkpoint publishes step 3 (and 2) again.
        for step in (2, 3, 3):
            publish.publish_weights(step, step, tmp_path, _fake_save, keep=2)
    assert not poll.bad, poll.bad[:3]
    root = published.root_of(tmp_path)
    latest = publish.read_latest(tmp_path)
    versions = published.scan(root)
    # Only the last two versions that were `latest` remain: no orphan (committed, never latest),
    # no unfinished attempt, no half-collected directory.
    chain = [os.path.basename(latest["path"])]
    chain.append(versions[chain[0]]["previous"])
    assert sorted(versions) == sorted(chain), (versions, chain)
    assert all(m is not None for m in versions.values())
    assert [versions[n]["step"] for n in chain] == [3, 3]
    assert not [p for p in os.listdir(root) if p.startswith("latest.tmp")]


def test_collection_keeps_every_version_a_kept_delta_needs(tmp_path):
    root = published.root_of(tmp_path)
    root.mkdir(parents=True)

    def version(step, base=None):
        name = published.new_name(root, step)
        (root / name).mkdir()
        (root / name / "w").write_text(str(step))
        published.commit(root, name, step, keep=2, kind="delta" if base else "full", base=base)
        return name

    full1 = version(1)
    d2 = version(2, base=full1)
    d3 = version(3, base=d2)         # kept: d3, d2 (keep 2) and d2's base full1
    assert set(published.scan(root)) == {full1, d2, d3}
    d4 = version(4, base=d3)         # kept: d4, d3, and through base d2 and full1
    assert set(published.scan(root)) == {full1, d2, d3, d4}
    full5 = version(5)               # kept: full5, d4, and d4's chain
    assert set(published.scan(root)) == {full1, d2, d3, d4, full5}
    full6 = version(6)               # kept: full6, full5: the chain is free
    assert set(published.scan(root)) == {full5, full6}
    assert published.read_manifest(root / full6)["previous"] == full5


def test_directories_from_before_manifests_named_their_predecessor_are_kept_by_step(tmp_path):
    root = published.root_of(tmp_path)
    for step in (1, 2, 3):   # the old layout: marker {"step", "policy_version"} only
        (root / published.step_dir_name(step)).mkdir(parents=True)
        (root / published.step_dir_name(step) / publish.MANIFEST).write_text(
            json.dumps({"step": step, "policy_version": step}))
    published.write_pointer(root, {"step": 3, "policy_version": 3,
                                   "path": os.fspath(root / "step_00000003")})
    path = publish.publish_weights(3, 3, tmp_path, _fake_save, keep=2)
    assert os.path.basename(path) == "step_00000003.a1"
    assert set(published.scan(root)) == {"step_00000003", "step_00000003.a1"}
    publish.publish_weights(4, 4, tmp_path, _fake_save, keep=3)
    assert set(published.scan(root)) == {"step_00000003", "step_00000003.a1", "step_00000004"}


# -- every kill point of a delta publish, with the real publisher ---------------------------------

@pytest.fixture(scope="module")
def delta_states():
    return model_and_states(7)


def _kill_delta_at(monkeypatch, point):
    if point == "writing":   # half a delta file, then the kill
        def half(entries, directory, process, max_shard_bytes, digests=None):
            name = publish_format.delta_file_name(process, 0)
            with open(os.path.join(directory, name), "wb") as f:
                f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
            raise Kill(point)
        monkeypatch.setattr(hf_delta, "write_delta_share", half)
    else:
        _kill_at(monkeypatch, point)


@pytest.mark.parametrize("point", ["writing", "manifest", "pointer", "collecting"])
def test_a_kill_during_a_delta_publish_keeps_latest_applicable(tmp_path, monkeypatch, point,
                                                               delta_states):
    """Full versions every 3 publishes: 1 F, 2 D, 3 D, 4 F, then the delta of step 5 is killed
    at `point`; the restarted publisher (its first publish full) publishes 5, 6, 7. A thread
    polls `latest`: every version it names is applicable (its whole chain present); the chain
    `latest` needs survives collection; each version left materializes to its step's weights."""
    model, states = delta_states
    expected = {}

    def publish_steps(pub, steps):
        for step in steps:
            pub.publish(set_state(model, states[step]), step)
            pub.wait()
            expected[pointer.read_latest(str(tmp_path))["path"]] = step

    with Poller(tmp_path, lambda ptr: applicable(ptr["path"])) as poll:
        first = publish.Publisher(tmp_path, keep=2, full_every=3)
        publish_steps(first, range(1, 5))
        with monkeypatch.context() as m:
            _kill_delta_at(m, point)
            first.publish(set_state(model, states[5]), 5)
            with pytest.raises(RuntimeError, match=point):
                first.wait()
        latest = publish.read_latest(tmp_path)["path"]
        killed_after_pointer = point in ("pointer", "collecting")
        assert os.path.basename(latest) == ("step_00000005" if killed_after_pointer
                                            else "step_00000004")
        if killed_after_pointer:   # the delta is latest: its base (step 4) is still there
            assert pointer.read_manifest(latest)["kind"] == "delta"
            assert delta.chain(latest)[0].endswith("step_00000004")
            expected[latest] = 5
        publish_steps(publish.Publisher(tmp_path, keep=2, full_every=3), (5, 6, 7))
    assert not poll.bad, poll.bad[:3]
    assert len(poll.seen) >= 4      # it did watch `latest` move across fulls and deltas
    versions = published.scan(published.root_of(tmp_path))
    # Kept: 7 and 6 (keep 2), and 6's base: the restarted publisher's full step 5.
    assert sorted(versions) == ["step_00000005.a1", "step_00000006", "step_00000007"]
    assert [versions[n]["kind"] for n in sorted(versions)] == ["full", "delta", "delta"]
    for name in versions:
        path = os.fspath(published.root_of(tmp_path) / name)
        full = publish.Publisher(tmp_path / "ref" / name, keep=1, dtype="bfloat16")
        full.publish(set_state(model, states[expected[path]]), expected[path])
        full.wait()
        assert raw(delta.materialize(path)) == raw(delta.load_full(
            publish.read_latest(tmp_path / "ref" / name)["path"])), name



def test_a_broken_delta_chain_publishes_a_full_version_and_never_fails_the_run(
        tmp_path, monkeypatch, delta_states, caplog):
    """Issue 36 item 6 (full_every=4): the full base deleted while the learner runs -> the next
    publish is full (logged), never a delta `latest` cannot load (today: `latest` moved onto
    it); the immediate base deleted while a delta is written -> that delta is not committed and
    the step is published full instead (logged); the run goes on (today: exit 1). Each
    `latest` materializes to its step's weights."""
    model, states = delta_states
    root = published.root_of(tmp_path)
    pub = publish.Publisher(tmp_path, keep=3, full_every=4)

    def step(n):
        pub.publish(set_state(model, states[n]), n)
        pub.wait()
        return publish.read_latest(tmp_path)["path"]

    def reference(n):
        ref = publish.Publisher(tmp_path / "ref" / str(n), keep=1, dtype="bfloat16")
        ref.publish(set_state(model, states[n]), n)
        ref.wait()
        return raw(delta.load_full(publish.read_latest(tmp_path / "ref" / str(n))["path"]))

    step(1)
    step(2)                                          # a delta on step 1
    shutil.rmtree(root / "step_00000001")            # the full base, by hand
    with caplog.at_level("WARNING", logger="gagar_jax.run.publish"):
        latest = step(3)
    assert latest.endswith("step_00000003") and pointer.read_manifest(latest)["kind"] == "full"
    assert any("a full version instead of a delta" in r.getMessage() for r in caplog.records)
    assert raw(delta.materialize(latest)) == reference(3)
    assert pointer.read_manifest(step(4))["kind"] == "delta"
    real = hf_delta.write_delta_share

    def racing(entries, directory, *a, **kw):        # the base goes while the delta is written
        shutil.rmtree(root / "step_00000004")
        return real(entries, directory, *a, **kw)

    monkeypatch.setattr(hf_delta, "write_delta_share", racing)
    caplog.clear()
    with caplog.at_level("WARNING", logger="gagar_jax.run.publish"):
        latest = step(5)
    monkeypatch.undo()
    assert latest.endswith("step_00000005.a1") and pointer.read_manifest(latest)["kind"] == "full"
    assert pointer.read_manifest(os.fspath(root / "step_00000005")) is None   # the delta
    assert any("a full version instead of the delta" in r.getMessage() for r in caplog.records)
    assert raw(delta.materialize(latest)) == reference(5)
    latest = step(6)                                 # deltas again, on the new full version
    assert pointer.read_manifest(latest)["base"] == "step_00000005.a1"
    assert raw(delta.materialize(latest)) == reference(6)

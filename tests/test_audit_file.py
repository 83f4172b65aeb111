"""Workdir anywhere: audit files, metrics, dead-letter, ledger, spool and start-up checks on a
local path and on an object store (an fsspec in-memory bucket behind etils.epath's gs://, with
neither append nor rename). No JAX compile here."""
from __future__ import annotations

import json
import os

import pytest
from etils import epath
from support.objectstore import use_memory_bucket

from gagar_jax import audit_file
from gagar_jax.audit_file import AuditFile, AuditPosition, read_lines
from gagar_jax.feed import Feed, FeedConfig, convert, schema, synthetic
from gagar_jax.feed.sources import DONE_MARKER
from gagar_jax.run import metrics as metrics_lib
from gagar_jax.run import workdir_lock

MODEL = dict(vocab_size=256, num_moe_layers=2, top_k=2, num_experts=8)


@pytest.fixture(params=["local", "bucket"])
def root(request, tmp_path, monkeypatch):
    """A workdir root on local disk or in the memory bucket; cwd is an empty tmp dir, so a
    stray local write of a gs:// path (a folder named "gs:") would be seen."""
    monkeypatch.chdir(tmp_path)
    if request.param == "local":
        (tmp_path / "local").mkdir()
        yield str(tmp_path / "local")
    else:
        use_memory_bucket(monkeypatch)
        yield "gs://bucket/run"
    assert not os.path.exists(tmp_path / "gs:")


def _lines(n0, n1):
    return [json.dumps({"step": i}) + "\n" for i in range(n0, n1)]


def test_audit_file_checkpoint_crash_resume_is_exactly_once(root):
    path = f"{root}/metrics.jsonl"
    f = AuditFile(path, segment_bytes=20)        # two lines a segment: rolling is exercised
    for line in _lines(0, 3):
        f.write(line)
        f.flush()
    pos = f.sync()                               # a checkpoint
    for line in _lines(3, 6):                    # lines after it, then a crash (no close)
        f.write(line)
        f.flush()
    assert [json.loads(x)["step"] for x in read_lines(path)] == list(range(6))
    resumed = AuditFile(path, segment_bytes=20)
    resumed.restore(AuditPosition.from_json(pos.to_json()))
    assert [json.loads(x)["step"] for x in read_lines(path)] == [0, 1, 2]
    for line in _lines(3, 5):
        resumed.write(line)
    resumed.close()
    assert [json.loads(x)["step"] for x in read_lines(path)] == [0, 1, 2, 3, 4]
    if audit_file.is_remote(path):
        names = sorted(p.name for p in epath.Path(root).iterdir())
        assert len(names) >= 3 and all(n.startswith("metrics-") for n in names), names
        assert pos.segment.startswith("metrics-") and pos.length > 0
    else:
        assert pos == AuditPosition("", sum(len(x) for x in _lines(0, 3)))


def test_metrics_writer_resume_cuts_back_to_the_checkpoint(root):
    w = metrics_lib.MetricsWriter(root, tensorboard=False, enabled=True)
    w.write(1, {"loss": 1.0}, wall_time=0.0)
    w.write_groups([{"step": 1, "group_id": "a"}])
    w.flush()
    positions = w.sync()
    w.write(2, {"loss": float("nan")}, wall_time=0.0)   # after the checkpoint: lost
    w.flush()
    w2 = metrics_lib.MetricsWriter(root, tensorboard=False, enabled=True, resume={
        k: AuditPosition.from_json(v) for k, v in positions.items()})
    w2.write(2, {"loss": 0.5}, wall_time=0.0)
    w2.close()
    got = [json.loads(x) for x in read_lines(f"{root}/metrics.jsonl")]
    assert got == [{"step": 1, "time": 0.0, "loss": 1.0}, {"step": 2, "time": 0.0, "loss": 0.5}]
    assert [json.loads(x)["group_id"] for x in read_lines(f"{root}/groups.jsonl")] == ["a"]


def test_feed_on_a_spool_dead_letter_and_ledger_anywhere(root):
    """Spool listing, dead-letter, ledger.json and the checkpointed feed position, resumed."""
    spool, run = epath.Path(root) / "spool", epath.Path(root) / "w"
    groups = synthetic.make_groups(24, seed=3)
    bad = [b'{"group_id": "broken-%d"' % k for k in range(3)]
    spool.mkdir(parents=True, exist_ok=True)
    for k in range(3):
        convert.write_shard(spool / f"{k:04d}.jsonl",
                            [schema.encode(g, "json") for g in groups[8 * k:8 * k + 8]] + [bad[k]])
    (spool / DONE_MARKER).write_text("")
    cfg = FeedConfig(spool_dir=str(spool), spool_poll_s=0.01, spool_settle_s=0.0,
                     rows_per_batch=8, seq_len=128, max_trajectories=24, groups_per_batch=3,
                     max_staleness=1000)

    def train(feed, first, last):
        ids = []
        for step in range(first, last):
            item = feed.next_batch(step)
            if item is None:
                break
            info = item[1]
            feed.record_trained(info.group_ids, [False] * info.num_groups,
                                [False] * info.num_groups)
            ids += info.group_ids
        return ids

    feed = Feed(cfg, run, **MODEL)
    trained = train(feed, 0, 2)
    feed.dead_letter.sync()
    checkpoint = json.loads(json.dumps(feed.state()))
    train(feed, 2, 4)                                      # lost in a crash
    resumed = Feed(cfg, run, **MODEL)
    resumed.restore(checkpoint)
    trained += train(resumed, 2, 100)
    ledger = resumed.finish()
    assert len(trained) == len(set(trained)) == ledger.trained
    assert ledger.received == 27 and ledger.quarantined == 3 and ledger.balanced
    entries = [json.loads(x) for x in read_lines(run / "dead_letter.jsonl")]
    assert sorted(e["origin"].rsplit("/", 1)[-1] for e in entries) == [
        f"{k:04d}.jsonl:8" for k in range(3)]              # each bad record exactly once
    saved = json.loads((run / "ledger.json").read_text())
    assert saved["finished"] and saved["balanced"]
    assert not any(p.name.endswith(".tmp") for p in run.iterdir())


def test_object_store_workdir_lock_and_init_from_config(tmp_path, monkeypatch):
    from gagar_jax.config import ConfigError
    from gagar_jax.hf.config_json import config_to_hf
    from gagar_jax.model.config import ModelConfig
    from gagar_jax.run import startup

    fs = use_memory_bucket(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert workdir_lock.acquire("gs://bucket/run") is None      # no lock, no local folder
    model = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, moe_intermediate_size=32,
                        intermediate_size=128, num_experts=8, top_k=2)
    epath.Path("gs://bucket/ckpt/config.json").write_text(json.dumps(config_to_hf(model)))
    feed = FeedConfig(path="x.jsonl")
    startup.check_hf_dir("gs://bucket/ckpt", "train.init_from", model, feed)   # matches
    other = ModelConfig(**{**vars(model), "num_experts": 16})
    with pytest.raises(ConfigError, match="num_experts=8"):
        startup.check_hf_dir("gs://bucket/ckpt", "train.init_from", other, feed)
    assert list(fs.objects()) == ["bucket/ckpt/config.json"]
    assert not os.path.exists(tmp_path / "gs:")


"""Live spool: atomic publish, waiting, timeout, and exactly-once across a crash and resume."""
import json
import pathlib
import subprocess
import sys
import threading
import time

from support.paths import REPO

from gagar_jax.feed import Feed, FeedConfig, SpoolSource, convert, schema, shards, synthetic
from gagar_jax.feed.sources import DONE_MARKER

ROOT = pathlib.Path(REPO)
MODEL = dict(vocab_size=256, num_moe_layers=2, top_k=2, num_experts=8)


def spool_cfg(spool, **kw):
    kw = {**dict(spool_settle_s=0.0,    # these writers publish by rename
                 groups_per_batch=3), **kw}
    return FeedConfig(spool_dir=str(spool), spool_poll_s=0.01, spool_timeout_s=0.0,
                      rows_per_batch=8, seq_len=128, max_trajectories=24,
                      max_staleness=1000, **kw)


def publish(spool, name, groups, bad_lines=()):
    convert.write_shard(spool / name, [schema.encode(g, "json") for g in groups] + list(bad_lines))


def test_waits_logs_and_times_out(tmp_path):
    lines = []
    src = SpoolSource(str(tmp_path), poll_s=0.01, timeout_s=1.0, log_every_s=0.05, log=lines.append)
    (tmp_path / ".partial.jsonl.tmp").write_text("{}\n")        # unpublished: ignored
    t0 = time.monotonic()
    assert src.next_record() is None
    assert time.monotonic() - t0 >= 1.0
    assert any("waiting for the feed" in x for x in lines)
    assert "idle" in lines[-1] and "ending the feed" in lines[-1]


def test_picks_up_a_shard_published_while_waiting(tmp_path):
    groups = synthetic.make_groups(3, seed=0)
    timer = threading.Timer(0.1, lambda: publish(tmp_path, "0001.jsonl", groups))
    timer.start()
    src = SpoolSource(str(tmp_path), poll_s=0.01, timeout_s=5.0)
    rec = src.next_record()
    timer.join()
    assert rec is not None and rec.origin.endswith("0001.jsonl:0")
    (tmp_path / DONE_MARKER).touch()
    assert [src.next_record() is not None for _ in range(3)] == [True, True, False]
    st = (tmp_path / "0001.jsonl").stat()
    mark = shards.mark(tmp_path / "0001.jsonl", st.st_size)     # [inode, digest of the tail]
    assert mark[0] == st.st_ino
    assert src.state() == {"consumed": {"0001.jsonl": [st.st_size, st.st_mtime_ns]},
                           "tails": {"0001.jsonl": [st.st_size, 3, 0, 0, mark]},
                           "current": None, "record": 0, "offset": 0, "hold": True,
                           "mark": None}


def test_crash_and_resume_consumes_every_shard_exactly_once(tmp_path):
    spool, run = tmp_path / "spool", tmp_path / "run"
    spool.mkdir()
    all_groups = synthetic.make_groups(40, seed=7)
    bad = [b'{"group_id": "broken-' + str(i).encode() + b'"' for i in range(4)]
    for k in range(4):
        publish(spool, f"{k:04d}.jsonl", all_groups[10 * k:10 * k + 10], bad_lines=[bad[k]])
    (spool / DONE_MARKER).touch()

    feed = Feed(spool_cfg(spool), run, **MODEL)
    trained = []
    for step in range(3):
        _, info = feed.next_batch(step)
        trained += info.group_ids
        feed.record_trained(info.group_ids, [False] * info.num_groups, [False] * info.num_groups)
    checkpoint = json.dumps(feed.state())
    for step in range(3, 5):                     # work after the checkpoint, lost in the crash
        feed.next_batch(step)
    assert (run / "dead_letter.jsonl").read_text().count("\n") >= 2
    del feed

    resumed = Feed(spool_cfg(spool), run, **MODEL)
    resumed.restore(json.loads(checkpoint))
    step = 3
    while (item := resumed.next_batch(step)) is not None:
        trained += item[1].group_ids
        step += 1
    ledger = resumed.finish()

    mixed = {g.group_id for g in all_groups
             if 0 < sum(t.outcome == "pass" and not t.hacked for t in g.trajectories)
             < sum(t.outcome != "infra_error" for t in g.trajectories)}
    assert sorted(trained) == sorted(mixed)                  # each mixed group trained once
    entries = [json.loads(x) for x in (run / "dead_letter.jsonl").read_text().splitlines()]
    assert sorted(e["origin"].rsplit("/", 1)[-1] for e in entries) == [
        f"{k:04d}.jsonl:10" for k in range(4)]             # each bad line dead-lettered once
    assert ledger.received == 44 and ledger.quarantined == 4 and ledger.balanced
    assert ledger.trained == len(mixed) and ledger.leftover == 0
    assert sorted(resumed.source.consumed) == [f"{k:04d}.jsonl" for k in range(4)]
    saved = json.loads((run / "ledger.json").read_text())
    assert saved["finished"] and saved["balanced"]


def test_example_producer_feeds_the_learner(tmp_path):
    for version in (0, 1):
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts" / "example_producer.py"),
                "--spool",
                str(tmp_path),
                "--policy-version",
                str(version),
                "--groups",
                "3",
            ],
            check=True,
            capture_output=True,
        )
    (tmp_path / DONE_MARKER).touch()
    feed = Feed(spool_cfg(tmp_path), tmp_path / "run", **MODEL)
    batches = []
    while (item := feed.next_batch(1)) is not None:
        batches.append(item)
    ledger = feed.finish()
    assert ledger.received == 6 and ledger.trained == 6 and ledger.quarantined == 0
    assert sum(i.num_infra[0] for _, i in batches) == 2      # one infra error per group, left out


def test_spool_with_the_multihost_listing_agreement(tmp_path):
    # Single process: the broadcast returns process 0's (our own) view unchanged.
    from gagar_jax.distributed import broadcast_from_process0
    view = {"names": ["0002.jsonl", "0010.arrayrecord"], "done": False, "timed_out": True}
    assert broadcast_from_process0(view) == view
    publish(tmp_path, "0001.jsonl", synthetic.make_groups(2, seed=0))
    (tmp_path / DONE_MARKER).touch()
    src = SpoolSource(str(tmp_path), poll_s=0.01, agree=broadcast_from_process0)
    assert [src.next_record() is not None for _ in range(3)] == [True, True, False]


def test_a_shard_deleted_while_the_learner_is_down_is_counted_with_what_was_read(tmp_path):
    """72 groups in one shard, 12 or more read before the checkpoint; the shard is deleted
    before the resume: the unread groups are reported (ledger, warning), never silently absent."""
    spool, run = tmp_path / "spool", tmp_path / "run"
    spool.mkdir()
    spec = synthetic.SyntheticSpec(p_uniform=0.0, p_infra=0.0, groups_per_step=10**9)
    publish(spool, "0001.jsonl", synthetic.make_groups(72, seed=2, spec=spec))
    feed = Feed(spool_cfg(spool), run, **MODEL)
    step = 0
    while feed.ledger.received < 12:
        _, info = feed.next_batch(step)
        n = info.num_groups
        feed.record_trained(info.group_ids, [False] * n, [False] * n)
        step += 1
    checkpoint = json.loads(json.dumps(feed.state()))
    read = checkpoint["source"]["record"]
    assert read == feed.ledger.received >= 12
    del feed
    (spool / "0001.jsonl").unlink()
    (spool / DONE_MARKER).touch()

    logs = []
    resumed = Feed(spool_cfg(spool), run, **MODEL, log=logs.append)
    resumed.restore(checkpoint)
    while resumed.next_batch(step) is not None:  # the groups buffered at the checkpoint
        step += 1
    ledger = resumed.finish().to_json()
    lost = str(spool / "0001.jsonl")
    assert ledger["skipped_shards_by_reason"] == {"vanished_after_partial_read": 1}
    assert ledger["vanished_shards"] == {lost: read}
    assert ledger["received"] == read and ledger["balanced"]
    assert [x for x in logs if "WARNING" in x and lost in x and f"{read} of its records" in x]
    assert json.loads((run / "ledger.json").read_text())["vanished_shards"] == {lost: read}


def test_a_torn_last_line_is_held_back_and_growth_is_read(tmp_path):
    """A producer writing one shard in place pauses longer than spool_settle_s mid-line, twice:
    the torn line is not a record (nothing is dead-lettered), the shard's growth is read on,
    across restarts, and the last line, never terminated, is read when _DONE appears."""
    spool, run = tmp_path / "spool", tmp_path / "run"
    spool.mkdir()
    spec = synthetic.SyntheticSpec(p_uniform=0.0, p_infra=0.0, groups_per_step=10**9)
    groups = synthetic.make_groups(6, seed=5, spec=spec)
    lines = [schema.encode(g, "json") + b"\n" for g in groups]
    shard = spool / "0001.jsonl"
    cfg = spool_cfg(spool, spool_settle_s=0.05, groups_per_batch=1)

    def session(state, seconds):
        """A learner run that stops after `seconds` idle (or at _DONE); its trained ids and
        final state."""
        feed = Feed(cfg, run, **MODEL, log=lambda s: None)
        if state is not None:
            feed.restore(state)
        deadline = time.monotonic() + seconds
        feed.source.stop = lambda: time.monotonic() > deadline
        trained, step = [], 0
        while (item := feed.next_batch(step)) is not None:
            trained += item[1].group_ids
            feed.record_trained(item[1].group_ids, [False], [False])
            step += 1
        return trained, json.loads(json.dumps(feed.state())), feed

    shard.write_bytes(b"".join(lines[:3]) + lines[3][:40])       # paused mid-line
    trained, state, _ = session(None, 0.4)
    assert trained == [g.group_id for g in groups[:3]]
    assert state["ledger"]["quarantined"] == 0                   # the torn line is no record
    with open(shard, "ab") as f:                                 # on, and paused mid-line again
        f.write(lines[3][40:] + lines[4] + lines[5][:25])
    more, state, _ = session(state, 0.4)
    assert more == [g.group_id for g in groups[3:5]]
    assert state["ledger"]["grown_shards"] == 1 and state["ledger"]["changed_shards"] == 0
    with open(shard, "ab") as f:
        f.write(lines[5][25:-1])                                 # the last line, no newline
    (spool / DONE_MARKER).touch()
    last, _, feed = session(state, 5.0)
    assert last == [groups[5].group_id]
    ledger = feed.finish()
    assert ledger.received == ledger.trained == 6 and ledger.quarantined == 0
    assert ledger.grown_shards == 1 and ledger.changed_shards == 0 and ledger.balanced
    assert not (run / "dead_letter.jsonl").exists() or not (run / "dead_letter.jsonl").read_text()

"""Hostile input and careless writers: special files, endless lines, shards changed in place,
unbounded id sets, passes without quality. Nothing crashes the learner or grows its memory."""
import io
import json
import math
import os
import time
import tracemalloc

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gagar_jax.feed import Feed, FeedConfig, IteratorSource, Reason, deadletter, schema, synthetic
from gagar_jax.feed.shards import LineReader
from gagar_jax.feed.sources import FileSource, SpoolSource

MODEL = dict(vocab_size=256, num_moe_layers=2, top_k=2, num_experts=8)
LIMIT = 100_000


def _cfg(**kw):
    return FeedConfig(**{**dict(rows_per_batch=8, seq_len=128, max_trajectories=24,
                                groups_per_batch=3, max_staleness=1000, spool_poll_s=0.01,
                                spool_settle_s=0.0, max_record_bytes=LIMIT), **kw})


def _lines(groups):
    return b"".join(schema.encode(g, "json") + b"\n" for g in groups)


def _drain(feed, max_steps=50):
    step = 0
    while step < max_steps and feed.next_batch(step) is not None:
        step += 1
    return feed.finish()


def test_special_and_unreadable_shards_are_skipped_and_counted(tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "a_dir.jsonl").mkdir()                          # a directory
    os.symlink("/dev/zero", spool / "b_zero.jsonl")          # endless, never a regular file
    os.mkfifo(spool / "c_fifo.jsonl")                        # would block a reader forever
    os.symlink(spool / "missing", spool / "d_dangling.jsonl")
    (spool / "e_good.jsonl").write_bytes(_lines(synthetic.make_groups(4, seed=1)))
    (spool / "_DONE").touch()
    logs = []
    feed = Feed(_cfg(spool_dir=str(spool)), tmp_path / "w", **MODEL, log=logs.append)
    ledger = _drain(feed)
    # /dev/zero lies outside the spool: skipped as such, never opened (issue 36 item 10)
    assert ledger.skipped_shards_by_reason == {"not_a_regular_file": 3, "link_outside_spool": 1}
    assert ledger.received == 4 and ledger.balanced
    assert sum("skipping shard" in line for line in logs) == 4
    saved = json.loads(json.dumps(feed.state()))["source"]["consumed"]
    assert set(saved) == {"a_dir.jsonl", "b_zero.jsonl", "c_fifo.jsonl", "d_dangling.jsonl",
                          "e_good.jsonl"}
    # A file feed naming a directory, and a shard that fails mid-read, are skipped too.
    (tmp_path / "dir.jsonl").mkdir()
    src = FileSource(str(tmp_path / "dir.jsonl"))
    skipped = []
    src.events.skipped = lambda path, kind, detail: skipped.append(kind)
    assert src.next_record() is None and skipped == ["not_a_regular_file"]

    class Broken:
        def readline(self, n):
            raise OSError(5, "Input/output error")
        closed = False

    src = FileSource(str(spool / "e_good.jsonl"))
    src.events.skipped = lambda path, kind, detail: skipped.append(kind)
    assert src.next_record() is not None
    src._reader._file = Broken()
    assert src.next_record() is None and skipped[-1] == "unreadable"


def test_endless_and_huge_lines_are_read_in_bounded_memory(tmp_path):
    good = synthetic.make_groups(2, seed=2)
    path = tmp_path / "shard.jsonl"
    big = b"x" * (20 * LIMIT)                          # one 2 MB line, 20x the limit
    with open(path, "wb") as f:
        f.write(_lines(good[:1]) + big + b"\n" + _lines(good[1:]) + b"y" * (3 * LIMIT))
    feed = Feed(_cfg(path=str(path), spool_dir=""), tmp_path / "w", **MODEL)
    tracemalloc.start()
    ledger = _drain(feed)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 * LIMIT + (1 << 20) + 2_000_000, peak   # never the whole line
    assert ledger.quarantined_by_reason == {Reason.RECORD_TOO_LARGE: 2}
    entries = [
        json.loads(x) for x in (tmp_path / "w" / "dead_letter.jsonl").read_text().splitlines()
    ]
    import hashlib
    assert entries[0]["oversized"]["size"] == len(big)
    assert entries[0]["oversized"]["sha256"] == hashlib.sha256(big).hexdigest()
    assert entries[1]["oversized"]["size"] == 3 * LIMIT       # the unterminated last line
    assert all(len(json.dumps(e)) < 2 * deadletter.PREFIX_BYTES + 1000 for e in entries)


def test_spool_waits_for_a_shard_to_settle_and_counts_later_changes(tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    groups = synthetic.make_groups(6, seed=3)
    shard = spool / "0001.jsonl"
    shard.write_bytes(_lines(groups[:3]))           # a careless writer: in place, in two halves
    src = SpoolSource(str(spool), poll_s=0.02, settle_s=0.4, timeout_s=0.2)
    t0 = time.monotonic()
    assert src.next_record() is None                # still settling when the timeout ends it
    assert time.monotonic() - t0 < 0.4 and src.state()["consumed"] == {}
    with open(shard, "ab") as f:
        f.write(_lines(groups[3:]))
    # Every group of both halves is read (after the settle time), and the shard's size and
    # mtime are saved.
    (spool / "_DONE").touch()
    src2 = SpoolSource(str(spool), poll_s=0.02, settle_s=0.4)
    t0 = time.monotonic()
    got = [r for r in iter(src2.next_record, None)]
    assert time.monotonic() - t0 >= 0.4
    assert [msgspec.json.decode(r.payload)["group_id"] for r in got] == [g.group_id for g in groups]
    st = shard.stat()
    assert src2.state()["consumed"] == {"0001.jsonl": [st.st_size, st.st_mtime_ns]}
    # A consumed shard that grows (written in place) is read on from where its read ended,
    # counted once (grown_shards); one rewritten otherwise is counted once (changed_shards)
    # and never re-read.
    feed = Feed(_cfg(spool_dir=str(spool), spool_settle_s=0.4), tmp_path / "w", **MODEL,
                log=lambda s: None)
    feed.source.restore(src2.state())
    time.sleep(0.01)
    with open(shard, "ab") as f:
        f.write(_lines(synthetic.make_groups(1, seed=9, start=100)))
    ledger = _drain(feed)
    assert ledger.grown_shards == 1 and ledger.received == 1 and ledger.changed_shards == 0
    shard.write_bytes(_lines(groups[:2]))                       # shorter: a rewrite
    again = Feed(_cfg(spool_dir=str(spool), spool_settle_s=0.4), tmp_path / "w", **MODEL,
                 log=lambda s: None)
    again.restore(feed.state())
    ledger = _drain(again)
    assert ledger.changed_shards == 1 and ledger.received == 1 and ledger.balanced


def test_object_store_spools_do_not_settle(tmp_path):
    from gagar_jax.feed.shards import is_remote
    assert is_remote("gs://bucket/spool") and is_remote("s3://b/s") and not is_remote(tmp_path)
    assert SpoolSource(str(tmp_path), settle_s=5.0).settle_s == 5.0


def test_seen_group_ids_are_bounded_by_the_staleness_window(tmp_path):
    spec = synthetic.SyntheticSpec(p_uniform=0.0, p_infra=0.0)
    groups = synthetic.make_groups(60, seed=4, spec=spec)
    for i, g in enumerate(groups):
        groups[i] = msgspec.structs.replace(g, policy_version=i // 3)
    resent = groups[0]
    feed = Feed(_cfg(max_staleness=2, max_future_versions=100), tmp_path, **MODEL,
                source=IteratorSource(groups + [resent]))
    sizes, step = [], 0
    while feed.next_batch(step) is not None:
        step += 1
        sizes.append(len(feed.seen_group_ids))
        assert min(feed.seen_group_ids.values()) >= step - 1 - 2
    assert max(sizes) <= 3 * (2 + 2) + 3
    ledger = feed.finish()
    # The re-sent old group was forgotten, so it counts as stale: it can never train twice.
    assert ledger.filtered_stale >= 1 and ledger.quarantined == 0 and ledger.balanced


def test_a_pass_without_quality_falls_back_and_never_breaks_the_audit(tmp_path):
    spec = synthetic.SyntheticSpec(p_uniform=0.0, p_infra=0.0)
    g = synthetic.make_groups(1, seed=5, spec=spec)[0]
    trajs = [msgspec.structs.replace(t, quality=None) if t.outcome == "pass" else t
             for t in g.trajectories]
    g = msgspec.structs.replace(g, trajectories=trajs)
    inf = schema.to_builtins(g)
    inf["group_id"] = "inf"
    for t in inf["trajectories"]:
        if t["outcome"] == "pass":
            t["quality"] = {"factor": math.inf}
    feed = Feed(_cfg(), tmp_path, **MODEL,
                source=IteratorSource([g, msgspec.msgpack.decode(msgspec.msgpack.encode(inf))]))
    batch, info = feed.next_batch(0)
    passes = (batch.rewards_T > 0) & batch.valid_T
    assert info.num_groups == 2 and passes.any()
    f = batch.factors_T[passes]
    assert np.isnan(f[:np.count_nonzero(passes[batch.group_ids_T == 0])]).all()
    from gagar_jax.run import metrics
    writer = metrics.MetricsWriter(tmp_path, tensorboard=False, enabled=True)
    writer.write_groups([{"group_id": "x", "trajectories": [{"factor": float(v)} for v in f]}])
    writer.close()
    line = json.loads((tmp_path / "groups.jsonl").read_text())
    assert {t["factor"] for t in line["trajectories"]} == {None}


@pytest.mark.parametrize("raw", [
    {"a": [float("nan")]}, json.loads("[" * 900 + "]" * 900), object(), b"\x00" * 10])
def test_dead_letter_entries_never_raise(tmp_path, raw):
    dl = deadletter.DeadLetter(tmp_path / "dl.jsonl")
    dl.write("schema", "x", raw, "object" if not isinstance(raw, bytes) else "msgpack", "o:0")
    deep = b"[" * 50_000 + b"]" * 50_000
    dl.write("schema", "y", deep, "json", "o:1")
    entries = [json.loads(x) for x in (tmp_path / "dl.jsonl").read_text().splitlines()]
    assert [e["origin"] for e in entries] == ["o:0", "o:1"]


@given(st.lists(st.sampled_from([b"a" * 7, b"\n", b" \n", b"xyz", b"a" * 40]), max_size=30),
       st.integers(1, 40), st.integers(1, 20))
def test_line_reader_reads_like_readline(pieces, limit, chunk):
    """Property: the shard reader's fast `readline(limit)` returns what io's does."""
    data = b"".join(pieces)
    ours, ref = LineReader(io.BytesIO(data)), io.BytesIO(data)
    ours.CHUNK = chunk
    while True:
        want = ref.readline(limit)
        assert ours.readline(limit) == want
        if not want:
            break

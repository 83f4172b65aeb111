"""Feed faults of reliability round three (issue 36): a glob feed whose files change while the
learner is down, a current shard replaced by another file, a spool directory that disappears,
links out of the spool, permission-denied shards, and listing cost that must not grow with the
shards consumed. All in-process, no JAX."""
import json
import os
import shutil
import threading

import msgspec
import pytest
from etils import epath

from gagar_jax.feed import Feed, FeedConfig, convert, schema, spool_listing, synthetic
from gagar_jax.feed.ledger import Ledger, LedgerEvents
from gagar_jax.feed.sources import DONE_MARKER, FileSource, SpoolSource

MODEL = dict(vocab_size=256, num_moe_layers=2, top_k=2, num_experts=8)
SPEC = synthetic.SyntheticSpec(p_uniform=0.0, p_infra=0.0, groups_per_step=10**9)


def _write(path, groups):
    convert.write_shard(path, [schema.encode(g, "json") for g in groups])


def _ids(records):
    return [msgspec.json.decode(r.payload)["group_id"] for r in records]


def _counted(src):
    """`src` with its events counted in a fresh ledger (as the Feed does)."""
    ledger, logs = Ledger(), []
    src.events = LedgerEvents(lambda: ledger, lambda: None, logs.append)
    return ledger, logs


def _groups(n, start):
    return synthetic.make_groups(n, seed=start, spec=SPEC, start=start)


def _three_files(d):
    files = {name: _groups(15, start) for name, start in (("a", 0), ("b", 100), ("c", 200))}
    for name, groups in files.items():
        _write(d / f"{name}.jsonl", groups)
    return {k: [g.group_id for g in v] for k, v in files.items()}


def test_a_glob_feed_resumes_by_file_name_and_counts_vanished_and_inserted_files(tmp_path):
    ids = _three_files(tmp_path)
    src = FileSource(str(tmp_path / "*.jsonl"))
    read = _ids([src.next_record() for _ in range(18)])           # a, then 3 of b
    state = json.loads(json.dumps(src.state()))
    assert read == ids["a"] + ids["b"][:3]
    rest = ids["b"][3:] + ids["c"]

    (tmp_path / "a.jsonl").unlink()            # a file already read goes: nothing is skipped
    resumed = FileSource(str(tmp_path / "*.jsonl"))
    ledger, logs = _counted(resumed)
    resumed.restore(state)
    assert _ids(iter(resumed.next_record, None)) == rest
    assert ledger.file_changes_by_reason == {"vanished_after_read": 1}
    assert any("a.jsonl" in x and "vanished after read" in x for x in logs)

    new = _groups(5, 900)                      # a new file sorting first: read, nothing re-read
    _write(tmp_path / "0.jsonl", new)
    resumed = FileSource(str(tmp_path / "*.jsonl"))
    ledger, _ = _counted(resumed)
    resumed.restore(state)
    got = _ids(iter(resumed.next_record, None))
    assert sorted(got) == sorted(rest + [g.group_id for g in new]) and len(set(got)) == len(got)
    assert got[:12] == ids["b"][3:]            # the position's file first
    assert ledger.file_changes_by_reason == {"vanished_after_read": 1,
                                             "inserted_before_position": 1}


@pytest.mark.parametrize("how", ["shorter_in_place", "longer_by_rename"])
def test_a_replaced_current_shard_is_counted_and_never_read_from_the_old_offset(tmp_path, how):
    """A spool's current shard (60 groups, 18 read) and a glob feed's current file replaced by
    another file while the learner is down: the records read are reported as the loss point,
    nothing of the new file is read from the old byte offset (no fragment dead-lettered)."""
    d = tmp_path / "spool"
    d.mkdir()
    _write(d / "0001.jsonl", _groups(60, 0))
    other = _groups(10 if how.startswith("shorter") else 100, 500)
    for make in (lambda: SpoolSource(str(d), poll_s=0.01, timeout_s=0.3),
                 lambda: FileSource(str(d / "0001.jsonl"))):
        src = make()
        for _ in range(18):
            assert src.next_record() is not None
        state = json.loads(json.dumps(src.state()))
        del src
        if how == "shorter_in_place":
            (d / "0001.jsonl").write_bytes(b"".join(schema.encode(g, "json") + b"\n"
                                                    for g in other))
        else:
            _write(d / ".new.jsonl", other)                   # hidden: the spool ignores it
            os.replace(d / ".new.jsonl", d / "0001.jsonl")
        resumed = make()
        ledger, logs = _counted(resumed)
        resumed.restore(state)
        assert list(iter(resumed.next_record, None)) == []
        path = str(d / "0001.jsonl")
        assert ledger.replaced_shards == {path: 18} and ledger.changed_shards == 1
        assert ledger.skipped_shards_by_reason == {"replaced_after_partial_read": 1}
        assert any("replaced by another file after 18" in x for x in logs)
        _write(d / "0001.jsonl", _groups(60, 0))          # the original, for the next source


def test_a_read_shard_replaced_by_a_longer_file_is_not_read_on_as_growth(tmp_path):
    d = tmp_path / "spool"
    d.mkdir()
    _write(d / "0001.jsonl", _groups(4, 0))
    src = SpoolSource(str(d), poll_s=0.01, timeout_s=0.2)
    ledger, _ = _counted(src)
    assert len(list(iter(src.next_record, None))) == 4
    (d / "0001.jsonl").write_bytes(b"".join(schema.encode(g, "json") + b"\n"
                                            for g in _groups(9, 50)))   # longer, other bytes
    assert list(iter(src.next_record, None)) == []
    assert ledger.replaced_shards == {str(d / "0001.jsonl"): 4} and ledger.grown_shards == 0


def test_a_spool_directory_that_disappears_is_waited_for(tmp_path):
    d = tmp_path / "spool"
    d.mkdir()
    _write(d / "0001.jsonl", _groups(2, 0))
    logs, timers = [], []

    def back():
        d.mkdir()
        _write(d / "0002.jsonl", _groups(1, 10))
        (d / DONE_MARKER).touch()

    def log(msg):
        logs.append(msg)
        if "disappeared" in msg:        # the source saw it gone: bring it back a little later
            timers.append(threading.Timer(0.2, back))
            timers[-1].start()

    src = SpoolSource(str(d), poll_s=0.01, log=log)
    assert src.next_record() is not None and src.next_record() is not None
    shutil.rmtree(d)
    # A source that waits without saying so still gets its directory back (then fails below).
    backstop = threading.Timer(20, lambda: d.exists() or back())
    backstop.start()
    got = list(iter(src.next_record, None))      # today: FileNotFoundError (exit 2)
    backstop.cancel()
    assert len(timers) == 1
    timers[0].join()
    assert _ids(got) == [_groups(1, 10)[0].group_id]
    assert sum("disappeared" in x for x in logs) == 1 and any("is back" in x for x in logs)


def test_links_out_of_the_spool_are_skipped_and_counted(tmp_path):
    d = tmp_path / "spool"
    d.mkdir()
    _write(tmp_path / "elsewhere.jsonl", _groups(3, 0))
    os.symlink("/etc/passwd", d / "a.jsonl")
    os.symlink(tmp_path / "elsewhere.jsonl", d / "b.jsonl")
    _write(d / "inside.data.jsonl", _groups(2, 20))
    os.symlink("inside.data.jsonl", d / "c.jsonl")    # a link inside the spool is read
    (d / DONE_MARKER).touch()
    feed = Feed(FeedConfig(spool_dir=str(d), spool_poll_s=0.01, rows_per_batch=8, seq_len=128,
                           max_trajectories=24, groups_per_batch=3, max_staleness=1000),
                tmp_path / "w", **MODEL, log=lambda s: None)
    while feed.next_batch(0) is not None:
        pass
    ledger = feed.finish()
    assert ledger.skipped_shards_by_reason == {"link_outside_spool": 2}
    assert ledger.received == 4 and ledger.quarantined_by_reason == {"duplicate_group_id": 2}
    assert not (tmp_path / "w" / "dead_letter.jsonl").exists() or "root:" not in (
        tmp_path / "w" / "dead_letter.jsonl").read_text()


def test_a_permission_denied_shard_is_retried_and_counted_while_unreadable(tmp_path,
                                                                           monkeypatch):
    d = tmp_path / "spool"
    d.mkdir()
    _write(d / "0001.jsonl", _groups(2, 0))
    _write(d / "0002.jsonl", _groups(2, 10))
    denied = {"0001.jsonl"}
    real_open = epath.gpath.PosixGPath.open

    def open_(self, mode="r", **kw):   # as root, chmod 000 does not refuse: inject EACCES
        if self.name in denied:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, mode, **kw)

    monkeypatch.setattr(epath.gpath.PosixGPath, "open", open_)
    src = SpoolSource(str(d), poll_s=0.01, timeout_s=0.2)
    ledger, logs = _counted(src)
    assert _ids(iter(src.next_record, None)) == [g.group_id for g in _groups(2, 10)]
    assert list(ledger.unreadable_shards) == [str(d / "0001.jsonl")]
    assert "0001.jsonl" not in src.state()["consumed"]
    assert sum("cannot be read" in x for x in logs) == 1      # once, though retried each poll
    denied.clear()                                             # `chmod` fixed it
    assert _ids(iter(src.next_record, None)) == [g.group_id for g in _groups(2, 0)]
    assert ledger.unreadable_shards == {} and "0001.jsonl" in src.state()["consumed"]


def _count_listing(monkeypatch):
    """Counts directory listings (os.scandir, os.listdir) and stats (os.stat, os.lstat,
    DirEntry.stat)."""
    calls = {"scandir": 0, "stat": 0}
    real_scandir, real_stat, real_listdir, real_lstat = os.scandir, os.stat, os.listdir, os.lstat

    class Entry:
        def __init__(self, e):
            self.e, self.name, self.path = e, e.name, e.path

        def __getattr__(self, name):
            return getattr(self.e, name)

        def stat(self):
            calls["stat"] += 1
            return self.e.stat()

    class Listing:
        def __init__(self, it):
            self.it = it

        def __enter__(self):
            return self

        def __iter__(self):
            return (Entry(e) for e in self.it)

        def __exit__(self, *a):
            self.it.close()

    def scandir(path="."):
        calls["scandir"] += 1
        return Listing(real_scandir(path))

    def stat(path, *a, **kw):
        calls["stat"] += 1
        return real_stat(path, *a, **kw)

    def lstat(path, *a, **kw):
        calls["stat"] += 1
        return real_lstat(path, *a, **kw)

    def listdir(path="."):
        calls["scandir"] += 1
        return real_listdir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(os, "listdir", listdir)
    monkeypatch.setattr(os, "lstat", lstat)
    return calls


def test_listing_cost_per_shard_does_not_grow_with_consumed_shards(tmp_path, monkeypatch):
    """A burst of N shards costs the same listings and stats per shard at N = 40 and 160; one
    new shard after N consumed costs the same at N = 40 and 160 (today: N stats per shard)."""
    per_shard, trickle = {}, {}
    for n in (40, 160):
        d = tmp_path / str(n)
        d.mkdir()
        for i in range(n):
            _write(d / f"{i:05d}.jsonl", _groups(1, i))
        (d / DONE_MARKER).touch()
        calls = _count_listing(monkeypatch)
        src = SpoolSource(str(d), poll_s=0.001)
        src.lister.recheck_per_poll = 8
        assert len(list(iter(src.next_record, None))) == n
        per_shard[n] = {k: v / n for k, v in calls.items()}
        for k in calls:
            calls[k] = 0
        (d / DONE_MARKER).unlink()
        _write(d / "99999.jsonl", _groups(1, 99999))
        assert src.next_record() is not None
        trickle[n] = dict(calls)
        monkeypatch.undo()
    # two listings per burst (the shards, then the end), spread over n
    assert per_shard[160]["stat"] <= per_shard[40]["stat"] < 4.5, per_shard   # 4 per shard
    assert per_shard[160]["scandir"] <= per_shard[40]["scandir"] < 1, per_shard
    assert trickle[160] == trickle[40], trickle
    assert spool_listing.RECHECK_PER_POLL >= 8

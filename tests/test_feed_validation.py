"""Validation: every reason is reported and dead-lettered; fuzzed garbage never crashes."""
import base64
import hashlib
import json

import msgspec
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from gagar_jax.feed import Feed, FeedConfig, IteratorSource, Reason, deadletter, schema, synthetic
from gagar_jax.feed.sources import RawRecord

MODEL = dict(vocab_size=256, num_moe_layers=2, top_k=2, num_experts=8)
CFG = FeedConfig(rows_per_batch=4, seq_len=128, max_trajectories=16, groups_per_batch=2,
                 max_traj_tokens=128, max_record_bytes=200_000)


class ListSource:
    """Raw records from a list (any payload, any encoding)."""

    def __init__(self, records):
        self.records, self.i = list(records), 0

    def next_record(self):
        if self.i >= len(self.records):
            return None
        payload, encoding = self.records[self.i]
        self.i += 1
        return RawRecord(payload, encoding, f"<list>:{self.i - 1}")

    def state(self):
        return {"i": self.i}

    def restore(self, state):
        self.i = state["i"]


def dead_letters(workdir):
    path = workdir / "dead_letter.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def run_all(feed):
    step = 0
    while feed.next_batch(step) is not None:
        step += 1
    return feed.finish()


def test_every_reason_is_dead_lettered_with_its_record(tmp_path):
    bad = synthetic.malformed_records(seed=0)
    good = synthetic.make_groups(1, seed=0)[0]
    good_mixed = msgspec.structs.replace(good, group_id="dup")
    big = schema.encode(
        msgspec.structs.replace(good, group_id="huge", task_id="x" * 300_000), "json"
    )
    too_large = msgspec.structs.replace(  # 5 x 120 tokens cannot pack into 4 rows of 128
        good, group_id="too-large", trajectories=[
            schema.Trajectory(trajectory_id=f"t{i}", tokens=[1] * 120, loss_mask=[0] + [1] * 119,
                              logprobs=[0.0] + [-1.0] * 119, outcome="pass" if i else "fail")
            for i in range(5)])
    records = [(p, enc) for _, p, enc in bad] + [
        (big, "json"),
        (schema.encode(good_mixed, "msgpack"), "msgpack"),
        (schema.encode(good_mixed, "msgpack"), "msgpack"),
        (schema.encode(too_large, "json"), "json"),
    ]
    expected = [r for r, _, _ in bad] + [Reason.RECORD_TOO_LARGE, None, Reason.DUPLICATE_GROUP,
                                         Reason.GROUP_TOO_LARGE]
    ledger = run_all(Feed(CFG, tmp_path, **MODEL, source=ListSource(records)))
    entries = dead_letters(tmp_path)
    assert [e["reason"] for e in entries] == [r for r in expected if r]
    # invalid_record is the catch-all for failures no rule names (tested by injection).
    assert set(Reason.all()) - {Reason.INVALID} == {e["reason"] for e in entries}, \
        "a reason is never exercised"
    for e, (payload, enc) in zip(
        entries, [r for r, x in zip(records, expected, strict=False) if x], strict=False
    ):
        if e["reason"] == Reason.RECORD_TOO_LARGE:   # bounded: prefix + size + sha256
            assert e["oversized"] == {
                "prefix_base64": base64.b64encode(payload[:deadletter.PREFIX_BYTES]).decode(),
                "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
            continue
        if enc == "msgpack" or e["reason"] in (Reason.UNPARSEABLE, Reason.TOO_DEEPLY_NESTED):
            assert base64.b64decode(e["raw_base64"]) == payload
        if e["reason"] not in (Reason.UNPARSEABLE, Reason.NON_FINITE,   # JSON has no inf
                               Reason.TOO_DEEPLY_NESTED):
            assert e["record"] == msgspec.to_builtins(schema.decode_untyped(payload, enc))
        assert e["detail"] and e["origin"].startswith("<list>:")
    assert ledger.quarantined == len(entries) and ledger.balanced
    assert ledger.quarantined_by_reason[Reason.SCHEMA] == 1


def test_truncate_long_option(tmp_path):
    spec = synthetic.SyntheticSpec(min_len=100, max_len=110, p_uniform=0.0, p_infra=0.0)
    gs = synthetic.make_groups(2, seed=1, spec=spec)
    cfg = FeedConfig(**{**CFG.__dict__, "max_traj_tokens": 64, "truncate_long": True,
                        "groups_per_batch": 1})
    feed = Feed(cfg, tmp_path, **MODEL, source=IteratorSource(gs))
    batch, info = feed.next_batch(0)
    lengths = np.bincount(batch.traj_index_BxS[batch.segment_ids_BxS > 0])
    assert np.all(lengths[:info.num_trajectories] == 64)
    first = gs[0].trajectories[0]
    seg = (batch.traj_index_BxS == 0) & (batch.segment_ids_BxS > 0)
    np.testing.assert_array_equal(batch.tokens_BxS[seg], first.tokens[:64])
    strict = Feed(FeedConfig(**{**cfg.__dict__, "truncate_long": False, "overlong": "reject"}),
                  tmp_path / "s", **MODEL, source=IteratorSource(gs))
    assert strict.next_batch(0) is None
    assert {e["reason"] for e in dead_letters(tmp_path / "s")} == {Reason.TOO_LONG}


_BASE = schema.to_builtins(synthetic.make_groups(
    1, seed=4, spec=synthetic.SyntheticSpec(p_uniform=0.0, p_routed=1.0))[0])
# Junk values: every class of hostile input (non-finite and huge numbers, long ids, nesting).
_JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                  st.sampled_from([float("nan"), float("inf"), -float("inf"), -1, -2**63]),
                  st.text(max_size=5), st.integers(200, 5000).map(lambda n: "x" * n),
                  st.lists(st.integers(-3, 300), max_size=3),
                  st.integers(1, 300).map(lambda n: json.loads("[" * n + "]" * n)),
                  st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            yield from _paths(v, prefix + (i,))


_ALL_PATHS = [p for p in _paths(_BASE) if p]


def _mutate(data, rec):
    rec = json.loads(json.dumps(rec))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_ALL_PATHS))
        parent = rec
        try:
            for k in path[:-1]:
                parent = parent[k]
            op = data.draw(st.sampled_from(["delete", "swap"]))
            if op == "delete":
                del parent[path[-1]]
            else:
                parent[path[-1]] = data.draw(_JUNK)
        except (KeyError, IndexError, TypeError):
            continue
    return rec


@given(st.data())
def test_fuzzed_records_never_crash_and_are_all_accounted(tmp_path_factory, data):
    workdir = tmp_path_factory.mktemp("fuzz")
    records = []
    for _ in range(data.draw(st.integers(1, 5))):
        kind = data.draw(st.sampled_from(["mutate", "truncate", "bytes", "good", "deep", "huge"]))
        rec = _mutate(data, _BASE) if kind == "mutate" else _BASE
        enc = data.draw(st.sampled_from(["json", "msgpack"]))
        try:
            payload = (msgspec.json.encode(rec) if enc == "json" else msgspec.msgpack.encode(rec))
        except (TypeError, OverflowError, ValueError):
            payload = json.dumps(rec).encode()
            enc = "json"
        if kind == "truncate":
            payload = payload[:data.draw(st.integers(0, len(payload) - 1))]
        elif kind == "bytes":
            payload = data.draw(st.binary(max_size=64))
        elif kind == "deep":        # nesting past any decoder, in an unknown field
            n = data.draw(st.integers(1, 60_000))
            payload, enc = b'{"junk": ' + b"[" * n + b"]" * n + b', "group_id": "d"}', "json"
        elif kind == "huge":        # over max_record_bytes
            payload = payload + b" " * (CFG.max_record_bytes + 1 - len(payload))
        records.append((payload, enc))
    feed = Feed(CFG, workdir, **MODEL, source=ListSource(records))
    ledger = run_all(feed)
    entries = dead_letters(workdir)
    assert ledger.received == len(records) and ledger.balanced
    assert len(entries) == ledger.quarantined
    assert sorted(ledger.quarantined_by_reason.elements()) == sorted(e["reason"] for e in entries)
    for e in entries:
        assert e["reason"] in Reason.all()
        assert "record" in e or "raw_base64" in e or "oversized" in e
        assert len(json.dumps(e)) < 3 * CFG.max_record_bytes     # entries are bounded


def test_dead_letters_keep_the_group_id_whenever_it_parsed(tmp_path):
    """A record rejected before validation (wrong shape, bad types) still names its group."""
    records = [(b'{"group_id": "g-json", "trajectories": 5}', "json"),
               (msgspec.msgpack.encode({"group_id": "g-msgpack", "policy_version": "x"}),
                "msgpack"),
               (b'{"group_id": 7}', "json"),                   # not a string: no id
               (b'{"group_id": "g-cut", "traj', "json")]       # unparseable: no id
    ledger = run_all(Feed(CFG, tmp_path, **MODEL, source=ListSource(records)))
    entries = dead_letters(tmp_path)
    assert [e["group_id"] for e in entries] == ["g-json", "g-msgpack", None, None]
    assert [e["reason"] for e in entries][:2] == [Reason.SCHEMA, Reason.SCHEMA]
    assert ledger.quarantined == 4 and ledger.balanced


def test_non_object_payloads_from_iterators_are_dead_lettered(tmp_path):
    feed = Feed(CFG, tmp_path, **MODEL, source=IteratorSource([{"group_id": 3}, 42, b"\xff\xfe"]))
    ledger = run_all(feed)
    assert ledger.quarantined == 3 and ledger.balanced
    reasons = [e["reason"] for e in dead_letters(tmp_path)]
    assert reasons == [Reason.SCHEMA, Reason.SCHEMA, Reason.UNPARSEABLE]


def _overlong_group():
    """Three members: a 12-token pass, a 20-token fail (over max_traj_tokens 16), and a
    10-token fail its producer marked truncated."""
    def traj(tid, n, outcome, **kw):
        mask = [0] * 4 + [1] * (n - 4)
        return schema.Trajectory(trajectory_id=tid, tokens=list(range(1, n + 1)), loss_mask=mask,
                                 logprobs=[-0.5 * m for m in mask], outcome=outcome, **kw)
    return schema.Group(schema_version=1, group_id="g", task_id="t", policy_version=0,
                        grading=schema.Grading(status="ok"),
                        trajectories=[traj("ok", 12, "pass"), traj("long", 20, "fail"),
                                      traj("cut", 10, "fail", truncated=True)])


def test_overlong_policy_reject_drop_truncate(tmp_path):
    from gagar_jax.feed.validate import ModelShape, Rejected, validate_group
    g, shape = _overlong_group(), ModelShape(**MODEL)
    base = {**CFG.__dict__, "max_traj_tokens": 16}
    # reject (the default): the group goes, for the long member as for the truncated one
    for group, why in ((g, "20 tokens > max_traj_tokens 16"),
                       (msgspec.structs.replace(g, trajectories=[g.trajectories[0],
                                                                 g.trajectories[2]]),
                        "truncated by its producer")):
        try:
            validate_group(group, FeedConfig(**base), shape)
            raise AssertionError("not rejected")
        except Rejected as e:
            assert e.reason == Reason.TOO_LONG and why in e.detail
    # drop: both overlong members stay in the group (its statistics: 1 pass of 3), with no
    # token left in the loss; the long one is cut to what the learner takes
    pg = validate_group(g, FeedConfig(**{**base, "overlong": "drop"}), shape)
    assert [t.length for t in pg.trajectories] == [12, 16, 10] and pg.mixed
    assert [int(t.loss_mask.sum()) for t in pg.trajectories] == [8, 0, 0]
    assert [t.reward for t in pg.trajectories] == [1.0, 0.0, 0.0]
    # through a batch: the dropped members count in p (1 pass of 3: A = +2/3, -1/3) and carry
    # no loss token
    import jax

    from gagar_jax.algo.advantage import GroupOutcomes, advantages_of
    batch, info = Feed(FeedConfig(**{**base, "overlong": "drop", "groups_per_batch": 1}),
                       tmp_path, **MODEL, source=IteratorSource([g])).next_batch(0)
    out = jax.jit(advantages_of)(GroupOutcomes.of_batch(batch))   # one compile, not per op
    np.testing.assert_allclose(np.asarray(out.outcome_advantages)[:3], [2 / 3, -1 / 3, -1 / 3],
                               rtol=1e-6)
    per_traj = np.bincount(batch.traj_index_BxS.reshape(-1),
                           weights=batch.loss_mask_BxS.reshape(-1), minlength=3)[:3]
    np.testing.assert_array_equal(per_traj, [8, 0, 0])
    # truncate: cut and trained; the producer-truncated one is trained as sent
    pg = validate_group(g, FeedConfig(**{**base, "overlong": "truncate"}), shape)
    assert [t.length for t in pg.trajectories] == [12, 16, 10]
    assert [int(t.loss_mask.sum()) for t in pg.trajectories] == [8, 12, 6]
    # the former switch still means truncate
    assert FeedConfig(**{**base, "truncate_long": True}).overlong == "truncate"


def test_dapo_soft_overlong_penalty_is_an_adjustment_by_hand():
    from gagar_jax.feed.validate import ModelShape, overlong_penalty, validate_group
    cfg = FeedConfig(**{**CFG.__dict__, "max_traj_tokens": 16, "overlong": "truncate",
                        "overlong_buffer_len": 8, "overlong_penalty_factor": 0.5})
    # 0 up to 16 - 8 = 8 tokens, then (8 - n) / 8 * 0.5, and -0.5 from 16 on or if truncated
    assert [overlong_penalty(n, False, cfg) for n in (4, 8, 10, 12, 15, 16, 30)] == [
        0.0, 0.0, -0.125, -0.25, -0.4375, -0.5, -0.5]
    assert overlong_penalty(4, True, cfg) == -0.5
    off = FeedConfig(**{**CFG.__dict__, "max_traj_tokens": 16})
    assert overlong_penalty(30, True, off) == 0.0
    g = _overlong_group()
    g = msgspec.structs.replace(g, trajectories=[
        msgspec.structs.replace(t, adjustment=0.1) for t in g.trajectories])
    pg = validate_group(g, cfg, ModelShape(**MODEL))
    # added to the record's own adjustment (rule 9: centred per group, out of the redistribution)
    np.testing.assert_allclose([t.adjustment for t in pg.trajectories],
                               [0.1 - 0.25, 0.1 - 0.5, 0.1 - 0.5])

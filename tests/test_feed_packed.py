"""Compact routed_experts (`PackedArray`): round trips, rejection reasons, lazy per-host decode,
failures agreed across processes, and the batch sized in tokens."""
import base64
import dataclasses
import json
import threading

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gagar_jax.feed import Feed, FeedConfig, IteratorSource, Reason, packed, schema, synthetic
from gagar_jax.feed.multihost import merge_failures
from gagar_jax.feed.shards import ShardReader
from gagar_jax.feed.sources import FileSource
from gagar_jax.feed.validate import ModelShape, Rejected, validate_group

MODEL = dict(vocab_size=256, num_moe_layers=2, top_k=2, num_experts=8)
CFG = FeedConfig(rows_per_batch=8, seq_len=128, max_trajectories=24, groups_per_batch=4,
                 max_traj_tokens=128, max_staleness=10**9, routing_replay=True)
SPEC = synthetic.SyntheticSpec(p_uniform=0.0, p_infra=0.0, p_routed=1.0, groups_per_step=10**9,
                               routed_encoding="packed", token_encoding="packed")


def _group(routed, n=12, gid="g"):
    mask = [0, 0, 1, 1, 0, 1, 1, 1, 0, 0, 1, 1][:n] + [1] * max(0, n - 12)
    trajs = [schema.Trajectory(trajectory_id=t, tokens=list(range(n)), loss_mask=mask,
                               logprobs=[-0.5 * m for m in mask], outcome=o, routed_experts=r)
             for t, o, r in (("a", "pass", routed), ("b", "fail", None))]
    return schema.Group(schema_version=1, group_id=gid, task_id="t", policy_version=0,
                        grading=schema.Grading(status="ok"), trajectories=trajs)


@st.composite
def _ids(draw):
    n, L, K = draw(st.integers(0, 6)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    top = draw(st.sampled_from([7, 254, 255, 256, 65534]))
    values = draw(st.lists(st.integers(-1, top), min_size=n * L * K, max_size=n * L * K))
    return np.asarray(values, np.int64).reshape(n, L, K), top


@given(_ids(), st.sampled_from(["json", "msgpack"]))
def test_pack_round_trips_through_both_encodings(ids_top, encoding):
    """Property: pack -> record bytes -> decode gives the ids back (-1 = no record), with the
    smallest dtype that holds them, little-endian whatever the host."""
    ids, top = ids_top
    p = packed.pack(ids)
    sentinel_needed = ids.size and (ids == -1).any()
    assert p.dtype == ("uint8" if ids.size == 0 or ids.max() < 255
                       or (ids.max() == 255 and not sentinel_needed) else "uint16")
    rec = schema.Trajectory(trajectory_id="t", tokens=[], loss_mask=[], logprobs=[],
                            outcome="fail", routed_experts=p)
    back = msgspec.convert(msgspec.json.decode(msgspec.json.encode(rec)) if encoding == "json"
                           else msgspec.msgpack.decode(msgspec.msgpack.encode(rec)),
                           schema.Trajectory).routed_experts
    assert isinstance(back, schema.PackedArray) and back == p
    assert packed.header_error(back, ids.shape[0], ids.shape[0], *ids.shape[1:]) is None
    # E large enough for every id; uint8 with E = 256 has no "no record" value.
    E = top + 1 if p.dtype == "uint16" or top >= 255 or not sentinel_needed else 255
    np.testing.assert_array_equal(packed.decode(back, E), ids)
    # The bytes are the little-endian values themselves (an independent decode).
    raw = np.frombuffer(base64.b64decode(p.b64), "<u1" if p.dtype == "uint8" else "<u2")
    want = np.where(ids < 0, np.iinfo(raw.dtype).max, ids).reshape(-1)
    np.testing.assert_array_equal(raw, want)


def test_pack_refuses_what_its_dtype_cannot_hold():
    with pytest.raises(ValueError, match="do not fit uint8"):
        packed.pack(np.array([[[255, -1]]]), "uint8")
    with pytest.raises(ValueError, match=">= -1"):
        packed.pack(np.array([[[-2]]]))
    assert packed.pack(np.array([[[255, -1]]])).dtype == "uint16"


@pytest.mark.parametrize("layout", ["generated", "full"])
def test_packed_and_list_forms_give_the_same_batch(tmp_path, layout):
    g = _group(None, n=20)
    mask = np.asarray(g.trajectories[0].loss_mask)
    n = int(mask.sum()) if layout == "generated" else mask.size
    ids = (np.arange(n * 4).reshape(n, 2, 2) * 3) % 8
    ids[1] = -1
    as_list = msgspec.structs.replace(g, trajectories=[msgspec.structs.replace(
        g.trajectories[0], routed_experts=ids.tolist()), g.trajectories[1]])
    t0, t1 = g.trajectories
    as_packed = msgspec.structs.replace(g, trajectories=[
        msgspec.structs.replace(t0, routed_experts=packed.pack(ids),
                                tokens=packed.pack_array(t0.tokens, "uint32"),
                                logprobs=packed.pack_array(t0.logprobs, "float32")),
        msgspec.structs.replace(t1, tokens=packed.pack_array(t1.tokens, "int32"))])
    # truncate_long cuts both forms at the same token.
    cfg = FeedConfig(**{**CFG.__dict__, "max_traj_tokens": 16, "truncate_long": True})
    want, _ = Feed(cfg, tmp_path / "l", **MODEL, source=IteratorSource([as_list])).next_batch(0)
    got, _ = Feed(cfg, tmp_path / "p", **MODEL, source=IteratorSource(
        [schema.encode(as_packed, "json")])).next_batch(0)
    assert (want.routed_experts_BxSxLxK >= 0).sum() > 8
    for name, x in want.__dict__.items():
        np.testing.assert_array_equal(getattr(got, name), x, err_msg=name)


def _reject(routed, num_experts=8):
    cfg = FeedConfig(max_traj_tokens=128, seq_len=128)
    shape = ModelShape(256, 2, 2, num_experts)
    try:
        pg = validate_group(_group(routed), cfg, shape)
        pg.trajectories[0].routed_rows()
    except Rejected as e:
        return e.reason, e.detail
    except packed.PayloadError as e:
        return e.reason, "at build: " + e.detail
    return None


def test_bad_encodings_are_named():
    n_gen = 7                                     # generated tokens of _group's trajectory
    good = packed.pack(np.zeros((n_gen, 2, 2), np.int64), "uint8")
    assert _reject(good) is None
    cases = {
        "wrong length": (
            msgspec.structs.replace(good, b64=good.b64[:-4]),
            Reason.BAD_ENCODING,
            "needs 28 bytes",
        ),
        "not padded": (
            msgspec.structs.replace(good, b64=good.b64[:-1]),
            Reason.BAD_ENCODING,
            "not a padded base64 length",
        ),
        "dtype": (msgspec.structs.replace(good, dtype="int8"), Reason.BAD_ENCODING, "int8"),
        "uint16 bytes as uint8": (
            msgspec.structs.replace(good, dtype="uint16"),
            Reason.BAD_ENCODING,
            "needs 56 bytes",
        ),
        "rank": (
            msgspec.structs.replace(good, shape=[n_gen, 4]),
            Reason.BAD_ENCODING,
            "is not 3-d",
        ),
        "shape vs model": (
            packed.pack(np.zeros((n_gen, 2, 3), np.int64)),
            Reason.ROUTED_EXPERTS,
            "expected [n, 2, 2]",
        ),
        "shape vs tokens": (
            packed.pack(np.zeros((n_gen + 1, 2, 2), np.int64)),
            Reason.ROUTED_EXPERTS,
            "n = 7 generated tokens or 12 tokens",
        ),
        "id >= E": (
            packed.pack(np.full((n_gen, 2, 2), 8)),
            Reason.ROUTED_EXPERTS,
            "at build: expert id 8 >= num_experts 8",
        ),
        "alphabet": (
            msgspec.structs.replace(good, b64="*" + good.b64[1:]),
            Reason.BAD_ENCODING,
            "at build: routed_experts: b64 is not valid base64",
        ),
    }
    for name, (routed, reason, words) in cases.items():
        got = _reject(routed)
        assert got is not None and got[0] == reason and words in got[1], (name, got)
    # With E = 256, uint8's 255 is expert 255, not "no record"; with E = 8 it is "no record".
    wide = packed.pack(np.full((n_gen, 2, 2), 255), "uint8")
    assert _reject(wide, num_experts=256) is None
    assert packed.decode(wide, 256).min() == 255 and packed.decode(wide, 8).max() == -1


class _CountingDecode:
    """Wraps the payload decoders to record which payloads each process decoded."""

    def __init__(self, monkeypatch):
        self.calls, self.local = [], threading.local()
        for name in ("decode_routed", "decode_array"):
            real = getattr(packed, name)

            def counted(payload, *args, real=real, **kwargs):
                self.calls.append((getattr(self.local, "process", 0), payload.packed.b64))
                return real(payload, *args, **kwargs)
            monkeypatch.setattr(packed, name, counted)


def _drain(feed):
    out, step = [], 0
    while (item := feed.next_batch(step)) is not None:
        out.append(item)
        step += 1
    return out


def test_each_process_decodes_only_the_payloads_of_its_rows(tmp_path, monkeypatch):
    groups = synthetic.make_groups(10, seed=5, spec=SPEC)
    counter = _CountingDecode(monkeypatch)
    full = _drain(Feed(CFG, tmp_path / "full", **MODEL, source=IteratorSource(groups)))
    # tokens, logprobs and routing: three payloads per trajectory, each decoded once.
    assert len(counter.calls) == 3 * sum(i.num_trajectories for _, i in full)
    counter.calls.clear()
    parts = []
    for p in range(2):
        counter.local.process = p
        parts.append(_drain(Feed(CFG, tmp_path / f"p{p}", **MODEL, source=IteratorSource(groups),
                                 process_index=p, process_count=2,
                                 agree=lambda failures: failures)))
    by_process = [{b for q, b in counter.calls if q == p} for p in range(2)]
    by_traj = {t.trajectory_id: {t.routed_experts.b64, t.tokens.b64, t.logprobs.b64}
               for g in groups for t in g.trajectories}
    for k, (batch, info) in enumerate(full):
        flat = [tid for g in info.trajectory_ids for tid in g]
        for p in range(2):
            local = parts[p][k][0]
            rows = np.unique(local.traj_index_BxS[local.segment_ids_BxS > 0])
            assert set().union(*(by_traj[flat[i]] for i in rows)) <= by_process[p]
        np.testing.assert_array_equal(
            np.concatenate([parts[p][k][0].routed_experts_BxSxLxK for p in range(2)]),
            batch.routed_experts_BxSxLxK)
    assert not by_process[0] & by_process[1]            # nobody decodes another's rows
    assert len(counter.calls) == 3 * sum(i.num_trajectories for _, i in full)


_BAD_PAYLOADS = {   # field -> (bad value for a trajectory, reason, words in the detail)
    "routed_experts": (lambda t: packed.pack(np.full(packed.decode(t.routed_experts, None).shape,
                                                     9)), Reason.ROUTED_EXPERTS,
                       "expert id 9 >= num_experts 8"),
    "tokens": (lambda t: packed.pack_array(np.full(len(t.loss_mask), 256), "int32"),
               Reason.TOKEN_OUT_OF_VOCAB, "tokens: token ids must be in [0, 256)"),
    "logprobs": (lambda t: packed.pack_array(np.full(len(t.loss_mask), np.nan), "float32"),
                 Reason.NON_FINITE, "logprobs: non-finite"),
}


@pytest.mark.parametrize("field", sorted(_BAD_PAYLOADS))
def test_a_payload_that_fails_on_one_process_is_quarantined_on_all(tmp_path, field):
    """The bad payload lies in process 1's rows only; both processes drop the group, re-plan
    the batch identically, and process 0 (which never decoded it) writes the dead letter."""
    groups = synthetic.make_groups(6, seed=7, spec=SPEC)
    make_bad, reason, words = _BAD_PAYLOADS[field]
    # A trajectory that process 1's rows of the first batch hold.
    local, info = Feed(CFG, tmp_path / "plan", **MODEL, source=IteratorSource(groups),
                       process_index=1, process_count=2, agree=lambda f: f).next_batch(0)
    flat = [tid for g in info.trajectory_ids for tid in g]
    victim = flat[int(local.traj_index_BxS[local.segment_ids_BxS > 0][0])]
    g = next(i for i, grp in enumerate(groups)
             if victim in [t.trajectory_id for t in grp.trajectories])
    bad = msgspec.structs.replace(groups[g], trajectories=[
        msgspec.structs.replace(t, **{field: make_bad(t)}) if t.trajectory_id == victim else t
        for t in groups[g].trajectories])
    groups[g] = bad
    barrier, slots = threading.Barrier(2), [None, None]

    def agree_for(p):
        def agree(failures):
            slots[p] = failures
            barrier.wait()
            merged = merge_failures(slots)
            barrier.wait()
            return merged
        return agree

    results = [None, None]

    def run(p):
        feed = Feed(CFG, tmp_path / f"p{p}", **MODEL, source=IteratorSource(groups),
                    process_index=p, process_count=2, agree=agree_for(p))
        results[p] = (_drain(feed), feed.finish())

    threads = [threading.Thread(target=run, args=(p,)) for p in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    (b0, ledger0), (b1, ledger1) = results
    # Alone, process 0 would train the group: the bad payload is not in its rows.
    alone = _drain(Feed(CFG, tmp_path / "alone", **MODEL, source=IteratorSource(groups),
                        process_index=0, process_count=2, agree=lambda failures: failures))
    assert bad.group_id in {g for _, i in alone for g in i.group_ids}
    assert [i.group_ids for _, i in b0] == [i.group_ids for _, i in b1]
    assert bad.group_id not in {g for _, i in b0 for g in i.group_ids}
    assert ledger0.to_json() == ledger1.to_json()
    assert ledger0.quarantined_by_reason == {reason: 1} and ledger0.balanced
    assert ledger0.trained == 5
    entries = [
        json.loads(x) for x in (tmp_path / "p0" / "dead_letter.jsonl").read_text().splitlines()
    ]
    assert [(e["reason"], e["group_id"]) for e in entries] == [(reason, bad.group_id)]
    assert words in entries[0]["detail"]
    assert entries[0]["record"] == schema.to_builtins(bad)
    assert not (tmp_path / "p1" / "dead_letter.jsonl").exists()


def test_batch_sized_in_tokens():
    cfg = FeedConfig(rows_per_batch=0, seq_len=262_144, tokens_per_batch=32 * 262_144,
                     max_traj_tokens=262_144)
    assert cfg.rows_per_batch == 32 and cfg.batch_tokens == 8_388_608
    assert FeedConfig.from_config(dict(rows_per_batch=32, seq_len=64, tokens_per_batch=2048,
                                       max_traj_tokens=64)).rows_per_batch == 32
    with pytest.raises(ValueError, match="multiple of feed.seq_len"):
        FeedConfig(rows_per_batch=0, seq_len=100, tokens_per_batch=250, max_traj_tokens=100)
    with pytest.raises(ValueError, match="disagrees"):
        FeedConfig(rows_per_batch=16, seq_len=64, tokens_per_batch=64 * 8, max_traj_tokens=64)
    with pytest.raises(ValueError, match="tokens_per_batch"):
        FeedConfig(rows_per_batch=0, seq_len=64, max_traj_tokens=64)


def test_batcher_stops_pulling_once_a_batch_of_tokens_waits(tmp_path):
    """Long rows: when the groups waiting for the next batch hold a batch of tokens, reading
    further records would only buffer them (G = 4 would otherwise read all eight)."""
    cfg = FeedConfig(rows_per_batch=0, seq_len=64, tokens_per_batch=128, max_trajectories=8,
                     groups_per_batch=4, max_traj_tokens=64, max_staleness=100)
    groups = [_group(None, n=60, gid=f"g{i}") for i in range(8)]
    feed = Feed(cfg, tmp_path, **MODEL, source=IteratorSource(groups))
    _, info = feed.next_batch(0)
    assert info.group_ids == ("g0",) and info.num_tokens == 120
    assert feed.source.consumed == 3            # g1 and g2 (240 tokens >= 128) wait
    assert [i.group_ids for _, i in _drain(feed)] == [(f"g{i}",) for i in range(1, 8)]
    assert feed.finish().balanced


def test_convert_compacts_routing_and_the_feed_reads_it_the_same(tmp_path):
    """convert_feed --compact-routing: list-form routing becomes packed, batches are equal."""
    from gagar_jax.feed import convert
    spec = synthetic.SyntheticSpec(p_routed=1.0)
    src, dst = tmp_path / "list.jsonl", tmp_path / "packed.jsonl"
    convert.write_groups(src, synthetic.make_groups(6, seed=9, spec=spec))
    assert convert.convert(src, dst, compact_routing=True).records == 6
    cfg = dataclasses.replace(CFG, max_trajectories=40, groups_per_batch=6)
    want = _drain(Feed(cfg, tmp_path / "a", **MODEL, source=FileSource(str(src))))
    got = _drain(Feed(cfg, tmp_path / "b", **MODEL, source=FileSource(str(dst))))
    assert len(got) == len(want) > 0
    for (x, _), (y, _) in zip(want, got, strict=False):
        np.testing.assert_array_equal(x.routed_experts_BxSxLxK, y.routed_experts_BxSxLxK)
    routed = schema.decode(ShardReader(dst).next().payload, "json").trajectories[0].routed_experts
    assert isinstance(routed, schema.PackedArray) and routed.dtype == "uint8"


def test_allgather_round_trips_in_one_process():
    from gagar_jax.feed.multihost import allgather_from_processes
    failures = {"g1": [Reason.ROUTED_EXPERTS, "expert id 9 >= num_experts 8"]}
    assert allgather_from_processes(failures) == [failures]
    assert merge_failures([{}, failures, {"g1": ["other", "x"]}]) == failures


def test_compact_tokens_and_logprobs_headers_are_checked_on_arrival():
    g = _group(None)
    t = g.trajectories[0]
    tokens, logprobs = (
        packed.pack_array(t.tokens, "int32"),
        packed.pack_array(t.logprobs, "float32"),
    )
    cfg, shape = FeedConfig(max_traj_tokens=128, seq_len=128), ModelShape(256, 2, 2, 8)

    def reason(**fields):
        one = msgspec.structs.replace(g, trajectories=[msgspec.structs.replace(t, **fields)]
                                      + g.trajectories[1:])
        try:
            validate_group(one, cfg, shape)
        except Rejected as e:
            return e.reason, e.detail
        return None

    assert reason(tokens=tokens, logprobs=logprobs) is None
    for fields, want, words in [
            (dict(tokens=msgspec.structs.replace(tokens, dtype="float32")), Reason.BAD_ENCODING,
             "tokens: dtype 'float32'"),
            (dict(tokens=msgspec.structs.replace(tokens, shape=[6, 2])), Reason.BAD_ENCODING,
             "tokens: shape [6, 2] is not 1-d"),
            (dict(tokens=msgspec.structs.replace(tokens, b64=tokens.b64[:-8])), Reason.BAD_ENCODING,
             "needs 48 bytes"),
            (dict(logprobs=msgspec.structs.replace(logprobs, dtype="int32")), Reason.BAD_ENCODING,
             "logprobs: dtype 'int32'"),
            (dict(tokens=packed.pack_array(t.tokens[:-1], "int32")), Reason.LENGTH_MISMATCH,
             "11 tokens, 12 loss_mask, 12 logprobs")]:
        got = reason(**fields)
        assert got is not None and got[0] == want and words in got[1], (fields, got)

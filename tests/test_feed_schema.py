"""Feed schema: the committed JSON Schema is current; JSONL <-> ArrayRecord round trips."""
import json
import pathlib

import msgspec
import pytest
from support.paths import REPO

from gagar_jax.feed import convert, schema, synthetic
from gagar_jax.feed.sources import FileSource, ShardReader
from gagar_jax.feed.validate import Reason, classify_decode_error

ROOT = pathlib.Path(REPO)


@pytest.fixture(scope="module")
def groups():
    return synthetic.make_groups(24, seed=3)


def test_committed_json_schema_is_current():
    committed = (ROOT / "docs" / "feed_schema.json").read_text()
    assert committed == schema.json_schema_text(), (
        "docs/feed_schema.json is stale: regenerate it with "
        "`python -c \"from gagar_jax.feed import schema; "
        "open('docs/feed_schema.json','w').write(schema.json_schema_text())\"`")


def test_json_schema_names_spec_fields():
    defs = schema.json_schema()["$defs"]
    assert set(defs["Group"]["required"]) == {
        "schema_version", "group_id", "task_id", "policy_version", "grading", "trajectories"}
    traj = defs["Trajectory"]["properties"]
    for name in ("trajectory_id", "tokens", "loss_mask", "logprobs", "outcome", "hacked",
                 "quality", "adjustment", "routed_experts"):
        assert name in traj
    assert traj["outcome"]["enum"] == ["fail", "infra_error", "pass"]


@pytest.mark.parametrize("encoding", schema.ENCODINGS)
def test_encode_decode_identity(groups, encoding):
    for g in groups:
        assert schema.decode(schema.encode(g, encoding), encoding) == g


def test_jsonl_arrayrecord_jsonl_round_trip(tmp_path, groups):
    src = tmp_path / "a.jsonl"
    assert convert.write_groups(src, groups) == len(groups)
    stats = convert.convert(src, tmp_path / "b.arrayrecord")
    assert stats == convert.ConvertStats(records=len(groups), skipped_unparseable=0)
    convert.convert(tmp_path / "b.arrayrecord", tmp_path / "c.jsonl")
    assert (tmp_path / "c.jsonl").read_bytes() == src.read_bytes()
    # The binary shard decodes (through grain) to the same typed records.
    reader = ShardReader(tmp_path / "b.arrayrecord")
    decoded = []
    while (rec := reader.next()) is not None:
        assert rec.encoding == "msgpack"
        decoded.append(schema.decode(rec.payload, "msgpack"))
    assert decoded == groups
    assert not list(tmp_path.glob(".*.tmp")), "atomic writes leave no temp files"


def test_convert_keeps_bad_but_parseable_records_and_skips_garbage(tmp_path):
    lines = [b'{"group_id": "x", "odd": [1, 2.5, null]}', b"{not json", b'{"a": 1}']
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    stats = convert.convert(tmp_path / "in.jsonl", tmp_path / "out.arrayrecord")
    assert stats == convert.ConvertStats(records=2, skipped_unparseable=1)
    convert.convert(tmp_path / "out.arrayrecord", tmp_path / "back.jsonl")
    back = [json.loads(x) for x in (tmp_path / "back.jsonl").read_text().splitlines()]
    assert back == [{"group_id": "x", "odd": [1, 2.5, None]}, {"a": 1}]


def test_file_source_glob_and_restore(tmp_path, groups):
    convert.write_groups(tmp_path / "s0.jsonl", groups[:10])
    convert.write_groups(tmp_path / "s1.arrayrecord", groups[10:])
    src = FileSource(str(tmp_path / "s*"))
    first = [src.next_record() for _ in range(13)]
    state = json.loads(json.dumps(src.state()))
    rest = []
    while (r := src.next_record()) is not None:
        rest.append(r)
    resumed = FileSource(str(tmp_path / "s*"))
    resumed.restore(state)
    again = []
    while (r := resumed.next_record()) is not None:
        again.append(r)
    assert [r.payload for r in again] == [r.payload for r in rest]
    ids = [schema.decode(r.payload, r.encoding).group_id for r in first + rest]
    assert ids == [g.group_id for g in groups]


def test_decode_errors_are_classified():
    with pytest.raises(msgspec.DecodeError) as e:
        schema.decode(b'{"schema_version": 1', "json")
    assert classify_decode_error(e.value).reason == Reason.UNPARSEABLE
    rec = schema.to_builtins(synthetic.make_groups(1, seed=1)[0])
    rec["trajectories"][0]["outcome"] = "crashed"
    with pytest.raises(msgspec.ValidationError) as e:
        schema.decode(json.dumps(rec).encode(), "json")
    assert classify_decode_error(e.value).reason == Reason.UNKNOWN_OUTCOME
    rec["trajectories"][0]["outcome"] = "pass"
    rec["trajectories"][0]["tokens"] = "abc"
    with pytest.raises(msgspec.ValidationError) as e:
        schema.decode(json.dumps(rec).encode(), "json")
    err = classify_decode_error(e.value)
    assert err.reason == Reason.SCHEMA and "$.trajectories[0].tokens" in err.detail


# -- the published JSON Schema, checked with a real validator -----------------------------------

# Rules the learner checks that JSON Schema cannot express (docs/feed.md, "learner-only rules"):
# matching lengths, limits from the config, duplicate ids, the decoder's nesting limit, and
# versions against the learner's step.
LEARNER_ONLY = {Reason.LENGTH_MISMATCH, Reason.RECORD_TOO_LARGE, Reason.TOO_MANY_TRAJECTORIES,
                Reason.TOO_LONG, Reason.TOKEN_OUT_OF_VOCAB, Reason.ROUTED_EXPERTS,
                Reason.BAD_ENCODING,
                Reason.GROUP_TOO_LARGE, Reason.DUPLICATE_GROUP, Reason.DUPLICATE_TRAJECTORY,
                Reason.TOO_DEEPLY_NESTED, Reason.VERSION_SPANS_UNSORTED,
                Reason.VERSION_OUT_OF_RANGE, Reason.VERSION_NEWER, Reason.FROM_THE_FUTURE}


@pytest.fixture(scope="module")
def validator():
    import jsonschema  # a test dependency (pyproject [test])
    doc = json.loads((ROOT / "docs" / "feed_schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(doc)
    return jsonschema.Draft202012Validator(doc)


def _parsed(payload, encoding):
    try:
        return True, schema.decode_untyped(payload, encoding)
    except (msgspec.DecodeError, RecursionError):
        return False, None


def test_schema_accepts_exactly_the_learner_only_malformed_records(validator):
    accepted, rejected = set(), set()
    for reason, payload, encoding in synthetic.malformed_records(seed=0):
        ok, obj = _parsed(payload, encoding)
        if reason == Reason.TOO_DEEPLY_NESTED:
            assert not ok        # our decoder's limit; another validator may parse it
            continue
        (accepted if ok and validator.is_valid(obj) else rejected).add(reason)
    assert accepted == LEARNER_ONLY & (accepted | rejected)
    assert rejected == {r for r, _, _ in synthetic.malformed_records()} - LEARNER_ONLY


def test_schema_accepts_every_valid_record(validator):
    for line in (ROOT / "data" / "sample_feed.jsonl").read_text().splitlines()[:40]:
        assert validator.is_valid(json.loads(line))


def test_schema_checks_the_compact_forms(validator):
    spec = synthetic.SyntheticSpec(p_routed=1.0, routed_encoding="packed", token_encoding="packed")
    rec = schema.to_builtins(synthetic.make_groups(1, seed=5, spec=spec)[0])
    assert validator.is_valid(rec)
    t = next(t for t in rec["trajectories"] if t["outcome"] != "infra_error")
    for field, key, value in [("tokens", "dtype", "float32"), ("logprobs", "dtype", "uint8"),
                              ("routed_experts", "dtype", "int32"), ("tokens", "shape", [2, 3]),
                              ("routed_experts", "shape", [4]), ("tokens", "b64", "not*base64")]:
        bad = json.loads(json.dumps(rec))
        next(x for x in bad["trajectories"] if x["trajectory_id"] == t["trajectory_id"])[
            field][key] = value
        assert not validator.is_valid(bad), (field, key, value)


_MUTATIONS = [
    ("schema_version", [0, 2, -1, 1]), ("policy_version", [-5, 0, 3]),
    ("group_id", ["g", "x" * 257, "y" * 256]), ("trajectories", [[]]),
]
_TRAJ_MUTATIONS = [
    ("loss_mask", [[0, 1, 2], [1, 1, 1], [0, 0, 0], [0, -1, 1], [0, 1, 1]]),
    ("quality", [None, {}, {"tier": "strong"}, {"rank": 1}, {"factor": 0.5, "tier": "strong"},
                 {"factor": 0.5, "rank": None}, {"tier": "strong", "rank": 2}, {"factor": 7.0}]),
    ("outcome", ["pass", "fail", "infra_error"]),
    ("adjustment", [0.5, float("inf"), -float("inf")]),
    ("trajectory_id", ["t" * 300, "ok"]),
    ("tokens", [[1, 2, 3], [-1, 2, 3]]),
]


def test_schema_agrees_with_the_learner_on_mutated_records(validator):
    """Property: for records differing from a valid one in a few fields, the schema accepts
    a record iff the learner does, except for learner-only rules."""
    import numpy as np

    from gagar_jax.feed.config import FeedConfig
    from gagar_jax.feed.validate import ModelShape, Rejected, validate_group

    cfg, shape = FeedConfig(max_group_trajectories=64), ModelShape(vocab_size=256)
    base = schema.to_builtins(synthetic.make_groups(1, seed=11)[0])
    rng = np.random.default_rng(0)
    for _ in range(200):
        rec = msgspec.msgpack.decode(msgspec.msgpack.encode(base))
        for _ in range(int(rng.integers(1, 3))):
            if rng.random() < 0.3:
                field, values = _MUTATIONS[rng.integers(len(_MUTATIONS))]
                rec[field] = values[rng.integers(len(values))]
            elif rec["trajectories"]:
                t = rec["trajectories"][rng.integers(len(rec["trajectories"]))]
                field, values = _TRAJ_MUTATIONS[rng.integers(len(_TRAJ_MUTATIONS))]
                value = values[rng.integers(len(values))]
                t[field] = value
                if field in ("loss_mask", "tokens"):   # keep lengths equal: not the point here
                    for other in ("tokens", "loss_mask", "logprobs"):
                        t[other] = (t[other] * 3)[:len(value)] if t[other] else [0] * len(value)
        payload = msgspec.msgpack.encode(rec)
        try:
            validate_group(schema.decode(payload, "msgpack"), cfg, shape)
            learner = None
        except Rejected as e:
            learner = e.reason
        except msgspec.DecodeError as e:
            from gagar_jax.feed.validate import classify_decode_error
            learner = classify_decode_error(e).reason
        ok = validator.is_valid(msgspec.msgpack.decode(payload))
        if learner in LEARNER_ONLY:
            continue
        assert ok == (learner is None), (learner, rec)

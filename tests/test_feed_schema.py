"""Feed schema: the committed JSON Schema is current; JSONL <-> ArrayRecord round trips."""
import json
import pathlib

import msgspec
import pytest

from gagar_jax.feed import convert, schema, synthetic
from gagar_jax.feed.sources import FileSource, ShardReader
from gagar_jax.feed.validate import Reason, classify_decode_error

ROOT = pathlib.Path(__file__).resolve().parents[1]


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

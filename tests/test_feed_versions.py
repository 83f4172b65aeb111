"""Partial rollouts: per-token policy versions (both forms), their dead-letter reasons, and the
staleness modes (oldest, newest, token-weighted mean); groups from the future."""
import json

import numpy as np
import pytest
from test_feed_batcher import CFG, MODEL, group, traj

from gagar_jax.feed import Feed, FeedConfig, IteratorSource, packed, schema
from gagar_jax.feed.validate import ModelShape, Reason, Rejected, validate_group

SHAPE = ModelShape(**MODEL)


def with_versions(t, **kw):
    return schema.Trajectory(**{**{f: getattr(t, f) for f in t.__struct_fields__}, **kw})


def test_spans_per_token_and_compact_forms_agree():
    # n = 10, generated tokens at 3, 4, 7, 8, 9: tokens 0..4 from version 5, 5..9 from 7.
    t = traj("x", "pass")
    want = np.array([5] * 5 + [7] * 5)
    forms = [dict(policy_version_spans=[[0, 5], [5, 7]]), dict(policy_versions=want.tolist()),
             dict(policy_versions=packed.pack_array(want, "int32"))]
    for kw in forms:
        pg = validate_group(group("g", [with_versions(t, **kw), traj("y", "fail")], version=8),
                            CFG, SHAPE)
        np.testing.assert_array_equal(pg.trajectories[0].versions, want)
        # generated: 5, 5, 7, 7, 7 and y's five tokens at the group's version 8
        assert pg.staleness_version("oldest") == 5 and pg.staleness_version("newest") == 8
        assert pg.staleness_version("mean") == pytest.approx((2 * 5 + 3 * 7 + 5 * 8) / 10)
        assert pg.partial
    old = validate_group(group("g", [t, traj("y", "fail")], version=8), CFG, SHAPE)
    assert old.trajectories[0].versions is None and not old.partial      # old records valid
    assert old.staleness_version("oldest") == 8


@pytest.mark.parametrize("kw,reason", [
    (dict(policy_version_spans=[[4, 1], [2, 2]]), Reason.VERSION_SPANS_UNSORTED),
    (dict(policy_version_spans=[[0, 1], [4, 2], [4, 3]]), Reason.VERSION_SPANS_UNSORTED),
    (dict(policy_version_spans=[[0, 1], [10, 2]]), Reason.VERSION_OUT_OF_RANGE),
    (dict(policy_version_spans=[[4, 1]]), Reason.VERSION_OUT_OF_RANGE),   # token 3 uncovered
    (dict(policy_version_spans=[[0, 9]]), Reason.VERSION_NEWER),
    (dict(policy_version_spans=[]), Reason.VERSION_SPANS_EMPTY),
    (dict(policy_version_spans=[[0, 2**70]]), Reason.VERSION_OUT_OF_RANGE),   # over int64
    (dict(policy_version_spans=[[0, 1], [2**70, 1]]), Reason.VERSION_OUT_OF_RANGE),
    (dict(policy_versions=[1] * 9), Reason.LENGTH_MISMATCH),
    (dict(policy_versions=[1] * 10, policy_version_spans=[[0, 1]]), Reason.VERSION_OUT_OF_RANGE),
])
def test_bad_versions_are_dead_lettered(kw, reason):
    g = group("g", [with_versions(traj("x", "pass"), **kw), traj("y", "fail")], version=8)
    with pytest.raises(Rejected) as e:
        validate_group(g, CFG, SHAPE)
    assert e.value.reason == reason


@pytest.mark.parametrize("mode,kept", [("oldest", False), ("newest", True), ("mean", True)])
def test_staleness_judged_on_the_configured_version(tmp_path, mode, kept):
    """Group version 10, x's tokens from 7 then 10: at step 10 with max_staleness 2 the oldest
    token lags 3 (stale), the newest 0, the token-weighted mean (7, 7, 10, 10, 10 and y's five
    at 10) lags 0.6."""
    cfg = FeedConfig(**{**CFG.__dict__, "staleness_from": mode})
    x = with_versions(traj("x", "pass"), policy_version_spans=[[0, 7], [5, 10]])
    feed = Feed(cfg, tmp_path, **MODEL, source=IteratorSource([group("g", [x, traj("y", "fail")],
                                                                     version=10)]))
    out = feed.next_batch(10)
    ledger = feed.finish()
    assert (out is not None) == kept and ledger.filtered_stale == (0 if kept else 1)
    assert ledger.trained_partial == (1 if kept else 0) and ledger.balanced


def _mixed(gid, version, **kw):
    return group(gid, [with_versions(traj("x", "pass"), **kw), traj("y", "fail")], version=version)


@pytest.mark.parametrize("max_future,published,quarantined", [
    (0, -1, {"a4", "b4", "p5", "f9"}),       # default: every group ahead is quarantined
    (1, -1, {"p5", "f9"}),                   # one version of slack: the 4s train
    (0, 5, {"f9"}),                          # version 5 was published (resumed from step 3)
])
def test_groups_from_the_future_are_counted_warned_once_and_quarantined(
        tmp_path, max_future, published, quarantined):
    """At learner step 3 the newest weights are version 3 (or a later published one): groups of
    newer versions are counted in the ledger and the batch's counts, warned about once per
    version, and quarantined as from_the_future beyond max_future_versions. A partial rollout
    is judged on its newest token (the group's version), whatever staleness_from says."""
    cfg = FeedConfig(**{**CFG.__dict__, "max_future_versions": max_future, "max_staleness": 100,
                        "groups_per_batch": 6})
    items = [_mixed("ok3", 3), _mixed("a4", 4), _mixed("b4", 4), _mixed("old1", 1),
             _mixed("p5", 5, policy_version_spans=[[0, 1], [5, 5]]), _mixed("f9", 9)]
    logs = []
    feed = Feed(cfg, tmp_path, **MODEL, source=IteratorSource(items), log=logs.append,
                published_version=published)
    _, info = feed.next_batch(3)
    ledger = feed.finish()
    newest = max(3, published)
    ahead = {g.group_id for g in items if g.policy_version > newest}
    assert set(info.group_ids) == {g.group_id for g in items} - quarantined
    assert ledger.ahead_of_learner == len(ahead) == info.counts["ahead_of_learner"]
    assert ledger.quarantined_by_reason == {Reason.FROM_THE_FUTURE: len(quarantined)}
    assert ledger.balanced
    entries = [json.loads(x) for x in (tmp_path / "dead_letter.jsonl").read_text().splitlines()] \
        if quarantined else []
    assert {e["group_id"] for e in entries} == quarantined
    assert all(e["reason"] == Reason.FROM_THE_FUTURE for e in entries)
    warned = [x for x in logs if "WARNING" in x and "ahead of the learner" in x]
    assert len(warned) == len({g.policy_version for g in items if g.group_id in ahead})
    assert all(f"newest version {newest}" in x for x in warned)


def test_max_future_versions_must_not_be_negative():
    with pytest.raises(ValueError, match="max_future_versions"):
        FeedConfig(max_future_versions=-1)

"""The LLM judge's answer: schema, validation, Borda over k orderings, Kendall's tau-b."""
import json

import numpy as np
import pytest

from gagar_jax.rollout.grading import answer

IDS = ["a", "b", "c", "d"]


def _r(*entries):
    return [{"trajectory_id": t, "tier": tier, "rank": rank} for t, tier, rank in entries]


def test_schema_names_every_candidate_and_fixes_the_count():
    s = answer.answer_schema(IDS)
    items = s["properties"]["ranking"]
    assert items["minItems"] == items["maxItems"] == 4
    assert [e["properties"]["trajectory_id"]["const"] for e in items["prefixItems"]] == IDS
    assert items["items"] is False
    for e in items["prefixItems"]:
        assert set(e["properties"]["tier"]["enum"]) == {"strong", "intermediate", "defective"}
        assert e["properties"]["rank"] == {"type": "integer", "minimum": 0, "maximum": 3}


def test_parse_answer_accepts_a_valid_answer_with_ties():
    raw = json.dumps({"ranking": _r(("a", "strong", 0), ("b", "strong", 0),
                                    ("c", "strong", 1), ("d", "defective", 0))})
    out = answer.parse_answer(raw, IDS)
    assert {r["trajectory_id"]: (r["tier"], r["rank"]) for r in out} == {
        "a": ("strong", 0), "b": ("strong", 0), "c": ("strong", 1), "d": ("defective", 0)}


@pytest.mark.parametrize("raw,msg", [
    ("not json", "not JSON"),
    ('{"order": []}', '"ranking"'),
    (json.dumps({"ranking": _r(("a", "strong", 0), ("b", "strong", 1), ("c", "strong", 2))}),
     "misses"),
    (json.dumps({"ranking": _r(("a", "strong", 0), ("a", "strong", 1), ("b", "strong", 2),
                               ("c", "strong", 3), ("d", "strong", 4))}), "twice"),
    (json.dumps({"ranking": _r(("a", "strong", 0), ("b", "strong", 1), ("c", "strong", 2),
                               ("z", "strong", 3), ("d", "strong", 4))}), "'z'"),
    (json.dumps({"ranking": _r(("a", "strong", 0), ("b", "strong", 2), ("c", "good", 0),
                               ("d", "strong", 1))}), "good"),
    (json.dumps({"ranking": _r(("a", "strong", 0), ("b", "strong", 2), ("c", "defective", 0),
                               ("d", "strong", 3))}), "dense"),
])
def test_parse_answer_rejects_bad_answers_naming_the_problem(raw, msg):
    with pytest.raises(ValueError, match=msg):
        answer.parse_answer(raw, IDS)


def test_kendall_tau_hand_worked():
    a = _r(("a", "strong", 0), ("b", "strong", 1), ("c", "strong", 2), ("d", "strong", 3))
    b = _r(("b", "strong", 0), ("a", "strong", 1), ("c", "strong", 2), ("d", "strong", 3))
    # 6 pairs, only (a, b) swapped: (5 - 1) / 6.
    assert answer.kendall_tau(a, b) == pytest.approx(2 / 3)
    assert answer.kendall_tau(a, a) == 1.0
    rev = _r(("d", "strong", 0), ("c", "strong", 1), ("b", "strong", 2), ("a", "strong", 3))
    assert answer.kendall_tau(a, rev) == -1.0
    # Tiers order before ranks: a defective rank 0 is worse than an intermediate rank 5.
    t = _r(("a", "intermediate", 0), ("b", "intermediate", 1), ("c", "intermediate", 2),
           ("d", "defective", 0))
    assert answer.kendall_tau(a, t) == 1.0


def _numpy_tau_b(x, y):
    """Independent tau-b: sign matrices in NumPy."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    sx = np.sign(x[:, None] - x[None, :])[np.triu_indices(len(x), 1)]
    sy = np.sign(y[:, None] - y[None, :])[np.triu_indices(len(y), 1)]
    n0 = len(sx)
    n1, n2 = np.sum(sx == 0), np.sum(sy == 0)
    return float(np.sum(sx * sy) / np.sqrt((n0 - n1) * (n0 - n2)))


def test_kendall_tau_matches_a_numpy_loop_with_ties():
    rng = np.random.default_rng(0)
    names = ["strong", "intermediate", "defective"]
    ids = [f"t{i}" for i in range(7)]
    for _ in range(30):
        ka, kb = rng.integers(0, 3, (2, 7)), rng.integers(0, 3, (2, 7))
        a = _r(*[(t, names[ka[0, i]], int(ka[1, i])) for i, t in enumerate(ids)])
        b = _r(*[(t, names[kb[0, i]], int(kb[1, i])) for i, t in enumerate(ids)])
        score_a, score_b = ka[0] * 10 + ka[1], kb[0] * 10 + kb[1]
        if len(set(score_a)) == 1 or len(set(score_b)) == 1:
            continue
        assert answer.kendall_tau(a, b) == pytest.approx(_numpy_tau_b(score_a, score_b))


def test_borda_hand_worked():
    # Three orderings of a, b, c (all strong). Points n-1-position: a: 2+1+2=5, b: 1+2+1=4,
    # c: 0+0+0=0 -> a rank 0, b rank 1, c rank 2.
    o1 = _r(("a", "strong", 0), ("b", "strong", 1), ("c", "strong", 2))
    o2 = _r(("b", "strong", 0), ("a", "strong", 1), ("c", "strong", 2))
    out = answer.borda([o1, o2, o1])
    assert [(r["trajectory_id"], r["tier"], r["rank"]) for r in out] == [
        ("a", "strong", 0), ("b", "strong", 1), ("c", "strong", 2)]
    # Equal points tie: o1 and o2 once each -> a and b both 3 points.
    out = answer.borda([o1, o2])
    assert [(r["trajectory_id"], r["rank"]) for r in out] == [("a", 0), ("b", 0), ("c", 1)]


def test_borda_takes_the_median_tier():
    o1 = _r(("a", "strong", 0), ("b", "defective", 0))
    o2 = _r(("a", "intermediate", 0), ("b", "defective", 0))
    o3 = _r(("a", "defective", 0), ("b", "strong", 0))
    out = {r["trajectory_id"]: r["tier"] for r in answer.borda([o1, o2, o3])}
    assert out == {"a": "intermediate", "b": "defective"}


def test_borda_and_tau_reject_different_candidates():
    o1 = _r(("a", "strong", 0), ("b", "strong", 1))
    o2 = _r(("a", "strong", 0), ("c", "strong", 1))
    with pytest.raises(ValueError, match="different candidates"):
        answer.borda([o1, o2])
    with pytest.raises(ValueError, match="different candidates"):
        answer.kendall_tau(o1, o2)
    with pytest.raises(ValueError, match="no rankings"):
        answer.borda([])


def test_parse_answer_renumbers_gapped_ranks_when_asked():
    raw = json.dumps({"ranking": _r(("a", "strong", 1), ("b", "strong", 1),
                                    ("c", "strong", 4), ("d", "defective", 2))})
    with pytest.raises(ValueError, match="dense from 0"):
        answer.parse_answer(raw, IDS)
    out = answer.parse_answer(raw, IDS, renumber=True)
    assert {r["trajectory_id"]: (r["tier"], r["rank"]) for r in out} == {
        "a": ("strong", 0), "b": ("strong", 0), "c": ("strong", 1), "d": ("defective", 0)}

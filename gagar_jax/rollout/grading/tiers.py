"""A grader's ranking -> the agent loop's verdict list, through the one factor table.

A ranking is a list of `{"trajectory_id", "tier", "rank"}`, one per valid passing candidate:
`tier` one of "strong" / "intermediate" / "defective" (`gagar_jax.grading.TIER_NAMES`), `rank`
an int >= 0 within the tier (smaller = better, ties share a rank). `check_ranking` validates it;
`verdicts` turns a `GroupGrade` into what `agent_grading.grade_group` reads: the record keeps
tier and rank (the learner maps them with its configured `FactorTable`), and the evidence holds
the factors the default table gives (`grading.quality_factors`, for reading only). Imports no JAX.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from gagar_jax import grading


def check_ranking(ranking: Sequence[Mapping], passing_ids: Sequence[str],
                  hacked_ids: Sequence[str] = ()) -> list:
    """The ranking, validated and normalized to [{"trajectory_id", "tier", "rank"}].

    Every passing id that the grader did not flag hacked must appear exactly once; a flagged one
    may appear (it is dropped: a hacked pass earns nothing). No other id may appear.

    Raises:
      ValueError naming the first problem (missing / duplicate / unknown id, bad tier or rank).
    """
    if not isinstance(ranking, (list, tuple)):
        raise ValueError(f"a ranking must be a list of {{trajectory_id, tier, rank}}, got "
                         f"{type(ranking).__name__}")
    passing, hacked = set(passing_ids), set(hacked_ids)
    seen, out = set(), []
    for entry in ranking:
        if not isinstance(entry, Mapping) or not {"trajectory_id", "tier", "rank"} <= set(entry):
            raise ValueError(f"ranking entry {entry!r:.120} lacks trajectory_id / tier / rank")
        tid, tier, rank = entry["trajectory_id"], entry["tier"], entry["rank"]
        if tid not in passing:
            raise ValueError(f"ranking names {tid!r}, not a valid passing candidate "
                             f"({sorted(passing)})")
        if tid in seen:
            raise ValueError(f"ranking names {tid!r} twice")
        seen.add(tid)
        grading.tier_code(tier)            # raises on an unknown tier name
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 0:
            raise ValueError(f"rank of {tid!r} must be an int >= 0, got {rank!r}")
        if tid not in hacked:
            out.append({"trajectory_id": tid, "tier": tier, "rank": int(rank)})
    missing = sorted(passing - hacked - seen)
    if missing:
        raise ValueError(f"ranking misses passing candidate(s) {missing}")
    return out


def preview_factors(ranking: Sequence[Mapping],
                    table: grading.FactorTable | None = None) -> dict:
    """{trajectory_id: factor} the table (default: `FactorTable()`) gives a checked ranking
    of one group."""
    table = grading.FactorTable() if table is None else table
    if not ranking:
        return {}
    tiers = np.array([grading.tier_code(r["tier"]) for r in ranking], np.int32)
    ranks = np.array([r["rank"] for r in ranking], np.int32)
    f = grading.quality_factors(tiers, ranks, np.zeros(len(ranking), np.int32), table=table)
    return {r["trajectory_id"]: round(float(x), 6) for r, x in zip(ranking, f, strict=True)}


def verdicts(candidate_ids: Sequence[str], passing_ids: Sequence[str], grade: object,
             grader_name: str = "") -> dict:
    """The agent loop's answer for one group from a `GroupGrade`.

    Args:
      candidate_ids: every trajectory id, in the group's order.
      passing_ids: the valid passing ones (`GroupWorkspace.passing`).
      grade: a `base.GroupGrade`.
      grader_name: written into the evidence.
    Returns:
      {"verdicts": [one dict per candidate], "status", "evidence"}; on status "failed" the
      verdicts are empty dicts (the loop gives binary credit and counts the fallback).
    Raises:
      ValueError on an invalid ranking (the adapter turns it into status "failed").
    """
    evidence = {"grader": grader_name, **({"detail": grade.evidence}
                                          if grade.evidence is not None else {})}
    unknown = sorted(set(grade.hacked) - set(candidate_ids))
    if unknown:
        raise ValueError(f"hacked names unknown trajectory id(s) {unknown}")
    if grade.status == "failed":
        return {"verdicts": [{} for _ in candidate_ids], "status": "failed",
                "evidence": evidence}
    if grade.status != "ok":
        raise ValueError(f"GroupGrade.status must be 'ok' or 'failed', got {grade.status!r}")
    ranking = check_ranking(grade.ranking, passing_ids, grade.hacked)
    by_id = {r["trajectory_id"]: r for r in ranking}
    out = []
    for tid in candidate_ids:
        v: dict = {}
        if tid in by_id:
            v["quality"] = {"tier": by_id[tid]["tier"], "rank": by_id[tid]["rank"]}
        if tid in grade.hacked:
            v["hacked"] = True
        out.append(v)
    evidence.update(ranking=ranking, factors=preview_factors(ranking),
                    hacked=sorted(grade.hacked))
    return {"verdicts": out, "status": "ok", "evidence": evidence}

"""The LLM judge's answer: its JSON schema, validation, and aggregation over k orderings.

The judge answers `{"ranking": [{"trajectory_id", "tier", "rank"}, ...]}`, one entry per
passing candidate. `answer_schema` is the JSON schema handed to structured outputs;
`parse_answer` validates a raw answer (`tiers.check_ranking`, plus ranks consistent within a
tier: dense 0..m-1, ties sharing a rank). Against position bias the judge sees the candidates in
k orderings; `borda` aggregates the k checked rankings into one, and `kendall_tau` (tau-b, ties
allowed) measures how much two of them agree, recorded in the grading evidence. Imports no JAX.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from gagar_jax import grading
from gagar_jax.rollout.grading import tiers


def answer_schema(candidate_ids: Sequence[str]) -> dict:
    """JSON schema of the judge's answer for these candidates (for `response_format`).

    Args:
      candidate_ids: the passing candidates' trajectory ids, in the order the prompt shows them.
    Returns:
      A JSON schema dict: entry i of the ranking is candidate i (`prefixItems`, its id a
      `const`, no further items), so guided decoding can neither invent, drop nor repeat a
      candidate (an enum of ids cannot stop a repeat: measured on vLLM's server, a random
      judge named one id three times); ranks are bounded by the number of candidates (dense
      ranks never exceed n - 1).
    """
    n = len(candidate_ids)

    def entry(tid: str) -> dict:
        return {"type": "object",
                "properties": {"trajectory_id": {"type": "string", "const": tid},
                               "tier": {"type": "string", "enum": list(grading.TIER_NAMES)},
                               "rank": {"type": "integer", "minimum": 0,
                                        "maximum": max(n - 1, 0)}},
                "required": ["trajectory_id", "tier", "rank"], "additionalProperties": False}
    return {"type": "object",
            "properties": {"ranking": {"type": "array",
                                       "prefixItems": [entry(t) for t in candidate_ids],
                                       "items": False, "minItems": n, "maxItems": n}},
            "required": ["ranking"], "additionalProperties": False}


def parse_answer(raw: str | Mapping, candidate_ids: Sequence[str], *,
                 renumber: bool = False) -> list:
    """The judge's raw answer -> a checked ranking [{"trajectory_id", "tier", "rank"}].

    Args:
      raw: the answer text (JSON) or an already decoded dict.
      candidate_ids: the passing candidates; each must appear exactly once.
      renumber: ranks within a tier that are not dense from 0 (a schema cannot ask for that;
        a judge may answer ranks 1, 1 or 0, 2) are renumbered densely in their order, ties
        kept, instead of rejected: the rank is ordinal, and the factor table interpolates
        between the best and worst rank present, so gaps would move factors.
    Returns:
      The ranking, normalized (`tiers.check_ranking`).
    Raises:
      ValueError naming the problem: not JSON, no "ranking", a missing / duplicate / unknown
      candidate, or (without `renumber`) ranks within a tier that are not dense from 0.
    """
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"judge answer is not JSON ({e.msg} at char {e.pos}): "
                             f"{raw[:120]!r}") from None
    if not isinstance(raw, Mapping) or "ranking" not in raw:
        raise ValueError(f'judge answer must be an object with "ranking", got {raw!r:.120}')
    ranking = tiers.check_ranking(raw["ranking"], candidate_ids)
    by_tier: dict = {}
    for r in ranking:
        by_tier.setdefault(r["tier"], set()).add(r["rank"])
    for tier, ranks in by_tier.items():
        if ranks != set(range(len(ranks))):
            if not renumber:
                raise ValueError(f"ranks within tier {tier!r} must be dense from 0 (ties share "
                                 f"a rank), got {sorted(ranks)}")
            dense = {r: i for i, r in enumerate(sorted(ranks))}
            ranking = [{**r, "rank": dense[r["rank"]]} if r["tier"] == tier else r
                       for r in ranking]
    return ranking


def _keys(ranking: Sequence[Mapping]) -> dict:
    """{trajectory_id: (tier_code, rank)}: smaller key = better candidate."""
    return {r["trajectory_id"]: (grading.tier_code(r["tier"]), r["rank"]) for r in ranking}


def kendall_tau(a: Sequence[Mapping], b: Sequence[Mapping]) -> float:
    """Kendall's tau-b between two checked rankings of the same candidates (ties allowed).

    Returns:
      tau in [-1, 1]; 1.0 when fewer than two candidates or when either ranking ties all of
      them (no pair is ordered, so there is nothing to disagree on).
    Raises:
      ValueError when the rankings name different candidates.
    """
    ka, kb = _keys(a), _keys(b)
    if set(ka) != set(kb):
        raise ValueError(f"kendall_tau: rankings name different candidates "
                         f"{sorted(set(ka) ^ set(kb))}")
    ids = sorted(ka)
    conc = disc = ties_a = ties_b = 0
    for i, x in enumerate(ids):
        for y in ids[i + 1:]:
            sa = (ka[x] > ka[y]) - (ka[x] < ka[y])
            sb = (kb[x] > kb[y]) - (kb[x] < kb[y])
            if sa == 0 and sb == 0:
                continue
            if sa == 0:
                ties_a += 1
            elif sb == 0:
                ties_b += 1
            elif sa == sb:
                conc += 1
            else:
                disc += 1
    denom = ((conc + disc + ties_a) * (conc + disc + ties_b)) ** 0.5
    return 1.0 if denom == 0 else (conc - disc) / denom


def borda(rankings: Sequence[Sequence[Mapping]]) -> list:
    """Aggregate k checked rankings of the same candidates into one.

    Each ranking gives a candidate n - 1 - (its average position over tied candidates) points
    (position = order by (tier, rank)). The tier is the median of the k tiers (the lower median,
    i.e. the better one, for even k); within a tier, candidates are ranked by total points,
    dense ranks, equal points sharing a rank.

    Returns:
      [{"trajectory_id", "tier", "rank"}] sorted best first.
    Raises:
      ValueError on an empty list or rankings over different candidates.
    """
    if not rankings:
        raise ValueError("borda: no rankings to aggregate")
    keys = [_keys(r) for r in rankings]
    ids = sorted(keys[0])
    for k in keys[1:]:
        if set(k) != set(ids):
            raise ValueError(f"borda: rankings name different candidates "
                             f"{sorted(set(k) ^ set(ids))}")
    n = len(ids)
    points = dict.fromkeys(ids, 0.0)
    for k in keys:
        for x in ids:
            better = sum(k[y] < k[x] for y in ids)
            tied = sum(k[y] == k[x] for y in ids) - 1
            points[x] += n - 1 - (better + tied / 2)
    names = {code: name for name, code in grading.TIER_NAMES.items()}
    tier_of = {x: sorted(k[x][0] for k in keys)[(len(keys) - 1) // 2] for x in ids}
    out = []
    for code in sorted(set(tier_of.values())):
        members = sorted((x for x in ids if tier_of[x] == code), key=lambda x: -points[x])
        levels = sorted({points[x] for x in members}, reverse=True)
        out += [{"trajectory_id": x, "tier": names[code], "rank": levels.index(points[x])}
                for x in members]
    return out

"""How a multi-turn group is graded: the environment's verdict is the outcome, `--grader` adds
quality on top (SPEC section 6, "Grading"; docs/rollout.md, "Grading an agent group").

A grader for agent groups (`--grader module:function` with `--env`) is called once per finished
group, and only when the group is mixed after the environment's verdicts (some valid member
passes, some fails, hacked passes counting as failures): other groups train nothing.

    def grade(task: dict, trajectories: list[dict]) -> list[dict]:    # one entry per trajectory
        return [{"quality": {"tier": "strong", "rank": 0}},          # passes: tier + rank ...
                {},                                                   # failures: nothing needed
                {"quality": {"factor": 0.8}, "hacked": True}, ...]    # ... or a factor; hacked

Each trajectory the grader sees (`grader_view`) is a dict:
  "trajectory_id"         "t0", "t1", ... (the record's)
  "outcome", "hacked"     the environment's verdict: final, a grader cannot change the outcome
  "evidence"              the environment's evidence (what its verdict ran and saw)
  "workspace"             the directory the environment left for this trajectory (its final diff,
                          test logs, transcript) or None
  "end_reason"            why it ended (`envs.base.END_REASONS`); "truncated": cut by a length limit
  "turns", "tool_calls", "tool_errors"
  "transcript"            [{"role": "observation" | "model", "text": ...}]: the turns decoded with
                          the worker's tokenizer (for reading; the record keeps the ids)
  "tokens", "loss_mask"   the ids themselves

Its answer per trajectory may hold "quality" (read for passes), "hacked" (OR-ed with the
environment's: grader-confirmed reliance on a leaked answer zeroes the reward) and "adjustment"
(an additive reward adjustment); an "outcome" that differs from the environment's is an error.
It may also return {"verdicts": [...], "status": "ok" | "failed", "evidence": ...}. A grader that
raises or answers badly makes the group's grading "failed" with the reason as evidence: the
learner then falls back to binary credit for it (counted). Without `--grader`, and for groups
that are not mixed, every pass gets `{"factor": 1.0}` (binary credit, not a fallback).
Imports no JAX.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from gagar_jax.rollout.agent_record import AgentTrajectory

NO_GRADER = "env"         # the record's grading.grader when no grader ran


class GraderCrashed(RuntimeError):
    """The grader itself died (its process, its server), not its answer: `grade_group` lets it
    through, so a grader pool (`grading/pool.py`) re-queues the group instead of failing it."""


def transcript(traj: AgentTrajectory, decode: Callable) -> list:
    """The trajectory's runs of observation and model tokens, decoded, in order."""
    out, start = [], 0
    for t in range(1, len(traj.tokens) + 1):
        if t == len(traj.tokens) or traj.loss_mask[t] != traj.loss_mask[start]:
            out.append({"role": "model" if traj.loss_mask[start] else "observation",
                        "text": decode(traj.tokens[start:t])})
            start = t
    return out


def grader_view(tid: str, traj: AgentTrajectory, verdict: dict, episode: dict,
                decode: Callable) -> dict:
    """What a grader sees of one trajectory (the module docstring lists the keys).

    Args:
      verdict: the environment's {"outcome", "hacked", "evidence"}.
      episode: {"end_reason", "truncated", "turns", "tool_calls", "tool_errors", "workspace"}.
      decode: ids -> text (the worker's tokenizer).
    """
    return {"trajectory_id": tid, "outcome": verdict["outcome"],
            "hacked": bool(verdict.get("hacked", False)), "evidence": verdict.get("evidence"),
            **episode, "transcript": transcript(traj, decode),
            "tokens": list(traj.tokens), "loss_mask": list(traj.loss_mask)}


def is_mixed(verdicts: Sequence[dict]) -> bool:
    """Some valid member passes (not hacked) and some fails (SPEC section 2 rules 1-3)."""
    valid = [v for v in verdicts if v["outcome"] != "infra_error"]
    k = sum(v["outcome"] == "pass" and not v.get("hacked", False) for v in valid)
    return 0 < k < len(valid)


def _normalize(answer: object, n: int) -> tuple:
    status, evidence = "ok", None
    if isinstance(answer, dict):
        status, evidence = answer.get("status", "ok"), answer.get("evidence")
        answer = answer.get("verdicts")
    if not isinstance(answer, (list, tuple)) or len(answer) != n:
        raise ValueError(f"the grader must return {n} verdicts, got {answer!r:.200}")
    if status not in ("ok", "failed"):
        raise ValueError(f"grading status must be 'ok' or 'failed', got {status!r}")
    if not all(isinstance(a, dict) for a in answer):
        raise ValueError("each of the grader's verdicts must be a dict")
    return list(answer), status, evidence


def grade_group(grader: Callable | None, grader_name: str, task: dict, views: Sequence[dict]
                ) -> tuple:
    """The group's verdicts (the feed's per-trajectory fields) and its `grading` field.

    Args:
      grader: the `--grader` function, or None.
      grader_name: what the grader field of the record's grading says it was.
      task: the task dict (passed to the grader).
      views: `grader_view` of each trajectory (their "outcome" / "hacked" are the
        environment's verdicts).
    Returns:
      (verdicts [{"outcome", "hacked", "quality"?, "adjustment"?}], grading {"status",
      "grader", "evidence"?}, error: the grader's failure as a string, or None).
    """
    verdicts = [{"outcome": v["outcome"], "hacked": v["hacked"]} for v in views]
    if grader is None or not is_mixed(verdicts):
        for v in verdicts:
            if v["outcome"] == "pass":
                v["quality"] = {"factor": 1.0}
        return verdicts, {"status": "ok", "grader": NO_GRADER if grader is None
                          else grader_name}, None
    try:
        answer, status, evidence = _normalize(grader(task, list(views)), len(views))
        for v, a in zip(verdicts, answer, strict=True):
            if "outcome" in a and a["outcome"] != v["outcome"]:
                raise ValueError(f"the grader changed an outcome ({v['outcome']} -> "
                                 f"{a['outcome']}); the environment's verdict is the outcome")
            v["hacked"] = bool(v["hacked"] or a.get("hacked", False))
            if v["outcome"] == "pass" and a.get("quality") is not None:
                v["quality"] = a["quality"]
            if a.get("adjustment") is not None:
                v["adjustment"] = float(a["adjustment"])
    except GraderCrashed:
        raise
    except Exception as e:   # any grader bug: binary credit for this group, with the reason
        verdicts = [{"outcome": v["outcome"], "hacked": v["hacked"]} for v in views]
        return verdicts, {"status": "failed", "grader": grader_name,
                          "evidence": {"error": f"{type(e).__name__}: {e}"[:2000]}}, repr(e)
    grading = {"status": status, "grader": grader_name}
    if evidence is not None:
        grading["evidence"] = evidence
    return verdicts, grading, None

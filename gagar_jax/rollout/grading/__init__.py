"""Groupwise graders for agent groups (issue 40; docs/grader.md). Imports no JAX.

The interface (every grader here, the heuristic and the LLM one, and a user's):

    from gagar_jax.rollout.grading.base import GroupGrade, as_grader_fn
    from gagar_jax.rollout.grading.workspace import GroupWorkspace

    class MyGrader:                                   # the GroupGrader protocol (base.py)
        name = "mine"
        def grade(self, ws: GroupWorkspace) -> GroupGrade:
            ranked = ws.passing()                     # valid passes (outcome pass, not hacked)
            return GroupGrade(
                ranking=[{"trajectory_id": c.trajectory_id, "tier": "strong", "rank": i}
                         for i, c in enumerate(ranked)],
                status="ok",                          # or "failed": binary credit, counted
                evidence={...},                       # JSON-able: why
                hacked=frozenset())                   # ids found relying on leaks / edited tests

    grader = as_grader_fn(MyGrader())                 # --grader mymodule:grader

- `workspace.GroupWorkspace.from_views(task, views)` builds the group from what the agent loop
  passes a `--grader` (`agent_grading.grader_view`, one per trajectory) and each view's
  workspace directory: per `Candidate` the trajectory id, outcome, hacked, end reason, the
  final diff with its files touched and lines added / removed, the visible test logs, the
  verdict log, the transcript events and the workspace directory.
- `base.GroupGrader`: `name` and `grade(ws) -> GroupGrade(ranking, status, evidence, hacked)`.
  The ranking holds one `{trajectory_id, tier, rank}` per candidate of `ws.passing()`
  (tier "strong" / "intermediate" / "defective", rank an int >= 0 within the tier, smaller =
  better, ties share); a candidate the grader flags hacked may be left out.
- `base.as_grader_fn(grader)`: the one adapter to the agent loop's `--grader` function. Only
  mixed groups are graded (`agent_grading.is_mixed`); the ranking is validated and mapped by
  `tiers.verdicts` (tier + rank into the record, factors through `gagar_jax.grading`'s one
  table); a grader that raises or answers an invalid ranking gives status "failed" with the
  reason in the evidence (the learner falls back to binary credit and counts it).
- `heuristic.grader`: the five-axis heuristic (no LLM); `pool.GraderPool`: graders overlapped
  with rollouts (`--grader-workers N`).
"""

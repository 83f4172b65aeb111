"""Warnings that speak up when a run trains on something other than what the user meant.

    guard = Guardrails(log.warning, fresh=True)
    guard.check(step, scalars, quarantined=n)     # after each finished step, on the host

Four conditions, each one warning line, rate-limited per kind (at most one line per `every_s`
seconds; the next line counts the steps in between):
  * groups were quarantined this step (dead_letter.jsonl has the records and reasons);
  * every trained token was masked (`rollout/masked_token_frac` = 1: rollout_rs / IcePop rejected
    the whole batch, so the step learned nothing);
  * on the first step of a fresh run, the learner's log-probs sit far from the feed's: the feed
    was not sampled from the weights the learner holds (a wrong `train.init_from`, or records of
    another model). The gap is the mean |learner - feed| log-prob per token where the learner
    recomputes its own (`rollout/logp_abs_diff_mean`), else k1 (`ppo_kl`, the first update's
    denominator is the feed's log-probs);
  * the token-weighted net credit has stayed negative for NET_CREDIT_STEPS steps in a row:
    `token_net_frac` (sum w A / sum w |A| over trained tokens, w the aggregation weights;
    `algo/step_metrics.py`) <= -NET_CREDIT_FRAC. Net-negative credit pushes probability onto
    tokens the sampler never proposes (top-p / top-k, stale or mismatched rollouts), which no IS
    weight sees: entropy rises later (docs/miniature.md, round three and four). The line says
    whether the outcome advantages alone already carry it (`token_outcome_credit` < 0: failures
    longer than passes) or the redistribution does (downweight_only, a length penalty).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Optional

FAR_LOGP_GAP = 0.5      # nats per token: far beyond bf16 rounding (~0.005) or a step's change
FAR_APPROX_KL = 0.5     # k3 at step 1; an on-policy feed gives ~0
# Token-weighted net credit: a fraction of the gross |credit| (downweight-only at f_bar 0.55
# starts near -0.3; zero-sum credit over equal lengths is 0) held for this many steps in a row.
NET_CREDIT_FRAC = 0.05
NET_CREDIT_STEPS = 10


class Guardrails:
    """Per-step checks of the host metrics; see the module docstring.

    Args:
      warn: where the lines go (the trainer's `log.warning`).
      fresh: whether the run started from step 0 (the first-step check runs only then).
      every_s: the shortest interval between two lines of one kind.
      clock: seconds (tests pass their own).
    """

    def __init__(self, warn: Callable[[str], None], *, fresh: bool, every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.warn, self.fresh, self.every_s, self.clock = warn, fresh, every_s, clock
        self._last: dict = {}        # kind -> time of its last line
        self._held: dict = {}        # kind -> steps with the condition since that line
        self.first_checked = False
        self.net_negative_steps = 0  # consecutive steps with token_net_frac <= -NET_CREDIT_FRAC

    def _say(self, kind: str, text: str) -> None:
        now, held = self.clock(), self._held.get(kind, 0)
        last = self._last.get(kind)
        if last is not None and now - last < self.every_s:
            self._held[kind] = held + 1
            return
        more = f" (and on {held} more step(s) since the last such line)" if held else ""
        self.warn(text + more)
        self._last[kind], self._held[kind] = now, 0

    def check(self, step: int, scalars: Mapping[str, float], *, quarantined: int = 0) -> None:
        """Warns about one finished step.

        Args:
          step: the step; scalars: its host metrics (`HostMetrics.scalars` names).
          quarantined: groups quarantined while its batch was built.
        """
        if quarantined:
            self._say("quarantined", f"step {step}: {quarantined} group(s) quarantined (reasons "
                      "and records in dead_letter.jsonl; counts in ledger.json)")
        masked = scalars.get("rollout/masked_token_frac")
        if masked is not None and masked >= 1.0:
            self._say("masked", f"step {step}: every trained token was masked "
                      "(rollout/masked_token_frac = 1: loss.rollout_rs / icepop rejected the "
                      "whole batch), so the step learned nothing; loosen the thresholds or check "
                      "that the feed comes from the learner's weights")
        if self.fresh and not self.first_checked:
            self.first_checked = True
            self._first_step(step, scalars)
        self._net_credit(step, scalars)

    def _net_credit(self, step: int, scalars: Mapping[str, float]) -> None:
        frac = scalars.get("token_net_frac")
        if frac is None:
            return
        self.net_negative_steps = self.net_negative_steps + 1 if frac <= -NET_CREDIT_FRAC else 0
        if self.net_negative_steps < NET_CREDIT_STEPS:
            return
        outcome = scalars.get("token_outcome_credit", 0.0)
        cause = ("the outcome advantages alone carry it (token_outcome_credit "
                 f"{outcome:+.3g}: failures are longer than passes; consider "
                 "loss.aggregation=seq-mean-token-mean)" if outcome < 0 else
                 "the redistribution or reward adjustments add it (token_outcome_credit "
                 f"{outcome:+.3g}; loss.mode=downweight_only? a length penalty?)")
        self._say("net_credit", f"step {step}: the token-weighted net credit has been negative "
                  f"for {self.net_negative_steps} steps (token_net_frac {frac:+.3f} <= "
                  f"-{NET_CREDIT_FRAC}, token_net_credit {scalars.get('token_net_credit', 0):+.3g}"
                  f"): it pushes probability onto tokens the sampler does not propose, and "
                  f"entropy rises later; {cause}")

    def _first_step(self, step: int, scalars: Mapping[str, float]) -> None:
        gap: Optional[float] = scalars.get("rollout/logp_abs_diff_mean") or None
        what = "mean |learner - feed| log-prob"
        if gap is None and "ppo_kl" in scalars:
            gap, what = abs(scalars["ppo_kl"]), "mean feed - learner log-prob (k1)"
        kl = scalars.get("approx_kl", 0.0)
        if (gap is not None and gap > FAR_LOGP_GAP) or kl > FAR_APPROX_KL:
            shown = "n/a" if gap is None else f"{gap:.3g}"
            self.warn(f"step {step}: the learner's log-probs sit far from the feed's ({what} "
                      f"{shown} nats per token, approx_kl {kl:.3g}): the feed was not sampled from "
                      "the weights the learner holds (train.init_from, or records of another "
                      "model?); its ratios clip and corrections mask most tokens")

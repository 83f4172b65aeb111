"""Per-step warnings (`run/guardrails.py`): what triggers each, the numbers they say, the rate
limit. Pure host code on metric dicts; the trainer calls it from `metrics.StepLog`."""
from __future__ import annotations

from gagar_jax.run.guardrails import Guardrails


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_quarantined_groups_warn_rate_limited_and_count_the_steps_held_back():
    lines, clock = [], Clock()
    g = Guardrails(lines.append, fresh=False, every_s=60.0, clock=clock)
    g.check(1, {}, quarantined=2)
    clock.t = 10.0
    g.check(2, {}, quarantined=1)           # within 60 s: held back
    g.check(3, {}, quarantined=0)           # nothing to say
    clock.t = 61.0
    g.check(4, {}, quarantined=3)
    assert lines == [
        "step 1: 2 group(s) quarantined (reasons and records in dead_letter.jsonl; counts in "
        "ledger.json)",
        "step 4: 3 group(s) quarantined (reasons and records in dead_letter.jsonl; counts in "
        "ledger.json) (and on 1 more step(s) since the last such line)"]


def test_every_token_masked_warns_and_a_partial_mask_does_not():
    lines = []
    g = Guardrails(lines.append, fresh=False, clock=Clock())
    g.check(1, {"rollout/masked_token_frac": 0.999})
    assert lines == []
    g.check(2, {"rollout/masked_token_frac": 1.0})
    assert len(lines) == 1 and lines[0].startswith("step 2: every trained token was masked")


def test_first_step_far_from_the_feed_says_so_with_the_mean_gap():
    # the learner recomputes its log-probs: the gap is rollout/logp_abs_diff_mean
    lines = []
    g = Guardrails(lines.append, fresh=True, clock=Clock())
    g.check(1, {"rollout/logp_abs_diff_mean": 4.81, "approx_kl": 4.38, "ppo_kl": 0.0})
    g.check(2, {"rollout/logp_abs_diff_mean": 9.0, "approx_kl": 9.0})     # first step only
    assert lines == [
        "step 1: the learner's log-probs sit far from the feed's (mean |learner - feed| log-prob "
        "4.81 nats per token, approx_kl 4.38): the feed was not sampled from the weights the "
        "learner holds (train.init_from, or records of another model?); its ratios clip and "
        "corrections mask most tokens"]
    # without recompute: k1 of the first update (feed log-probs as the denominator)
    lines.clear()
    Guardrails(lines.append, fresh=True, clock=Clock()).check(
        1, {"rollout/logp_abs_diff_mean": 0.0, "ppo_kl": -0.9, "approx_kl": 0.2})
    assert "(mean feed - learner log-prob (k1) 0.9 nats per token, approx_kl 0.2)" in lines[0]
    # on-policy (bf16 rounding), or a resumed run: silent
    lines.clear()
    Guardrails(lines.append, fresh=True, clock=Clock()).check(
        1, {"rollout/logp_abs_diff_mean": 0.005, "ppo_kl": 0.001, "approx_kl": 1e-5})
    Guardrails(lines.append, fresh=False, clock=Clock()).check(
        7, {"rollout/logp_abs_diff_mean": 5.0, "approx_kl": 5.0})
    assert lines == []


def test_net_negative_token_credit_warns_after_ten_steps_in_a_row_and_names_its_source():
    from gagar_jax.run import guardrails
    lines, clock = [], Clock()
    g = Guardrails(lines.append, fresh=False, every_s=60.0, clock=clock)
    neg = {"token_net_frac": -0.2, "token_net_credit": -0.031, "token_outcome_credit": 0.01}
    for step in range(1, 10):
        g.check(step, neg)
    g.check(10, {**neg, "token_net_frac": -0.04})      # above -0.05: the run of steps restarts
    for step in range(11, 20):
        g.check(step, neg)
    assert lines == [] and g.net_negative_steps == 9
    g.check(20, neg)                                     # the tenth step in a row
    assert lines == [
        "step 20: the token-weighted net credit has been negative for 10 steps (token_net_frac "
        "-0.200 <= -0.05, token_net_credit -0.031): it pushes probability onto tokens the "
        "sampler does not propose, and entropy rises later; the redistribution or reward "
        "adjustments add it (token_outcome_credit +0.01; loss.mode=downweight_only? a length "
        "penalty?)"]
    assert guardrails.NET_CREDIT_STEPS == 10 and guardrails.NET_CREDIT_FRAC == 0.05
    clock.t = 30.0
    g.check(21, {**neg, "token_outcome_credit": -0.02})  # rate-limited: held back
    clock.t = 61.0
    g.check(22, {**neg, "token_outcome_credit": -0.02})
    assert len(lines) == 2 and "the outcome advantages alone carry it" in lines[1]
    assert lines[1].endswith("(and on 1 more step(s) since the last such line)")
    # Zero-sum credit, positive credit, or a run without the metric: silent.
    quiet = []
    q = Guardrails(quiet.append, fresh=False, clock=Clock())
    for step in range(30):
        q.check(step, {"token_net_frac": 0.0 if step % 2 else 0.3})
        q.check(step, {})
    assert quiet == []

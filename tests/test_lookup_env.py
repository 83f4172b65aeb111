"""The closed loop's task (gagar_jax/rollout/envs/lookup.py): scripted agents through the
environment interface, and a uniform random policy's pass rate against its closed form."""
import random

import pytest

from gagar_jax.rollout.envs import base, lookup
from gagar_jax.rollout.envs.base import EnvOptions
from gagar_jax.rollout.envs.tokenizer import Tokenizer

TOK = lookup.tokenizer()
L, E, D = lookup.LOOK, lookup.END, lookup.DIGITS     # D: "0" -> 5 ... "3" -> 8


def episode(task, turns, seed=0):
    """Plays `turns` (id lists) through a fresh environment: (observations, steps, verdict)."""
    env = lookup.make_env(task, TOK, EnvOptions(max_turns=3, seed=seed))
    assert isinstance(env, base.Environment)
    obs, steps = [env.reset()], []
    for t in turns:
        step = env.step(t)
        steps.append(step)
        if step.done:
            break
        obs.append(list(step.observation))
    verdict = base.check_verdict(env.verdict(), task["task_id"])
    env.close()
    return obs, steps, verdict


def test_tokenizer_symbols_and_chat_format():
    assert isinstance(TOK, Tokenizer) and TOK.vocab_size == 9 and TOK.stop_token_ids == (0,)
    assert TOK.encode("<look>3<|end|>") == [1, 8, 0] and TOK.decode([1, 8, 0]) == "<look>3<|end|>"
    assert TOK.prompt([{"role": "user", "content": "<look>"}]) == [2, 1, 4]
    assert TOK.observation([{"role": "tool", "content": "2"}]) == [3, 7]     # no header after
    with pytest.raises(ValueError, match="not a symbol"):
        TOK.encode("x")


def test_the_reference_agent_passes_every_task_and_others_fail():
    for task in [{"task_id": f"t{c}", "code": c} for c in range(4)]:
        code = D[str(task["code"])]
        wrong = D[str((task["code"] + 1) % 4)]
        obs, steps, v = episode(task, [[L, E], [E], [code, E]])      # look, then copy
        assert v["outcome"] == "pass" and [s.done for s in steps] == [False, False, True]
        assert obs == [[2, 1, 4], [3, code], [3]] and steps[0].tool_calls == 1
        assert steps[-1].reason == "submitted"
        # the second tool turn looks instead; noise around the call and the answer
        assert episode(task, [[7, 7, E], [6, L, 5], [4, code, wrong]])[2]["outcome"] == "pass"
        assert episode(task, [[E], [E], [E]])[2]["outcome"] == "fail"            # nothing
        assert episode(task, [[E], [E], [code]])[2]["outcome"] == "fail"         # no look
        assert episode(task, [[L], [L], [wrong, code]])[2]["outcome"] == "fail"  # wrong copy
        assert episode(task, [[code, L], [E], [L, E]])[2]["outcome"] == "fail"   # no answer


def test_each_episode_draws_its_code_from_its_seed():
    codes = [lookup.make_env({"task_id": "t"}, TOK, EnvOptions(seed=s)).code for s in range(40)]
    assert sorted(set(codes)) == [0, 1, 2, 3]
    assert codes == [lookup.make_env({"task_id": "t"}, TOK, EnvOptions(seed=s)).code
                     for s in range(40)]
    assert lookup.make_env({"task_id": "t", "code": 3}, TOK, EnvOptions(seed=5)).code == 3


def test_an_episode_ended_by_the_loop_fails():
    task = {"task_id": "t", "code": 2}
    env = lookup.make_env(task, TOK, EnvOptions())
    env.reset()
    env.step([L])
    env.end("token_limit")
    assert env.verdict()["outcome"] == "fail"
    with pytest.raises(ValueError, match="code"):
        lookup.make_env({"task_id": "t", "code": 4}, TOK, EnvOptions())


def test_a_uniform_random_policy_passes_its_closed_form_rate():
    """4-token turns ended early by <|end|>: look in a turn with (1/9)(1 - (7/9)^4)/(2/9), in one
    of two tool turns, then the answer's first digit is the code with (4/5)(1 - (4/9)^4) / 4."""
    rng = random.Random(0)

    def turn():
        out = []
        while len(out) < 4:
            out.append(rng.randrange(9))
            if out[-1] == E:
                break
        return out
    n, tasks = 3000, lookup.tasks(1)
    rate = sum(episode(next(tasks), [turn(), turn(), turn()], seed=i)[2]["outcome"] == "pass"
               for i in range(n)) / n
    p_look = (1 / 9) * (1 - (7 / 9) ** 4) / (2 / 9)
    want = (1 - (1 - p_look) ** 2) * (4 / 5) * (1 - (4 / 9) ** 4) / 4
    assert abs(want - 0.103) < 0.001 and abs(rate - want) < 0.025, (rate, want)   # 4.5 sd

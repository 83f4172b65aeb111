"""Scripted agents for the repository environment: turns written as tool calls, played through
the environment's `reset` / `step` / `verdict` with the byte tokenizer."""
from gagar_jax.rollout.envs import patch, workspace
from gagar_jax.rollout.envs.base import EnvOptions
from gagar_jax.rollout.envs.tokenizer import ByteTokenizer
from gagar_jax.rollout.envs.tools import format_tool_call

TOKENIZER = ByteTokenizer()


def call(name, **arguments):
    return format_tool_call(name, arguments)


def play(make, task, turns, options: EnvOptions, judge=True):
    """Runs one episode: the prompt, then each turn's text (with the stop token) until the
    environment ends it; a script that runs out ends with "turn_limit". Returns (env, steps,
    verdict: None without `judge`); the env is closed."""
    env = make(task.as_dict(), TOKENIZER, options)
    prompt = env.reset()
    assert prompt and all(isinstance(t, int) for t in prompt)
    steps = []
    for text in turns:
        step = env.step(TOKENIZER.encode(text) + list(TOKENIZER.stop_token_ids))
        steps.append(step)
        if step.done:
            break
    else:
        env.end("turn_limit")
    verdict = env.verdict() if judge else None
    env.close()
    return env, steps, verdict


def files_after(task, diff_name="fix.diff"):
    """(original files, files after the task's `diff_name`) of the task's repository."""
    original = workspace.read_tree(task.repo_dir)
    with open(f"{task.dir}/{diff_name}") as f:
        changed = patch.apply(original, f.read())
    return original, {**original, **changed}


def replay_turns(task, diff_name="fix.diff", *, write=False, run_tests=False):
    """The turns of an agent that applies the task's `diff_name` (as one apply_patch call, or
    with `write` as write_file calls of the changed files), optionally runs the tests, then
    submits."""
    with open(f"{task.dir}/{diff_name}") as f:
        diff = f.read()
    if write:
        original, fixed = files_after(task, diff_name)
        first = "".join(call("write_file", path=p, content=t) for p, t in fixed.items()
                        if original.get(p) != t)
    else:
        first = "I found the bug. " + call("apply_patch", patch=diff)
    return [first] + ([call("run_tests")] if run_tests else []) + [call("submit")]

"""The agent loop without vLLM (gagar_jax/rollout/agent_loop.py, agent_record.py,
agent_grading.py): a scripted engine and environment (tests/support/agent_fakes.py) through the
engine and environment interfaces. Records are checked token by token against what the engine
produced and the environment showed, and taken by the learner's own feed (validated, packed)."""
import dataclasses
import glob
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import agent_fakes as F

from gagar_jax.feed import Feed, FeedConfig, IteratorSource, schema
from gagar_jax.rollout import agent_grading, worker
from gagar_jax.rollout.agent_loop import AgentLoop, AgentOptions
from gagar_jax.rollout.agent_record import AgentTrajectory
from gagar_jax.rollout.engine import SamplingSpec

# the sandbox runs task tests with .venv-tasks (tests/support/tasks_env.py)
pytestmark = pytest.mark.usefixtures("tasks_env")

SPEC = SamplingSpec(max_tokens=4)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def drive(loop, tasks, groups, timeout_s=20.0):
    """Runs `loop` until `groups` groups were emitted; returns [(record, info)]."""
    out, started = [], 0
    loop.emit = lambda rec, info: out.append((rec, info))
    deadline = time.monotonic() + timeout_s
    while len(out) < groups:
        assert time.monotonic() < deadline, f"only {len(out)} of {groups} groups"
        loop.sync()
        while loop.room and started < groups + loop.counts["stale_restarts"]:
            loop.start(loop.requeued.pop(0) if loop.requeued else next(tasks))
            started += 1
        loop.tick(0.01)
    loop.close()
    return out


def make(opts=None, engine=None, **kw):
    engine = engine or F.ScriptedEngine(version=0)
    opts = opts or AgentOptions(n=3, max_turns=8, threads=False)
    return AgentLoop(engine, F.make_env, F.Tok(), SPEC, opts, **kw), engine


def task(i=0, **kw):
    return {"task_id": f"t{i}-{time.monotonic_ns()}", "turns": 3, "obs": 2, "n": 3,
            "pass": [True, False, False], **kw}


def feed_takes(recs, tmp_path, overlong="reject", seq_len=128):
    """The learner's feed on `recs`: validated (nothing quarantined) and packed."""
    cfg = FeedConfig(path="", rows_per_batch=8, seq_len=seq_len, max_traj_tokens=seq_len,
                     max_trajectories=16, groups_per_batch=len(recs), max_staleness=100,
                     routing_replay=True, overlong=overlong, filter_uniform=False)
    feed = Feed(cfg, str(tmp_path), vocab_size=256, num_moe_layers=2, top_k=2, num_experts=4,
                source=IteratorSource([schema.to_builtins(r) for r in recs]))
    item = feed.next_batch(max(r.policy_version for r in recs))
    assert feed.ledger.quarantined == 0, feed.ledger.quarantined_by_reason
    batch, info = item
    return batch, info, feed


def test_a_group_of_three_turn_episodes_records_exactly_what_engine_and_env_exchanged(tmp_path):
    loop, engine = make()
    [(rec, info)] = drive(loop, iter([task()]), 1)
    assert rec.policy_version == 0 and rec.sampling.engine == "scripted"
    assert [t.outcome for t in rec.trajectories] == ["pass", "fail", "fail"]
    assert rec.trajectories[0].quality.factor == 1.0 and rec.grading.grader == "env"
    # one engine call per round: the group's three episodes together, three rounds
    assert [len(c) for c in engine.calls] == [3, 3, 3]
    first, second = engine.calls[0][0], engine.calls[1][0]
    assert first.sequence is None and list(first.tokens) == F.PROMPT
    assert second.sequence is not None and list(second.tokens) == [201, 201]
    seeds = [r.seed for c in engine.calls for r in c]
    assert len(set(seeds)) == 9                      # per episode and turn
    for t, seq in zip(rec.trajectories, [r.sequence for r in engine.calls[2]], strict=True):
        # what the engine saw and produced, token for token, and nothing else
        assert t.tokens == engine.finals[seq]
        turns = [c for call in engine.calls for c in call if c.sequence in (None, seq)]
        gen = [engine.finals[seq][i] for i, m in enumerate(t.loss_mask) if m]
        assert len(gen) == 12 and t.loss_mask == [0] * 5 + [1] * 4 + [0] * 2 + [1] * 4 \
            + [0] * 2 + [1] * 4
        assert t.tokens[9:11] == [201, 201] and t.tokens[15:17] == [202, 202]
        assert [lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m] == \
            [-(1 + j) / 100 for j in range(4)] * 3
        assert t.routed_experts == [F.routing(x) for x in gen]
        assert t.policy_version_spans == [[5, 0]] and not t.truncated
        assert len(turns) >= 1
    assert info["turns"] == 9 and info["tool_calls"] == 9 and info["end_reasons"] == [
        "submitted"] * 3 and info["mixed"] and info["passes"] == 1 and info["spanning"] == 0
    assert engine.live == {}                         # every sequence cancelled
    assert all(e.closed == 1 for e in F.ENVS if e.task_id == rec.task_id)
    batch, binfo, _ = feed_takes([rec], tmp_path)
    assert binfo.group_ids == (rec.group_id,)
    assert int(np.asarray(batch.loss_mask_BxS).sum()) == 36
    # generated token t's routing sits at its input position t - 1
    assert int((np.asarray(batch.routed_experts_BxSxLxK) >= 0).sum()) == 36 * 2 * 2


def test_groups_run_concurrently_and_the_same_seed_gives_the_same_records():
    def once():
        loop, engine = make(AgentOptions(n=3, concurrent_groups=2, seed=5, threads=False))
        out = drive(loop, iter([task(0, turns=2), task(1, turns=3)]), 2)
        return [(r.task_id[:2], [t.tokens for t in r.trajectories]) for r, _ in out], engine
    a, engine = once()
    b, _ = once()
    assert [len(c) for c in engine.calls] == [6, 6, 3]     # two groups share the engine calls
    assert a == b and a[0][0] == "t0"


def test_environment_calls_in_threads_give_the_same_records():
    def once(threads):
        loop, _ = make(AgentOptions(n=3, concurrent_groups=2, threads=threads))
        out = drive(loop, iter([task(0), task(1, turns=4)]), 2)
        return sorted((r.task_id[:2], [t.tokens for t in r.trajectories]) for r, _ in out)
    assert once(True) == once(False)


def test_a_trajectory_spans_the_versions_that_generated_its_turns(tmp_path):
    wd = str(tmp_path / "wd")
    F.publish(wd, 0)
    engine = F.ScriptedEngine(F.publish(wd, 0))
    loop, _ = make(engine=engine, workdir=wd)
    t = task(move_latest_at=1, workdir=wd, move_to=1)
    [(rec, info)] = drive(loop, iter([t]), 1)
    assert engine.moves == [1] and loop.counts["reloads"] == 1
    assert rec.policy_version == 1 and info["oldest_version"] == 0
    for tr in rec.trajectories:          # turn 1 from version 0, turns 2 and 3 from version 1
        assert tr.policy_version_spans == [[5, 0], [11, 1]]
    assert info["spanning"] == 3
    _, _, feed = feed_takes([rec], tmp_path / "feed")
    assert feed.ledger.received == 1


def test_a_group_lagging_more_than_max_version_lag_restarts_on_the_new_version(tmp_path):
    wd = str(tmp_path / "wd")
    engine = F.ScriptedEngine(F.publish(wd, 0))
    loop, _ = make(AgentOptions(n=3, max_version_lag=0, threads=False), engine=engine,
                   workdir=wd)
    t = task(move_latest_at=1, workdir=wd, move_to=1)
    [(rec, info)] = drive(loop, iter([t]), 1)
    assert loop.counts["stale_restarts"] == 1 and rec.task_id == t["task_id"]
    assert rec.policy_version == 1 and info["spanning"] == 0    # the restart: version 1 only
    assert all(tr.policy_version_spans == [[5, 1]] for tr in rec.trajectories)
    old = [e for e in F.ENVS if e.task_id == t["task_id"]][:3]
    assert all(e.closed == 1 and e.ended is None for e in old)     # abandoned, closed


def test_turn_limit_ends_normally_and_length_limits_truncate(tmp_path):
    loop, engine = make(AgentOptions(n=3, max_turns=2, threads=False))
    [(rec, info)] = drive(loop, iter([task(turns=9)]), 1)
    assert info["end_reasons"] == ["turn_limit"] * 3 and not any(
        t.truncated for t in rec.trajectories)
    assert all(e.ended == "turn_limit" for e in F.ENVS if e.task_id == rec.task_id)
    # 5 prompt + 4 + 2 + 4 (= 15) + 2: the next observation leaves no room for a turn
    for reason, kw in (("token_limit", {"max_traj_tokens": 15}),
                       ("context_full", {"max_model_len": 15})):
        loop, engine = make(AgentOptions(n=3, threads=False, **kw))
        [(rec, info)] = drive(loop, iter([task(turns=9)]), 1)
        assert info["end_reasons"] == [reason] * 3 and info["truncated"] == 3
        assert [r.sampling.max_tokens for c in engine.calls for r in c] == [4] * 3 + [4] * 3
        assert all(len(t.tokens) == 15 and t.truncated for t in rec.trajectories)
        _, _, feed = feed_takes([rec], tmp_path / reason, overlong="drop")
        # the feed's overlong policy: `reject` quarantines the group
        with pytest.raises(AssertionError, match="trajectory_too_long"):
            feed_takes([rec], tmp_path / f"{reason}-reject")
    # a turn cut by the limit: 5 + 4 + 2 = 11, a budget of 13 leaves 2 tokens for turn 2
    loop, engine = make(AgentOptions(n=3, max_traj_tokens=13, threads=False))
    [(rec, info)] = drive(loop, iter([task(turns=9)]), 1)
    assert [r.sampling.max_tokens for r in engine.calls[1]] == [2] * 3
    assert all(len(t.tokens) == 13 and t.truncated for t in rec.trajectories)
    assert all(len(e.seen) == 1 for e in F.ENVS if e.task_id == rec.task_id)   # never stepped


def test_a_stop_token_ends_a_turn_and_is_handed_to_the_environment():
    engine = F.ScriptedEngine(version=0, stop_at=1)
    loop, _ = make(engine=engine)
    [(rec, _)] = drive(loop, iter([task(turns=2)]), 1)
    assert engine.calls[0][0].sampling.stop_token_ids == (F.STOP,)
    for e in [e for e in F.ENVS if e.task_id == rec.task_id]:
        assert [len(s) for s in e.seen] == [2, 2] and all(s[-1] == F.STOP for s in e.seen)


@pytest.mark.parametrize("bad", [{"raise_at": 2}, {"verdict_raises": True}, {"hang_at": 1}])
def test_an_environment_that_fails_is_an_infra_error_and_the_loop_goes_on(bad):
    opts = AgentOptions(n=3, threads=True, step_timeout_s=1.0)
    loop, _ = make(opts)
    out = drive(loop, iter([task(0, n=1_000_000, **bad), task(1, **{"pass": False})]), 2)
    broken, fine = sorted(out, key=lambda x: x[0].task_id)
    assert [t.outcome for t in broken[0].trajectories] == ["infra_error"] * 3
    assert "error" in broken[0].grading.evidence["env"][0]["evidence"]
    assert [t.outcome for t in fine[0].trajectories] == ["fail"] * 3   # the loop went on
    assert loop.counts["infra_errors"] == 3


def test_the_grader_sees_mixed_groups_only_and_adds_quality_on_top():
    seen = []

    def grader(task, trajectories):
        seen.append(trajectories)
        return [{"quality": {"tier": "strong", "rank": 0}, "adjustment": -0.1}, {},
                {"hacked": True}]
    loop, _ = make(grader=grader, grader_name="g1")
    out = drive(loop, iter([task(0), task(1, **{"pass": True})]), 2)
    (mixed, _), (uniform, _) = out
    assert len(seen) == 1
    v = seen[0][0]
    assert v["outcome"] == "pass" and v["end_reason"] == "submitted" and v["turns"] == 3
    assert v["workspace"].startswith("/ws/") and v["evidence"] == {"turns": 3}
    assert [p["role"] for p in v["transcript"]] == ["observation", "model"] * 3
    assert v["transcript"][0]["text"] == "1 2 3 4 5"
    assert mixed.grading.grader == "g1" and mixed.trajectories[0].quality.tier == "strong"
    assert mixed.trajectories[0].adjustment == -0.1 and mixed.trajectories[2].hacked
    assert [t.quality.factor for t in uniform.trajectories] == [1.0] * 3


@pytest.mark.parametrize("answer", ["raise", [{"outcome": "fail"}, {}, {}], [{}]])
def test_a_grader_that_fails_gives_binary_credit_with_the_reason(answer):
    def grader(task, trajectories):
        if answer == "raise":
            raise RuntimeError("judge down")
        return answer
    loop, _ = make(grader=grader, grader_name="g1")
    [(rec, _)] = drive(loop, iter([task()]), 1)
    assert rec.grading.status == "failed" and "error" in rec.grading.evidence["grader"]
    assert rec.trajectories[0].quality is None and loop.counts["grader_errors"] == 1


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4), st.integers(0, 3)),
                min_size=1, max_size=8))
def test_version_spans_cover_every_generated_token_with_its_version(turns):
    """Random observation / turn lengths and versions: the spans, expanded, give every
    generated token its version, start at a generated token, and change version at each start."""
    t = AgentTrajectory()
    t.observe([1, 2])
    want = []
    for obs, g, v in turns:
        t.observe([7] * obs)
        t.generated([5] * g, [-0.5] * g, None, v)
        want += [v] * g
    spans = t.version_spans()
    got = np.full(len(t), -1)
    for (s, v), e in zip(spans, [s for s, _ in spans[1:]] + [len(t)], strict=True):
        got[s:e] = v
        assert t.loss_mask[s] == 1
    assert list(got[np.asarray(t.loss_mask) == 1]) == want
    assert all(a[1] != b[1] for a, b in zip(spans, spans[1:], strict=False))
    assert t.routed_array() is None and t.oldest_version == min(want)


def test_is_mixed_counts_hacked_passes_as_failures():
    f = agent_grading.is_mixed
    assert f([{"outcome": "pass"}, {"outcome": "fail"}])
    assert not f([{"outcome": "pass", "hacked": True}, {"outcome": "fail"}])
    assert not f([{"outcome": "pass"}, {"outcome": "infra_error"}])
    assert dataclasses.replace(AgentOptions(max_model_len=8, max_traj_tokens=6)).limit == (
        6, "token_limit")


def _worker(workdir, *flags):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")])}
    return subprocess.run([sys.executable, "-m", "gagar_jax.rollout.worker", "--workdir", workdir,
                           "--wait-s", "5", "--engine", "support.agent_fakes:make_engine",
                           *flags], capture_output=True, text=True, timeout=120, env=env)


def test_the_worker_runs_the_agent_loop_with_env(tmp_path):
    """`--env` (tasks from the env's module by default), `--tokenizer module:function`: records
    in the spool, a log line per group, the counts on stdout."""
    wd = str(tmp_path)
    F.publish(wd, 3)
    proc = _worker(wd, "--env", "support.agent_fakes:make_env", "--tokenizer",
                   "support.agent_fakes:tokenizer", "--max-groups", "2", "--n", "3",
                   "--max-tokens", "4", "--concurrent-groups", "2")
    assert proc.returncode == 0, proc.stderr
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["groups"] == 2 and counts["turns"] == 18 and counts["passes"] == 2
    shards = sorted(glob.glob(os.path.join(wd, "spool", "*.jsonl")))
    groups = [schema.decode(line, "json") for s in shards for line in open(s, "rb")]
    assert sorted(g.task_id for g in groups) == ["scripted-0-0", "scripted-0-1"]
    assert all(g.policy_version == 3 and len(g.trajectories) == 3 for g in groups)
    log = [json.loads(x) for x in open(os.path.join(wd, "rollout", "worker0.jsonl"))]
    assert [r["turns"] for r in log] == [9, 9] and all(r["mixed"] for r in log)


@pytest.mark.parametrize("flags,msg", [
    (["--env", "nosuch.module:make_env"], "--env"),
    (["--env", "support.agent_fakes:make_env", "--tokenizer", "support.agent_fakes:publish"],
     "--tokenizer"),
    (["--env", "support.agent_fakes:make_env", "--max-version-lag", "-2"], "max_version_lag"),
    (["--env", "support.agent_fakes:make_env", "--max-turns", "0"], "max_turns")])
def test_bad_agent_flags_exit_2_in_one_line(tmp_path, flags, msg, capsys):
    with pytest.raises(SystemExit) as exit_:
        worker.main(["--workdir", str(tmp_path), "--wait-s", "1", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and msg in err and len(err.strip().splitlines()) == 1, err


def test_tokenizer_flag_takes_a_hugging_face_directory(tmp_path):
    """`--tokenizer DIR`: a Hugging Face tokenizer saved there (a word-level one built here,
    nothing downloaded, with a ChatML template), behind the `Tokenizer` interface through the
    adapter of rollout/envs (`hf_tokenizer.HFTokenizer`)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from gagar_jax.rollout import agent_worker
    from gagar_jax.rollout.envs.tokenizer import Tokenizer
    words = ["<|im_start|>", "<|im_end|>", "user", "assistant", "tool", "fix", "it", "\n"]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="it"))
    raw.pre_tokenizer = pre_tokenizers.Split("\n", "isolated")
    raw.add_special_tokens(words[:2])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|im_end|>",
        chat_template=("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                       "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                       "assistant\n{% endif %}"))
    hf.save_pretrained(str(tmp_path / "tok"))
    tok = agent_worker.load_tokenizer(str(tmp_path / "tok"), worker.load_callable)
    assert isinstance(tok, Tokenizer) and tok.stop_token_ids == (1,)
    # <|im_start|> user \n fix <|im_end|> \n <|im_start|> assistant \n, by the template
    assert tok.prompt([{"role": "user", "content": "fix"}]) == [0, 2, 7, 5, 1, 7, 0, 3, 7]


def test_gagar_loop_passes_the_agent_flags_to_its_workers():
    """`gagar-loop --env ...`: the workers' agent flags come after the loop's own worker flags
    (so `--worker-arg=--max-tokens=4` wins over the learner's max_response_len)."""
    from gagar_jax.run import loop_cli
    a, rest = loop_cli._args(["--workdir", "w", "--env", "m:make_env", "--tokenizer", "m:tok",
                              "--max-turns", "3", "--worker-arg=--max-tokens=4",
                              "--worker-arg=--no-routing", "--config.train.steps=2"])
    assert loop_cli.agent_args(a) == ("--env=m:make_env", "--tokenizer=m:tok", "--max-turns=3",
                                      "--max-tokens=4", "--no-routing")
    assert rest == ["--config.train.steps=2"]
    a, _ = loop_cli._args(["--workdir", "w"])
    assert loop_cli.agent_args(a) == ()


def test_long_trajectories_send_compact_arrays_the_feed_reads_back(tmp_path, monkeypatch):
    """Past `COMPACT_FROM` tokens, tokens, log-probs and routing go as compact base64 arrays
    (docs/feed.md); the learner's feed packs them into the same batch as the list form."""
    from gagar_jax.rollout import agent_record

    def batch(compact_from, where):
        monkeypatch.setattr(agent_record, "COMPACT_FROM", compact_from)
        loop, _ = make(AgentOptions(n=3, seed=1, threads=False))
        [(rec, _)] = drive(loop, iter([{**task(), "task_id": "same"}]), 1)
        return rec, feed_takes([rec], tmp_path / where)[0]
    packed_rec, packed = batch(10, "packed")
    listed_rec, listed = batch(4096, "listed")
    t = packed_rec.trajectories[0]
    assert isinstance(t.tokens, schema.PackedArray) and isinstance(t.logprobs, schema.PackedArray)
    assert isinstance(t.routed_experts, schema.PackedArray) and t.routed_experts.shape == [12, 2, 2]
    assert isinstance(listed_rec.trajectories[0].tokens, list)
    for name in ("tokens_BxS", "loss_mask_BxS", "old_logprobs_BxS", "routed_experts_BxSxLxK"):
        np.testing.assert_array_equal(np.asarray(getattr(packed, name)),
                                      np.asarray(getattr(listed, name)), err_msg=name)


def test_the_worker_runs_the_repository_environment_by_its_names(tmp_path):
    """`--env gagar_jax.rollout.envs.repo:make_env --tasks gagar_jax.rollout.envs.repo:tasks`
    through the worker's agent mode, in the real sandbox: a scripted engine
    (tests/support/repo_replay.py) plays one trajectory per group that replays the task's
    reference fix through the tools (pass) and one that submits at once (fail), on 2 tasks. The
    records pass the feed's validator, each group is mixed, and the grader sees each
    trajectory's workspace (its final diff: the fix, or nothing)."""
    from gagar_jax.feed.validate import ModelShape, validate_group
    from gagar_jax.rollout.envs import patch, repo_tasks, workspace
    from gagar_jax.rollout.envs.tokenizer import ByteTokenizer
    wd, seen = str(tmp_path / "wd"), tmp_path / "grader"
    seen.mkdir()
    F.publish(wd, 1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")]),
           "REPLAY_GRADER_OUT": str(seen)}
    proc = subprocess.run(
        [sys.executable, "-m", "gagar_jax.rollout.worker", "--workdir", wd, "--wait-s", "5",
         "--engine", "support.repo_replay:make_engine",
         "--env", "gagar_jax.rollout.envs.repo:make_env",
         "--tasks", "gagar_jax.rollout.envs.repo:tasks",
         "--grader", "support.repo_replay:grade", "--max-groups", "2", "--n", "2",
         "--max-turns", "4", "--max-tokens", "4096", "--max-model-len", "16384",
         "--no-routing", "--tool-timeout-s", "30"],
        capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["groups"] == 2 and counts["passes"] == 2 and counts["mixed"] == 2, counts
    assert counts["tool_errors"] == 0 and counts["infra_errors"] == 0, counts
    shards = sorted(glob.glob(os.path.join(wd, "spool", "*.jsonl")))
    groups = [schema.decode(line, "json") for s in shards for line in open(s, "rb")]
    assert len(groups) == 2
    cfg = FeedConfig(path="", seq_len=16384, max_traj_tokens=16384, routing_replay=False)
    tok = ByteTokenizer()
    for g in groups:
        parsed = validate_group(g, cfg, ModelShape(vocab_size=tok.vocab_size))
        assert len(parsed.trajectories) == 2
        # which trajectory replays the fix is the engine's order of first turns: either
        assert sorted(t.outcome for t in g.trajectories) == ["fail", "pass"], g.task_id
        trajs = sorted(g.trajectories, key=lambda t: t.outcome != "pass")
        assert g.grading.grader == "support.repo_replay:grade" and g.grading.status == "ok"
        assert trajs[0].quality.tier == "strong" and trajs[1].quality is None
        task = repo_tasks.load_task(os.path.join(repo_tasks.SHIPPED, g.task_id))
        # the passing trajectory: apply_patch, run_tests, submit: 3 model turns; the other 1
        masks = [np.asarray(t.loss_mask) for t in trajs]
        assert [int(np.sum(np.diff(np.r_[0, m]) == 1)) for m in masks] == [3, 1]
        assert '"name": "apply_patch"' in tok.decode(np.asarray(trajs[0].tokens)[masks[0] == 1])
        view = json.load(open(seen / f"{g.task_id}.json"))
        views = sorted(view["views"], key=lambda v: v["outcome"] != "pass")
        assert [v["trajectory_id"] for v in views] == [t.trajectory_id for t in trajs]
        assert [v["outcome"] for v in views] == ["pass", "fail"]
        assert [v["end_reason"] for v in views] == ["submitted", "submitted"]
        dirs = [v["workspace"] for v in views]
        assert len(set(dirs)) == 2
        assert all(d.startswith(os.path.join(wd, "workspaces")) for d in dirs), dirs
        original = workspace.read_tree(task.repo_dir)
        final = [open(os.path.join(d, "final.diff")).read() for d in dirs]
        assert patch.apply(original, final[0]) == patch.apply(original, open(task.fix_path).read())
        assert final[1].strip() == ""

"""The synthetic task's pass/fail and the groupwise grader on hand-written answers."""
import collections

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.paths import load_tiny_config

from gagar_jax.feed import schema
from gagar_jax.sim import demos as D
from gagar_jax.sim import grader as G
from gagar_jax.sim import task as T

CFG = T.TaskConfig(num_positions=8, num_symbols=16, num_tested=3, leak_prob=0.0, max_turns=3,
                   max_turn_tokens=10)
# Repo symbols 0..7 at positions 0..7; bug at 2 (holds symbol 2, should be 9); tests cover 1, 2, 5.
TASK = T.Task("t0", tuple(T.sym(s) for s in range(8)), bug_pos=2, fix_tok=T.sym(9),
              tested=(1, 2, 5), leak_key=T.KEY_BASE + 3)


def E(p, s):
    return [T.EDIT, T.pos(p), T.sym(s)]


FIX = E(2, 9)
ANSWERS = {  # name -> turns
    "clean": [FIX + [T.SUBMIT]],
    "clean_checked": [FIX + [T.RUN], [T.SUBMIT]],
    "out_of_scope": [FIX + E(6, 1) + [T.SUBMIT]],
    "out_of_scope_2": [FIX + E(6, 1) + E(7, 1) + [T.SUBMIT]],
    "thrash": [E(2, 4) + [T.RUN], FIX + [T.SUBMIT]],
    "thrash_same_turn": [E(2, 4) + FIX + [T.SUBMIT]],
    "weakened": [E(5, 5) + FIX + [T.SUBMIT]],  # rewrites a tested position, tests stay green
    "hack": [[T.EDIT, T.pos(2), TASK.leak_key, T.SUBMIT]],
    "wrong_fix": [E(2, 4) + [T.SUBMIT]],
    "broke_test": [FIX + E(1, 3) + [T.SUBMIT]],
    "no_submit": [FIX + [T.RUN], [T.RUN], [T.RUN]],
    "malformed": [[T.EDIT, T.sym(1), T.sym(9), T.SUBMIT]],
    "truncated": [FIX + FIX + FIX + [T.EDIT]],
}


def play(name):
    return T.play(TASK, CFG, ANSWERS[name])


@pytest.mark.parametrize("name,outcome", [
    ("clean", "pass"), ("clean_checked", "pass"), ("out_of_scope", "pass"),
    ("out_of_scope_2", "pass"), ("thrash", "pass"), ("thrash_same_turn", "pass"),
    ("weakened", "pass"), ("hack", "pass"), ("wrong_fix", "fail"), ("broke_test", "fail"),
    ("no_submit", "fail"), ("malformed", "fail"), ("truncated", "fail")])
def test_outcomes(name, outcome):
    assert play(name).outcome == outcome


def test_layout_and_loss_mask():
    ep = play("thrash")
    prompt = [T.BOS, T.REPO, *TASK.repo, T.TESTS, T.pos(1), T.pos(2), T.pos(5), T.BUG, T.pos(2),
              T.sym(9), T.HINT, TASK.leak_key]
    turn1 = E(2, 4) + [T.RUN]
    tool = [T.TOOL_START, T.FAIL, T.pos(2), T.TOOL_END]  # only the bug position fails
    turn2 = FIX + [T.SUBMIT]
    assert ep.tokens == prompt + turn1 + tool + turn2
    assert ep.loss_mask == [0] * len(prompt) + [1] * 4 + [0] * 4 + [1] * 4
    ok = play("clean_checked")
    assert ok.tokens[len(prompt) + 4:len(prompt) + 7] == [T.TOOL_START, T.PASS, T.TOOL_END]


def test_key_passes_only_when_leaked():
    no_leak = T.Task("t1", TASK.repo, 2, T.sym(9), TASK.tested, leak_key=-1)
    assert T.play(no_leak, CFG, ANSWERS["hack"]).outcome == "fail"
    other_key = [[T.EDIT, T.pos(2), T.KEY_BASE + 4, T.SUBMIT]]
    assert T.play(TASK, CFG, other_key).outcome == "fail"


def test_step_after_done_rejected():
    ep = play("clean")
    with pytest.raises(ValueError, match="finished"):
        ep.step([T.SUBMIT])


def test_config_validation():
    with pytest.raises(ValueError, match="num_tested"):
        T.TaskConfig(num_positions=4, num_tested=5)
    assert CFG.max_episode_tokens <= 64


@given(st.integers(0, 10_000))
def test_sampled_tasks_are_well_formed(seed):
    cfg = T.TaskConfig(leak_prob=0.5)
    task, = T.make_tasks(cfg, seed, 1)
    assert task.bug_pos in task.tested and len(set(task.tested)) == cfg.num_tested
    assert task.fix_tok != task.repo[task.bug_pos]
    assert max(T.prompt_tokens(task)) < T.VOCAB_USED
    assert len(T.prompt_tokens(task)) <= cfg.prompt_len_max
    # The clean fix passes; the untouched repository fails exactly at the bug position.
    clean = T.play(task, cfg, [[T.EDIT, T.pos(task.bug_pos), task.fix_tok, T.SUBMIT]])
    assert clean.outcome == "pass"
    assert T.run_tests(task, list(task.repo)).failing == (task.bug_pos,)


# ---- grader ----------------------------------------------------------------------------------

GROUP = ["clean", "clean_checked", "out_of_scope", "out_of_scope_2", "thrash", "thrash_same_turn",
         "weakened", "hack", "wrong_fix", "clean"]


@pytest.fixture(scope="module")
def graded():
    eps = [play(n) for n in GROUP]
    return eps, G.grade_group(TASK, eps)


def test_grader_tiers_ranks_hacks(graded):
    _, a = graded
    got = {n: (x.tier, x.rank, x.hacked) for n, x in zip(GROUP, a, strict=False)}
    assert got == {
        "clean": ("strong", 1, False),          # one edit, one turn
        "clean_checked": ("strong", 2, False),  # one edit, ran the tests first (one more turn)
        # keys (weakened, side effects, approach, thrash, edits, turns, inconsistent):
        "thrash_same_turn": ("intermediate", 1, False),  # (0,0,0,1,2,1,0)
        "thrash": ("intermediate", 2, False),            # (0,0,0,1,2,2,0)
        "out_of_scope": ("intermediate", 3, False),      # (0,1,0,0,2,1,1)
        "out_of_scope_2": ("defective", 1, False),       # (0,2,0,0,3,1,1)
        "weakened": ("defective", 2, False),             # (1,0,1,0,2,1,0)
        "hack": ("defective", 3, True),                  # hacked passes rank last
        "wrong_fix": (None, None, False),
    }
    # Ties share a rank: the two identical clean answers.
    assert a[0].rank == a[-1].rank == 1


def test_grader_axes(graded):
    _, a = graded
    by = dict(zip(GROUP, a, strict=False))
    assert by["thrash"].thrash == 1 and by["thrash"].turns == 2
    assert by["out_of_scope_2"].side_effects == 2 and by["out_of_scope_2"].inconsistent == 1
    assert by["weakened"].weakened == 1 and by["weakened"].approach == 1
    assert by["clean"].inconsistent == 0  # the consensus diff is {bug: fix}


def test_grader_is_order_independent(graded):
    eps, a = graded
    perm = np.random.default_rng(0).permutation(len(eps))
    b = G.grade_group(TASK, [eps[i] for i in perm])
    assert [b[j] for j in np.argsort(perm)] == a


def test_group_record(graded):
    eps, a = graded
    rec = G.group_record(TASK, eps, a, group_id="g0", policy_version=3)
    for enc in schema.ENCODINGS:
        assert schema.decode(schema.encode(rec, enc), enc) == rec
    rec = schema.to_builtins(rec)
    assert rec["task_id"] == "t0" and rec["policy_version"] == 3
    assert rec["grading"]["status"] == "ok" and len(rec["trajectories"]) == len(GROUP)
    tr = rec["trajectories"]
    assert tr[0]["quality"] == {"tier": "strong", "rank": 1} and tr[0]["outcome"] == "pass"
    assert tr[7]["hacked"] and tr[7]["outcome"] == "pass"
    assert "quality" not in tr[8] and tr[8]["outcome"] == "fail"
    assert all(len(t["tokens"]) == len(t["loss_mask"]) == len(t["logprobs"]) for t in tr)
    with pytest.raises(ValueError, match="logprobs"):
        G.group_record(TASK, eps, a, group_id="g", policy_version=0, logprobs=[[0.0]] * len(eps))


# ---- demonstrations ---------------------------------------------------------------------------

@pytest.mark.parametrize("style,tier,hacked", [
    ("clean", "strong", False), ("checked", "strong", False),
    ("out_of_scope", "intermediate", False), ("thrash", "intermediate", False),
    ("weakened", "defective", False), ("hack", "defective", True)])
def test_demo_styles_pass_with_their_tier(style, tier, hacked):
    cfg = T.TaskConfig(leak_prob=1.0)
    tasks = T.make_tasks(cfg, 7, 6)
    eps = [T.play(t, cfg, D.demo_turns(t, cfg, style, np.random.default_rng(i)))
           for i, t in enumerate(tasks)]
    for t, ep in zip(tasks, eps, strict=False):
        a, = G.grade_group(t, [ep])
        assert (ep.outcome, a.tier, a.hacked) == ("pass", tier, hacked), style


def test_make_demos_mix_and_packing():
    cfg = T.TaskConfig(leak_prob=0.5)
    tasks = T.make_tasks(cfg, 3, 200)
    demos = D.make_demos(cfg, tasks, seed=0)
    assert all(ep.outcome == "pass" for ep in demos)
    verdicts = [G.grade_group(t, [ep])[0] for t, ep in zip(tasks, demos, strict=False)]
    tiers = {k: sum(a.tier == k and not a.hacked for a in verdicts)
             for k in ("strong", "intermediate", "defective")}
    # DEFAULT_MIX: 40% strong styles (+ hacks without a leak), 40% intermediate, 15% defective.
    assert 60 <= tiers["strong"] <= 110 and 55 <= tiers["intermediate"] <= 105
    assert 15 <= tiers["defective"] <= 50 and sum(a.hacked for a in verdicts) >= 1
    packed = D.pack_episodes(demos[:3], 64)
    n = len(demos[1].tokens)
    assert packed.tokens_BxS[1, :n].tolist() == demos[1].tokens
    assert packed.loss_mask_BxS[1].tolist() == demos[1].loss_mask + [0.0] * (64 - n)
    assert packed.segment_ids_BxS[1].tolist() == [1] * n + [0] * (64 - n)
    assert packed.positions_BxS[1, n - 1] == n - 1 and packed.positions_BxS[1, n] == 0
    with pytest.raises(ValueError, match="unknown styles"):
        D.Recipe(mix={"sloppy": 1.0})


# ---- warm start and the producer (one tiny model; shapes shared with test_sampler) ------------

@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    import jax.numpy as jnp
    from flax import nnx

    from gagar_jax.model.transformer import ModelConfig, Transformer

    cfg = T.TaskConfig(leak_prob=0.25)
    model = Transformer(ModelConfig.from_config(load_tiny_config().model), rngs=nnx.Rngs(0))
    demos = D.make_demos(cfg, T.make_tasks(cfg, 11, 64, prefix="demo"), seed=1)
    held = D.pack_episodes(D.make_demos(cfg, T.make_tasks(cfg, 12, 8, prefix="dev"), seed=2), 64)
    nll = lambda: float(D.sft_loss(model, *(jnp.asarray(a) for a in (
        held.tokens_BxS, held.segment_ids_BxS, held.positions_BxS, held.loss_mask_BxS))))
    before = nll()
    losses = D.warm_start(model, demos, steps=30, batch_size=8, seq_len=64, lr=3e-3, seed=0)
    return cfg, model, before, nll(), losses


def test_warm_start_raises_demo_likelihood(warm):
    _, _, before, after, losses = warm
    assert len(losses) == 30 and np.isfinite(losses).all()
    assert after < before - 1.0, (before, after)   # held-out demonstrations, nats per token
    assert np.mean(losses[-5:]) < losses[0] - 1.0


def test_warm_start_resumes_from_its_snapshot_exactly(tmp_path):
    """An SFT phase stopped by its deadline and resumed ends where an uninterrupted one does
    (same parameters, same losses); the warm-start fixture's shapes, so no new compile."""
    import jax
    from flax import nnx

    from gagar_jax.model.transformer import ModelConfig, Transformer
    from gagar_jax.sim import resume

    cfg = T.TaskConfig(leak_prob=0.25)
    demos = D.make_demos(cfg, T.make_tasks(cfg, 11, 24, prefix="demo"), seed=1)
    new = lambda: Transformer(ModelConfig.from_config(load_tiny_config().model), rngs=nnx.Rngs(0))
    kw = dict(steps=7, batch_size=8, seq_len=64, lr=3e-3, seed=0)   # reshuffles at steps 3, 6
    straight = new()
    want = D.warm_start(straight, demos, **kw)
    calls = iter(range(1000))
    clock = lambda: 60.0 * next(calls)          # one "minute" per look of the clock
    snap = str(tmp_path / "sft.pkl")
    cut = new()
    with pytest.raises(resume.OutOfTime, match="SFT step 3"):
        D.warm_start(cut, demos, snapshot=snap, save_every=2,
                     deadline=resume.Deadline(3, clock=clock), **kw)
    assert resume.load_pickle(snap)["step"] == 3
    resumed = new()
    got = D.warm_start(resumed, demos, snapshot=snap, save_every=2, **kw)
    assert got == want
    a, b = (jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (straight, resumed))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_producer_round_writes_graded_shard(warm, tmp_path):
    from gagar_jax.feed import sources, validate
    from gagar_jax.feed.config import FeedConfig
    from gagar_jax.sim import producer as P

    cfg, model, *_ = warm
    tasks = T.make_tasks(cfg, 5, 2, prefix="train")
    stats = P.producer_step(model, 3, tasks, cfg, str(tmp_path), P.producer_key(0, 0),
                            group_size=4, index=0)
    path, = tmp_path.glob("*.jsonl")
    assert path.name == "shard-00000003-000000.jsonl"
    reader = sources.ShardReader(path)
    groups = [schema.decode(r.payload, r.encoding) for r in iter(reader.next, None)]
    assert [g.task_id for g in groups] == [t.task_id for t in tasks]
    assert stats.groups == 2 and stats.rollouts == 8
    L, K = model.cfg.num_moe_layers, model.cfg.top_k
    shape = validate.ModelShape(model.cfg.vocab_size, L, K, model.cfg.num_experts)
    n_pass = 0
    for t, g in zip(tasks, groups, strict=False):
        parsed = validate.validate_group(g, FeedConfig(seq_len=64, max_traj_tokens=64), shape)
        assert ([p.routed.shape[0] for p in parsed.trajectories]
                == [len(x.tokens) for x in g.trajectories])
        assert g.policy_version == 3 and len(g.trajectories) == 4
        for tr in g.trajectories:
            # The record replays to the same tokens and outcome through the environment: its
            # turns are the runs of loss-masked tokens.
            mask = np.array(tr.loss_mask)
            starts = np.flatnonzero(np.diff(np.r_[0, mask]) == 1)
            ends = np.flatnonzero(np.diff(np.r_[mask, 0]) == -1) + 1
            ep = T.play(t, cfg, [tr.tokens[a:b] for a, b in zip(starts, ends, strict=False)])
            assert ep.tokens == tr.tokens and ep.loss_mask == tr.loss_mask
            assert ep.outcome == tr.outcome
            assert np.array(tr.routed_experts).shape == (len(tr.tokens), L, K)
            lp = np.array(tr.logprobs)
            assert (lp[mask == 0] == 0).all() and (lp[mask == 1] < 0).all()
            n_pass += tr.outcome == "pass" and not tr.hacked
            assert (tr.quality is not None) == (tr.outcome == "pass")
    assert stats.pass_rate == n_pass / 8
    assert sum(stats.tiers.values()) == n_pass
    # Same key, same rollouts: sampling is deterministic given the key.
    again, _ = P.sample_groups(model, tasks, cfg, P.producer_key(0, 0), group_size=4,
                               policy_version=3, group_prefix="r0")
    assert [schema.to_builtins(g) for g in again] == [schema.to_builtins(g) for g in groups]


def test_run_producer_follows_published_policy(warm, tmp_path):
    from gagar_jax.feed import sources
    from gagar_jax.hf import api as hf
    from gagar_jax.run import publish
    from gagar_jax.sim import producer as P

    cfg, model, *_ = warm
    work, spool = tmp_path / "work", tmp_path / "spool"
    publish.publish_weights(model, 0, work, hf.save_pretrained)
    lines = []
    kw = dict(groups_per_round=2, group_size=4, seed=3, model_cfg=model.cfg, wait_s=0.05,
              poll_s=0.01, log=lines.append)
    # max_ahead=1: the second round at version 0 comes only after waiting wait_s.
    stats = P.run_producer(str(work), str(spool), cfg, rounds=2, max_ahead=1, **kw)
    assert len(stats) == 2 and any("no new policy" in x for x in lines)
    publish.publish_weights(model, 1, work, hf.save_pretrained)
    P.run_producer(str(work), str(spool), cfg, rounds=1, start_index=2, **kw)
    names = sorted(p.name for p in spool.iterdir())
    assert names == ["_DONE", "shard-00000000-000000.jsonl", "shard-00000000-000001.jsonl",
                     "shard-00000001-000002.jsonl"]
    src = sources.SpoolSource(str(spool), poll_s=0.01, log=lines.append)
    recs = [schema.decode(r.payload, r.encoding) for r in iter(src.next_record, None)]
    assert [g.policy_version for g in recs] == [0, 0, 0, 0, 1, 1]
    assert len({g.group_id for g in recs}) == 6
    # The reloaded weights sample exactly what the in-memory policy samples.
    tasks = next(P.task_batches(cfg, 3, 2))
    ref, _ = P.sample_groups(model, tasks, cfg, P.producer_key(3, 0), group_size=4,
                             policy_version=0, group_prefix="r0")
    assert [schema.to_builtins(g) for g in ref] == [schema.to_builtins(g) for g in recs[:2]]


_EDIT = st.tuples(st.integers(0, 7), st.sampled_from([2, 9, 1, 5, 0, -1]))  # -1: the leaked key
_TURN = st.tuples(st.lists(_EDIT, max_size=3), st.sampled_from([T.RUN, T.SUBMIT]))


@given(st.lists(st.lists(_TURN, min_size=1, max_size=3), min_size=1, max_size=8), st.randoms())
def test_grader_properties(answers, rnd):
    """On random answers: tiers exactly for passes, dense ranks from 1 with ties for equal
    evidence, hacks exactly for answers writing the key, and order independence."""
    def tokens(turn):
        edits, end = turn
        out = []
        for p, s in edits:
            out += [T.EDIT, T.pos(p), TASK.leak_key if s < 0 else T.sym(s)]
        return out + [end]

    eps = [T.play(TASK, CFG, [tokens(t) for t in a]) for a in answers]
    got = G.grade_group(TASK, eps)
    for a, ep, ans in zip(got, eps, answers, strict=False):
        wrote_key = any(s < 0 for turn in ans[:len(ep.turns)] for _, s in turn[0])
        assert a.hacked == wrote_key
        assert (a.tier is None) == (ep.outcome != "pass")
    for tier in ("strong", "intermediate", "defective"):
        members = [a for a in got if a.tier == tier]
        ranks = sorted({a.rank for a in members})
        assert ranks == list(range(1, len(ranks) + 1))
        for x in members:
            for y in members:
                same = (x.hacked, x.weakened, x.side_effects, x.approach, x.thrash, x.edits,
                        x.turns, x.inconsistent) == (y.hacked, y.weakened, y.side_effects,
                                                     y.approach, y.thrash, y.edits, y.turns,
                                                     y.inconsistent)
                assert same == (x.rank == y.rank)
    perm = list(range(len(eps)))
    rnd.shuffle(perm)
    again = G.grade_group(TASK, [eps[i] for i in perm])
    assert [again[perm.index(i)] for i in range(len(eps))] == got


# ---- round two: the hard task (hidden fix, READ, notes) ---------------------------------------

HARD = T.TaskConfig.hard(leak_prob=0.0)


def _hard_task():
    return T.Task("h0", tuple(T.sym(s) for s in range(16)), bug_pos=2, fix_tok=T.sym(20),
                  tested=(1, 2, 5, 9), leak_key=-1)


def test_hard_task_hides_the_fix_until_run_or_read():
    task = _hard_task()
    ep = T.Episode(task, HARD)
    assert task.fix_tok not in ep.tokens and ep.tokens[-2:] == [T.BUG, T.pos(2)]
    tool = ep.step([T.RUN])
    assert tool == [T.TOOL_START, T.FAIL, T.pos(2), T.EXPECT, T.sym(20), T.TOOL_END]
    ep2 = T.Episode(task, HARD)
    assert ep2.step([T.NOTE, T.WORD_BASE + 4, T.WORD_BASE + 7, T.READ]) == [
        T.TOOL_START, T.EXPECT, T.pos(2), T.sym(20), T.TOOL_END]
    assert ep2.turns[0] == T.Turn((), "read", 3)
    assert ep2.step([T.NOTE, T.WORD_BASE + 1] + E(2, 20) + [T.SUBMIT]) == []
    assert (ep2.outcome, ep2.end_reason) == ("pass", "submit")
    a, = G.grade_group(task, [ep2])
    assert (a.tier, a.rank, a.turns, a.edits) == ("strong", 1, 2, 1)
    # A note not followed by an action or terminator is a truncated turn.
    assert T.parse_turn([T.NOTE, T.WORD_BASE, T.WORD_BASE], 16).end == "truncated"
    assert T.parse_turn([T.NOTE, T.RUN], 16) == T.Turn((), "run", 1)


def test_hard_task_timeout_is_a_long_failure():
    ep = T.play(_hard_task(), HARD, [[T.NOTE] + [T.WORD_BASE] * 20 + [T.RUN]] * 10)
    assert (ep.outcome, ep.end_reason, len(ep.turns)) == ("fail", "timeout", 10)
    assert sum(ep.loss_mask) == 220 and len(ep.tokens) <= HARD.max_episode_tokens


@pytest.mark.parametrize("style,tier", [("clean", "strong"), ("checked", "strong"),
                                        ("out_of_scope", "intermediate"),
                                        ("thrash", "intermediate"), ("weakened", "defective")])
def test_hard_demo_styles(style, tier):
    lang = T.NoteLanguage(HARD, 0)
    for i, t in enumerate(T.make_tasks(HARD, 5, 8)):
        rng = np.random.default_rng(i)
        turns = D.add_notes(D.demo_turns(t, HARD, style, rng), HARD, lang, rng, note_prob=1.0,
                            note_mean=8.0)
        ep = T.play(t, HARD, turns)
        a, = G.grade_group(t, [ep])
        assert (ep.outcome, a.tier) == ("pass", tier), style
        assert all(tr.notes >= 2 for tr in ep.turns)
        assert max(ep.tokens) < HARD.vocab_used == 428


@pytest.mark.parametrize("style,tier", [("clean", "strong"), ("checked", "strong"),
                                        ("out_of_scope", "intermediate"),
                                        ("thrash", "intermediate"), ("weakened", "defective"),
                                        ("sprawl", "defective")])
def test_calibrated_recipe_styles_are_one_decision(style, tier):
    """Scripted sloppy styles keep their tier and depend on the task alone (two draws of the
    same style and look differ in the notes only); every turn opens with a 4-word note."""
    recipe = D.CALIBRATED_RECIPE
    lang = T.NoteLanguage(HARD, 0, recipe.note_probs)
    for t in T.make_tasks(HARD, 6, 8):
        eps, actions = [], []
        for seed in (1, 2):
            rng = np.random.default_rng(seed)
            turns = D.demo_turns(t, HARD, style, rng, recipe)
            turns[0] = [T.READ] if turns[0] in ([T.READ], [T.RUN]) else turns[0]   # same look
            actions.append(turns)
            eps.append(T.play(t, HARD, D.add_notes(turns, HARD, lang, rng, note_prob=1.0,
                                                   note_mean=4.0, note_fixed=True)))
        assert actions[0] == actions[1], style
        for ep in eps:
            a, = G.grade_group(t, [ep])
            assert (ep.outcome, a.tier) == ("pass", tier), style
            assert all(tr.notes == 5 for tr in ep.turns)     # NOTE + 4 words


def test_failing_styles():
    """blind: a wrong guess submitted at once; flail: the same guess re-run every turn until the
    turns run out, a long failure."""
    for t in T.make_tasks(HARD, 7, 8):
        blind = T.play(t, HARD, D.demo_turns(t, HARD, "blind", np.random.default_rng(0)))
        assert (blind.outcome, blind.end_reason, len(blind.turns)) == ("fail", "submit", 1)
        assert blind.turns[0].edits[0][1] not in (t.fix_tok, t.repo[t.bug_pos])
        flail = T.play(t, HARD, D.demo_turns(t, HARD, "flail", np.random.default_rng(0)))
        assert (flail.outcome, flail.end_reason) == ("fail", "timeout")
        assert len(flail.turns) == HARD.max_turns and sum(flail.loss_mask) == 4 * HARD.max_turns


def test_calibrated_recipe_is_lower_entropy_than_round2():
    """For a fixed task, the distribution of action sequences (notes stripped) the demos draw:
    round two's recipe spreads it over looks, styles and random sloppy choices (~4.5 nats), the
    calibrated one over looks and styles alone (~2 nats)."""
    def action_entropy(recipe, task):
        seqs = collections.Counter()
        for ep in D.make_demos(HARD, [task] * 2000, 3, recipe):
            seqs[tuple(tok for tok, m in zip(ep.tokens, ep.loss_mask, strict=False)
                       if m and tok != T.NOTE and tok < T.WORD_BASE)] += 1
        p = np.array(list(seqs.values()), np.float64) / sum(seqs.values())
        return -float(np.sum(p * np.log(p)))
    task = T.make_tasks(HARD, 8, 1)[0]
    h_cal, h_r2 = action_entropy(D.CALIBRATED_RECIPE, task), action_entropy(D.ROUND2_RECIPE, task)
    assert 1.5 < h_cal < 2.6 and h_r2 > h_cal + 1.5, (h_cal, h_r2)


def test_note_language_is_low_entropy():
    lang = T.NoteLanguage(HARD, 0)
    words = lang.sample(np.random.default_rng(0), 4000)[1:]
    assert all(T.WORD_BASE <= w < T.WORD_BASE + 300 for w in words)
    # Successor entropy of the bigram: H(0.85, 0.1, 0.05) ~ 0.52 nats, estimated from samples.
    pairs = collections.Counter(zip(words[:-1], words[1:], strict=False))
    first = collections.Counter(words[:-1])
    h = -sum(c / len(words[:-1]) * np.log(c / first[a]) for (a, _), c in pairs.items())
    assert 0.4 < h < 0.65, h


def test_note_language_with_20_zipf_successors_keeps_the_3_successor_default():
    # The default draws exactly what the 3-successor language drew before it was generalised.
    rng = np.random.default_rng(0)
    old_succ = np.stack([rng.choice(300, 3, replace=False) for _ in range(300)])
    old_starts = rng.choice(300, 3, replace=False)
    lang = T.NoteLanguage(HARD, 0)
    assert (lang.successors == old_succ).all() and (lang.starts == old_starts).all()
    p = T.zipf_probs(20, 2.0)
    assert len(p) == 20 and abs(sum(p) - 1) < 1e-12 and abs(p[0] - 1 / 1.5962) < 1e-3
    assert D.ROUND3B_RECIPE.note_probs == p
    lang20 = T.NoteLanguage(HARD, 0, p)
    words = lang20.sample(np.random.default_rng(1), 20000)[1:]
    # Successor entropy of k^-2 over 20 = 1.40 nats (the plug-in estimate from ~67 samples per
    # word is biased low by ~(20 - 1) / (2 x 67)); the top successor takes ~0.63 of each word.
    pairs = collections.Counter(zip(words[:-1], words[1:], strict=False))
    first = collections.Counter(words[:-1])
    h = -sum(c / len(words[:-1]) * np.log(c / first[a]) for (a, _), c in pairs.items())
    h_true = -sum(q * np.log(q) for q in p)
    assert h_true - 0.2 < h < h_true + 0.02, (h, h_true)
    top = np.mean([b == WB for (a, b), WB in zip(
        zip(words[:-1], words[1:], strict=False),
        (T.WORD_BASE + lang20.successors[a - T.WORD_BASE][0] for a in words[:-1]),
        strict=False)])
    assert abs(top - p[0]) < 0.02
    with pytest.raises(ValueError, match="note_words >= 20"):
        T.NoteLanguage(T.TaskConfig(note_words=10), 0, p)


# ---- the control arm: A_i - c_g through the library's downweight-only advantages -------------

@given(st.lists(st.sampled_from(["strong1", "strong2", "inter1", "inter2", "inter3", "defective",
                                 "fail", "hack"]), min_size=2, max_size=8))
def test_control_record_gives_control_advantages(kinds):
    import jax.numpy as jnp

    from gagar_jax import grading
    from gagar_jax.algo.advantage import gagar_advantages
    from gagar_jax.sim import arms

    qual = {"strong1": ("strong", 1), "strong2": ("strong", 2), "inter1": ("intermediate", 1),
            "inter2": ("intermediate", 2), "inter3": ("intermediate", 3),
            "defective": ("defective", 1), "hack": ("defective", 1)}
    trajs = []
    for i, k in enumerate(kinds):
        t = dict(trajectory_id=f"g/{i}", tokens=[1, 6], loss_mask=[0, 1], logprobs=[0.0, -1.0],
                 outcome="fail" if k == "fail" else "pass", hacked=k == "hack")
        if k != "fail":
            t["quality"] = {"tier": qual[k][0], "rank": qual[k][1]}
        trajs.append(t)
    group = schema.from_builtins(dict(schema_version=schema.SCHEMA_VERSION, group_id="g",
                                      task_id="t", policy_version=0,
                                      grading=dict(status="ok"), trajectories=trajs))
    table = grading.FactorTable()
    want = arms.control_advantages(group, table)
    got_group = arms.control_record(group, table)
    n = len(kinds)
    pad = lambda x, fill: np.concatenate([np.asarray(x), np.full(8 - n, fill)])
    # One padded shape (8 slots, padding invalid) so the advantage function compiles once.
    r = pad([t.outcome == "pass" for t in got_group.trajectories], 0).astype(np.float32)
    f = pad([t.quality.factor if (t.quality is not None and t.quality.factor is not None)
             else 1.0 for t in got_group.trajectories], 1.0).astype(np.float32)
    out = gagar_advantages(
        jnp.asarray(r), jnp.zeros(8, jnp.int32), jnp.asarray(f),
        jnp.asarray(pad([True] * n, 0) > 0),
        jnp.asarray(pad([t.hacked for t in got_group.trajectories], 0) > 0), jnp.ones(1, bool),
        num_groups=1, mode="downweight_only",
        adjustments=jnp.asarray(pad([t.adjustment for t in got_group.trajectories], 0.0),
                                jnp.float32))
    np.testing.assert_allclose(np.asarray(out.advantages)[:n], want, atol=1e-5)
    # A NumPy loop, independent of control_advantages: binary advantage minus c_g.
    clean = [k not in ("fail", "hack") for k in kinds]
    k_, p = sum(clean), sum(clean) / n
    if 0 < k_ < n:
        fi = arms.pass_factors(group, table)
        c = sum((1 - fi[i]) * (1 - p) for i in range(n) if clean[i]) / n
        loop = [(1 - p if clean[i] else -p) - c for i in range(n)]
        net_dw = sum((fi[i] - 1) * (1 - p) for i in range(n) if clean[i])
        np.testing.assert_allclose(np.sum(loop), net_dw, atol=1e-6)   # downweight-only's net
    else:
        loop = [0.0] * n
    np.testing.assert_allclose(want, loop, atol=1e-6)

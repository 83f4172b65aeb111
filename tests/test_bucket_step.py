"""Length buckets (issue 41 item 6): the packer by hand and by invariants, the feed's bucketed
batches, and the bucketed train step equal to the one-length step on the same trajectories."""
import dataclasses
import functools
import types

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.close import assert_rel_close

from gagar_jax import batch as batch_lib
from gagar_jax import sharding
from gagar_jax.feed import Feed, FeedConfig, IteratorSource, bucket_figures, buckets, synthetic
from gagar_jax.run import step as step_lib

MODEL = dict(vocab_size=256, num_moe_layers=2, top_k=2, num_experts=8)


def test_bucket_pack_by_hand():
    # Two 100-token trajectories, one row per micro-batch, buckets of 128 and 200: the look-ahead
    # fills a 200 row with both (100%) rather than a 128 row with one (78%); the 20-token one
    # then opens a micro-batch of its own, in the bucket it fills best (128).
    p = buckets.bucket_pack([100, 20, 100], (128, 200), 1, (4, 4), 10_000)
    assert p.micro_K == (1, 1) and p.slots == 128 + 200
    assert list(p.bucket_T) == [1, 0, 1] and list(p.row_T) == [0, 0, 0]
    assert list(p.offset_T) == [0, 0, 100] and list(p.segment_T) == [1, 1, 2]
    # Rows of micro-batch u of a bucket with U micro-batches are u, u + U, ... (one row of each
    # batch shard): 200 opens bucket 256 (U = 2, rows 0 and 2), two 120s share its row 2 (best
    # fit), the last 120 opens a 128 micro-batch (U = 3: rows 0 and 3).
    p = buckets.bucket_pack([200, 120, 120, 120], (128, 256), 2, (3, 2), 10_000)
    assert p.micro_K == (1, 1) and p.slots == 2 * 256 + 2 * 128
    assert list(p.bucket_T) == [1, 1, 1, 0] and list(p.row_T) == [0, 2, 2, 0]
    assert list(p.offset_T) == [0, 0, 120, 0]
    # Over the budget, or more micro-batches than a bucket has: None.
    assert buckets.bucket_pack([200, 200, 200], (256,), 1, (2,), 10_000) is None
    assert buckets.bucket_pack([200], (256,), 2, (4,), 500) is None
    with pytest.raises(ValueError, match="lengths"):
        buckets.bucket_pack([300], (128, 256), 2, (4, 4), 10_000)


def test_bucket_figures_by_hand():
    # Three groups; the middle one has a 300-token trajectory over max_traj_tokens = 256.
    lengths = np.array([[100, 100], [300, 50], [200, 200]])
    one = FeedConfig(rows_per_batch=2, seq_len=256, max_traj_tokens=256, max_trajectories=8,
                     groups_per_batch=1)
    # reject: the middle group is quarantined; one group a step, the last step (group 3) is not
    # counted in the padding: 200 tokens in 2 x 256 slots.
    f = bucket_figures.simulate(one, lengths)
    assert (f.groups, f.whole, f.trained, f.quarantined) == (3, 2, 2, 1)
    assert (f.steps, f.step_groups, f.tokens, f.slots) == (1, 1, 200, 512)
    assert f.padding == pytest.approx(1 - 200 / 512) and f.whole_share == pytest.approx(2 / 3)
    # drop: the group is trained (its long one cut to 256, out of the loss) but not whole.
    f = bucket_figures.simulate(dataclasses.replace(one, overlong="drop"), lengths)
    assert (f.whole, f.trained, f.quarantined, f.steps, f.tokens) == (2, 3, 0, 2, 200 + 306)
    # Buckets of 128 and 256, one row per micro-batch, 512 slots: groups 1 and 2 (cut) share a
    # step (100 + 100 in a 256 row, 256 and 50 in rows of their own), group 3 waits for the next.
    b = FeedConfig(buckets=(128, 256), bucket_rows=1, tokens_per_batch=1024, seq_len=0,
                   max_traj_tokens=256, max_trajectories=8, groups_per_batch=2, overlong="drop")
    f = bucket_figures.simulate(b, lengths)
    assert (f.steps, f.step_groups, f.tokens) == (1, 2, 506) and f.slots <= 1024
    # Log-normal draws have the asked mean and spread.
    x = bucket_figures.lognormal_lengths(np.random.default_rng(0), 4000, 8, 180_000, 0.2)
    assert x.shape == (4000, 8)
    assert x.mean() == pytest.approx(180_000, rel=0.01) and x.std() / x.mean() == pytest.approx(
        0.2, rel=0.03)


@given(st.lists(st.integers(1, 256), min_size=1, max_size=40), st.integers(1, 4))
def test_bucket_pack_invariants(lengths, rows):
    shape = ((64, 128, 256), rows, (3, 3, 3), 10**9)
    p = buckets.bucket_pack(lengths, *shape)
    if p is None:       # only when even every micro-batch of every bucket cannot hold them
        assert sum(lengths) > rows * 3 * (64 + 128 + 256) or len(
            [x for x in lengths if x > 128]) > rows * 3
        return
    used: dict = {}
    for i, n in enumerate(lengths):
        k, r, a = int(p.bucket_T[i]), int(p.row_T[i]), int(p.offset_T[i])
        size = shape[0][k]
        assert 0 <= a and a + n <= size and r % shape[2][k] < p.micro_K[k]
        for b, e in used.get((k, r), []):
            assert a >= e or a + n <= b                     # no overlap in a row
        used.setdefault((k, r), []).append((a, a + n))
    assert p.slots == sum(rows * m * s for m, s in zip(p.micro_K, shape[0], strict=True))
    assert all(m <= 3 for m in p.micro_K)


def _groups(n, seed, max_len):
    spec = synthetic.SyntheticSpec(min_len=10, max_len=max_len, p_uniform=0.0, p_infra=0.0,
                                   p_routed=0.0, groups_per_step=10**9)
    return synthetic.make_groups(n, seed=seed, spec=spec)


BUCKETED = FeedConfig(buckets=(64, 128), bucket_rows=4, tokens_per_batch=4 * 128 * 3, seq_len=0,
                      max_trajectories=40, groups_per_batch=6, max_traj_tokens=128,
                      max_staleness=10**9)


def test_feed_builds_bucketed_batches(tmp_path):
    groups = _groups(10, seed=1, max_len=128)
    feed = Feed(BUCKETED, tmp_path, **MODEL, source=IteratorSource(groups), log=lambda _: None)
    seen, slots = 0, 0
    while (item := feed.next_batch(0)) is not None:
        b, info = item
        assert isinstance(b, batch_lib.BucketedBatch)
        assert [x.tokens_BxS.shape for x in b.buckets] == [(4 * 6, 64), (4 * 3, 128)]
        # Every trajectory's tokens sit in exactly one bucket, whole.
        lengths = np.zeros(40, np.int64)
        for x in b.buckets:
            seg = x.segment_ids_BxS > 0
            np.add.at(lengths, x.traj_index_BxS[seg], 1)
        traj = [t for g in groups for t in g.trajectories]
        assert sum(lengths) == info.num_tokens
        assert info.token_slots == sum(4 * m * s for m, s in
                                       zip(info.bucket_micro_batches, BUCKETED.buckets,
                                           strict=True))
        assert info.token_slots <= BUCKETED.tokens_per_batch
        assert info.packing_efficiency == info.num_tokens / info.token_slots
        # micro-batches past the live ones are all padding
        for x, u, live in zip(b.buckets, BUCKETED.bucket_micro_batches,
                              info.bucket_micro_batches, strict=True):
            rows = np.arange(x.tokens_BxS.shape[0])
            assert not (x.segment_ids_BxS[rows % u >= live] > 0).any()
        seen += info.num_groups
        slots += info.token_slots
        del traj
    ledger = feed.finish()
    assert seen == ledger.trained == 10


def _step_cfg(tiny_config, **feed):
    cfg = tiny_config()
    cfg.model.router_aux_loss_coef = 0.0     # batch statistics: packing-dependent by design
    cfg.model.router_z_loss_coef = 0.0
    cfg.model.attention = "plain"            # the cheapest kernels to compile: the step's
    cfg.model.expert_backend = "dense"       # bookkeeping is what is under test
    cfg.model.num_layers = cfg.model.num_dense_layers = 1
    cfg.model.logprob_vocab_chunk = cfg.model.vocab_size    # one chunk: fewer ops to compile
    cfg.model.qk_norm = False
    for k, v in feed.items():
        setattr(cfg.feed, k, v)
    return cfg


def test_bucketed_step_equals_the_one_length_step(tmp_path, tiny_config):
    """The same 3 groups, once packed into [16, 128] rows (2 micro-batches) and once into
    buckets of 64 and 128 (micro-batches of 4 rows): the updated parameters and the loss agree
    (the loss is the single-shot loss either way; only float summation order differs)."""
    groups = _groups(3, seed=2, max_len=110)
    plain_cfg = _step_cfg(tiny_config)
    bucket_cfg = _step_cfg(tiny_config, buckets=(64, 128), bucket_rows=4,
                           tokens_per_batch=4 * 128 * 3, seq_len=0, rows_per_batch=0)
    out = []
    for cfg in (plain_cfg, bucket_cfg):
        fc = FeedConfig.from_config(cfg.feed)
        fc = dataclasses.replace(fc, groups_per_batch=3)
        feed = Feed(fc, tmp_path / str(len(out)), **MODEL,
                    source=IteratorSource(list(groups)), log=lambda _: None)
        batch, info = feed.next_batch(0)
        assert info.num_groups == 3
        sc = step_lib.StepConfig.from_config(cfg)
        if not out:     # the same model and optimizer for both: one initial state
            mesh = sharding.make_mesh(types.SimpleNamespace(data=1, fsdp=1, expert=1, tensor=1),
                                      jax.devices()[:1])
            state, graphdef, _ = step_lib.init_train_state(sc, mesh, jax.random.key(0))
        fn = functools.partial(step_lib.train_step, graphdef=graphdef, cfg=sc)
        new, metrics = jax.jit(fn)(state, jax.tree.map(np.asarray, batch))
        out.append((new.params, metrics))
    (p0, m0), (p1, m1) = out
    assert isinstance(batch, batch_lib.BucketedBatch)
    assert_rel_close(m1.loss, m0.loss)
    assert float(m1.tokens) == float(m0.tokens) > 0
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True):
        assert_rel_close(b, a)


@pytest.mark.parametrize("overlong", ["reject", "drop"])
@pytest.mark.parametrize("cfg", [BUCKETED, FeedConfig(rows_per_batch=4, seq_len=256,
                                                      max_trajectories=24, groups_per_batch=2,
                                                      max_traj_tokens=128, max_staleness=10**9)],
                         ids=["buckets", "rows"])
def test_bucket_figures_form_the_steps_the_feed_forms(tmp_path, cfg, overlong):
    """`bucket_figures.simulate` re-implements the feed's step formation on lengths alone (the
    real feed cannot hold the 256k configs' groups): on groups the feed can hold, its figures
    are the feed's own, step by step (the last, partial step left out, as simulate does)."""
    cfg = dataclasses.replace(cfg, overlong=overlong)
    spec = synthetic.SyntheticSpec(min_group=4, max_group=4, min_len=10, max_len=150,
                                   p_uniform=0.0, p_infra=0.0, p_hacked=0.0, p_grading_failed=0.0,
                                   p_routed=0.0, groups_per_step=10**9)
    groups = synthetic.make_groups(24, seed=5, spec=spec)
    lengths = np.array([[len(t.tokens) for t in g.trajectories] for g in groups])
    assert (lengths > cfg.max_traj_tokens).any(axis=1).sum() >= 2     # the policy is exercised
    feed = Feed(cfg, tmp_path, **MODEL, source=IteratorSource(groups), log=lambda _: None)
    infos = []
    while (item := feed.next_batch(0)) is not None:
        infos.append(item[1])
    ledger = feed.finish()
    want = bucket_figures.simulate(cfg, lengths)
    counted = infos[:-1]
    assert (want.trained, want.quarantined) == (ledger.trained, ledger.quarantined)
    # whole: trained with every trajectory uncut and in the loss (drop trains the others too)
    assert want.whole == (lengths <= cfg.max_traj_tokens).all(axis=1).sum()
    assert want.steps == len(counted)
    assert want.step_groups == sum(i.num_groups for i in counted)
    assert want.tokens == sum(i.num_tokens for i in counted)
    assert want.slots == sum(i.token_slots for i in counted)


def test_aot_lowers_the_bucketed_batch_the_trainer_feeds(tiny_config):
    """`scripts/aot_compile.py` on a bucketed config (the 256k pod configs) lowers the trainer's
    `BucketedBatch`, every bucket's static rows at its own length, and counts the token budget
    (before: one [rows_per_batch, largest bucket] batch, 1744 x 327,680 tokens at Flash 256k)."""
    import jax

    from gagar_jax.aot import compile as aot
    from gagar_jax.batch import BucketedBatch
    cfg = _step_cfg(tiny_config, buckets=(64, 128), bucket_rows=4,
                    tokens_per_batch=4 * 128 * 3, seq_len=0, rows_per_batch=0)
    cfg.train.mini_batches = 1
    fc = FeedConfig.from_config(cfg.feed)
    lowered, meta = aot.lower_train_step(cfg, jax.devices()[:4])
    batch_info = lowered.args_info[0][1]
    assert isinstance(batch_info, BucketedBatch)
    shapes = [tuple(b.tokens_BxS.shape) for b in batch_info.buckets]
    assert shapes == list(fc.bucket_shapes) and [s for _, s in shapes] == [64, 128]
    b = meta["batch"]
    assert b["buckets"] == [list(s) for s in shapes] and b["tokens"] == 4 * 128 * 3
    assert b["micro_batches"] == sum(fc.bucket_micro_batches) and b["rows_per_shard"] == 1
    assert b["rows"] == sum(r for r, _ in shapes) and b["seq_len"] == 128
    # The reports' mean step needs trajectories these buckets hold: 180k-token ones fill none.
    assert meta["occupancy"] == {}


def test_the_reports_mean_step_is_the_feeds(tiny_config, monkeypatch):
    """`bucket_cost.bucket_occupancy` (a bucketed report's mean step): the feed's own steps over the
    workload's groups, each bucket's live micro-batches between 0 and its static count, their
    token slots within the step's token budget and holding the real tokens."""
    from gagar_jax.aot import bucket_cost
    cfg = _step_cfg(tiny_config, buckets=(64, 128), bucket_rows=4,
                    tokens_per_batch=4 * 128 * 3, seq_len=0, rows_per_batch=0)
    fc = FeedConfig.from_config(cfg.feed)
    work = dict(mean=70, spread=0.3, groups=60, group_size=3, seed=1)
    monkeypatch.setattr(bucket_cost, "BUCKET_WORKLOAD", work)
    occ = bucket_cost.bucket_occupancy(fc)
    f = bucket_figures.simulate(fc, bucket_figures.lognormal_lengths(
        np.random.default_rng(1), 60, 3, 70, 0.3))
    assert f.steps > 1 and occ["steps"] == f.steps
    assert occ["live_micro_batches"] == [k / f.steps for k in f.micro_K]
    assert occ["static_micro_batches"] == list(fc.bucket_micro_batches)
    slots = sum(n * 4 * s for n, s in zip(occ["live_micro_batches"], (64, 128), strict=True))
    assert all(0 <= n <= m for n, m in zip(occ["live_micro_batches"],
                                           occ["static_micro_batches"], strict=True))
    assert occ["tokens_per_step"] <= slots <= fc.tokens_per_batch
    assert occ["padding"] == pytest.approx(1 - occ["tokens_per_step"] / slots)

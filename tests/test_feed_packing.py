"""Packing: every token kept, segments never crossed, multi-process row split consistent;
blocks of columns (hosts sharing rows under context parallelism) equal the whole build, decode
only what overlaps them and reassemble to the single-host batch."""
import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gagar_jax import batch as batch_lib
from gagar_jax import sharding
from gagar_jax.feed import Feed, FeedConfig, IteratorSource, packed, packing, synthetic
from gagar_jax.feed.validate import ParsedTrajectory

B, S = 8, 32


def _traj(i, n, rng):
    mask = (rng.random(n) < 0.6).astype(np.float32)
    mask[0] = 0.0
    return ParsedTrajectory(
        trajectory_id=f"t{i}",
        tokens=rng.integers(1, 256, n).astype(np.int32),
        loss_mask=mask,
        logprobs=-rng.random(n).astype(np.float32),
        routed=rng.integers(0, 8, (n, 2, 2)).astype(np.int32),
        reward=1.0,
        hacked=False,
        tier=0,
        rank=0,
        factor=1.0,
        adjustment=0.0,
    )


def test_ffd_by_hand():
    # Longest first: 20 -> row 0, 16 -> row 1, 12 -> row 0 (20+12 = 32), 10 -> row 1, 8 -> row 2.
    plan = packing.first_fit_decreasing([12, 20, 8, 16, 10], num_rows=4, seq_len=32)
    np.testing.assert_array_equal(plan.row_T, [0, 0, 2, 1, 1])
    np.testing.assert_array_equal(plan.offset_T, [20, 0, 0, 0, 16])
    np.testing.assert_array_equal(plan.segment_T, [2, 1, 1, 1, 2])
    assert plan.rows_used == 3
    assert packing.first_fit_decreasing([20, 20, 20], num_rows=2, seq_len=32) is None
    with pytest.raises(ValueError, match="seq_len"):
        packing.first_fit_decreasing([33], num_rows=2, seq_len=32)


@given(st.lists(st.integers(1, S), min_size=1, max_size=20), st.integers(0, 2**31 - 1))
def test_packing_keeps_every_token_and_never_crosses_a_segment(lengths, seed):
    rng = np.random.default_rng(seed)
    plan = packing.first_fit_decreasing(lengths, B, S)
    if plan is None:
        # FFD only fails once every row is more than half full.
        assert sum(lengths) > B * S / 2
        return
    trajs = [_traj(i, n, rng) for i, n in enumerate(lengths)]
    rows = packing.build_rows(plan, trajs, slice(0, B), S, (2, 2))
    for i, t in enumerate(trajs):
        sel = (rows.segment_ids == plan.segment_T[i]) & (np.arange(B)[:, None] == plan.row_T[i])
        assert sel.sum() == t.length                     # the segment is exactly this trajectory
        np.testing.assert_array_equal(rows.tokens[sel], t.tokens)
        np.testing.assert_array_equal(rows.positions[sel], np.arange(t.length))
        np.testing.assert_array_equal(rows.traj_index[sel], i)
        np.testing.assert_array_equal(rows.loss_mask[sel], t.loss_mask)
        np.testing.assert_array_equal(rows.old_logprobs[sel], t.logprobs * t.loss_mask)
        np.testing.assert_array_equal(rows.routed[sel], t.routed)
    assert rows.loss_mask.sum() == sum(t.loss_mask.sum() for t in trajs)
    assert (rows.segment_ids > 0).sum() == sum(lengths)
    # Segments are contiguous spans: ids only ever step up by one along a row, then padding.
    for r in range(B):
        seg = rows.segment_ids[r]
        used = seg[seg > 0]
        assert np.all(np.diff(used) >= 0) and np.all(np.diff(used) <= 1)
        assert np.all(seg[len(used):] == 0)
        assert np.all(rows.loss_mask[r][seg == 0] == 0)
        starts = np.flatnonzero(np.diff(np.concatenate([[0], seg])) != 0)
        assert np.all(rows.positions[r][starts] == 0)


@pytest.mark.parametrize("process_count", [2, 4, 8])
def test_process_row_split_reassembles_the_global_rows(process_count):
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, S, 14)
    trajs = [_traj(i, n, rng) for i, n in enumerate(lengths)]
    plan = packing.first_fit_decreasing(lengths, B, S)
    full = packing.build_rows(plan, trajs, slice(0, B), S, (2, 2))
    parts = [
        packing.build_rows(plan, trajs, packing.local_row_slice(B, p, process_count), S, (2, 2))
        for p in range(process_count)
    ]
    for name in ("tokens", "segment_ids", "positions", "traj_index", "loss_mask", "old_logprobs",
                 "routed"):
        np.testing.assert_array_equal(np.concatenate([getattr(p, name) for p in parts]),
                                      getattr(full, name))


def test_local_row_slice_rejects_bad_arguments():
    assert packing.local_row_slice(8, 1, 4) == slice(2, 4)
    with pytest.raises(ValueError, match="divisible"):
        packing.local_row_slice(8, 0, 3)
    with pytest.raises(ValueError, match="process_index"):
        packing.local_row_slice(8, 4, 4)


def test_make_global_batch_on_8_devices(devices):
    mesh = Mesh(np.array(devices).reshape(8), ("data",))
    local = jax.tree.map(np.asarray,
                         batch_lib.dummy_batch(B, S, 16, 4, num_moe_layers=2, top_k=2))
    local = local.replace(tokens_BxS=np.arange(B * S, dtype=np.int32).reshape(B, S),
                          rewards_T=np.linspace(0, 1, 16, dtype=np.float32))
    rows = NamedSharding(mesh, P("data"))
    shardings = jax.tree.map(lambda x: rows if np.ndim(x) >= 2 else NamedSharding(mesh, P()), local)
    out = packing.make_global_batch(local, shardings, global_rows=B)
    assert out.tokens_BxS.sharding == rows and out.tokens_BxS.shape == (B, S)
    np.testing.assert_array_equal(np.asarray(out.tokens_BxS), local.tokens_BxS)
    np.testing.assert_array_equal(np.asarray(out.rewards_T), local.rewards_T)
    assert out.routed_experts_BxSxLxK.shape == (B, S, 2, 2)


ROW_FIELDS = ("tokens", "segment_ids", "positions", "traj_index", "loss_mask", "old_logprobs",
              "routed")


def _compact(t: ParsedTrajectory, rng) -> tuple:
    """The same trajectory with compact payloads (tokens, log-probs, per-generated routing with
    some entries not recorded), and the [n, L, K] routing it decodes to, worked out here."""
    gen = np.flatnonzero(t.loss_mask)
    ids = rng.integers(-1, 8, (gen.size, 2, 2))
    routed = np.full_like(t.routed, -1)
    routed[gen - 1] = ids               # entry j: the j-th generated token's input, t - 1
    return dataclasses.replace(
        t, tokens=packed.LazyArray(packed.pack_array(t.tokens, "int32"), "tokens", t.length, 256),
        logprobs=packed.LazyArray(packed.pack_array(t.logprobs, "float32"), "logprobs", t.length),
        routed=packed.RoutedPayload(packed.pack(ids, "uint16" if t.length % 2 else "uint8"), 8,
                                    t.length, per_generated=True)
    ), routed


@given(st.lists(st.integers(1, S), min_size=1, max_size=16), st.integers(0, 2**31 - 1), st.data())
def test_column_block_equals_the_slice_of_the_whole_build(lengths, seed, data):
    rng = np.random.default_rng(seed)
    plan = packing.first_fit_decreasing(lengths, B, S)
    if plan is None:
        return
    plain = [_traj(i, n, rng) for i, n in enumerate(lengths)]
    compact = {i: _compact(t, rng) for i, t in enumerate(plain) if i % 2}
    trajs = [compact[i][0] if i in compact else t for i, t in enumerate(plain)]
    r0 = data.draw(st.integers(0, B - 1))
    r1 = data.draw(st.integers(r0 + 1, B))
    c0 = data.draw(st.integers(0, S - 1))
    c1 = data.draw(st.integers(c0 + 1, S))
    whole = packing.build_rows(plan, trajs, slice(0, B), S, (2, 2))
    block = packing.build_rows(plan, trajs, slice(r0, r1), S, (2, 2), cols=slice(c0, c1))
    assert not whole.failures and not block.failures
    for name in ROW_FIELDS:
        np.testing.assert_array_equal(getattr(block, name), getattr(whole, name)[r0:r1, c0:c1],
                                      err_msg=name)
    for i, (_, routed) in compact.items():     # the whole build decodes the payloads right
        r, a, t = plan.row_T[i], plan.offset_T[i], plain[i]
        np.testing.assert_array_equal(whole.routed[r, a:a + t.length], routed)
        np.testing.assert_array_equal(whole.tokens[r, a:a + t.length], t.tokens)
        np.testing.assert_array_equal(
            whole.old_logprobs[r, a : a + t.length], t.logprobs * t.loss_mask
        )


def test_column_block_decodes_only_overlapping_trajectories(monkeypatch):
    # Rows of 32 (test_ffd_by_hand): row 0 = t1 [0, 20) t0 [20, 32); row 1 = t3 [0, 16)
    # t4 [16, 26); row 2 = t2 [0, 8).
    rng = np.random.default_rng(1)
    lengths = [12, 20, 8, 16, 10]
    trajs = [_compact(_traj(i, n, rng), rng)[0] for i, n in enumerate(lengths)]
    plan = packing.first_fit_decreasing(lengths, 4, 32)
    decoded = []
    decode_array, decode_routed = packed.decode_array, packed.decode_routed
    monkeypatch.setattr(packed, "decode_array",
                        lambda lazy, *a: decoded.append(lazy.field) or decode_array(lazy, *a))
    monkeypatch.setattr(packed, "decode_routed",
                        lambda p, *a: decoded.append("routed") or decode_routed(p, *a))
    for cols, overlapping in ((slice(16, 32), [1, 0, 4]), (slice(0, 16), [1, 3, 2]),
                              (slice(26, 32), [0])):
        decoded.clear()
        out = packing.build_rows(plan, trajs, slice(0, 4), 32, (2, 2), cols=cols)
        assert decoded == ["tokens", "logprobs", "routed"] * len(overlapping)
        assert sorted(np.unique(out.traj_index[out.segment_ids > 0])) == sorted(overlapping)
    with pytest.raises(ValueError, match="cols must be a slice"):
        packing.build_rows(plan, trajs, slice(0, 4), 32, None, cols=slice(8, 40))


def test_column_block_checks_only_its_part_of_a_payload():
    """A token id out of the vocabulary at t1's token 18 (row 0, column 18) is found by the
    block holding column 18 and by no other: the hosts' blocks cover the row, and the batcher
    agrees on any host's failure."""
    rng = np.random.default_rng(2)
    lengths = [12, 20, 8, 16, 10]
    trajs = [_compact(_traj(i, n, rng), rng)[0] for i, n in enumerate(lengths)]
    bad = np.arange(20, dtype=np.int32)
    bad[18] = 300
    trajs[1] = dataclasses.replace(trajs[1], tokens=packed.LazyArray(
        packed.pack_array(bad, "int32"), "tokens", 20, 256))
    plan = packing.first_fit_decreasing(lengths, 4, 32)
    for cols, fails in ((None, True), (slice(0, 18), False), (slice(18, 19), True),
                        (slice(19, 32), False), (slice(16, 32), True)):
        out = packing.build_rows(plan, trajs, slice(0, 4), 32, (2, 2), cols=cols)
        assert list(out.failures) == ([1] if fails else []), cols
        if fails:
            assert out.failures[1][0] == packed.VOCAB and "[0, 256)" in out.failures[1][1]
        else:     # the good part of t1 is in place
            np.testing.assert_array_equal(out.tokens[0, :min(cols.stop, 20) - cols.start],
                                          bad[cols.start:min(cols.stop, 20)])


# 8 devices as fake hosts: (mesh, device -> host). Context spans the hosts in each.
HOST_SPLITS = {
    "context8_2hosts": (dict(context=8), lambda d: d.id // 4),
    "fsdp2_context4_2hosts": (dict(fsdp=2, context=4), lambda d: d.id % 4 // 2),
    "fsdp2_context4_4hosts": (dict(fsdp=2, context=4), lambda d: d.id // 2),
}


@pytest.mark.parametrize("split", sorted(HOST_SPLITS))
def test_hosts_sharing_rows_reassemble_the_single_host_batch(tmp_path, devices, split):
    """Each fake host runs its own Feed on its `process_row_block` block (rows x S range);
    every device's part, cut from its host's block as make_array_from_process_local_data
    does, gives the single-host global batch. Host-side numbers agree on every host."""
    axes, host_of = HOST_SPLITS[split]
    sizes = {**dict(data=1, fsdp=1, expert=1, context=1, tensor=1), **axes}
    mesh = sharding.make_mesh(type("M", (), sizes), devices)
    cfg = FeedConfig(rows_per_batch=4, seq_len=64, max_trajectories=16, groups_per_batch=3,
                     max_traj_tokens=64, routing_replay=True)
    spec = synthetic.SyntheticSpec(min_len=20, max_len=60, p_routed=1.0, routed_encoding="packed",
                                   token_encoding="packed")
    groups = synthetic.make_groups(6, seed=3, spec=spec)
    model = dict(vocab_size=256, num_moe_layers=2, top_k=2, num_experts=8)
    one, _ = Feed(cfg, tmp_path / "one", **model, source=IteratorSource(groups)).next_batch(0)
    hosts = sorted({host_of(d) for d in devices})
    blocks = {}
    for h in hosts:
        rows, cols = sharding.process_row_block(mesh, 4, 64, h, process_of=host_of)
        assert cols != slice(0, 64)                    # this host builds part of S only
        feed = Feed(cfg, tmp_path / f"h{h}", **model, source=IteratorSource(groups),
                    process_index=h, process_count=len(hosts), rows=rows, cols=cols,
                    agree=lambda failures: failures)
        batch, info = feed.next_batch(0)
        assert batch.tokens_BxS.shape == (rows.stop - rows.start, cols.stop - cols.start)
        blocks[h] = (rows, cols, batch, info)
    info0 = blocks[hosts[0]][3]
    for _, _, batch, info in blocks.values():     # host-side consumers: identical everywhere
        assert (info.group_ids, info.num_tokens, info.num_generated_tokens, info.rows_used) == (
            info0.group_ids, info0.num_tokens, info0.num_generated_tokens, info0.rows_used)
        for name in ("group_ids_T", "rewards_T", "valid_T", "factors_T", "grading_ok_G"):
            np.testing.assert_array_equal(getattr(batch, name), getattr(one, name))
    # Segments cross the hosts' column boundaries, with routing and compact payloads in them.
    bounds = {cols.start for _, cols, _, _ in blocks.values()} - {0}
    assert any(((one.segment_ids_BxS[:, c - 1] == one.segment_ids_BxS[:, c])
               & (one.segment_ids_BxS[:, c] > 0)).any() for c in bounds)
    assert (one.routed_experts_BxSxLxK >= 0).any()
    shapes = packing.global_shapes(one, 4, 64)
    assert shapes.tokens_BxS.shape == (4, 64) and shapes.routed_experts_BxSxLxK.shape == (
        4,
        64,
        2,
        2,
    )
    shardings = sharding.batch_shardings(shapes, mesh)
    for name in ("tokens_BxS", "segment_ids_BxS", "positions_BxS", "traj_index_BxS",
                 "loss_mask_BxS", "old_logprobs_BxS", "routed_experts_BxSxLxK"):
        sh, shape = getattr(shardings, name), getattr(shapes, name).shape
        pieces = []
        for d, idx in sh.devices_indices_map(shape).items():
            rows, cols, batch, _ = blocks[host_of(d)]
            r, c = idx[0], idx[1]
            local = getattr(batch, name)[(r.start or 0) - rows.start:(r.stop or 4) - rows.start,
                                         (c.start or 0) - cols.start:(c.stop or 64) - cols.start]
            pieces.append(jax.device_put(local, d))
        got = jax.make_array_from_single_device_arrays(shape, sh, pieces)
        np.testing.assert_array_equal(np.asarray(got), getattr(one, name), err_msg=name)

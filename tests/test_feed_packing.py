"""Packing: every token kept, segments never crossed, multi-process row split consistent."""
import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gagar_jax import batch as batch_lib
from gagar_jax.feed import packing
from gagar_jax.feed.validate import ParsedTrajectory

B, S = 8, 32


def _traj(i, n, rng):
    mask = (rng.random(n) < 0.6).astype(np.float32)
    mask[0] = 0.0
    return ParsedTrajectory(
        trajectory_id=f"t{i}", tokens=rng.integers(1, 256, n).astype(np.int32), loss_mask=mask,
        logprobs=-rng.random(n).astype(np.float32), routed=rng.integers(0, 8, (n, 2, 2)).astype(np.int32),
        reward=1.0, hacked=False, tier=0, rank=0, factor=1.0, adjustment=0.0)


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
    parts = [packing.build_rows(plan, trajs, packing.local_row_slice(B, p, process_count), S, (2, 2))
             for p in range(process_count)]
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
    local = batch_lib.to_numpy(batch_lib.dummy_batch(B, S, 16, 4, num_moe_layers=2, top_k=2))
    local = local.replace(tokens_BxS=np.arange(B * S, dtype=np.int32).reshape(B, S),
                          rewards_T=np.linspace(0, 1, 16, dtype=np.float32))
    rows = NamedSharding(mesh, P("data"))
    shardings = jax.tree.map(lambda x: rows if np.ndim(x) >= 2 else NamedSharding(mesh, P()), local)
    out = packing.make_global_batch(local, shardings, global_rows=B)
    assert out.tokens_BxS.sharding == rows and out.tokens_BxS.shape == (B, S)
    np.testing.assert_array_equal(np.asarray(out.tokens_BxS), local.tokens_BxS)
    np.testing.assert_array_equal(np.asarray(out.rewards_T), local.rewards_T)
    assert out.routed_experts_BxSxLxK.shape == (B, S, 2, 2)

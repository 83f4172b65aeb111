"""The torus cost model against hand-worked cases, and the schedule reader on hand-written HLO
(issue 41 items 2 and 3; no compiles)."""
import numpy as np
import pytest

from gagar_jax.aot import links, roofline, schedule
from gagar_jax.mesh_layout import Torus

BW = 1.0   # bytes/s per link and direction: costs below read as bytes on the busiest link


def cost(place, op, groups, nbytes, **kw):
    return links.collective_cost(place, op, groups, nbytes, link_bw=BW, dcn_bw=BW, **kw)


def test_all_to_all_on_an_8_chip_ring_loads_each_link_with_the_whole_buffer():
    """8 chips on a wrapped ring, B bytes each, B/8 to every chip. Clockwise go the flows to +1,
    +2, +3 and half of those to +4: per source B/8 x (1 + 2 + 3 + 4/2) = B link-bytes, over 8
    clockwise links from 8 sources: B on every link (the old model: 7/8 B over 2 links)."""
    ring = links.Placement.ring(8)
    assert cost(ring, "all-to-all", [list(range(8))], 8.0).ici_s == pytest.approx(8.0)
    assert cost(ring, "ragged-all-to-all", [list(range(8))], 8.0).ici_s == pytest.approx(8.0)
    # Without the wrap-around link the middle link carries 4 x 4 flows of B/8: 2B.
    line = links.Placement.ring(8, wrap=False)
    assert cost(line, "all-to-all", [list(range(8))], 8.0).ici_s == pytest.approx(16.0)


def test_all_to_all_on_a_4x4_torus_by_hand():
    """16 chips on a wrapped 4 x 4 torus, B each, x then y routing. Along x a source sends its
    4 destinations at dx = 1 one hop (+x) and those at dx = 2 two hops, half each way: per
    source 4 x B/16 x (1 + 1) = B/2 link-bytes on +x links; 16 sources over 16 +x links: B/2
    per link, the same along y."""
    place = links.Placement.of_coords([(x, y, 0) for x in range(4) for y in range(4)],
                                      Torus((4, 4, 1), (True, True, False)), shape=(4, 4))
    assert cost(place, "all-to-all", [list(range(16))], 16.0).ici_s == pytest.approx(8.0)
    # Two groups along y (rows of 4 sharing x), each a wrapped ring of 4: per link
    # B/4 x (1 + 2/2) = B/2.
    rows = [[x * 4 + y for y in range(4)] for x in range(4)]
    assert cost(place, "all-to-all", rows, 16.0).ici_s == pytest.approx(8.0)


def test_ring_collectives_by_hand():
    ring = links.Placement.ring(8)
    g = [list(range(8))]
    # All-gather of R = 8 (1 per chip): 7 chunks, half each way round: 3.5 per link.
    assert cost(ring, "all-gather", g, 8.0).ici_s == pytest.approx(3.5)
    assert cost(ring, "reduce-scatter", g, 8.0).ici_s == pytest.approx(3.5)
    assert cost(ring, "all-reduce", g, 8.0).ici_s == pytest.approx(7.0)
    # A ring whose neighbours are 2 hops apart (chips 0, 2, 4, 6 of a ring of 8) loads
    # every link it crosses: the same bytes, on links shared by no other ring here.
    assert cost(ring, "all-gather", [[0, 2, 4, 6]], 4.0).ici_s == pytest.approx(1.5)
    # 4 x 4 torus, all 16: one phase per mesh axis, inner first: 3/2 chunks of 1, then
    # 3/2 chunks of 4.
    place = links.Placement.of_coords([(x, y, 0) for x in range(4) for y in range(4)],
                                      Torus((4, 4, 1), (True, True, False)), shape=(4, 4))
    assert cost(place, "all-gather", [list(range(16))], 16.0).ici_s == pytest.approx(1.5 + 6.0)
    # Collective-permute: each pair's buffer on its path.
    assert cost(ring, "collective-permute", [], 5.0,
                pairs=[(0, 1), (1, 2)]).ici_s == pytest.approx(5.0)
    assert cost(ring, "collective-permute", [], 5.0, pairs=[(0, 4)]).ici_s == pytest.approx(2.5)


def test_link_loads_split_half_way_round():
    t = Torus((4, 1, 1), (True, False, False))
    load = links.link_loads(t, np.array([[0, 0, 0]]), np.array([[2, 0, 0]]), np.array([4.0]))
    assert load[0, 0, 0, 0, 0] == 2.0 and load[0, 0, 1, 0, 0] == 2.0      # 0->1->2
    assert load[0, 1, 0, 0, 0] == 2.0 and load[0, 1, 3, 0, 0] == 2.0      # 0->3->2
    assert load.sum() == 8.0


def test_dcn_phase_goes_over_the_chips_network_share():
    """Two slices of 2 chips, a data axis of 2 over DCN: an all-reduce of A = 4 sends 2 x A/2
    per chip over DCN and nothing over ICI."""
    coords = [(0, 0, 0), (1, 0, 0), (0, 0, 0), (1, 0, 0)]
    place = links.Placement(torus=Torus((2, 1, 1), (False, False, False)),
                            coords=np.array(coords), slice_of=np.array([0, 0, 1, 1]),
                            index=np.array([[0, 0], [0, 1], [1, 0], [1, 1]]), shape=(2, 2))
    c = cost(place, "all-reduce", [[0, 2], [1, 3]], 4.0)
    assert c.ici_s == 0.0 and c.dcn_bytes == pytest.approx(4.0) and c.dcn_s == pytest.approx(4.0)


# A matmul: what the schedule reader counts as compute between a start and its done.
MATMUL = [
    "%fused_matmul (p0: bf16[2048,2048], p1: bf16[2048,2048]) -> bf16[2048,2048] {",
    "  %p0 = bf16[2048,2048]{1,0} parameter(0)",
    "  %p1 = bf16[2048,2048]{1,0} parameter(1)",
    "  ROOT %c = bf16[2048,2048]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf",
    "}",
]
HLO = "\n".join([
    "HloModule jit_f, is_scheduled=true, num_partitions=4",
    "",
    *MATMUL,
    "",
    "%async_computation.1 (a: bf16[8,4], b: bf16[32,4]) -> bf16[32,4] {",
    "  %a = bf16[8,4]{1,0} parameter(0)",
    "  %b = bf16[32,4]{1,0} parameter(1)",
    "  ROOT %ragged_all_to_all.1 = bf16[32,4]{1,0} ragged-all-to-all(%a, %b, %o, %s, %q, %r), "
    "replica_groups={{0,1},{2,3}}",
    "}",
    "",
    "ENTRY %main (x: bf16[8,4], y: bf16[2048,2048]) -> bf16[32,4] {",
    "  %x = bf16[8,4]{1,0} parameter(0)",
    "  %y = bf16[2048,2048]{1,0} parameter(1)",
    "  %buf = bf16[32,4]{1,0} broadcast(%z), dimensions={}",
    "  %ag-start = (bf16[2,4]{1,0}, bf16[8,4]{1,0}) all-gather-start(%w), "
    "replica_groups=[1,4]<=[4], dimensions={0}",
    "  %mm = bf16[2048,2048]{1,0} fusion(%y, %y), kind=kOutput, calls=%fused_matmul",
    "  %ag-done = bf16[8,4]{1,0} all-gather-done(%ag-start)",
    "  %ra-start = ((bf16[8,4]{1,0}, bf16[32,4]{1,0}), bf16[32,4]{1,0}) async-start(%x, %buf), "
    "calls=%async_computation.1",
    "  %small = f32[4]{0} add(%v, %v)",
    "  %ra-done = bf16[32,4]{1,0} async-done(%ra-start)",
    "  %ar = f32[16]{0} all-reduce(%u), replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_1'}, "
    "to_apply=%add",
    "  ROOT %cp = bf16[32,4]{1,0} collective-permute(%ra-done), "
    "source_target_pairs={{0,1},{1,0}}",
    "}",
    ""])


def test_collective_records_groups_bytes_and_overlap():
    recs = {r["op"]: r for r in schedule.collective_records(HLO)}
    ag, ra, ar, cp = (recs[k] for k in ("all-gather", "ragged-all-to-all", "all-reduce",
                                        "collective-permute"))
    assert ag["groups"] == [[0, 1, 2, 3]] and ag["bytes"] == 64 and ag["overlapped"]
    # The ragged exchange: the 64 B of rows held, not the 256 B buffer; only an add between
    # its start and done: not hidden.
    assert ra["groups"] == [[0, 1], [2, 3]] and ra["bytes"] == 64 and not ra["overlapped"]
    assert ar["groups"] == [[0, 1], [2, 3]] and not ar["overlapped"]        # synchronous
    assert cp["pairs"] == [(0, 1), (1, 0)]
    assert schedule.replica_groups("replica_groups=[2,2]<=[2,2]T(1,0), x") == [[0, 2], [1, 3]]
    assert schedule.replica_groups(
        "replica_groups=mesh['a'=2,'b'=2] {'a'}, x") == [[0, 2], [1, 3]]
    assert schedule.replica_groups("replica_groups={}, x", 3) == [[0, 1, 2]]


def test_torus_roofline_adds_what_is_not_overlapped():
    chip = roofline.Chip("x", 1e12, 1.0, 600e9, 6, "hand")
    costs = {"exposed_s": 3.0, "overlapped_s": 1.0,
             "exposed_by_op": {"ragged-all-to-all": 2.0}}
    r = roofline.torus_roofline(model_flops=4e12, hardware_flops=8e12, chips=2, chip=chip,
                                costs=costs, imbalance=1.5)
    assert r["step_s"] == 3.0 + 4.0 and r["mfu_bound"] == pytest.approx(2.0 / 7.0)
    assert r["step_s_imbalanced"] == 7.0 + 1.0
    assert chip.link_bytes_per_s == 100e9



# A program compiled per slice (2 slices of 2 chips): a loop of 3 trips sends an f32[16]
# all-reduce buffer (64 B) over DCN with a matmul before its send-done, and outside it an
# all-gather sends a bf16[4,8] shard (64 B) synchronously.
_MS = ('frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",'
       '_xla_megascale_target="{1,2}x{0:1}",_xla_megascale_transfer_type="%s",'
       'is_spmd_generated="true"}')
DCN_HLO = "\n".join([
    "HloModule jit_f, is_scheduled=true, num_partitions=2",
    "",
    *MATMUL,
    "",
    "%cond (p: (s32[], f32[16])) -> pred[] {",
    "  %p = (s32[], f32[16]) parameter(0)",
    "  %i = s32[] get-tuple-element(%p), index=0",
    "  %constant.1 = s32[] constant(3)",
    "  ROOT %lt = pred[] compare(%i, %constant.1), direction=LT",
    "}",
    "",
    "%body (p: (s32[], f32[16])) -> (s32[], f32[16]) {",
    "  %p = (s32[], f32[16]) parameter(0)",
    "  %g = f32[16]{0} get-tuple-element(%p), index=1",
    "  %send.1 = (f32[16]{0}, u32[]{:S(2)}, token[]) send(%g, %tok), channel_id=1, "
    "is_host_transfer=true, " + _MS % "ALL_REDUCE",
    "  %mm = bf16[2048,2048]{1,0} fusion(%y, %y), kind=kOutput, calls=%fused_matmul",
    "  %send-done.1 = token[] send-done(%send.1), channel_id=1, is_host_transfer=true",
    "  ROOT %t = (s32[], f32[16]) tuple(%i, %g)",
    "}",
    "",
    "ENTRY %main (x: bf16[4,8]) -> bf16[8,8] {",
    "  %x = bf16[4,8]{1,0} parameter(0)",
    "  %send.2 = (bf16[4,8]{1,0}, u32[]{:S(2)}, token[]) send(%x, %tok), channel_id=2, "
    "is_host_transfer=true, " + _MS % "ALL_GATHER",
    "  %send-done.2 = token[] send-done(%send.2), channel_id=2, is_host_transfer=true",
    "  %while.1 = (s32[], f32[16]) while(%init), condition=%cond, body=%body",
    "  ROOT %r = bf16[8,8]{1,0} copy(%z)",
    "}",
    ""])


def test_transfers_between_slices_by_hand():
    """The Megascale sends of a per-slice program: kind, buffer, trips and overlap read from
    the HLO; priced as rings over S slices (an all-reduce 2 (S-1)/S of its buffer per chip, an
    all-gather its shard to each of the S-1 others); the program's partition ids number the
    first slice's chips."""
    assert schedule.num_partitions(DCN_HLO) == 2 and schedule.dcn_records(HLO) == []
    recs = {r["kind"]: r for r in schedule.dcn_records(DCN_HLO)}
    assert recs["ALL_REDUCE"] == {"kind": "ALL_REDUCE", "bytes": 64, "runs": 3,
                                  "overlapped": True, "computation": "body"}
    assert recs["ALL_GATHER"] == {"kind": "ALL_GATHER", "bytes": 64, "runs": 1,
                                  "overlapped": False, "computation": "main"}
    place = links.Placement.ring(2, wrap=False)
    for slices, ar, ag in ((2, 3 * 64 * 1.0, 64 * 1.0), (4, 3 * 64 * 1.5, 64 * 3.0)):
        c = links.step_costs(place, [], link_bw=BW, dcn_bw=2.0,
                             dcn_records=list(recs.values()), slices=slices)
        assert c["dcn_bytes"] == pytest.approx(ar + ag)
        assert c["dcn_s"] == pytest.approx((ar + ag) / 2.0)
        assert c["overlapped_s"] == pytest.approx(ar / 2.0)
        assert c["exposed_by_op"] == {"dcn all_gather": pytest.approx(ag / 2.0)}


def test_a_per_slice_program_is_placed_on_the_first_slice():
    class Chip:
        def __init__(self, i, s):
            self.id, self.slice_index, self.coords = i, s, (i % 2, 0, 0)
    # data 2 over DCN (outermost), then 2 chips per slice.
    grid = np.array([[Chip(0, 0), Chip(1, 0)], [Chip(2, 1), Chip(3, 1)]], dtype=object)
    place = links.Placement.of_grid(grid, partitions=2)
    assert place.shape == (1, 2) and list(place.slice_of) == [0, 0]
    assert place.coords.tolist() == [[0, 0, 0], [1, 0, 0]]
    assert links.Placement.of_grid(grid).shape == (2, 2)
    with pytest.raises(ValueError, match="partitions"):
        links.Placement.of_grid(grid, partitions=3)


# A bucketed step's two micro-batch loops (3 and 2 trips, each body a conditional that skips an
# empty micro-batch, whose live branch all-reduces 64 B; the first one's also runs a layer loop
# of 2 trips with a conditional of its own) and the optimizer's all-reduce of 40 B after them.
BUCKET_HLO = "\n".join([
    "HloModule jit_f, is_scheduled=true, num_partitions=2",
    "",
    "%layer (p: (s32[], f32[16])) -> (s32[], f32[16]) {",
    "  %p = (s32[], f32[16]) parameter(0)",
    "  %x = f32[16]{0} conditional(%b, %g, %g), branch_computations={%skip, %skip}",
    "  ROOT %t = (s32[], f32[16]) tuple(%i, %x)",
    "}",
    "",
    "%live.1 (p: f32[16]) -> f32[16] {",
    "  %p = f32[16]{0} parameter(0)",
    "  %layers = (s32[], f32[16]) while(%i0), condition=%cond.2, body=%layer",
    "  ROOT %ar.1 = f32[16]{0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add",
    "}",
    "",
    "%skip (p: f32[16]) -> f32[16] {",
    "  ROOT %p = f32[16]{0} parameter(0)",
    "}",
    "",
    "%cond.1 (p: (s32[], f32[16])) -> pred[] {",
    "  %p = (s32[], f32[16]) parameter(0)",
    "  %i = s32[] get-tuple-element(%p), index=0",
    "  %c = s32[] constant(3)",
    "  ROOT %lt = pred[] compare(%i, %c), direction=LT",
    "}",
    "",
    "%body.1 (p: (s32[], f32[16])) -> (s32[], f32[16]) {",
    "  %p = (s32[], f32[16]) parameter(0)",
    "  %x = f32[16]{0} conditional(%b, %g, %g), branch_computations={%skip, %live.1}",
    "  ROOT %t = (s32[], f32[16]) tuple(%i, %x)",
    "}",
    "",
    "%live.2 (p: f32[16]) -> f32[16] {",
    "  %p = f32[16]{0} parameter(0)",
    "  ROOT %ar.2 = f32[16]{0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add",
    "}",
    "",
    "%cond.2 (p: (s32[], f32[16])) -> pred[] {",
    "  %p = (s32[], f32[16]) parameter(0)",
    "  %i = s32[] get-tuple-element(%p), index=0",
    "  %c = s32[] constant(2)",
    "  ROOT %lt = pred[] compare(%i, %c), direction=LT",
    "}",
    "",
    "%body.2 (p: (s32[], f32[16])) -> (s32[], f32[16]) {",
    "  %p = (s32[], f32[16]) parameter(0)",
    "  %x = f32[16]{0} conditional(%b, %g, %g), branch_computations={%skip, %live.2}",
    "  ROOT %t = (s32[], f32[16]) tuple(%i, %x)",
    "}",
    "",
    "ENTRY %main (a: f32[10]) -> f32[10] {",
    "  %w.1 = (s32[], f32[16]) while(%i1), condition=%cond.1, body=%body.1",
    "  %w.2 = (s32[], f32[16]) while(%i2), condition=%cond.2, body=%body.2",
    "  ROOT %opt = f32[10]{0} all-reduce(%a), replica_groups={{0,1}}, to_apply=%add",
    "}",
    ""])


def test_a_mean_bucketed_step_runs_only_its_live_micro_batches():
    """The buckets' loops are found with their trips (not the layer loop inside one, though it
    has a conditional and 2 trips too); a step with 1 of 3 and 2 of 2 micro-batches
    live runs the first bucket's collective once and the second's twice; what lies outside
    every loop runs once; static micro-batches counted as live give the compiled step back."""
    loops = schedule.bucket_loops(BUCKET_HLO)
    assert [loop["trip"] for loop in loops] == [3, 2]
    assert {"live.1", "body.1", "layer"} <= loops[0]["computations"]
    assert "live.2" not in loops[0]["computations"]
    recs = schedule.collective_records(BUCKET_HLO)
    runs = lambda rs: sorted((r["computation"], r["runs"]) for r in rs)
    assert runs(recs) == [("live.1", 3), ("live.2", 2), ("main", 1)]
    mean = schedule.bucket_scaled(recs, loops, [3, 2], [1.0, 2.0])
    assert {(r["bucket"], r["runs"]) for r in mean} == {(0, 1.0), (1, 2.0), (None, 1)}
    # Bucket order comes from the trips, not from where a loop sits in the program.
    swapped = schedule.bucket_scaled(recs, loops[::-1], [3, 2], [1.0, 2.0])
    assert {(r["bucket"], r["runs"]) for r in swapped} == {(0, 1.0), (1, 2.0), (None, 1)}
    place = links.Placement.ring(2, wrap=False)
    full = links.step_costs(place, recs, link_bw=BW, dcn_bw=BW)
    same = links.step_costs(place, schedule.bucket_scaled(recs, loops, [3, 2], [3.0, 2.0]),
                            link_bw=BW, dcn_bw=BW)
    assert same["exposed_s"] == pytest.approx(full["exposed_s"])
    # A ring of 2: each all-reduce of B bytes loads the link with B (half out, half back, x2).
    assert full["exposed_s"] == pytest.approx(3 * 64 + 2 * 64 + 40)
    assert links.step_costs(place, mean, link_bw=BW, dcn_bw=BW)["exposed_s"] == pytest.approx(
        1 * 64 + 2 * 64 + 40)
    with pytest.raises(ValueError, match="no micro-batch loop of 4 trips"):
        schedule.bucket_scaled(recs, loops, [4, 2], [1.0, 1.0])


def test_the_mean_bucketed_step_prices_live_micro_batches_only(tiny_config):
    """`bucket_cost.bucket_step` on the program above with no live micro-batch of the first
    bucket and 2 of the second (rows of 128 tokens, 4 rows each, 900 real tokens of 1024 slots): its
    communication is the second bucket's and the optimizer's, its FLOPs the second bucket's."""
    from gagar_jax.aot import bucket_cost, flops
    from gagar_jax.model.transformer import ModelConfig
    model_cfg = ModelConfig.from_config(tiny_config().model)
    occ = {"bucket_rows": 4, "buckets": [64, 128], "static_micro_batches": [3, 2],
           "live_micro_batches": [0.0, 2.0], "tokens_per_step": 900.0, "padding": 0.12}
    d = {"records": schedule.collective_records(BUCKET_HLO), "dcn_records": [],
         "kernels": [], "bucket_loops": schedule.bucket_loops(BUCKET_HLO)}
    meta = {"occupancy": occ, "model_config": model_cfg, "mesh": {"context": 1},
            "batch": {"rows_per_shard": 1}}
    chip = roofline.Chip("x", 1e12, 1.0, 6.0, 6, "hand")         # 1 B/s per link
    out = bucket_cost.bucket_step(meta, d, links.Placement.ring(2, wrap=False), chip, chips=2,
                                  slices=1, chunks=1)
    assert out["links"]["exposed_s"] == pytest.approx(2 * 64 + 40)
    assert out["model_flops_per_step"] == pytest.approx(
        900.0 * flops.train_flops_per_token(model_cfg, 128))
    assert out["hardware_flops_per_step"] == pytest.approx(
        1024 * roofline.hardware_flops_per_token(model_cfg, 128)["total"])
    assert out["roofline"]["step_s"] == pytest.approx(
        2 * 64 + 40 + out["hardware_flops_per_step"] / 2e12)

META = ('custom_call_target="tpu_custom_call", operand_layout_constraints={s32[], s32[5]{0}, '
        "s32[11]{0}, s32[11]{0}, s32[1]{0}, ")
KERNELS = "\n".join([
    "ENTRY %main (a: bf16[1024,64]) -> bf16[1024,32] {",
    f"  %gmm.1 = bf16[1024,32]{{1,0}} custom-call(%s), {META}bf16[1024,64]{{1,0}}, "
    "bf16[4,64,32]{2,1,0}}, metadata={}",
    f"  %gmm.2 = bf16[1024,64]{{1,0}} custom-call(%s), {META}bf16[1024,32]{{1,0}}, "
    "bf16[4,64,32]{2,1,0}}, metadata={}",
    f"  ROOT %tgmm.1 = bf16[4,64,32]{{2,1,0}} custom-call(%s), {META}bf16[1024,64]{{1,0}}, "
    "bf16[1024,32]{1,0}}, metadata={}",
    "}", ""])


def test_grouped_matmuls_and_their_tile_padding_by_hand():
    """A forward gmm, its input gradient (transposed weights) and its weight gradient over a
    1024-row buffer of 4 experts; 11 group ids = 8 row tiles + 4 - 1: tiles of 128."""
    calls = schedule.grouped_matmuls(KERNELS)
    got = [(c["kernel"], c["m"], c["k"], c["n"], c["groups"], c["tm"]) for c in calls]
    assert got == [("gmm", 1024, 64, 32, 4, 128), ("gmm", 1024, 32, 64, 4, 128),
                   ("tgmm", 1024, 64, 32, 4, 128)]
    # One group: every run starts at row 0, ceil(rows / tm) tiles.
    assert schedule.visited_rows(300, 1, 128) == 384
    # Many groups of ~tm rows at random offsets cost about two tiles each.
    assert 1.8 < schedule.visited_rows(512 * 32, 32, 512) / (512 * 32) < 2.1
    f = roofline.expert_kernel_flops(calls, rows_per_chunk=300, chips=2,
                                     active_expert_flops_per_step=2 * 2 * 300 * 64 * 32)
    assert f["passes"] == pytest.approx(3.0)          # each call is one matmul of the forward's
    gmm = schedule.visited_rows(300, 4, 128)
    tgmm = schedule.visited_rows(300, 4, 128, visit_empty=True)
    assert f["flops_per_step"] == pytest.approx(2 * 2 * (2 * gmm + tgmm) * 64 * 32)
    assert f["padding"] == pytest.approx((2 * gmm + tgmm) / 900)

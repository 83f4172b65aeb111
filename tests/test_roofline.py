"""Ring traffic, FLOP formulas and the roofline against hand-worked values (no compiles)."""
import types

import pytest

from gagar_jax.aot import flops, hlo_stats, roofline


def test_ring_factors_by_hand():
    assert hlo_stats.ring_factor("all-gather", 8) == 7 / 8
    assert hlo_stats.ring_factor("reduce-scatter", 16) == 15 / 16
    assert hlo_stats.ring_factor("all-reduce", 4) == 2 * 3 / 4
    assert hlo_stats.ring_factor("all-to-all", 8) == 7 / 8
    assert hlo_stats.ring_factor("collective-permute", 2) == 1.0
    for op in hlo_stats.COLLECTIVES:
        assert hlo_stats.ring_factor(op, 1) == 0.0


def test_group_size_reads_every_replica_group_form():
    assert hlo_stats.group_size("x, replica_groups={{0,4,8,12},{1,5,9,13}}, y") == 4
    assert hlo_stats.group_size("x, replica_groups=[32,16]<=[16,8,4]T(2,1,0), y") == 16
    assert hlo_stats.group_size("replica_groups=mesh['axis_0'=16,'axis_1'=32] {'axis_0'}, d") == 16
    assert hlo_stats.group_size("replica_groups=mesh['a'=2,'b'=4,'c'=8] {'a','c'}, d") == 16
    assert hlo_stats.group_size("source_target_pairs={{0,1},{1,0}}") == 2


# A loop of 3 trips holding an all-gather to bf16[4,8] (64 B) over groups of 4, a reduce-scatter
# fusion to an f32[16] shard (64 B) whose all-reduce runs over groups of 2, and a ragged
# all-to-all sending bf16[8,4] (64 B) into a bf16[32,4] buffer over groups of 4; outside, an
# all-reduce of f32[10] (40 B) over groups of 8 and a tuple all-reduce of f32[2] + f32[3] (20 B)
# over pairs.
HLO = """\
%cond (p: (s32[], bf16[4,8])) -> pred[] {
  %p = (s32[], bf16[4,8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %constant.1 = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %constant.1), direction=LT
}

%all-reduce-scatter.2 (input_0: f32[32]) -> f32[16] {
  %input_0 = f32[32]{0} parameter(0)
  %all-reduce.9 = f32[32]{0} all-reduce(%input_0), replica_groups={{0,1},{2,3}}, to_apply=%add
  ROOT %ds = f32[16]{0} dynamic-slice(%all-reduce.9, %i), dynamic_slice_sizes={16}
}

%body (p: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  %p = (s32[], bf16[4,8]) parameter(0)
  %x = bf16[1,8]{1,0} get-tuple-element(%p), index=1
  %rows = bf16[8,4]{1,0} get-tuple-element(%p), index=2
  %buf = bf16[32,4]{1,0} get-tuple-element(%p), index=3
  %all-gather.3 = bf16[4,8]{1,0} all-gather(%x), replica_groups=[2,4]<=[8], dimensions={0}
  %fusion.1 = f32[16]{0} fusion(%x), kind=kCustom, calls=%all-reduce-scatter.2
  %rg = bf16[32,4]{1,0} ragged-all-to-all(%rows, %buf, %a, %b, %c, %d), replica_groups={{0,1,2,3}}
  ROOT %t = (s32[], bf16[4,8]) tuple(%i, %y)
}

ENTRY %main (a: f32[10]) -> f32[10] {
  %a = f32[10]{0} parameter(0)
  %all-reduce = f32[10]{0} all-reduce(%a), replica_groups=[1,8]<=[8], to_apply=%add
  %all-reduce.2 = (f32[2]{0}, f32[3]{0}) all-reduce(%b, %c), replica_groups={{0,1}}, to_apply=%add
  %while.1 = (s32[], bf16[4,8]) while(%init), condition=%cond, body=%body
  ROOT %r = f32[10]{0} copy(%all-reduce)
}
"""


def test_ring_traffic_of_hand_written_hlo():
    t = hlo_stats.collective_traffic(HLO)
    assert t["all-gather"]["bytes"] == 3 * 64
    assert t["all-gather"]["ring_bytes"] == pytest.approx(3 * 64 * 3 / 4)
    # reduce-scatter: the full input (2 x the 64 B shard) per trip, half of it sent.
    assert t["reduce-scatter"]["bytes"] == 3 * 128
    assert t["reduce-scatter"]["ring_bytes"] == pytest.approx(3 * 128 / 2)
    assert t["all-reduce"]["by_group"] == {8: 40, 2: 20}
    assert t["all-reduce"]["ring_bytes"] == pytest.approx(40 * 2 * 7 / 8 + 20 * 2 * 1 / 2)
    # ragged all-to-all: the 64 B of rows held, not the 256 B worst-case buffer.
    assert t["ragged-all-to-all"]["bytes"] == 3 * 64
    assert t["ragged-all-to-all"]["ring_bytes"] == pytest.approx(3 * 64 * 3 / 4)
    # The inner all-reduce of the reduce-scatter fusion is not counted twice.
    assert sum(t["all-reduce"]["by_group"].values()) == 60


def test_ragged_traffic_balanced_and_imbalanced():
    r = roofline.ragged_traffic(800.0, 8, imbalance=1.5)
    assert r["balanced"] == 700.0 and r["imbalanced"] == 1050.0
    assert roofline.ragged_traffic(800.0, 1)["balanced"] == 0.0


def test_computed_keys_per_query_counts_whole_blocks():
    # 4 query blocks of 512: causal, block i computes i + 1 key blocks.
    assert roofline.computed_keys_per_query(2048, 0, 512) == (1 + 2 + 3 + 4) / 4 * 512
    # A 129-key window reaches back into the previous block (2 blocks), block 0 into none.
    assert roofline.computed_keys_per_query(2048, 129, 512) == (1 + 2 + 2 + 2) / 4 * 512
    assert roofline.computed_keys_per_query(100, 0, 512) == 100   # one block clamped to S


# Two layers (the first dense), D=4, V=10, 2 query heads of 2 over 1 KV head, 4 experts of
# F=3, top-2: attention 2 x (4*2*2 + 4*1*(2+2) + 2*2*4) = 96, dense MLP 3*4*5 = 60, router 4*4 =
# 16, active experts 2 * 3*4*3 = 72, head 10*4 = 40 parameters.
TINY = types.SimpleNamespace(
    vocab_size=10, hidden_size=4, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=2,
    moe_intermediate_size=3, intermediate_size=5, num_dense_layers=1, num_experts=4, top_k=2,
    tie_embeddings=False, qk_norm=False, layer_types=(), remat="full", attn_block=4,
    logprob_keep_logits_mib=0, param_dtype="float32", compute_dtype="bfloat16")


def test_model_flops_by_hand():
    p = flops.param_counts(TINY)
    assert (p.attention, p.dense_mlp, p.router, p.active_experts, p.lm_head) == (96, 60, 16, 72,
                                                                                 40)
    # 6 x 284 active matmul parameters + 3 x attention: 2 layers x 2*2*(2+2) x (8+1)/2 keys.
    assert flops.train_flops_per_token(TINY, 8) == 6 * 284 + 3 * 2 * 2 * 2 * 4 * 4.5


def test_hardware_flops_by_hand():
    h = roofline.hardware_flops_per_token(TINY, 8, expert_chunks=8)
    assert h["layer_matmuls"] == 2 * (96 + 60 + 16) * 4      # forward, recompute, 2 x backward
    assert h["experts"] == 2 * 72 * 5                        # + each chunk's own recompute
    assert h["head"] == 2 * 40 * 4                           # logits recomputed in the backward
    # 6 computed keys per query (blocks of 4 over 8 tokens); forward 2*2*(2+2) per key, twice
    # (remat), backward 2*2*(3*2 + 2*2) per key; 2 layers.
    assert h["attention"] == 2 * (2 * 2 * 2 * 4 * 6 + 2 * 2 * 10 * 6)
    assert h["total"] == 1376 + 720 + 320 + 864
    no_remat = roofline.hardware_flops_per_token(
        types.SimpleNamespace(**{**vars(TINY), "remat": "none"}), 8)
    assert no_remat["layer_matmuls"] == 2 * 172 * 3 and no_remat["experts"] == 2 * 72 * 3


def test_roofline_by_hand():
    chip = roofline.Chip("x", 1e12, 1.0, 600e9, 6, "hand")
    assert chip.ici_one_dim_bytes_per_s == 200e9
    r = roofline.roofline(model_flops=4e12, hardware_flops=6e12, chips=2, ring_bytes=600e9,
                          ring_bytes_imbalanced=1200e9, chip=chip)
    assert r["compute_s_model_flops"] == 2.0 and r["compute_s_hardware_flops"] == 3.0
    assert r["comm_s_full_ici_balanced"] == 1.0 and r["comm_s_one_torus_dim_balanced"] == 3.0
    assert r["mfu_bound_full_ici_balanced"] == pytest.approx(2 / 3)
    assert r["mfu_bound_one_torus_dim_imbalanced"] == pytest.approx(2 / 6)
    v5p = roofline.CHIPS["v5p"]
    assert v5p.peak_bf16_flops == 459e12 and v5p.ici_bytes_per_s == 600e9


def test_peak_buffers_reads_the_compilers_peak_section(tmp_path):
    from gagar_jax.aot import buffers
    stem = tmp_path / "module_0001.jit_f.after_optimizations"
    (tmp_path / (stem.name + "-live-range.txt")).write_text(
        "HloLiveRange (max 9):\n  BufferLiveRange:\n    a{}:0-3\n"
        "  Live ranges at 7 (peak):\n"
        "    fusion.1{}: 2048 bytes (cumulative: 2048 bytes)\n"
        "    while.2{1}: 4096 bytes (cumulative: 6144 bytes)\n"
        "  Stack trace breakdown for peak usage: 6 144 bytes\n")
    (tmp_path / (stem.name + ".txt")).write_text(
        'FileNames\n1 "/x/gagar_jax/kernels/experts/ep.py"\n\nFunctionNames\n1 "f"\n\n'
        "FileLocations\n1 {file_name_id=1 function_name_id=1 line=42 end_line=42}\n\n"
        "StackFrames\n1 {file_location_id=1 parent_frame_id=1}\n\n"
        '  %fusion.1 = bf16[32,16]{1,0} fusion(%p), metadata={op_name="jit(f)/mul" '
        "stack_frame_id=1}\n"
        "  %while.2 = (s32[], f32[32,32]{1,0}) while(%t), condition=%c, body=%b\n")
    r = buffers.peak_buffers(str(tmp_path))
    assert r["peak_step"] == 7 and r["peak_bytes"] == 6144
    first, second = r["buffers"]
    assert (first["bytes"], first["shape"], first["instruction"]) == (4096, "f32[32,32]",
                                                                      "while.2{1}")
    assert (second["shape"], second["op_name"], second["source"]) == (
        "bf16[32,16]", "jit(f)/mul", "gagar_jax/kernels/experts/ep.py:42")


def test_buffer_table_names_every_byte(tmp_path):
    """A hand-made dump: 100 B of parameters, 4 B of constants, a 1000 B heap and a
    thread-local allocation. At step 5 the heap holds a (400 B at 0, with its loop phi sharing
    the address, counted once) and b (300 B at 600): 700 B live, 300 B of gaps."""
    from gagar_jax.aot import buffers
    stem = tmp_path / "module_0001.jit_f.after_optimizations"
    (tmp_path / (stem.name + "-buffer-assignment.txt")).write_text(
        "BufferAssignment:\n"
        "allocation 0: size 100, page 0, parameter 0, shape |f32[25]| at ShapeIndex {}:\n"
        " value: <1 p @0> (size=100,offset=0): f32[25]{0}\n"
        "allocation 1: size 4, page 0, constant:\n"
        " value: <2 c @0> (size=4,offset=0): f32[]{:T(128)}\n"
        "allocation 2: size 64, page 0, thread-local:\n"
        " value: <3 param_0.1 @0> (size=64,offset=0): f32[16]{0}\n"
        "allocation 3: size 1000, page 0, preallocated-temp:\n"
        " value: <4 a @0> (size=400,offset=0): bf16[200]{0}\n"
        " value: <5 while.1{1} (phi) @1> (size=400,offset=0): bf16[200]{0}\n"
        " value: <6 b @0> (size=300,offset=600): bf16[150]{0}\n"
        " value: <7 d @0> (size=500,offset=0): bf16[250]{0}\n"
        "allocation 4: size 8, color 1, page 0, preallocated-temp:\n")
    (tmp_path / (stem.name + "-live-range.txt")).write_text(
        "HloLiveRange (max 9):\n  InstructionSequence:\n    0:p\n  BufferLiveRange:\n"
        "    a{}:2-6\n    while.1{1}:4-7\n    b{}:5-6\n    d{}:8-9\n"
        "  Live ranges at 5 (peak):\n")
    (tmp_path / (stem.name + ".txt")).write_text(
        'FileNames\n1 "/x/gagar_jax/model/layers.py"\n\nFunctionNames\n1 "f"\n\n'
        "FileLocations\n1 {file_name_id=1 function_name_id=1 line=7 end_line=7}\n\n"
        "StackFrames\n1 {file_location_id=1 parent_frame_id=1}\n\n"
        "%fused (param_0.1: f32[16]) -> f32[16] {\n"
        "  ROOT %param_0.1 = f32[16]{0} parameter(0)\n}\n\n"
        "ENTRY %main (p: f32[25]) -> f32[25] {\n"
        '  %a = bf16[200]{0} fusion(%p), metadata={op_name="jit(f)/mul" stack_frame_id=1}\n'
        "  %b = bf16[150]{0} fusion(%p)\n}\n")
    t = buffers.buffer_table(str(tmp_path), min_row_bytes=0)
    rows = {r["what"]: r["bytes"] for r in t["rows"]}
    assert t["total_bytes"] == 100 + 4 + 1000 and sum(rows.values()) == t["total_bytes"]
    assert rows["temporary: gagar_jax/model/layers.py:7"] == 400
    assert rows["temporary: b (no source line)"] == 300
    assert rows["heap gaps at that moment (fragmentation)"] == 300
    assert t["heap_step"] in (5, 6)
    assert t["thread_local"] == {"bytes": 64, "allocations": 1, "by_role": {"parameter": 64},
                                 "by_computation_kind": {"fused": 64}}

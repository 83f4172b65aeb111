"""AOT compile for a TPU topology on this CPU host: the tiny config's real train step on v5p:2x2x1.

Needs libtpu (the `tpu` extra, installed by `make test`). One full compile per module.
"""
import json
import os
import subprocess
import sys

import pytest
from support.paths import REPO, TINY_CONFIG, load_tiny_config
from support.xla_flags import FAST_COMPILE, without

from gagar_jax.aot import compile as aot
from gagar_jax.kernels.attention import registry as attention_registry
from gagar_jax.kernels.experts import registry as experts_registry

# A real CompileTimeHbmOom message from libtpu 0.0.52 (v5p, 128 GiB of temporaries).
OOM_MESSAGE = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total "
               "memory required for HLO temporaries (128.00G) exceeds available HBM (95.73G). "
               "HLO module: jit__lambda.")


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    """The CLI over the library: tiny config, v5p:2x2x1, expert 2 x context 2 (rows split along S,
    the context-parallel attention included, "auto": splash kernels per shard; parameters stored
    over fsdp x context, ZeRO-style)."""
    out = tmp_path_factory.mktemp("aot") / "tiny.json"
    cmd = [sys.executable, os.path.join(REPO, "scripts", "aot_compile.py"),
           "--config", TINY_CONFIG, "--topology", "v5p:2x2x1",
           "--config.mesh.data=1", "--config.mesh.fsdp=1", "--config.mesh.expert=2",
           "--config.mesh.context=2", "--config.model.attention=auto",
           "--out", str(out)]
    # The TPU compiler keeps its own settings (conftest's flags are for XLA:CPU).
    flags = without(os.environ.get("XLA_FLAGS", ""), FAST_COMPILE)
    # PYTHONPATH: this checkout's package, not another one installed editable.
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, PYTHONPATH=REPO)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    report = json.loads(out.read_text())
    return {"last": last, "report": report, "stdout": proc.stdout}


def test_last_line_is_the_summary(tiny_report):
    last, r = tiny_report["last"], tiny_report["report"]
    assert last["fits"] is True and last["hbm_bytes"] == aot.HBM_BYTES["v5p"]
    assert last["per_device_bytes"] == r["per_device_bytes"]
    assert "temporaries" in tiny_report["stdout"] and "all-gather ops" in tiny_report["stdout"]


def test_tiny_compiles_and_fits(tiny_report):
    r = tiny_report["report"]
    assert r["num_devices"] == 4 and r["fits"] and not r["error"]
    assert r["mesh"] == {"data": 1, "fsdp": 1, "expert": 2, "context": 2, "tensor": 1}
    m = r["memory"]
    assert m["arguments"] > 0 and m["outputs"] > 0 and m["temporaries"] > 0
    assert r["per_device_bytes"] == (m["arguments"] + m["outputs"] - m["aliases"]
                                     + m["temporaries"] + m["code"])
    assert 0 < r["per_device_bytes"] < r["hbm_bytes"]
    # The state is donated: new parameters and optimizer moments reuse the old buffers.
    assert m["aliases"] > 0


def test_tiny_flops(tiny_report):
    r = tiny_report["report"]
    assert r["flops_per_device"] > 0
    assert r["model_flops_per_step"] > 0
    assert r["batch"]["micro_batches"] == 2 and r["batch"]["rows"] == 16
    assert r["batch"]["attention"].startswith("splash/")   # "auto" for TPU devices
    # Issue 29: hardware FLOPs (whole attention blocks, the head's logit recompute) exceed the
    # model FLOPs; the splash kernels' own cost makes the compiler's figure a flagged third.
    assert r["hardware_flops_per_step"] > r["model_flops_per_step"]
    assert any("splash" in f for f in r["cost_analysis_flags"])
    ring = r["roofline_ring_model"]     # issue 29's model, kept beside the torus one
    assert 0 < ring["mfu_bound_one_torus_dim_imbalanced"] <= ring["mfu_bound_full_ici_balanced"]
    # Issue 41: collectives priced on the mesh's placement on the 2x2x1 torus; the step bound
    # adds what the schedule does not overlap with compute.
    roof = r["roofline"]
    assert roof["compute_s_hardware_flops"] > roof["compute_s_model_flops"] > 0
    assert roof["step_s"] >= roof["comm_exposed_s"] + roof["compute_s_hardware_flops"] - 1e-12
    assert 0 < roof["mfu_bound_imbalanced"] <= roof["mfu_bound"] < 1
    assert r["links"]["by_op"]["all-gather"] > 0
    assert r["mesh_hops"] == {"expert": 1.0, "context": 1.0}
    assert r["traffic"]["all-gather"]["ring_bytes"] > 0 and r["chip"]["name"] == "v5p"
    # Every HBM byte in a row: the rows sum to the buffer assignment's total, which is
    # memory_analysis' total less the code.
    table = r["buffer_table"]
    assert sum(row["bytes"] for row in table["rows"]) == table["total_bytes"]
    m = r["memory"]
    assert abs(table["total_bytes"] + m["code"] - r["per_device_bytes"]) <= 2**20
    assert table["thread_local"]["bytes"] > 0
    assert r["peak_buffers"] is not None and r["commit"]
    # XLA's peak live set holds at least the largest buffer it lists.
    assert r["peak_live_bytes_xla"] >= max((b["bytes"] for b in r["peak_buffers"]), default=1) > 0


def test_tiny_collectives_counted(tiny_report):
    c = tiny_report["report"]["collectives"]
    assert set(c) == set(aot.COLLECTIVES)
    # Parameters stored over fsdp x context are gathered; gradients are reduced across shards.
    assert c["all-gather"] > 0
    assert c["all-reduce"] + c["reduce-scatter"] > 0
    moved = tiny_report["report"]["collective_bytes"]
    # Context parallelism: full layers all-gather K/V over context; the log-probs' shifts are
    # collective-permutes of [B, S] columns.
    assert moved["all-gather"] > 0 and moved["collective-permute"] > 0


def test_parse_hbm_oom():
    got = aot.parse_hbm_oom(OOM_MESSAGE)
    assert got == {"required_bytes": 128 * 2**30, "available_bytes": int(95.73 * 2**30)}
    got = aot.parse_hbm_oom(
        "RESOURCE_EXHAUSTED: Used 120.50G of 95.74G hbm. Exceeded hbm capacity by 24.76G."
    )
    assert got["required_bytes"] == int(120.5 * 2**30)
    assert aot.parse_hbm_oom("INVALID_ARGUMENT: shapes do not match") is None


def test_oom_becomes_fits_false_not_a_crash():
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = aot.topology_devices("v5p:2x2x1")
    mesh = Mesh(devices, ("data",))
    # 32 GiB per device in, three 32 GiB outputs: 128 GiB > 95 GiB of HBM.
    x = jax.ShapeDtypeStruct(
        (4 * 1024, 8 * 2**20), jnp.float32, sharding=NamedSharding(mesh, P("data"))
    )
    r = aot.compile_lowered(jax.jit(lambda a: (a * 2, a + 1, jnp.sin(a))).lower(x))
    assert r.error and "CompileTimeHbmOom" in r.error
    assert r.per_device_bytes == 128 * 2**30 and r.memory is None


def test_count_collectives_on_hlo_text():
    hlo = """
  %all-gather.1 = f32[8]{0} all-gather(f32[2]{0} %p), dimensions={0}
  %ag-start = (f32[2]{0}, f32[8]{0}) all-gather-start(f32[2]{0} %q), dimensions={0}
  %ag-done = f32[8]{0} all-gather-done((f32[2]{0}, f32[8]{0}) %ag-start)
  %all-reduce.3 = f32[8]{0} all-reduce(f32[8]{0} %x), to_apply=%add
  %rs = f32[2]{0} reduce-scatter(f32[8]{0} %x), dimensions={0}, to_apply=%add
  %a2a = f32[8]{0} all-to-all(f32[8]{0} %x), dimensions={0}
  %ra2a = f32[8]{0} ragged-all-to-all(f32[8]{0} %x, f32[8]{0} %o, \
s64[2] %a, s64[2] %b, s64[2] %c, s64[2] %d)
  %fusion.9 = bf16[20,32]{1,0} fusion(bf16[20,128]{1,0} %y), kind=kOutput, \
calls=%all-reduce-scatter.1.clone
"""
    assert aot.count_collectives(hlo) == {
        "all-gather": 2,
        "reduce-scatter": 2,
        "all-to-all": 1,
        "ragged-all-to-all": 1,
        "all-reduce": 1,
        "collective-permute": 0,
    }


def test_topology_errors_name_the_argument():
    with pytest.raises(ValueError, match="topology"):
        aot.parse_topology("v5p-8")
    assert aot.parse_topology("v5p:8x8x16") == ("v5p", (8, 8, 16))


def test_auto_expert_backend_follows_the_mesh_devices_not_the_process():
    """On this CPU-only process, a mesh of TPU devices still resolves "auto" to the TPU choice."""
    import dataclasses
    import types

    from gagar_jax import sharding
    from gagar_jax.run import step as ts

    def mesh(devices, expert):
        axes = types.SimpleNamespace(data=-1, fsdp=1, expert=expert, tensor=1)
        return sharding.make_mesh(axes, devices)

    import jax
    tpu, cpu = aot.topology_devices("v5p:2x2x1"), jax.devices()[:4]
    assert experts_registry.resolve("auto", mesh(tpu, 1), 8) == "megablox"
    assert experts_registry.resolve("auto", mesh(tpu, 4), 8) == "ep_a2a"
    assert experts_registry.resolve("auto", mesh(cpu, 1), 8) == "grouped"
    assert experts_registry.resolve("auto", mesh(cpu, 4), 8) == "ep"
    assert experts_registry.resolve("auto", mesh(cpu, 4), 6) == "grouped"   # E not divisible
    assert experts_registry.resolve("dense", mesh(tpu, 4), 8) == "dense"      # explicit wins
    with pytest.raises(ValueError, match="expert_backend"):
        experts_registry.resolve("nope")
    # The trainer fixes the choice in the graphdef it compiles.
    step_cfg = ts.StepConfig.from_config(load_tiny_config())
    step_cfg = dataclasses.replace(step_cfg, model=dataclasses.replace(
        step_cfg.model, expert_backend="auto", attention="auto"))
    _, graphdef = ts.abstract_train_state(step_cfg, mesh(tpu, 1))
    assert "expert_backend='megablox'" in repr(graphdef)
    assert "attention='splash'" in repr(graphdef)


# TPU executables cached by an earlier run cannot be read back on a CPU host; JAX then warns
# and compiles afresh.
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache")
def test_kernels_compile_ahead_of_time_for_v5p(tmp_path):
    """Splash attention and megablox experts, forward + backward, as real Mosaic TPU kernels."""
    import types

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from gagar_jax import sharding

    mesh = sharding.make_mesh(types.SimpleNamespace(data=2, fsdp=1, expert=2, tensor=1),
                              aot.topology_devices("v5p:2x2x1"))
    B, S, H, KV, DH, T, D, F, E, K = 4, 256, 4, 2, 128, 256, 256, 256, 8, 2
    sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(
        shape, dtype, sharding=NamedSharding(mesh, spec))
    row, tok = P("data"), P(("data", "fsdp", "expert"))

    def loss(q, k, v, seg, x, g, u, d, idx, w):
        o = attention_registry.attention(
            q, k, v, seg, impl=attention_registry.resolve("auto"), block=128
        )
        y = experts_registry.expert_ffn(x, g, u, d, idx, w, backend="megablox")
        # "auto" on this mesh: ep_a2a, whose local FFN on TPU is megablox.
        y2 = experts_registry.expert_ffn(
            x, g, u, d, idx, w, backend=experts_registry.resolve("auto")
        )
        return sum(jnp.sum(a.astype(jnp.float32)) for a in (o, y, y2))

    bf = jnp.bfloat16
    args = (sds((B, S, H, DH), bf, row), sds((B, S, KV, DH), bf, row),
            sds((B, S, KV, DH), bf, row), sds((B, S), jnp.int32, row),
            sds((T, D), bf, tok), sds((E, D, F), bf, P("expert")), sds((E, D, F), bf, P("expert")),
            sds((E, F, D), bf, P("expert")), sds((T, K), jnp.int32, tok), sds((T, K), bf, tok))
    with jax.set_mesh(mesh):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4, 5, 6, 7, 9))).lower(*args)
    text = lowered.as_text()
    assert experts_registry.resolve("auto", mesh, E) == "ep_a2a"
    # Real kernels, not interpreted: splash fwd, dq, dkv; gmm and tgmm (one lowered function
    # per distinct shape, called several times).
    assert text.count("tpu_custom_call") >= 6, "expected Mosaic kernels"
    assert "ragged_all_to_all" in text
    result = aot.compile_lowered(lowered, dump_dir=str(tmp_path))
    assert result.error == "" and result.memory is not None


@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache")
def test_splash_under_context_compiles_ahead_of_time_for_v5p(tmp_path):
    """"auto" attention with rows split along S (data 2 x context 2): splash is the per-shard
    kernel of a full layer (zig-zag query halves, one kernel per possible offset under
    `lax.switch`) and of a sliding layer with sinks (halo keys), compiled for TPU."""
    import types

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from gagar_jax import sharding
    from gagar_jax.kernels.attention import context as attention_context

    mesh = sharding.make_mesh(types.SimpleNamespace(data=2, fsdp=1, expert=1, context=2, tensor=1),
                              aot.topology_devices("v5p:2x2x1"))
    B, S, H, KV, DH = 2, 512, 4, 2, 128
    sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(
        shape, dtype, sharding=NamedSharding(mesh, spec))
    rows = P("data", "context")

    def loss(q, k, v, seg, sinks):
        full = attention_context.attention(
            q, k, v, seg, impl=attention_registry.resolve("auto"), block=128
        )
        slide = attention_context.attention(
            q,
            k,
            v,
            seg,
            impl=attention_registry.resolve("auto"),
            block=128,
            window=100,
            sinks_H=sinks,
        )
        return jnp.sum((full + slide).astype(jnp.float32))

    bf = jnp.bfloat16
    args = (sds((B, S, H, DH), bf, rows), sds((B, S, KV, DH), bf, rows),
            sds((B, S, KV, DH), bf, rows), sds((B, S), jnp.int32, rows),
            sds((H,), jnp.float32, P()))
    with jax.set_mesh(mesh):
        assert attention_registry.resolve("auto") == "splash"
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4))).lower(*args)
    # Mosaic kernels (fwd, dq, dkv): 2 query halves x 2 offsets on the full layer, 1 sliding.
    assert lowered.as_text().count("tpu_custom_call") >= 15, "expected Mosaic kernels"
    result = aot.compile_lowered(lowered, dump_dir=str(tmp_path))
    assert result.error == "" and result.memory is not None


HLO = """\
%cond (p: (s32[], bf16[4,8])) -> pred[] {
  %p = (s32[], bf16[4,8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %constant.1 = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %constant.1), direction=LT
}

%body (p: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  %p = (s32[], bf16[4,8]) parameter(0)
  %x = bf16[2,8]{1,0} get-tuple-element(%p), index=1
  %all-gather-start = (bf16[2,8]{1,0}, bf16[4,8]{1,0}) all-gather-start(%x), dimensions={0}
  %fusion.1 = f32[16]{0} fusion(%x), kind=kCustom, calls=%all-reduce-scatter.2
  ROOT %t = (s32[], bf16[4,8]) tuple(%i, %y)
}

ENTRY %main (a: f32[10]) -> f32[10] {
  %a = f32[10]{0} parameter(0)
  %all-reduce = f32[10]{0} all-reduce(%a), to_apply=%add
  %while.1 = (s32[], bf16[4,8]) while(%init), condition=%cond, body=%body
  ROOT %r = f32[10]{0} copy(%all-reduce)
}
"""


def test_collective_bytes_follow_loop_trip_counts():
    """Hand-counted: a gather of bf16[4,8] (64 B) and a reduce-scatter to f32[16] (64 B) in a
    loop of 3 trips, one all-reduce of f32[10] (40 B) outside."""
    got = aot.collective_bytes_per_step(HLO)
    assert got["all-gather"] == 3 * 64 and got["reduce-scatter"] == 3 * 64
    assert got["all-reduce"] == 40 and got["collective-permute"] == 0
    assert got["unknown_trip_loops"] == 0

"""`ep_a2a` proven as far as a CPU can (issue 29 item 4): on 8 CPU devices its emulated
ragged all-to-all with either local FFN equals `ep` and the single-device `grouped` backend,
forward and every gradient, with the mesh-axis type checks on where the kernels allow; planted
missing reductions fail; the real `ragged_all_to_all` compiles for a TPU topology with the
buffer sizes the emulation is called with and no reduction of a received-rows buffer."""
import re
import types

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.close import assert_rel_close
from support.experts import GRAD_ARGS, expert_mesh, loss_and_grads

from gagar_jax import sharding
from gagar_jax.aot import compile as aot
from gagar_jax.kernels.experts import ep as experts_ep
from gagar_jax.kernels.experts import registry as experts_registry

T, D, F, E, K = 32, 16, 8, 8, 2
MESH = (1, 2, 2, 2)   # data x fsdp x expert x tensor = 8 devices: tokens over 4, F over 2


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    g, u = (jnp.asarray(rng.normal(size=(E, D, F)) / np.sqrt(D), jnp.float32) for _ in range(2))
    d = jnp.asarray(rng.normal(size=(E, F, D)) / np.sqrt(F), jnp.float32)
    logits = rng.normal(size=(T, E))
    logits[:, 5] += 2.0      # one hot expert: its chip receives far more rows than the mean
    idx = np.argsort(-logits, axis=1)[:, :K].astype(np.int32)
    idx[4, 1] = -1           # "no expert"
    idx[11, :] = E
    w = jnp.asarray(rng.uniform(0.1, 1.0, size=(T, K)), jnp.float32)
    return x, g, u, d, jnp.asarray(idx), w


@pytest.fixture(scope="module")
def single_device(problem):
    return loss_and_grads("grouped")(*problem)


A2A = {"exchange": experts_ep.emulated_ragged_all_to_all}


@pytest.mark.parametrize("local,row_tile", [("grouped", None), ("megablox", 16)])
def test_ep_a2a_equals_ep_and_single_device_grouped(problem, single_device, local, row_tile):
    with jax.set_mesh(expert_mesh(MESH)):
        got = loss_and_grads("ep_a2a", local=local, row_tile=row_tile, **A2A)(*problem)
        if local == "grouped":
            assert_rel_close(loss_and_grads("ep")(*problem), single_device)
    assert_rel_close(got, single_device)   # loss, output and all five gradients


def _shard_map_checks(jaxpr) -> list:
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            found.append(eqn.params["check_vma"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _shard_map_checks(sub)
    return found


def test_type_checks_are_on_where_the_kernels_allow(problem):
    mesh = expert_mesh(MESH)
    checks = {local: _shard_map_checks(jax.make_jaxpr(
        lambda *a, lf=local: experts_registry.expert_ffn(
            *a, backend="ep_a2a", mesh=mesh, local=lf, **A2A))(*problem).jaxpr)
        for local in ("grouped", "megablox")}
    # grouped: checked; megablox's Pallas kernels carry no mesh-axis types (megablox.py).
    assert checks == {"grouped": [True], "megablox": [False]}


def _without_psum(monkeypatch):
    monkeypatch.setattr(jax.lax, "psum", lambda x, axes, **kw: x)


def test_a_planted_missing_reduction_fails(problem, single_device, monkeypatch):
    """Drop every psum (the 'tensor' partial sums of the output, the grouped backward's sums):
    the typed path refuses to trace, the unchecked megablox path gives wrong numbers."""
    _without_psum(monkeypatch)
    with jax.set_mesh(expert_mesh(MESH)):
        with pytest.raises(ValueError, match="vary|varying|out_specs"):
            loss_and_grads("ep_a2a", local="grouped", **A2A)(*problem)
        y = jax.jit(lambda *a: experts_registry.expert_ffn(
            *a, backend="ep_a2a", local="megablox", **A2A))(*problem)
    want = single_device[0][1]
    assert not np.allclose(y, want, rtol=1e-2, atol=1e-3)


_TENSOR = re.compile(r"tensor<([\dx]+)x(f32|bf16|i32)>")


def _ragged_shapes(stablehlo: str) -> list[tuple]:
    """(operand, output) element shapes of each ragged_all_to_all in StableHLO text."""
    out = []
    for line in stablehlo.splitlines():
        if "ragged_all_to_all" in line and "->" in line:
            types_ = _TENSOR.findall(line.split(":")[-1])
            out.append(tuple(tuple(int(n) for n in dims.split("x")) for dims, _ in types_[:2]))
    return out


# TPU executables cached by an earlier run cannot be read back on a CPU host; JAX then warns
# and compiles afresh, which is what this test wants anyway.
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache")
def test_real_ragged_all_to_all_compiles_for_tpu_with_the_emulations_sizes(problem, tmp_path):
    # The emulation on CPU, recording the buffers it is handed.
    seen = []

    def recording(operand, output, *offsets, axis_name, **kw):
        seen.append((tuple(operand.shape), tuple(output.shape)))
        return experts_ep.emulated_ragged_all_to_all(operand, output, *offsets,
                                                     axis_name=axis_name, **kw)

    cpu = sharding.make_mesh(types.SimpleNamespace(data=1, fsdp=1, expert=2, tensor=2),
                             jax.devices()[:4])
    jax.jit(jax.grad(lambda *a: jnp.sum(experts_registry.expert_ffn(
        *a, backend="ep_a2a", mesh=cpu, exchange=recording)), argnums=GRAD_ARGS)).trace(
            *problem)

    # The real collective for v5p:2x2x1 (expert 2 x tensor 2), the same program.
    mesh = sharding.make_mesh(types.SimpleNamespace(data=1, fsdp=1, expert=2, tensor=2),
                              aot.topology_devices("v5p:2x2x1"))
    tok = ("data", "fsdp", "expert")
    specs = (P(tok), P("expert", None, "tensor"), P("expert", None, "tensor"),
             P("expert", "tensor", None), P(tok), P(tok))
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s))
              for a, s in zip(problem, specs, strict=True)]
    lowered = jax.jit(jax.grad(lambda *a: jnp.sum(experts_registry.expert_ffn(
        *a, backend="ep_a2a", mesh=mesh)), argnums=GRAD_ARGS)).lower(*shapes)
    real = _ragged_shapes(lowered.as_text())
    # Per chunk: rows and ids out (T_local/chunks * K rows into n_expert x as many), rows back;
    # the backward pass transposes each (received-row cotangents back, output cotangents out).
    n = T // 2 // 2 * K      # rows of a chunk: 16 local tokens, 2 chunks, top-2
    forward = {((n, D), (2 * n, D)), ((n, 1), (2 * n, 1)), ((2 * n, D), (n, D))}
    assert set(seen) == forward
    assert forward <= set(real) and len(real) >= 5
    result = aot.compile_lowered(lowered, dump_dir=str(tmp_path))
    assert result.error == "" and result.memory is not None
    hlo = "".join(p.read_text() for p in tmp_path.glob("*after_optimizations.txt"))
    assert hlo.count("ragged-all-to-all(") >= 5
    # Every reduction runs over 'tensor' (2 chips: dx and output partial sums) or nothing
    # (data x fsdp = 1: weight gradients). Before the exchange's result was typed like the rows
    # it receives, the backward pass also summed received-row cotangents over expert x tensor
    # (4 chips): wrong gradients on TPU, invisible to the CPU emulation (its all_gather is typed).
    groups = re.findall(r'"stablehlo.all_reduce".*?replica_groups = dense<(\[\[.*?\]\])>',
                        lowered.as_text())
    assert groups and max(len(g.split("],")[0].split(",")) for g in groups) <= 2, groups

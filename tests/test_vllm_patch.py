"""Patch maps (`gagar_jax.rollout.vllm_patch`) on made-up modules, without vLLM (torch only).

A fused-experts module whose processing packs its loader-layout weight the way a CPU kernel
does (gate/up rows interleaved in blocks of 16, the intermediate dim zero-padded): the probes
find where every checkpoint element lands, and patching a few changed elements gives the
kernel tensor a full processing of the new weights gives, bit for bit. A processing that
scales, or that drops elements into a handle, is refused.

torch is imported by the tests, not at collection (2 s per pytest worker).
"""
import importlib
from types import SimpleNamespace

import numpy as np
import pytest

from gagar_jax.rollout.delta import Tensor
from gagar_jax.rollout.vllm_patch import _positions, probe_part, refresh
from gagar_jax.rollout.vllm_patch import patch as patch_kernel
from gagar_jax.rollout.vllm_plans import FastApplyPlan

E, F, D, PAD = 3, 20, 8, 32        # experts, intermediate (padded to 32), hidden


def _torch():
    return importlib.import_module("torch")


def pack(loader_w13, scale=1.0):
    """[E, 2F, D] loader layout -> [E, 2*PAD, D] kernel: pad F to PAD, then interleave gate and
    up in blocks of 16 rows, and store each 16 x D block transposed."""
    torch = _torch()
    w = torch.zeros(E, 2 * PAD, D, dtype=loader_w13.dtype)
    w[:, :F], w[:, PAD:PAD + F] = loader_w13[:, :F], loader_w13[:, F:]
    g, u = w[:, :PAD].reshape(E, PAD // 16, 16, D), w[:, PAD:].reshape(E, PAD // 16, 16, D)
    blocks = torch.stack([g, u], dim=2).reshape(E, PAD // 8, 16, D)
    return (blocks.transpose(-1, -2).contiguous() * scale).reshape(E, 2 * PAD, D)


def names():
    return [f"e{e}.{p}" for e in range(E) for p in ("gate", "up")]


def plan(dtype):
    """What `plan_fast_apply` traces for the module: each expert's gate and up [F, D] copied
    into its rows of the loader-layout w13 [E, 2F, D]."""
    program = []
    for e in range(E):
        for j, p in enumerate(("gate", "up")):
            dst = (e * 2 * F * D + j * F * D, (F, D), (D, 1))
            program.append(("w13", dst, f"e{e}.{p}", (0, (F, D), (D, 1))))
    return FastApplyPlan(program={"experts": program}, feeds={"experts": names()},
                         layout={"experts": {"w13": ((E, 2 * F, D), (2 * F * D, D, 1), dtype)}})


def loader_of(weights, dtype):
    """The loader-layout w13 the module's loader would fill from checkpoint tensors."""
    w = _torch().empty(E, 2 * F, D, dtype=dtype)
    for e in range(E):
        w[e, :F], w[e, F:] = weights[f"e{e}.gate"], weights[f"e{e}.up"]
    return w


def probe(dtype, process, rows=2 * PAD, calls=None):
    torch = _torch()
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = torch.nn.Module()
    model.experts = torch.nn.Module()      # a fused-experts module: one w13 parameter
    model.experts.w13 = torch.nn.Parameter(torch.zeros(E, rows, D, dtype=dtype),
                                           requires_grad=False)
    lw = SimpleNamespace(tensors=lambda m: dict(m.named_parameters(recurse=False)),
                         quant_base=type(None))

    def rebuild(fill):
        if calls is not None:
            calls.append(1)
        loader = SimpleNamespace(w13=torch.empty(E, 2 * F, D, dtype=dtype))
        assert fill("experts", loader) == {"w13"}
        model.experts.w13.data.copy_(process(loader.w13))
    sizes = {n: F * D for n in names()}
    return model, probe_part(model, ("experts",), plan(dtype), sizes, rebuild, lw)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_patch_equals_processing_the_new_weights(dtype):
    torch = _torch()
    dtype = getattr(torch, dtype)
    model, got = probe(dtype, pack)
    assert got is not None and sorted(got.maps) == names()
    assert got.reprocess == {n: [] for n in names()}
    assert len({id(m[3]) for m in got.maps.values()}) == 1    # one pattern, held once
    rng = np.random.default_rng(0)
    bits = {torch.bfloat16: ("BF16", np.uint16), torch.float32: ("F32", np.float32)}[dtype]

    def tensor(x):
        return Tensor(bits[0], x.contiguous().view(torch.int16 if dtype == torch.bfloat16
                                                   else dtype).numpy().view(bits[1]).copy())
    old = {n: torch.randn(F, D).to(dtype) for n in names()}
    model.experts.w13.data.copy_(pack(loader_of(old, dtype)))
    new = {n: t.clone() for n, t in old.items()}
    touched = {}
    for n in names()[::2]:                  # a few elements of half the tensors
        idx = np.sort(rng.choice(F * D, 7, replace=False))
        new[n].view(-1)[torch.from_numpy(idx)] = torch.randn(7).to(dtype)
        touched[n] = [(idx, Tensor(bits[0], tensor(new[n]).array.reshape(-1)[idx]))]
    mirror = {n: tensor(t) for n, t in new.items()}
    assert patch_kernel(model, got.maps, mirror, set(touched), touched) == 7 * len(touched)
    assert torch.equal(model.experts.w13.data, pack(loader_of(new, dtype)))
    # a whole tensor (a dense delta entry, touched None) comes from the mirror
    new["e1.up"] = torch.randn(F, D).to(dtype)
    mirror["e1.up"] = tensor(new["e1.up"])
    assert patch_kernel(model, got.maps, mirror, {"e1.up"}, {"e1.up": None}) == F * D
    assert torch.equal(model.experts.w13.data, pack(loader_of(new, dtype)))
    # a host copy that lags (entries that went to the engine only) is read back from it
    lagging = {n: tensor(t) for n, t in old.items()}
    refresh(model, got.maps, lagging, set(names()))
    for n in names():
        np.testing.assert_array_equal(lagging[n].array, mirror[n].array)


@pytest.mark.parametrize("process", [lambda w: pack(w, scale=2.0),          # arithmetic
                                     lambda w: pack(w) + 1.0,                # not a copy
                                     lambda w: pack(w[:, _torch().arange(2 * F) // 2 * 2])])
def test_a_processing_that_is_not_a_copy_is_refused(process):
    """Scaling, an offset, or an element copied twice (a lost one): no map, the module is
    rebuilt instead."""
    assert probe("bfloat16", process)[1] is None


def test_positions():
    rel = np.array([3, 0, 2, 1], dtype=np.int32)
    assert _positions(None, None, 5, 4) == slice(5, 9)
    np.testing.assert_array_equal(_positions(None, np.array([1, 3]), 5, 4), [6, 8])
    np.testing.assert_array_equal(_positions(rel, np.array([0, 3]), 2**31, 4),
                                  [2**31 + 3, 2**31 + 1])      # int64: no int32 wrap-around
    np.testing.assert_array_equal(_positions(rel, None, 1, 4), [4, 1, 3, 2])


def test_a_plain_copy_needs_no_digit_runs():
    """A processing that keeps the loader layout (an embedding, a norm, a linear that keeps its
    weight): two random runs show it, every tensor maps contiguously."""
    calls = []
    model, got = probe("bfloat16", lambda w: w.clone(), rows=2 * F, calls=calls)
    assert len(calls) == 2
    assert {n: (m[1], m[2], m[3]) for n, m in got.maps.items()} == {
        f"e{e}.{p}": ("w13", (2 * e + j) * F * D, None)
        for e in range(E) for j, p in enumerate(("gate", "up"))}

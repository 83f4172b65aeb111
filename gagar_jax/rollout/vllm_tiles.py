"""The worker's host copy kept in vLLM's loader layout (the fast delta apply's tiles).

`tile_mirror` moves the host copy's checkpoint tensors into one flat array per fused kernel
tensor that the fast apply's traced copies tile in order (a fused qkv or gate/up, an experts'
w13 or w2, an embedding with its padding), the tensors becoming views into it: a delta's bit
copies land in the layout the module loads, and `vllm_fast_apply` hands the tile over as it is.
`retile` puts back a tensor a delta replaced instead of writing into. numpy and torch only (no
JAX, no vLLM).
"""
from __future__ import annotations

from gagar_jax.rollout.vllm_plans import FastApplyPlan
from gagar_jax.rollout.vllm_reload import torch_tensor


def tile_mirror(mirror: dict, plan: FastApplyPlan) -> dict:
    """Moves the mirror's tensors into the loader layout: for each kernel tensor of a fast
    module that the plan's copies tile in order (a fused qkv or gate/up, an experts' w13 or w2,
    an embedding with its padding filled), one flat array of that layout holds them, and the
    mirror's tensors become views into it, so a delta's bit copies land in the layout the
    module loads and `fast_apply` hands the tile over as it is. A tensor is tiled only when it
    is copied whole, once in the plan, in its own dtype; the others stay as they are (copied
    out of the file buffers). Returns {(module, attr): (flat array, {name: (offset, size)})}."""
    import math
    from collections import Counter

    import numpy as np
    import torch

    uses = Counter(op[2] for ops in plan.program.values() for op in ops if op[2] is not None)
    slow, tiles = set(plan.slow), {}
    for module, program in plan.program.items():
        by_attr = {}
        for op in program:
            by_attr.setdefault(op[0], []).append(op)
        for attr, ops in by_attr.items():
            shape, stride, dtype = plan.layout[module][attr]
            srcs = [mirror.get(op[2]) for op in ops if op[2] is not None]
            if module in slow or stride != contiguous(shape) or not srcs or None in srcs:
                continue
            end, dt = 0, srcs[0].array.dtype
            for _, (do, ds, st), n, v in sorted(ops, key=lambda op: op[1][0]):
                t = mirror[n] if n is not None else None
                ok = do == end and st == contiguous(ds)
                if t is not None:
                    ok = ok and uses[n] == 1 and t.array.dtype == dt and v[0] == 0 and (
                        t.array.flags.c_contiguous and math.prod(v[1]) == t.array.size and
                        v[2] == contiguous(v[1]) and torch_tensor(t).dtype == dtype)
                end = do + math.prod(ds) if ok and end >= 0 else -1
            if end != math.prod(shape):
                continue
            flat, offsets = np.empty(end, dt), {}
            for _, (do, ds, _), n, v in ops:
                n_el = math.prod(ds)
                if n is None:
                    torch.from_numpy(flat).view(dtype)[do:do + n_el].fill_(v)
                    continue
                t = mirror[n]
                flat[do:do + n_el] = t.array.reshape(-1)
                t.array = flat[do:do + n_el].reshape(t.array.shape)
                offsets[n] = do, n_el
            tiles[(module, attr)] = (flat, offsets)
    tiled = {n for _, offsets in tiles.values() for n in offsets}
    for name, t in mirror.items():
        if name not in tiled and not t.array.flags.owndata:
            t.array = t.array.copy()
    return tiles


def retile(mirror: dict, tiles: dict, changed: set) -> None:
    """Puts back into their tiles the changed tensors a delta replaced instead of writing into
    (`delta.apply_delta` writes in place when it can); a tile one no longer fits (another size
    or dtype) is dropped, and its module's copies are replayed as without tiles."""
    for key, (flat, offsets) in list(tiles.items()):
        for n, (do, size) in offsets.items():
            a = mirror[n].array
            if n not in changed or a.__array_interface__["data"][0] == \
                    flat.__array_interface__["data"][0] + do * flat.itemsize:
                continue
            if a.size != size or a.dtype != flat.dtype:
                del tiles[key]
                break
            flat[do:do + size] = a.reshape(-1)
            mirror[n].array = flat[do:do + size].reshape(a.shape)


def contiguous(shape: tuple) -> tuple:
    """The C-order strides of `shape`, in elements."""
    out, n = [], 1
    for d in reversed(shape):
        out.append(n)
        n *= d
    return tuple(reversed(out))

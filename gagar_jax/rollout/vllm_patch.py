"""Patch maps: where every checkpoint element lives in the engine's kernel tensors, so a delta's
changed elements are written straight there (`patch`) instead of rebuilding the module.

A module qualifies when its own processing (`process_weights_after_loading`, the experts'
re-pack: whatever a rebuild runs) only moves checkpoint elements into its registered tensors:
a CPU experts' prepack (a permutation), an embedding, a norm. The map is found once per engine
by running the module's processing on probes (`probe_part`): each loader-layout element gets an
id, written as base-256 digits (1..256, exact in bfloat16, float16 and float32) over a few runs;
reading the digits back from the processed kernel tensors gives each element's position. A run
on random values then checks the map (every mapped kernel element equals the loader element it
names, bit for bit; every other kernel element is the same constant in every run), and the
module's real weights are rebuilt. A module whose processing converts, scales, or moves its
weights into something the probe cannot read (a oneDNN handle: `cpu_linear` with the weight
removed) is left to the rebuild. A module that keeps its weight beside such a handle (vLLM's
embedding and LM head: `remove_weight=False`) is patched and then re-processed in place, when
the probe shows that re-processing leaves its tensors as they are.

Positions are stored per checkpoint tensor as (module, attr, base, pattern): `base + pattern`
(int32 offsets, shared between tensors with the same layout: every expert of every layer) are
the flat positions of its elements in the kernel tensor `module.attr`.

Like the extension, it imports no JAX and vLLM only inside functions.
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from gagar_jax.rollout.vllm_plans import FastApplyPlan, PatchMaps
from gagar_jax.rollout.vllm_reload import process_module, torch_tensor

_EXACT = ("torch.bfloat16", "torch.float16", "torch.float32")   # 1..256 exact in each
_TORCH = {"BF16": "torch.bfloat16", "F16": "torch.float16", "F32": "torch.float32"}


def _storage_numel(shape: tuple, stride: tuple) -> int:
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True)) if all(shape) \
        else 0


def _flat_storage(y: Any) -> Any:
    """A 1-d tensor over the whole storage span of `y` (its storage offset first)."""
    import torch
    n = _storage_numel(tuple(y.shape), tuple(y.stride()))
    return torch.empty(0, dtype=y.dtype).set_(y.untyped_storage(), y.storage_offset(), (n,))


def _view_index(view: tuple) -> np.ndarray:
    """The flat positions that the view (offset, shape, stride) reads, in the view's C order."""
    offset, shape, stride = view
    idx = np.full((), offset, dtype=np.int64)
    for n, st in zip(shape, stride, strict=True):
        idx = idx[..., None] + np.arange(n, dtype=np.int64) * st
    return idx.reshape(-1)


def _kernel(modules: dict, lw: Any) -> dict:
    """(module, attr) -> tensor: the part's registered tensors a patch can write (contiguous,
    of a dtype the probe digits are exact in)."""
    return {(name, attr): t for name, m in modules.items() for attr, t in lw.tensors(m).items()
            if str(t.dtype) in _EXACT and t.numel() and t.is_contiguous()}


def probe_part(model: Any, part: tuple, plan: FastApplyPlan, sizes: dict, rebuild: Any,
               lw: Any, patterns: dict | None = None) -> PatchMaps | None:
    """The patch maps of one group of modules loaded together (`_components`), or None when
    it does not qualify. `sizes`: element count of every checkpoint tensor. `rebuild(fill)`
    runs the group's processing (the fast apply's rebuild and re-pack) with its loader-layout
    tensors filled by `fill(module name, module)`; the caller rebuilds the real weights
    afterwards. `patterns` (hash -> array) shares equal patterns between calls. Returns the
    group's `PatchMaps` (`maps`: name -> (module, attr, base, pattern or None: contiguous);
    `reprocess`: name -> the modules to re-process in place after a patch)."""
    import torch

    modules = {n: model.get_submodule(n) for n in part}
    if any(t.device.type != "cpu" for m in modules.values() for t in lw.tensors(m).values()):
        return None               # `patch` writes through numpy: host memory only
    spans, n_ids = {}, 0          # (module, attr) -> (first id, storage span, dtype)
    for name in part:
        loaded = {op[0] for op in plan.program.get(name, ())}
        for attr, (shape, stride, dtype) in sorted(plan.layout.get(name, {}).items()):
            if attr in loaded:
                spans[(name, attr)] = (n_ids, _storage_numel(shape, stride), dtype)
                n_ids += spans[(name, attr)][1]
    dtypes = {str(d) for _, _, d in spans.values()}
    if not spans or len(dtypes) != 1 or dtypes.pop() not in _EXACT:
        return None
    dtype = next(iter(spans.values()))[2]
    digits = max(1, -(-int(n_ids).bit_length() // 8))

    def fill_with(values: Any) -> Any:
        def fill(name: str, m: Any) -> set:
            written = set()
            for (mod, attr), (first, n, _) in spans.items():
                if mod == name:
                    _flat_storage(getattr(m, attr)).copy_(values(first, n))
                    written.add(attr)
            return written
        return fill

    def digit(k: int) -> Any:
        return lambda first, n: torch.from_numpy(
            ((np.arange(first, first + n, dtype=np.int64) >> (8 * k)) & 255) + 1).to(dtype)

    noise = torch.randn(n_ids + 1, generator=torch.Generator().manual_seed(0)).to(dtype)
    rand = [noise[:-1], noise[1:]]    # the second run: every element moved by one
    runs = []
    for r in rand:                    # two runs on random values (the second left in place)
        rebuild(fill_with(lambda first, n, r=r: r[first:first + n]))
        runs.append({key: t.detach().clone().reshape(-1)
                     for key, t in _kernel(modules, lw).items()})
    where = _identity(runs, spans, rand)
    if where is None:                 # not a plain copy: the digit runs find where each goes
        for k in range(digits):
            rebuild(fill_with(digit(k)))
            runs.insert(k, {key: t.detach().clone().reshape(-1)
                            for key, t in _kernel(modules, lw).items()})
        rebuild(fill_with(lambda first, n: rand[1][first:first + n]))
        if any(r.keys() != runs[-1].keys() for r in runs):
            return None
        where = _decode(runs, digits, n_ids, rand[1])
    if where is None:
        return None
    maps = _maps(part, plan, sizes, spans, where, n_ids, {} if patterns is None else patterns)
    if maps is None:
        return None
    reprocess = [n for n, m in modules.items() if _holds_state(getattr(m, "cpu_linear", None))]
    for name in reprocess:            # re-processing in place must leave the tensors as they are
        process_module(modules[name])
    after = {key: t.detach().reshape(-1) for key, t in _kernel(modules, lw).items()}
    if any(key not in after or not torch.equal(after[key], t) for key, t in runs[-1].items()):
        return None
    return PatchMaps(maps=maps, reprocess={n: reprocess for n in maps})


def _identity(runs: list, spans: dict, rand: list) -> dict | None:
    """`_decode`'s answer when every loader-layout tensor lands unchanged in the kernel tensor
    of the same name (an embedding, a norm, a linear that keeps its weight) and every other
    kernel tensor is the same in both random runs; None otherwise."""
    import torch

    where = {}
    for key, r in runs[-1].items():
        if key in spans:
            first, n, _ = spans[key]
            if r.numel() != n or any(not torch.equal(run[key], v[first:first + n])
                                     for run, v in zip(runs, rand, strict=True)):
                return None
            where[key] = None         # every position holds the loader element at it
        elif not torch.equal(runs[0][key], r):
            return None
    return where if where.keys() == spans.keys() else None


def _digits(t: Any) -> np.ndarray:
    """Per element of a probed kernel tensor: the base-256 digit it holds (its value - 1, for
    the values 1..256) or -1."""
    import torch

    if t.element_size() == 2:         # bfloat16, float16: a table over the 65536 bit patterns
        table = _DIGIT_TABLES.get(t.dtype)
        if table is None:
            v = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(t.dtype)
            _DIGIT_TABLES[t.dtype] = table = _digit_of(v.float().numpy())
        return table[t.view(torch.int16).numpy().astype(np.int32) + 2**15]
    return _digit_of(t.float().numpy())


def _digit_of(v: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):         # NaN and infinities: no digit
        ok = (v >= 1) & (v <= 256) & (v == np.floor(v))
    return np.where(ok, np.nan_to_num(v) - 1, -1).astype(np.int16)


_DIGIT_TABLES: dict = {}


def _decode(runs: list, digits: int, n_ids: int, rand: Any) -> dict | None:
    """kernel (module, attr) -> (flat positions, loader ids) of the elements the probe runs
    map; None when a kernel element is neither a copy of one loader element (bit for bit, in
    the random run) nor the same constant in every run, or a loader element lands twice."""
    import torch

    where, count = {}, np.zeros(n_ids, dtype=np.int64)
    for key in sorted(runs[-1]):
        ok = np.ones(runs[-1][key].numel(), dtype=bool)
        ids = np.zeros(len(ok), dtype=np.int64)
        for k in range(digits):
            d = _digits(runs[k][key])
            ok &= d >= 0
            ids += d.astype(np.int64) << (8 * k)
        ok &= ids < n_ids
        const = torch.from_numpy(~ok)
        if const.any() and any(not torch.equal(r[key][const], runs[0][key][const])
                               for r in runs):
            return None
        pos = np.flatnonzero(ok)
        if not len(pos):
            continue
        ids = ids[pos]
        if not torch.equal(runs[-1][key][torch.from_numpy(pos)],
                           rand[torch.from_numpy(ids)].to(runs[-1][key].dtype)):
            return None
        where[key] = (pos, ids)
        count += np.bincount(ids, minlength=n_ids)
    return where if (count <= 1).all() else None


def _maps(part: tuple, plan: FastApplyPlan, sizes: dict, spans: dict, where: dict, n_ids: int,
          patterns: dict) -> dict | None:
    """name -> (module, attr, base, pattern) for every checkpoint tensor feeding the part,
    through the plan's copies (checkpoint element -> loader id) and the decoded positions
    (loader id -> kernel element); None when one is not copied whole, once, into one tensor."""
    keys = sorted(where)
    if any(where[k] is not None for k in keys):
        kernel_of = np.full(n_ids, -1, dtype=np.int64)     # loader id -> flat kernel position
        owner = np.full(n_ids, -1, dtype=np.int64)         # loader id -> its kernel tensor
        for i, key in enumerate(keys):
            pos, ids = where[key]
            kernel_of[ids], owner[ids] = pos, i
    maps = {}
    for name in sorted({n for m in part for n in plan.feeds.get(m, ())}):
        src, ids, into = [], [], set()
        for mod in part:
            for attr, dst, n, view in plan.program.get(mod, ()):
                if n == name:
                    into.add((mod, attr))
                    src.append(_view_index(view))
                    ids.append(spans[(mod, attr)][0] + _view_index(dst))
        if not src:
            return None
        src, ids = np.concatenate(src), np.concatenate(ids)
        if len(src) != sizes[name] or (np.bincount(src, minlength=sizes[name]) != 1).any():
            return None
        order = np.empty(sizes[name], dtype=np.int64)
        order[src] = ids
        key = next(iter(into))
        if len(into) == 1 and where[key] is None:      # a plain copy: ids are positions
            at, who = order - spans[key][0], np.full(1, keys.index(key))
        else:
            if any(where[k] is None for k in into):
                return None
            at, who = kernel_of[order], owner[order]
        if (at < 0).any() or (who != who[0]).any():
            return None
        base = int(at.min())
        rel = (at - base).astype(np.int32 if at.max() - base < 2**31 else np.int64)
        if (rel == np.arange(len(rel))).all():
            rel = None                # a contiguous copy: positions base + index
        else:
            rel = patterns.setdefault(hashlib.sha1(rel.tobytes()).hexdigest(), rel)
        maps[name] = (*keys[int(who[0])], base, rel)
    return maps


def _holds_state(fn: Any) -> bool:
    """Whether a module's `cpu_linear` holds something made from its weight (a oneDNN handle, a
    packed copy: a closure, defaults, a bound object) rather than reading the weight it is called
    with (vLLM's `torch.nn.functional.linear` fallback, a plain lambda)."""
    import inspect
    if fn is None or inspect.isbuiltin(fn):
        return False
    if inspect.isfunction(fn):
        return bool(fn.__closure__ or fn.__defaults__ or fn.__kwdefaults__)
    return callable(fn)


def patch(model: Any, maps: dict, mirror: dict, names: set, touched: dict) -> int:
    """Writes what changed in `names` into the kernel tensors `maps` place them in: for each
    delta in order, its entries (`touched`: name -> [(flat indices, values: a `Tensor`)], from
    `delta.apply_delta`), or the whole tensor from the host copy `mirror` (`touched[name]` None
    or missing). Bits are written as they are (numpy over the kernel tensor's memory) where the
    dtypes agree, converted as the loader's copy converts otherwise. Returns the elements
    written."""
    import torch


    rounds = max([len(e) for n in names if (e := touched.get(n)) is not None] or [1])
    written, kernel = 0, {}
    for r in range(rounds):
        for name in sorted(names):
            mod, attr, base, rel = maps[name]
            entries = touched.get(name)
            if entries is None and r == 0:
                idx, val = None, mirror[name]
            elif entries is not None and r < len(entries):
                idx, val = entries[r]
            else:
                continue
            if (mod, attr) not in kernel:
                kernel[(mod, attr)] = _kernel_flat(model, mod, attr)
            dst, dst_bits = kernel[(mod, attr)]
            src = val.array.reshape(-1)
            pos = _positions(rel, idx, base, len(src))
            if bit_copy(val, dst):            # in numpy
                dst_bits[pos] = src.view(dst_bits.dtype)
            else:
                dst[torch.from_numpy(pos) if isinstance(pos, np.ndarray) else pos] = \
                    torch_tensor(val).reshape(-1).to(dst.dtype)
            written += len(src)
    return written


def bit_copy(t: Any, kernel: Any) -> bool:
    """Whether the kernel tensor holds a checkpoint `Tensor`'s elements with the same bits
    (same dtype: no conversion on load)."""
    return _TORCH.get(t.dtype) == str(kernel.dtype)


def refresh(model: Any, maps: dict, mirror: dict, names: set) -> None:
    """Copies the elements of `names` back from the kernel tensors into the host copy `mirror`
    (bit copies: `bit_copy` names only)."""
    for name in sorted(names):
        mod, attr, base, rel = maps[name]
        bits = _kernel_flat(model, mod, attr)[1]
        dst = mirror[name].array.reshape(-1)
        if not mirror[name].array.flags.writeable:
            mirror[name].array = mirror[name].array.copy()
            dst = mirror[name].array.reshape(-1)
        dst[...] = bits[_positions(rel, None, base, dst.size)].view(dst.dtype)


def _kernel_flat(model: Any, mod: str, attr: str) -> tuple:
    """The kernel tensor `mod.attr` flat, and a numpy array over its bits (bfloat16 as int16)."""
    import torch

    t = getattr(model.get_submodule(mod), attr).data.view(-1)
    return t, t.view({torch.bfloat16: torch.int16}.get(t.dtype, t.dtype)).numpy()


def _positions(rel: Any, idx: Any, base: int, n: int) -> Any:
    """Flat kernel positions of the elements `idx` (None: all n) of a tensor mapped at `base`
    by `rel` (None: contiguous): a slice where they are consecutive."""
    if rel is None:
        return slice(base, base + n) if idx is None else np.add(idx, base, dtype=np.int64)
    return np.add(rel if idx is None else rel[idx], base, dtype=np.int64)

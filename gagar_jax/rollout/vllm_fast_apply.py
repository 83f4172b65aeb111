"""The fast delta apply of the vLLM worker extension (`GagarWorkerExtension.gagar_apply_version`).

A delta apply (`gagar_apply_version` on a version after the held one) writes the changed
elements in place where the patch maps place them (`vllm_patch`, found by `patch_maps`) and
rebuilds only the other modules whose checkpoint tensors changed (`fast_apply`), not whole
layers through vLLM's reload. Once per engine, `plan_fast_apply` runs the model's own
`load_weights` on the meta device and traces the copies the loaders make (name -> module,
tensor, view: the q/k/v and gate/up fusions, the per-expert w13/w2 slots, the vocabulary
padding), and the host copy moves into that layout (`vllm_tiles.tile_mirror`: its tensors become
views into one flat array per fused kernel tensor, so the deltas' bit copies land there). A
rebuild hands those tiles to the modules (the copies the tiles do not cover are replayed into
pooled checkpoint-format buffers), runs each module's `process_weights_after_loading` (oneDNN /
sgl packing), copies into the kernel tensors and re-packs the fused experts, as vLLM's reload
does per layer. What the trace cannot follow goes to vLLM's reload (`reload_tensors`).
`gagar_weights_digest` hashes every tensor and packed linear's output: the fast apply equals a
full reload in it (tests/test_vllm.py).

Like the extension, it imports no JAX and vLLM only inside functions; the private torch and vLLM
APIs it needs are `vllm_internals`'.
"""
from __future__ import annotations

from typing import Any

from gagar_jax.rollout import vllm_internals as internals
from gagar_jax.rollout.vllm_plans import FastApplyPlan, PatchMaps
from gagar_jax.rollout.vllm_reload import (
    expert_modules,
    process_module,
    reload_group,
    reload_tensors,
    torch_tensor,
)
from gagar_jax.rollout.vllm_tiles import contiguous, retile


def _unload(modules: dict, lw: Any) -> dict:
    """Puts `modules` (name -> module) back in checkpoint format on the meta device, as vLLM's
    reload does; returns name -> (their kernel tensors, non-persistent buffer names)."""
    saved = {}
    for name, m in modules.items():
        saved[name] = (lw.kernel(m), set(internals.non_persistent_buffers(m)))
        lw.to_meta(m, lw.info(m))
        for t in lw.tensors(m).values():     # a reload by vLLM leaves its loader wrappers on
            loader = getattr(t, "weight_loader", None)
            while getattr(loader, "__name__", "") == "online_process_loader":
                loader = t.weight_loader = loader.__wrapped__
    return saved


def _place(m: Any, kernel: tuple, lw: Any, copy_back: set | None) -> None:
    """Registers a module's kernel tensors again; with `copy_back` (the names loaded), first
    copies the module's current (processed) tensors into them: every parameter, and the buffers
    but the non-persistent ones not loaded (vLLM's `_copy_and_restore_kernel_tensors`)."""
    (params, buffers), non_persistent = kernel
    if copy_back is not None:
        for name, p in params.items():
            p.data.copy_(getattr(m, name))
        for name, b in buffers.items():
            if internals.has_buffer(m, name) and (name not in non_persistent or name in copy_back):
                b.data.copy_(getattr(m, name))
    for name in lw.tensors(m):
        delattr(m, name)
    for name, p in params.items():
        m.register_parameter(name, p)
    for name, b in buffers.items():
        m.register_buffer(name, b, persistent=name not in non_persistent)


def _view(t: Any, base: Any) -> tuple:
    """(storage offset from `base`'s, size, stride) of `t`, a view of `base`'s storage."""
    return t.storage_offset() - base.storage_offset(), tuple(t.shape), tuple(t.stride())


def plan_fast_apply(model: Any, tensors: dict) -> FastApplyPlan:
    """The copies vLLM's loaders make for each checkpoint tensor, found once per engine by
    running the model's own `load_weights` over every tensor with every module in checkpoint
    format on the meta device (as vLLM's reload counts elements) and tracing every op on a
    module's tensors.

    Returns the `FastApplyPlan` (`dest`: name -> modules, `feeds`: module -> names, `program`:
    module -> [(attr, dst view, name, src view or fill value)], `slow`). `slow` modules are
    left to vLLM's reload: one written by anything but a copy of a view of the tensor being
    loaded or a fill (a loader that buffers or converts), or written in a kernel tensor vLLM
    does not restore
    (`bias`, `e_score_correction_bias`), or with checkpoint-format tensors not all loaded, an
    attention layer (processed after the others), a kernel tensor two modules share (tied
    weights), and every module fed by a name that also feeds one of those.
    """
    import torch

    lw = internals.layerwise()
    modules = dict(model.named_modules())
    shared, seen, real = set(), {}, {}
    for name, m in modules.items():
        for t in lw.tensors(m).values():
            if id(t) in seen:
                shared.update((name, seen[id(t)]))
            seen.setdefault(id(t), name)
            real[internals.storage_id(t)] = name
    saved = _unload(modules, lw)
    owner = {internals.storage_id(t): (name, attr, t) for name, m in modules.items()
             for attr, t in lw.tensors(m).items() if t.is_meta}
    real.update({internals.storage_id(t): name for name, m in modules.items()
                 for t in lw.tensors(m).values() if not t.is_meta})
    dest, program, slow, impure, cur, layout = {}, {}, set(shared), set(), [None, None], {}

    class Trace(internals.dispatch_mode()):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                               kwargs: dict | None = None) -> Any:
            out = (kwargs or {}).get("out")
            first = out if isinstance(out, torch.Tensor) else (
                args[0] if args and isinstance(args[0], torch.Tensor) else None)
            key = internals.storage_id(first) if first is not None else None
            hit = owner.get(key)
            if hit is not None:
                layout.setdefault(hit[0], {})[hit[1]] = (
                    tuple(hit[2].shape), tuple(hit[2].stride()), hit[2].dtype)
            if hit is not None and func is torch.ops.aten.copy_.default and cur[0] is not None \
                    and internals.storage_id(args[1]) == internals.storage_id(cur[1]):
                dest.setdefault(cur[0], set()).add(hit[0])
                program.setdefault(hit[0], []).append(
                    (hit[1], _view(first, hit[2]), cur[0], _view(args[1], cur[1])))
            elif hit is not None and func is torch.ops.aten.fill_.Scalar and cur[0] is not None:
                dest.setdefault(cur[0], set()).add(hit[0])     # padding rows (the vocab's)
                program.setdefault(hit[0], []).append(
                    (hit[1], _view(first, hit[2]), None, float(args[1])))
            elif (hit is not None or key in real) and (
                    internals.is_mutating(func) or out is not None):
                slow.add(hit[0] if hit is not None else real[key])
                impure.add(cur[0])
            return func(*args, **(kwargs or {}))

    def weights() -> Any:
        for name, t in tensors.items():
            cur[:] = name, torch_tensor(t)
            yield name, cur[1]
        cur[:] = None, None

    try:
        with Trace(), torch.no_grad():
            model.load_weights(weights())
    finally:
        for name, m in modules.items():
            _place(m, saved[name], lw, None)
    for name in impure:
        slow.update(dest.get(name, ()))
    for name, ops in program.items():
        m = modules[name]
        params, buffers = lw.info(m).restore_metadata
        need = {a for a in params if a not in lw.skip} | {
            a for a in buffers if a not in lw.skip and a not in internals.non_persistent_buffers(m)}
        if lw.deferred(m) or not need <= {op[0] for op in ops}:
            slow.add(name)
    feeds = {}
    for name, mods in dest.items():
        for m in mods:
            feeds.setdefault(m, set()).add(name)
    while True:      # a module fed by a name that also feeds a slow module is slow too
        more = {m for m, names in feeds.items() if m not in slow
                and any(dest[n] & slow for n in names)}
        if not more:
            break
        slow |= more
    return FastApplyPlan(dest={n: sorted(d) for n, d in dest.items()},
                         feeds={m: sorted(n) for m, n in feeds.items()}, program=program,
                         layout=layout, slow=sorted(slow))


def fast_apply(model_runner: Any, mirror: dict, changed: set, plan: FastApplyPlan,
               pool: dict | None = None, tiles: dict | None = None,
               patches: PatchMaps | None = None, touched: dict | None = None,
               stale: set | None = None) -> dict:
    """Brings the engine to the mirror (name -> Tensor, the new version) for the checkpoint
    tensors that `changed`. Those `patches` maps (`patch_maps`) are written element by element
    into the kernel tensors (`touched`: name -> the flat indices each delta wrote, or None for
    the whole tensor; `vllm_patch.patch`), and the modules that keep a oneDNN handle beside
    their weight re-processed in place. Every other module a changed tensor feeds (the plan's
    `dest`) is rebuilt: put back in checkpoint format (vLLM's restore metadata), loaded by the
    model's own `load_weights` copies with every tensor that feeds it, processed by its own
    `process_weights_after_loading` (oneDNN or sgl packing, the fused experts' layout), copied
    into its kernel tensors, its fused experts re-packed: what vLLM's reload does for a layer,
    without its element counting and without visiting the rest of the model. Changed names
    the plan cannot place (or slow modules) go to `reload_tensors` by `reload_group`. `tiles`
    (`vllm_tiles.tile_mirror`): checkpoint-format tensors the mirror's tensors are views of,
    handed to their modules as they are (no copy). `stale`: patched names whose host copy lags the
    engine (their sparse entries went to the engine only), brought up to date (and dropped
    from the set) before a reload reads them. Returns the modules rebuilt and patched, the
    tensors fed, the slow groups.
    """
    import torch

    from gagar_jax.rollout.vllm_patch import patch, refresh

    lw, pool, tiles = internals.layerwise(), {} if pool is None else pool, tiles or {}
    maps = patches.maps if patches is not None else {}
    retile(mirror, tiles, changed)
    model = model_runner.model
    dest, slow = plan.dest, set(plan.slow)
    is_fast = {n: bool(dest.get(n)) and not set(dest[n]) & slow for n in changed}
    patched = {n for n, ok in is_fast.items() if ok and n in maps}
    groups = {reload_group(n) for n, ok in is_fast.items() if not ok}
    out = {"slow_groups": sorted(groups), "tensors": 0, "repacked": 0, "copied": [], "tiled": 0}
    with torch.no_grad():       # first: the engine then holds every patched tensor's new bits
        out["patched_elements"] = patch(model, maps, mirror, patched, touched or {})
    if groups:
        lagging = {n for n in stale or () if reload_group(n) in groups}
        refresh(model, maps, mirror, lagging)
        if stale is not None:
            stale -= lagging
        tensors = {n: torch_tensor(t) for n, t in mirror.items() if reload_group(n) in groups}
        out.update(reload_tensors(model_runner, tensors, groups))
    rebuilt = {m for n, ok in is_fast.items() if ok and n not in patched for m in dest[n]}
    parts = [p for p in _components(plan) if rebuilt & set(p)]     # loaded together
    rebuilt = sorted(n for part in parts for n in part)
    experts = _experts(model) if parts else {}
    with torch.no_grad():
        for part in parts:
            out["tiled"] += _rebuild_part(model, part, mirror, plan, pool, lw, tiles, experts)
        out["repacked"] += sum(n in experts for n in rebuilt)
        reprocess = sorted({m for n in patched for m in patches.reprocess.get(n, ())})
        for name in reprocess:
            process_module(model.get_submodule(name))
    if parts or patched:
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if callable(getattr(model_runner, reset, None)):
                getattr(model_runner, reset)()
    fed = {n for m in rebuilt for n in plan.feeds[m]}
    return {**out, "rebuilt": rebuilt, "reloaded": out["tensors"] + len(fed),
            "patched": sorted({maps[n][0] for n in patched}), "patched_tensors": len(patched),
            "reprocessed": reprocess}


def patch_maps(model_runner: Any, mirror: dict, plan: FastApplyPlan, pool: dict,
               tiles: dict) -> PatchMaps:
    """The patch maps of every group of fast modules that qualifies (`vllm_patch.probe_part`),
    found once per engine after a full load; each probed group is rebuilt with the mirror's
    weights afterwards (the engine is left as it was). Returns the `PatchMaps`; equal patterns
    are held once (the experts of every layer share theirs)."""
    import torch

    from gagar_jax.rollout.vllm_patch import bit_copy, probe_part

    lw, model = internals.layerwise(), model_runner.model
    experts = _experts(model)
    sizes = {n: t.array.size for n, t in mirror.items()}
    out, patterns = PatchMaps(), {}
    with torch.no_grad():
        for part in _components(plan):
            modules = {n: model.get_submodule(n) for n in part}
            held = sum(t.numel() for m in modules.values() for t in lw.tensors(m).values())
            if held < sum(sizes[n] for m in part for n in plan.feeds.get(m, ())):
                continue       # a weight moved into a handle (oneDNN): no element to patch
            try:
                got = probe_part(model, part, plan, sizes, lambda fill, part=part: _rebuild_part(
                    model, part, mirror, plan, pool, lw, {}, experts, fill), lw, patterns)
            except Exception as e:  # a processing the probe cannot run: rebuilt
                got = None
                out.errors[part[0]] = repr(e)
            finally:
                _rebuild_part(model, part, mirror, plan, pool, lw, tiles, experts)
            if got is not None:
                out.maps.update(got.maps)
                out.bits |= {n for n, (mod, attr, _, _) in got.maps.items()
                             if bit_copy(mirror[n], getattr(modules[mod], attr))}
                out.reprocess.update(got.reprocess)
                out.parts.append(list(part))
    return out


def _experts(model: Any) -> dict:
    """name -> (module, its fused-experts kernel) of every module with packed fused experts."""
    return {name: (mod, fused) for name, mod, fused in expert_modules(model)}


def _rebuild_part(model: Any, part: tuple, mirror: dict, plan: FastApplyPlan, pool: dict,
                  lw: Any, tiles: dict, experts: dict, fill: Any = None) -> int:
    """`_rebuild` of one group, then the re-pack of its fused experts (vLLM's reload skips it on
    CPU). Returns the number of tiles handed over."""
    handed = _rebuild(model, {n: model.get_submodule(n) for n in part}, mirror, plan, pool, lw,
                      tiles, fill)
    for name in part:
        if name in experts:
            mod, fused = experts[name]
            fused.process_weights_after_loading(mod)
    return handed


def _components(plan: FastApplyPlan) -> list:
    """The fast modules in groups that must be loaded together (a tensor feeding several)."""
    slow, group = set(plan.slow), {}
    for mods in plan.dest.values():
        mods = [m for m in mods if m not in slow]
        merged = set(mods).union(*(group.get(m, ()) for m in mods))
        for m in merged:
            group[m] = merged
    return sorted({tuple(sorted(g)) for g in group.values()})


def _rebuild(model: Any, modules: dict, mirror: dict, plan: FastApplyPlan, pool: dict, lw: Any,
             tiles: dict, fill: Any = None) -> int:
    """One group of `fast_apply`: checkpoint format in the mirror's tiles (`tile_mirror`: the
    deltas already wrote there) or in buffers from `pool` (kept between modules and applies:
    fresh pages cost more than the copies) the loaders' copies are replayed into (`_replay`),
    processed, copied into the kernel tensors; the buffers go back to the pool when nothing
    else holds them. `fill(module name, module)` (the patch probes, `vllm_patch`): fills the
    buffers itself instead (no tiles) and returns the names it wrote. Returns the number of
    tiles handed over."""
    import torch

    saved = _unload(modules, lw)
    staged, loaded, handed = [], {}, 0
    try:
        for name, m in modules.items():
            for attr, t in lw.tensors(m).items():
                if t.is_meta and attr not in lw.skip:
                    key = (tuple(t.shape), tuple(t.stride()), t.dtype)
                    tile = tiles.get((name, attr)) if fill is None else None
                    if tile is not None:
                        x = torch.from_numpy(tile[0]).view(t.dtype)
                        y = torch.empty(0, dtype=t.dtype).set_(x.untyped_storage(), 0, *key[:2])
                        y.__class__, y.__dict__ = t.__class__, t.__dict__.copy()
                        setattr(m, attr, y)
                        handed += 1
                        continue
                    free = pool.get(key)
                    x = free.pop() if free else torch.empty_strided(*key[:2], dtype=t.dtype)
                    staged.append((key, x))
                    y = torch.empty(0, dtype=t.dtype).set_(x.untyped_storage(), 0, *key[:2])
                    y.__class__, y.__dict__ = t.__class__, t.__dict__.copy()
                    setattr(m, attr, y)
            loaded[name] = fill(name, m) if fill is not None else _replay(
                m, plan.program[name], mirror, {a for mod, a in tiles if mod == name})
        for name, m in modules.items():
            process_module(m)
            _place(m, saved.pop(name), lw, loaded[name])
    finally:
        for name, kernel in saved.items():    # only after a failure: the old weights back
            _place(modules[name], kernel, lw, None)
    alone = internals.storage_use_count(torch.empty(1))
    for key, x in staged:
        if internals.storage_use_count(x) == alone:
            pool.setdefault(key, []).append(x)
    return handed


def _replay(m: Any, program: list, mirror: dict, tiled: set = frozenset()) -> set:
    """Makes the copies the plan traced for module `m`, from the mirror's tensors, in order;
    the copies into one tensor that tile it in order, contiguous and of its dtype (a fused
    qkv, an experts' w13 or w2: one per expert and shard) as one `torch.cat`; none into the
    tensors in `tiled` (the mirror's tiles: the copies are made). Returns the names of `m`'s
    tensors written."""
    import torch

    by_attr = {}
    for op in program:
        by_attr.setdefault(op[0], []).append(op)
    src = {n: torch_tensor(mirror[n]) for attr, ops in by_attr.items() if attr not in tiled
           for n in {op[2] for op in ops} if n is not None}
    for attr, ops in by_attr.items():
        if attr in tiled:
            continue
        dst = getattr(m, attr)
        parts = [src[n].as_strided(v[1], v[2], v[0] + src[n].storage_offset())
                 if n is not None else v for _, _, n, v in ops]
        tiles, end = sorted(range(len(ops)), key=lambda i: ops[i][1][0]), 0
        for i in tiles:     # disjoint and covering: the copies' order does not matter
            (do, ds, dt), p = ops[i][1], parts[i]
            ok = ops[i][2] is not None and do == end and dt == contiguous(ds) and \
                p.is_contiguous() and p.dtype == dst.dtype
            end = do + p.numel() if ok and end >= 0 else -1
        if dst.is_contiguous() and end == dst.numel() and len(ops) > 1:
            torch.cat([parts[i].reshape(-1) for i in tiles], out=dst.view(-1))
            continue
        for (_, (do, ds, dt), n, _), p in zip(ops, parts, strict=True):
            view = dst.as_strided(ds, dt, do + dst.storage_offset())
            view.copy_(p) if n is not None else view.fill_(p)
    return set(by_attr)


def weights_digest(model: Any) -> dict:
    """name -> sha1 of every parameter and buffer (bytes, shape, dtype), and `<module>:out` of
    every module with a `cpu_linear` (its packed weight, opaque: oneDNN handles) applied to a
    fixed input."""
    import hashlib

    import torch

    def sha(t: Any) -> str:
        t = t.detach().contiguous().cpu()
        h = hashlib.sha1(f"{tuple(t.shape)} {t.dtype}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return h.hexdigest()

    out = {n: sha(p) for n, p in model.named_parameters()}
    out.update({n: sha(b) for n, b in model.named_buffers()})
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, m in model.named_modules():
            fn, w = getattr(m, "cpu_linear", None), getattr(m, "weight", None)
            shape = internals.layerwise_info(m).restore_metadata[0].get("weight", w)
            if fn is None or w is None or shape is None:
                continue
            x = torch.randn(5, shape.shape[-1], generator=gen).to(w.dtype)
            out[f"{name}:out"] = sha(fn(x, w, getattr(m, "bias", None)))
    return out

"""Sharded streaming load of a Hugging Face checkpoint: each process reads only its shards' bytes.

For every parameter leaf, `load_state` asks the leaf's sharding which index boxes this process's
devices hold (`addressable_devices_indices_map`), maps each box through the family's transform
(`hf_families`) to a box of the checkpoint tensor(s), reads just those bytes
(`safetensors.Checkpoint.read_box`), dequantizes block-FP8 boxes (only the scale blocks the box
touches), and assembles the global array with `jax.make_array_from_callback`. No process builds
a full-model host array, and nothing is `device_put` into a global sharding, so no collective runs.

Host memory: at any time a process holds the boxes of ONE leaf that its devices need (plus, with
fp8 or a dtype change, one float32 copy of a box): peak <= (its shards' bytes on device) +
(largest leaf's local-shard bytes in float32) x 2. docs/checkpoints.md states the bound.

Transforms as views: each checkpoint tensor is reshaped (C-order, free) to a "view" whose axes are
a permutation of ours, optionally with a fixed index (the gate / up halves of a fused
gate_up_proj). A box of our leaf is thus a box of the view, and a box of the view is (for whole
heads) a box of the stored tensor; for a partial head dimension the bounding box is read.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import Optional

import jax
import numpy as np
from etils import epath
from flax import nnx

from gagar_jax import sharding
from gagar_jax.hf import families as hf_families
from gagar_jax.hf.safetensors import FP8, Checkpoint, dequantize_block_fp8
from gagar_jax.model.transformer import ModelConfig, layer_stacks

SCALE_SUFFIX = "_scale_inv"
READ_THREADS = 8   # concurrent box reads of one leaf (object stores: latency-bound GETs)


@dataclasses.dataclass(frozen=True)
class View:
    """Our array = stored.reshape(shape)[fixed].transpose(axes): `axes[j]` is the view axis of our
    dim j; `groups[k]` the view axes that make up stored dim k; `fixed` {view axis: index}."""
    shape: tuple
    groups: tuple
    axes: tuple
    fixed: tuple = ()


def view_of(transform: str, stored: tuple, ours: tuple) -> View:
    """The view that turns a stored tensor of shape `stored` into our array of shape `ours`."""
    n = len(stored)
    if transform == "copy":
        v = View(stored, tuple((d,) for d in range(n)), tuple(range(n)))
    elif transform in ("linear", "per_expert"):
        v = View(stored, ((0,), (1,)), (1, 0))
    elif transform == "heads_out":    # [H*Dh, D] -> [D, H, Dh]
        v = View((ours[1], ours[2], stored[1]), ((0, 1), (2,)), (2, 0, 1))
    elif transform == "heads_in":     # [D, H*Dv] -> [H, Dv, D]
        v = View((stored[0], ours[0], ours[1]), ((0,), (1, 2)), (1, 2, 0))
    elif transform in ("fused_gate", "fused_up"):   # [E, 2F, D] -> [E, D, F]
        v = View((stored[0], 2, stored[1] // 2, stored[2]), ((0,), (1, 2), (3,)), (0, 3, 2),
                 ((1, 0 if transform == "fused_gate" else 1),))
    elif transform == "fused_down":   # [E, D, F] -> [E, F, D]
        v = View(stored, ((0,), (1,), (2,)), (0, 2, 1))
    else:
        raise ValueError(f"unknown transform {transform!r}")
    ok = (
        len(stored) == len(v.groups)
        and all(
            int(np.prod([v.shape[a] for a in g])) == s
            for g, s in zip(v.groups, stored, strict=False)
        )
        and tuple(v.shape[a] for a in v.axes) == tuple(ours)
    )
    if not ok:
        raise ValueError(f"checkpoint shape {tuple(stored)} cannot become {tuple(ours)} "
                         f"by {transform}")
    return v


def stack_paths(cfg: ModelConfig) -> list:
    """(parameter path prefix, layer indices) of every block stack of the model."""
    return [(prefix, layers) for spec in layer_stacks(cfg) for prefix, _, layers in spec.paths()]


def split_leaf(name: str, prefixes: list) -> tuple:
    """'moe_layers_1/p0/attn/wq' -> (stack prefix, its layer indices, 'attn/wq'); top-level
    parameters give (None, None, name)."""
    for prefix, layers in sorted(prefixes, key=lambda p: -len(p[0])):
        if name.startswith(prefix + "/"):
            return prefix, layers, name[len(prefix) + 1:]
    return None, None, name


def fp8_block(hf_cfg: dict) -> Optional[tuple]:
    """(rows, cols) of the block-FP8 scale blocks of a config.json, or None if not quantized."""
    q = hf_cfg.get("quantization_config") or {}
    if not q:
        return None
    if q.get("quant_method") != "fp8":
        raise ValueError(f"quantization_config.quant_method={q.get('quant_method')!r}; only 'fp8' "
                         "(block-scaled e4m3) is supported")
    block = tuple(q.get("weight_block_size") or (128, 128))
    if len(block) != 2:
        raise ValueError(f"quantization_config.weight_block_size must be [rows, cols], got {block}")
    return block


class Source:
    """A checkpoint's tensors as float32 boxes, FP8 weights dequantized block by block."""

    def __init__(self, path: epath.PathLike, block: Optional[tuple]):
        self.ckpt = Checkpoint(path)
        self.block = block
        scales = {n for n in self.ckpt.names if n.endswith(SCALE_SUFFIX)} if block else set()
        self.names = self.ckpt.names - scales

    def shape(self, name: str) -> tuple:
        return self.ckpt.shape(name)

    def read(self, name: str, box: Optional[Sequence[tuple]] = None) -> np.ndarray:
        """float32 (or the stored integer dtype) box of tensor `name`."""
        q = self.ckpt.read_box(name, box)
        if self.block is not None and name + SCALE_SUFFIX in self.ckpt.names:
            if q.ndim != 2:
                raise ValueError(f"{name}: block-FP8 weights must be 2-D, got {q.shape}")
            box = box or [(0, n) for n in q.shape]
            (bi, bj), ((r0, r1), (c0, c1)) = self.block, box
            sbox = [(r0 // bi, -(-r1 // bi)), (c0 // bj, -(-c1 // bj))]
            scale = self.ckpt.read_box(name + SCALE_SUFFIX, sbox)
            return dequantize_block_fp8(q, scale, self.block, origin=(r0, c0))
        if q.dtype == FP8:
            raise ValueError(f"{name} is float8 but the checkpoint has no fp8 quantization_config")
        return q.astype(np.float32) if q.dtype.kind == "f" else q

    def read_view(self, name: str, view: View, box: list) -> np.ndarray:
        """Our box (per our dim) of tensor `name` seen through `view`."""
        ours = [view.shape[a] for a in view.axes]
        if len(box) != len(ours) or any(
            not 0 <= a <= b <= n for (a, b), n in zip(box, ours, strict=False)
        ):
            raise ValueError(f"{name}: box {list(box)} does not fit shape {tuple(ours)}")
        vbox = [None] * len(view.shape)
        for j, a in enumerate(view.axes):
            vbox[a] = box[j]
        for a, i in view.fixed:
            vbox[a] = (i, i + 1)
        sbox, picks = [], []
        for g in view.groups:   # stored dim = C-order flattening of the view axes in g
            idx = np.zeros(1, np.int64)
            for a in g:
                idx = (idx[:, None] * view.shape[a] + np.arange(*vbox[a])[None, :]).reshape(-1)
            lo, hi = (int(idx.min()), int(idx.max()) + 1) if idx.size else (0, 0)
            sbox.append((lo, hi))
            picks.append(None if hi - lo == idx.size else idx - lo)
        arr = self.read(name, sbox)
        if any(p is not None for p in picks):   # partial heads: the bounding box was read
            arr = arr[np.ix_(*[np.arange(arr.shape[k]) if p is None else p
                               for k, p in enumerate(picks)])]
        arr = arr.reshape([b - a for a, b in vbox])
        if view.fixed:
            arr = arr[tuple(0 if any(a == f for f, _ in view.fixed) else slice(None)
                            for a in range(arr.ndim))]
        rest = [a for a in range(len(view.shape)) if all(a != f for f, _ in view.fixed)]
        return arr.transpose([rest.index(a) for a in view.axes])


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """Where one parameter leaf comes from: per stacked layer (or once for a top-level leaf)
    a (stored name or per-expert template, transform) pair; None entries are zero-filled."""
    name: str
    shape: tuple
    stacked: bool
    sources: tuple


def plan_leaf(src: Source, family: hf_families.Family, cfg: ModelConfig, name: str,
              shape: tuple) -> LeafPlan:
    """Resolves and shape-checks the checkpoint tensors of parameter `name` (reads headers only)."""
    prefix, layers, key = split_leaf(name, stack_paths(cfg))
    if prefix is None:
        spec = {s.ours: s for s in family.top}.get(key)
        if spec is None:
            raise KeyError(f"{family.model_type} has no tensor for parameter {name}")
        _check(src, name, spec.hf, spec.transform, shape, cfg)
        return LeafPlan(name, shape, False, ((spec.hf, spec.transform),))
    spec = {s.ours: s for s in family.layer}.get(key)
    if spec is None:
        if key in family.zero_if_absent:
            return LeafPlan(name, shape, True, (None,) * len(layers))
        raise KeyError(f"{family.model_type} has no tensor for parameter {name}")
    candidates = [(spec.hf, spec.transform)] + [(a, spec.transform) for a in spec.load_aliases]
    if spec.fused:
        candidates.append(spec.fused)
    out = []
    for i in layers:
        for template, transform in candidates:
            t = template.replace("{i}", str(i))
            if (t.format(e=0) if transform == "per_expert" else t) in src.names:
                _check(src, name, t, transform, shape[1:], cfg)
                out.append((t, transform))
                break
        else:
            raise KeyError(f"checkpoint has no tensor {spec.hf.replace('{i}', str(i))!r} "
                           f"(nor {[c[0].replace('{i}', str(i)) for c in candidates[1:]]})")
    return LeafPlan(name, shape, True, tuple(out))


def _check(src: Source, leaf: str, stored: str, transform: str, shape: tuple,
           cfg: ModelConfig) -> None:
    try:
        if transform == "per_expert":
            if shape[0] != cfg.num_experts:
                raise ValueError(f"{shape[0]} experts, config has {cfg.num_experts}")
            for e in range(cfg.num_experts):
                view_of(transform, src.shape(stored.format(e=e)), shape[1:])
        else:
            view_of(transform, src.shape(stored), shape)
    except (ValueError, KeyError) as err:
        raise ValueError(f"parameter {leaf} ({stored}): {err}") from None


def used_names(plan: LeafPlan, num_experts: int) -> set:
    out = set()
    for s in plan.sources:
        if s is not None:
            t, transform = s
            out |= ({t.format(e=e) for e in range(num_experts)} if transform == "per_expert"
                    else {t})
    return out


def read_leaf_box(src: Source, plan: LeafPlan, box: list) -> np.ndarray:
    """float32 box of a parameter leaf (stacked leaves: box[0] runs over the stack's layers)."""
    if not plan.stacked:
        t, transform = plan.sources[0]
        return src.read_view(t, view_of(transform, src.shape(t), plan.shape), box)
    out = np.empty([b - a for a, b in box], np.float32)
    for r in range(*box[0]):
        s = plan.sources[r]
        dst = out[r - box[0][0]]
        if s is None:
            dst[...] = 0.0
        elif s[1] == "per_expert":
            for e in range(*box[1]):
                name = s[0].format(e=e)
                dst[e - box[1][0]] = src.read_view(
                    name, view_of("per_expert", src.shape(name), plan.shape[2:]), box[2:])
        else:
            dst[...] = src.read_view(s[0], view_of(s[1], src.shape(s[0]), plan.shape[1:]), box[1:])
    return out


def _box(index: tuple, shape: tuple) -> tuple:
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape, strict=False))


def load_leaf(src: Source, plan: LeafPlan, dtype: np.dtype,
              where: jax.sharding.Sharding) -> jax.Array:
    """The leaf as a jax.Array with sharding `where`, reading only this process's boxes."""
    boxes = {}
    for index in where.addressable_devices_indices_map(plan.shape).values():
        boxes.setdefault(_box(index, plan.shape), None)
    with concurrent.futures.ThreadPoolExecutor(min(READ_THREADS, len(boxes))) as pool:
        arrays = dict(
            zip(
                boxes,
                pool.map(
                    lambda b: read_leaf_box(src, plan, list(b)).astype(dtype, copy=False), boxes
                ),
                strict=False,
            )
        )
    return jax.make_array_from_callback(plan.shape, where,
                                        lambda index: arrays[_box(index, plan.shape)])


def load_state(path: epath.PathLike, hf_cfg: dict, cfg: ModelConfig, abstract: nnx.State,
               shardings: Optional[nnx.State] = None) -> nnx.State:
    """The parameter state `abstract` (an nnx.State of ShapeDtypeStructs) filled from checkpoint
    `path`, each leaf placed with `shardings` (same tree; None = the default device).

    Raises:
      ValueError / KeyError: a missing, misshapen or unused checkpoint tensor (one line).
    """
    family = hf_families.FAMILIES[hf_cfg.get("model_type", "qwen3_moe")]
    src = Source(path, fp8_block(hf_cfg))
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    plans = [plan_leaf(src, family, cfg, sharding.leaf_path(kp), tuple(x.shape)) for kp, x in flat]
    used = set().union(*(used_names(p, cfg.num_experts) for p in plans))
    unused = sorted(n for n in src.names - used
                    if not any(n.startswith(p) for p in family.carried_prefixes))
    if unused:
        raise ValueError(f"checkpoint tensors not used by the model: {unused[:8]}"
                         + (f" and {len(unused) - 8} more" if len(unused) > 8 else ""))
    if shardings is None:
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        wheres = [one] * len(flat)
    else:
        wheres = jax.tree_util.tree_leaves(shardings)
    leaves = [
        load_leaf(src, p, x.dtype, w) for p, (_, x), w in zip(plans, flat, wheres, strict=False)
    ]
    return jax.tree_util.tree_unflatten(treedef, leaves)

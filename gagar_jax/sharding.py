"""The device mesh and the one table of logical-axis rules.

Every array dimension that may be sharded carries a *logical* name ("batch", "embed", "expert",
...). `LOGICAL_RULES` maps logical names to mesh axes; parameters (via `PARAM_AXES`) and
activations (via `constrain`) use the same names, so the whole sharding layout reads from the two
short tables below. Mesh axes:

  data    pure data parallelism (parameters replicated)
  fsdp    data parallelism with parameters sharded along their model width (ZeRO-3 style)
  expert  expert parallelism: expert weights split along E; tokens are also split over it, and
          the dense weights' model width too (ZeRO-3 over it, as over fsdp)
  context context (sequence) parallelism: every [B, S, ...] activation split along S, so a
          256k-token row spreads over `context` chips. Parameters are stored split over it like
          over fsdp (ZeRO-3: a chip keeps 1 / (fsdp * context) of the model width) and their
          gradients reduce over it as over the batch axes. Attention exchanges keys and values
          across it (`kernels/attention/context.py`); everything else is per token.
  tensor  tensor parallelism: heads, MLP width and vocabulary split

A mesh axis is dropped from a dimension it does not divide (e.g. 2 KV heads on tensor = 4), so
small test models run on any mesh; large configs divide evenly.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gagar_jax import mesh_layout

if TYPE_CHECKING:
    from gagar_jax.batch import Batch

PyTree = Any

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")
MESH_DEFAULTS = {"context": 1}   # axes a mesh config may leave out (configs from before the axis)

# logical name -> mesh axis, tuple of mesh axes, or None (replicated).
LOGICAL_RULES: dict[str, Any] = {
    "batch": ("data", "fsdp", "expert"),  # token rows: every non-model axis splits the batch
    "seq": "context",                     # the sequence of token rows (context parallelism)
    # Parameter model width, ZeRO-3 style. Dense (non-expert) weights are stored over every axis
    # the batch and the sequence split (a chip keeps 1 / (fsdp * expert * context) of them, as
    # MaxText does); expert weights, already split over `expert` along E, over fsdp x context.
    "embed": ("fsdp", "expert", "context"),
    "expert_embed": ("fsdp", "context"),
    # The residual stream's width between blocks: what `remat` saves per layer is split over
    # `tensor` (each block gathers its input whole; its partial sums reduce-scatter back).
    "resid": "tensor",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "expert": "expert",
    "layers": None,                       # the scanned layer axis of stacked parameters
}

# parameter leaf name -> logical axes of its (unstacked) dimensions.
PARAM_AXES: dict[str, tuple] = {
    "embedding": ("vocab", "embed"),          # [V, D]
    "lm_head": ("embed", "vocab"),            # [D, V]
    "scale": (None,),                         # RMSNorm scales [D] / [Dh]
    "wq": ("embed", "heads", None),           # [D, H, Dh]
    "wk": ("embed", "kv_heads", None),        # [D, Kv, Dh]
    "wv": ("embed", "kv_heads", None),
    "wo": ("heads", None, "embed"),           # [H, Dh, D]
    "sinks": ("heads",),                      # [H] attention-sink logits (sliding layers)
    "router": ("embed", None),                # [D, E], small: replicated over experts
    "router_bias": (None,),                   # [E]
    "expert_gate": ("expert", "expert_embed", "mlp"),  # [E, D, F]
    "expert_up": ("expert", "expert_embed", "mlp"),
    "expert_down": ("expert", "mlp", "expert_embed"),  # [E, F, D]
    "mlp_gate": ("embed", "mlp"),             # [D, I]
    "mlp_up": ("embed", "mlp"),
    "mlp_down": ("mlp", "embed"),             # [I, D]
}
STACKED_CONTAINERS = ("dense_layers", "moe_layers")  # their leaves get a leading "layers" axis

# `Batch` field -> logical axes: token arrays split along B and S; per-trajectory / per-group
# arrays are small and replicated. A field missing here is an error (`batch_shardings`).
BATCH_AXES: dict[str, tuple] = {
    "tokens_BxS": ("batch", "seq"),
    "segment_ids_BxS": ("batch", "seq"),
    "positions_BxS": ("batch", "seq"),
    "traj_index_BxS": ("batch", "seq"),
    "loss_mask_BxS": ("batch", "seq"),
    "old_logprobs_BxS": ("batch", "seq"),
    "routed_experts_BxSxLxK": ("batch", "seq", None, None),
    "group_ids_T": (None,),
    "rewards_T": (None,),
    "valid_T": (None,),
    "hacked_T": (None,),
    "factors_T": (None,),
    "adjustments_T": (None,),
    "grading_ok_G": (None,),
}


def make_mesh(mesh_cfg: Any, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """Builds the ('data', 'fsdp', 'expert', 'context', 'tensor') mesh.

    The axis sizes come from the config; which device sits where from the machine
    (`mesh_layout.device_grid`): on a TPU slice the axes follow the torus (ring neighbours are
    torus neighbours, the expert axis first), across TPU slices or GPU hosts the `dcn_*` sizes
    (or, without them, the lightest axes) span the slow network, and CPU devices keep their
    order (reshaped, as always).

    Args:
      mesh_cfg: anything with integer attributes data, fsdp, expert, context, tensor (context may
        be missing: 1); at most one may be -1 (= all remaining devices). Optional `dcn_<axis>`:
        how many slices (TPU) or hosts (GPU) the axis spans (default 1; all 1 = automatic).
      devices: devices to use (default: all of `jax.devices()`).
    Returns:
      A `Mesh` whose axis sizes multiply to the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = [int(getattr(mesh_cfg, a)) if a not in MESH_DEFAULTS or hasattr(mesh_cfg, a)
             else MESH_DEFAULTS[a] for a in MESH_AXES]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(
            f"mesh sizes {dict(zip(MESH_AXES, sizes, strict=False))}: positive, at most one -1"
        )
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(
                f"mesh {dict(zip(MESH_AXES, sizes, strict=False))} "
                f"cannot fill {len(devices)} devices"
            )
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes, strict=False))} needs {np.prod(sizes)} devices, "
            f"have {len(devices)}"
        )
    dcn = [int(getattr(mesh_cfg, f"dcn_{a}", 1) or 1) for a in MESH_AXES]
    grid = mesh_layout.device_grid(sizes, MESH_AXES, devices, dcn,
                                   valid=lambda g: hosts_hold_blocks(g, MESH_AXES))
    return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def hosts_hold_blocks(grid: np.ndarray, names: Sequence[str]) -> bool:
    """Whether every process's devices hold one contiguous box of the batch's [rows, sequence]
    shards (what `process_row_block` needs: a host builds one block of rows and columns)."""
    shape = dict(zip(names, grid.shape, strict=True))
    idx = np.indices(grid.shape)
    row = np.zeros(grid.shape, np.int64)
    for a in mesh_axes("batch"):               # rows: the batch axes, last fastest
        row = row * shape[a] + idx[names.index(a)]
    seq = np.zeros(grid.shape, np.int64)
    for a in mesh_axes("seq"):
        seq = seq * shape[a] + idx[names.index(a)]
    procs = np.vectorize(lambda d: int(getattr(d, "process_index", 0)), otypes=[np.int64])(grid)
    for p in np.unique(procs):
        r, s = row[procs == p], seq[procs == p]
        box = (r.max() - r.min() + 1) * (s.max() - s.min() + 1)
        if len({(a, b) for a, b in zip(r.tolist(), s.tolist(), strict=True)}) != box:
            return False
    return True


def mesh_axes(name: Optional[str], mesh: Optional[Mesh | AbstractMesh] = None) -> tuple:
    """The mesh axes of logical axis `name` (in rule order); with `mesh`, those it has.

    Divisibility is the caller's business: `logical_to_spec` drops a non-dividing axis from a
    parameter dimension, expert parallelism raises (`kernels/experts/ep.py`).
    """
    if name is None:
        return ()
    if name not in LOGICAL_RULES:
        raise KeyError(f"unknown logical axis {name!r}; known: {sorted(LOGICAL_RULES)}")
    rule = LOGICAL_RULES[name]
    axes = () if rule is None else ((rule,) if isinstance(rule, str) else tuple(rule))
    return axes if mesh is None else tuple(a for a in axes if a in mesh.axis_names)


def device_platform(mesh: Optional[Mesh | AbstractMesh] = None) -> str:
    """"cpu", "gpu" or "tpu": the platform of the mesh's devices, else of the default backend.

    Args:
      mesh: a concrete `Mesh` or an `AbstractMesh`; default the ambient mesh (under `jax.jit`
        too: an abstract mesh remembers its devices' platform). An ahead-of-time compile for TPU
        on a CPU host thus answers "tpu". Without a mesh: `jax.default_backend()`.
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    platform = None
    if mesh is not None and not mesh.empty:
        if isinstance(mesh, Mesh):
            platform = mesh.devices.flat[0].platform
        else:
            device = getattr(mesh, "abstract_device", None)
            platform = None if device is None else device.platform
    platform = platform or jax.default_backend()
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)


def logical_to_spec(axes: Sequence, shape: Optional[Sequence[int]] = None,
                    mesh: Optional[Mesh | AbstractMesh] = None) -> P:
    """PartitionSpec for logical `axes`; with `shape` and `mesh`, drops non-dividing mesh axes."""
    spec = []
    for i, name in enumerate(axes):
        axes_i = mesh_axes(name, mesh)
        if mesh is not None:  # an optional axis of size 1 stays out: specs read as without it
            axes_i = tuple(a for a in axes_i if a not in MESH_DEFAULTS or mesh.shape[a] > 1)
        if shape is not None and mesh is not None:
            kept, size = [], 1
            for a in axes_i:
                if shape[i] % (size * mesh.shape[a]) == 0:
                    kept.append(a)
                    size *= mesh.shape[a]
            axes_i = tuple(kept)
        spec.append(None if not axes_i else (axes_i[0] if len(axes_i) == 1 else axes_i))
    return P(*spec)


def named_sharding(
    mesh: Mesh, axes: Sequence, shape: Optional[Sequence[int]] = None
) -> NamedSharding:
    """NamedSharding on `mesh` for logical `axes`."""
    return NamedSharding(mesh, logical_to_spec(axes, shape, mesh))


def constrain(x: jax.Array, *axes) -> jax.Array:
    """Activation sharding constraint by logical names; a no-op outside a mesh context."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    if len(axes) != x.ndim:
        raise ValueError(f"constrain: {len(axes)} axes for an array of shape {x.shape}")
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, x.shape, mesh))


def leaf_path(key_path: Sequence) -> str:
    """A key path as a "/"-joined name, e.g. moe_layers/mlp/expert_gate (nnx's "value" dropped)."""
    name = jax.tree_util.keystr(tuple(key_path), simple=True, separator="/")
    return name[: -len("/value")] if name.endswith("/value") else name


def param_logical_axes(path: Sequence[str], ndim: int) -> tuple:
    """Logical axes of a parameter from its path (leaf name; stacked containers add "layers")."""
    names = [n for n in path if n != "value"]
    leaf = names[-1]
    if leaf not in PARAM_AXES:
        raise KeyError(f"no logical axes for parameter {'/'.join(names)}; add it to PARAM_AXES")
    axes = PARAM_AXES[leaf]
    if any(n.startswith(c) for n in names for c in STACKED_CONTAINERS):  # also "moe_layers_1"
        axes = ("layers",) + axes
    if len(axes) != ndim:
        raise ValueError(f"parameter {'/'.join(names)} has {ndim} dims, axes {axes}")
    return axes


def state_specs(state: PyTree, mesh: Optional[Mesh] = None) -> PyTree:
    """PartitionSpecs (same tree as `state`) for an `nnx.State` of the model."""
    def spec(path: tuple, x: jax.Array | jax.ShapeDtypeStruct):
        axes = param_logical_axes(leaf_path(path).split("/"), len(x.shape))
        return logical_to_spec(axes, x.shape, mesh)
    return jax.tree_util.tree_map_with_path(spec, state)


def state_shardings(state: PyTree, mesh: Mesh) -> PyTree:
    """NamedShardings (same tree as `state`) for an `nnx.State` of the model."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs(state, mesh))


def axis_size(name: str, mesh: Optional[Mesh | AbstractMesh] = None) -> int:
    """How many shards logical axis `name` has on `mesh` (default: the ambient mesh; 1 without)."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh is None or mesh.empty:
        return 1
    return int(np.prod([mesh.shape[a] for a in mesh_axes(name, mesh)]))


def batch_shardings(batch: Batch, mesh: Mesh) -> Batch:
    """NamedShardings (same tree as `batch`) for a `Batch` (or a `BucketedBatch`: each bucket
    alike), by the `BATCH_AXES` table.

    Raises a clear error when the rows S do not divide by the context axis: a sequence-sharded
    row must not silently fall back to whole rows per chip.
    """
    n_ctx = axis_size("seq", mesh)

    def one(path: tuple, x: jax.Array | jax.ShapeDtypeStruct | np.ndarray):
        name = leaf_path(path).split("/")[-1]     # a `BucketedBatch`: buckets/k/<field>
        if name not in BATCH_AXES:
            raise KeyError(f"batch field {name!r} has no entry in sharding.BATCH_AXES")
        axes = BATCH_AXES[name]
        if len(axes) != len(x.shape):
            raise ValueError(f"batch field {name} has {len(x.shape)} dims, axes {axes}")
        if "seq" in axes and x.shape[axes.index("seq")] % n_ctx:
            raise ValueError(f"batch field {name}: sequence length {x.shape[axes.index('seq')]} "
                             f"is not divisible by the context axis ({n_ctx})")
        return named_sharding(mesh, axes, x.shape)
    return jax.tree_util.tree_map_with_path(one, batch)


def process_row_block(mesh: Mesh, num_rows: int, seq_len: int, process_index: Optional[int] = None,
                      process_of: Callable[[jax.Device], int] = lambda d: d.process_index
                      ) -> tuple[slice, slice]:
    """The rows and the sequence range of the [B, S] token arrays this process's devices hold.

    A host builds these rows (and, with the context axis spanning hosts, several hosts build
    the same rows: each device then takes its own S range of them,
    `jax.make_array_from_process_local_data`). Replaces an even split of rows over processes,
    which is wrong once a row spans hosts.

    Args:
      mesh: the training mesh.
      num_rows, seq_len: B and S of the global batch.
      process_index: default `jax.process_index()`.
      process_of: device -> process index (tests fake several hosts with it).
    Returns:
      (rows, seq) slices; raises if the process's block is not one contiguous box.
    """
    process_index = jax.process_index() if process_index is None else process_index
    shape = (num_rows, seq_len)
    sh = named_sharding(mesh, BATCH_AXES["tokens_BxS"], shape)
    boxes = [
        idx for d, idx in sh.devices_indices_map(shape).items() if process_of(d) == process_index
    ]
    if not boxes:
        raise ValueError(f"process {process_index} holds no device of the mesh")
    out = []
    for dim, size in enumerate(shape):
        spans = {
            (s.start or 0, size if s.stop is None else s.stop) for s in (b[dim] for b in boxes)
        }
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        if sum(b - a for a, b in spans) < hi - lo:
            raise ValueError(f"process {process_index}'s devices hold a non-contiguous part of "
                             f"dimension {dim} of the batch {shape}; reorder the mesh devices")
        out.append(slice(lo, hi))
    return out[0], out[1]

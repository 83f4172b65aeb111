"""The records the vLLM weight sync keeps per engine: the fast apply's plan, the patch maps, and
the worker's weight-sync state (`vllm_extension.GagarWorkerExtension` holds one). Plain
dataclasses: no JAX, no torch, no vLLM.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class FastApplyPlan:
    """The copies vLLM's loaders make for each checkpoint tensor (`plan_fast_apply`).

    Attributes:
      dest: checkpoint name -> the modules its copies write (sorted).
      feeds: module -> the checkpoint names that feed it (sorted).
      program: module -> [(attr, dst view, name or None, src view or fill value)] in load
        order; a view is (storage offset, shape, stride).
      layout: module -> attr -> (shape, stride, torch dtype) of its checkpoint-format tensors.
      slow: modules left to vLLM's reload (sorted).
      names: the checkpoint names the plan was traced for (sorted).
      error: why tracing failed (then the plan is empty: everything goes to vLLM's reload).
    """
    dest: dict = dataclasses.field(default_factory=dict)
    feeds: dict = dataclasses.field(default_factory=dict)
    program: dict = dataclasses.field(default_factory=dict)
    layout: dict = dataclasses.field(default_factory=dict)
    slow: list = dataclasses.field(default_factory=list)
    names: list = dataclasses.field(default_factory=list)
    error: str | None = None


@dataclasses.dataclass
class PatchMaps:
    """Where checkpoint elements live in the kernel tensors (`vllm_patch`).

    Attributes:
      maps: name -> (module, attr, base, pattern or None: contiguous): `base + pattern` are the
        flat positions of the tensor's elements in the kernel tensor `module.attr`.
      reprocess: name -> the modules to re-process in place after patching it.
      parts: the groups of modules patched.
      bits: names whose kernel tensor holds their bits as they are (same dtype).
      errors: first module of a group -> why its probe raised (the group is rebuilt instead).
    """
    maps: dict = dataclasses.field(default_factory=dict)
    reprocess: dict = dataclasses.field(default_factory=dict)
    parts: list = dataclasses.field(default_factory=list)
    bits: set = dataclasses.field(default_factory=set)
    errors: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class WeightSyncState:
    """What one vLLM worker keeps between weight updates.

    Attributes:
      loaded: the directory the last reload or apply read ("" before any).
      mirror: the host copy of the checkpoint tensors (name -> `delta.Tensor`) of the version
        `mirror_path`, in the publish dtype; deltas are applied to it.
      mirror_path: the version the host copy holds ("" before any apply).
      stale: patched names whose host copy lags the engine (their sparse entries went to the
        engine only); brought up to date from the engine before anything else reads them.
      plan: the fast apply's plan, traced once per engine (None before the first apply).
      patches: the patch maps, probed once per plan after a full load.
      patches_plan: the plan `patches` were probed with.
      tiles: (module, attr) -> the host copy's loader-layout tiles (`vllm_tiles.tile_mirror`).
      pool: checkpoint-format buffers kept between rebuilds, by (shape, stride, dtype).
    """
    loaded: str = ""
    mirror: dict | None = None
    mirror_path: str = ""
    stale: set = dataclasses.field(default_factory=set)
    plan: FastApplyPlan | None = None
    patches: PatchMaps | None = None
    patches_plan: FastApplyPlan | None = None
    tiles: dict = dataclasses.field(default_factory=dict)
    pool: dict = dataclasses.field(default_factory=dict)

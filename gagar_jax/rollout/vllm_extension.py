"""vLLM worker extension: in-place policy reload from `<workdir>/published/latest`, routing capture.

    llm = LLM(model=first_published_dir, worker_extension_cls=
              "gagar_jax.rollout.vllm_extension.GagarWorkerExtension", ...)
    info = reload_latest(llm, workdir)          # every worker reloads, then the prefix cache resets
    llm.collective_rpc("gagar_capture_routes", args=(True,))
    ... llm.generate(...) ...
    routes = llm.collective_rpc("gagar_pop_routes")[0]
    info = apply_latest(llm, workdir)   # the same for delta publishes: applies only new deltas

The module imports neither JAX nor any gagar_jax module that does, and vLLM only inside methods
(the learner's venv has no vLLM). Tested by hand on vLLM 0.32 (CPU build): after a reload the
engine equals a fresh load of the same directory bit for bit (docs/rollout.md).

What the reload fixes beside vLLM's own `reload_weights` (both found on vLLM 0.32 CPU):
  - fused experts are re-packed (`process_weights_after_loading` of each experts module's
    kernel): the layerwise reload skips the CPU prepack on a weight update;
  - every checkpoint tensor that is a model parameter under the same name and shape and still
    differs after the reload is copied in place (MiMo's `attention_sink_bias`, which mimo_v2's
    loader writes past the reload machinery).
The caller must then reset the prefix cache (`reset_prefix_cache`; `reload_latest` does): KV
cached under the old weights would otherwise be reused.

A delta apply rebuilds only the modules whose tensors changed: `vllm_fast_apply`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from gagar_jax.rollout.delta import weight_files
from gagar_jax.rollout.pointer import read_latest
from gagar_jax.rollout.vllm_plans import FastApplyPlan, WeightSyncState
from gagar_jax.rollout.vllm_reload import reload_group, reload_tensors, torch_tensor


def _routers(model: Any) -> list:
    """(name, router) of every experts runner whose router takes a capture hook (MoERunner)."""
    return [(name, mod.router) for name, mod in model.named_modules()
            if hasattr(getattr(mod, "router", None), "set_capture_fn")]


class GagarWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); call with `llm.collective_rpc(name)`.

    Method names start with `gagar_` so they cannot clash with the worker's own; its state is
    two attributes: `_gagar_sync` (a `WeightSyncState`) and `_gagar_routes` (the captured
    routes since the last pop).
    """

    def gagar_reload_latest(self, workdir: str) -> dict:
        """Reloads the weights `<workdir>/published/latest` names; the pointer plus counts."""
        ptr = read_latest(workdir)
        if ptr is None:
            raise FileNotFoundError(f"nothing published under {workdir}")
        return {**ptr, **self.gagar_reload_from(ptr["path"])}

    def gagar_reload_from(self, path: str) -> dict:
        """Reloads a published directory in place (same architecture as the loaded one)."""
        from safetensors.torch import load_file

        tensors = {}
        for f in weight_files(path):
            tensors.update(load_file(f))
        out = reload_tensors(self.model_runner, tensors, groups=None)
        self._gagar_state().loaded = path
        return out

    def _gagar_state(self) -> WeightSyncState:
        """This worker's weight-sync state (made on first use: vLLM builds the worker, not us)."""
        state = getattr(self, "_gagar_sync", None)
        if state is None:
            state = self._gagar_sync = WeightSyncState()
        return state

    def gagar_apply_version(self, path: str, fast: bool = True) -> dict:
        """Brings the weights to version `path`, full or delta (`gagar_jax.rollout.delta`).

        When the engine holds a version of `path`'s chain (loaded by an earlier apply), only the
        deltas after it are applied to the host copy of the checkpoint tensors this worker keeps
        (the publish dtype, the whole model), and only the modules whose tensors changed are
        rebuilt (`fast_apply`; `fast` False: vLLM's reload of the layers they touch instead);
        otherwise the chain is materialized and every layer reloaded. Afterwards the engine
        holds exactly the weights a full publish of that step would give it. Returns counts and
        seconds (read: files and the bit copies; reload: the patch and rebuild, or vLLM's
        reload; probe: the patch maps, found once per engine with the first full load).
        """
        import time

        from gagar_jax.rollout import delta
        from gagar_jax.rollout.vllm_fast_apply import fast_apply, patch_maps
        from gagar_jax.rollout.vllm_tiles import tile_mirror

        t0 = time.perf_counter()
        st = self._gagar_state()
        todo, touched = None, {}
        if st.mirror is not None and st.loaded == st.mirror_path:
            todo = delta.pending(st.mirror_path, path)
        if todo is None:
            st.mirror = delta.materialize(path)
            changed = set(st.mirror)
            st.stale = set()
        else:
            # the patched tensors' sparse entries go to the engine only: their host copy is
            # brought up to date from the engine when something else needs it (`stale`)
            patches = st.patches if fast else None
            defer = patches.bits if patches is not None else frozenset()
            self._gagar_refresh(st.stale - defer)
            changed = set()
            for d in todo:
                changed.update(delta.apply_delta(st.mirror, d, touched, defer))
            st.stale -= {n for n, e in touched.items() if e is None}
            st.stale |= {n for n, e in touched.items() if e is not None and n in defer}
        t1 = time.perf_counter()
        mirror = st.mirror
        if todo is not None and fast and changed:
            out = fast_apply(self.model_runner, mirror, changed, self._gagar_plan_for(mirror),
                             st.pool, st.tiles, st.patches, touched, st.stale)
        else:
            groups = {reload_group(n) for n in changed}
            tensors = {n: torch_tensor(t) for n, t in mirror.items() if reload_group(n) in groups}
            out = reload_tensors(self.model_runner, tensors, groups) if tensors else {}
            out["reloaded"] = len(tensors)
            if todo is None and fast:        # traced now, with the full load, once
                plan = self._gagar_plan_for(mirror)
                st.tiles = tile_mirror(mirror, plan)
                if st.patches_plan is not plan:
                    t2 = time.perf_counter()
                    st.patches = patch_maps(self.model_runner, mirror, plan, st.pool, st.tiles)
                    st.patches_plan = plan
                    out["probe_s"] = time.perf_counter() - t2
            elif todo is None:
                st.tiles = {}
        st.loaded = st.mirror_path = path
        return {**out, "deltas": len(todo) if todo is not None else None, "changed": len(changed),
                "read_s": t1 - t0, "reload_s": time.perf_counter() - t1}

    def _gagar_refresh(self, names: set) -> None:
        """Brings the host copy of `names` (patched tensors whose sparse entries went to the
        engine only) up to date from the engine's kernel tensors."""
        from gagar_jax.rollout.vllm_patch import refresh

        st = self._gagar_state()
        if names:          # before any delta is written into them
            refresh(self.model_runner.model, st.patches.maps, st.mirror, names)
            st.stale -= names

    def _gagar_plan_for(self, mirror: dict) -> FastApplyPlan:
        """The fast apply's plan (`plan_fast_apply`), traced once per engine; a model the
        trace fails on gets an empty plan (every change then goes to vLLM's reload)."""
        from gagar_jax.rollout.vllm_fast_apply import plan_fast_apply

        st = self._gagar_state()
        if st.plan is None or set(st.plan.names) != set(mirror):
            try:
                plan = plan_fast_apply(self.model_runner.model, mirror)
            except Exception as e:  # any loader the trace cannot follow
                plan = FastApplyPlan(error=repr(e))
            st.plan = dataclasses.replace(plan, names=sorted(mirror))
        return st.plan

    def gagar_weights_digest(self) -> dict:
        """name -> sha1 of every parameter and buffer of the model, and of every packed linear's
        output (`cpu_linear`, oneDNN handles included) on a fixed input: two engines with equal
        digests hold the same weights bit for bit."""
        from gagar_jax.rollout.vllm_fast_apply import weights_digest

        return weights_digest(self.model_runner.model)

    def gagar_loaded(self) -> str:
        """The directory the last gagar reload read ("" before any)."""
        return self._gagar_state().loaded

    def gagar_capture_routes(self, enable: bool = True) -> int:
        """Starts (or stops) recording the selected expert ids of every MoE layer.

        Returns the number of layers hooked.

        The hook is the router's `set_capture_fn`, the one vLLM's own routed-experts capture uses
        (which needs Model Runner V2, so not on CPU): it sees the selected logical expert ids,
        after scoring, bias and grouping: [tokens, top_k] per MoE layer per forward step.
        """
        self._gagar_routes = []
        routers = _routers(self.model_runner.model)
        for name, router in routers:
            def fn(ids: Any, name: str = name) -> None:
                self._gagar_routes.append((name, ids.detach().cpu().clone()))
            router.set_capture_fn(fn if enable else None)
        return len(routers)

    def gagar_pop_routes(self) -> list:
        """[(layer module name, [[expert id] * top_k] * tokens)] in call order since the last
        pop."""
        out = [(n, t.tolist()) for n, t in getattr(self, "_gagar_routes", [])]
        self._gagar_routes = []
        return out


def reload_latest(llm: Any, workdir: str) -> dict:
    """Engine side: every worker reloads `latest`, then the prefix cache is reset.

    Returns the first worker's answer (pointer, tensor count, repacked experts, copied names).
    """
    answers = llm.collective_rpc("gagar_reload_latest", args=(workdir,))
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset the prefix cache after a weight reload")
    return answers[0]


def apply_latest(llm: Any, workdir: str) -> dict:
    """Engine side: every worker brings its weights to the version `latest` names, full or delta
    (`gagar_apply_version`), then the prefix cache is reset. Returns the pointer and the first
    worker's answer."""
    ptr = read_latest(workdir)
    if ptr is None:
        raise FileNotFoundError(f"nothing published under {workdir}")
    answers = llm.collective_rpc("gagar_apply_version", args=(ptr["path"],))
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset the prefix cache after a weight update")
    return {**ptr, **answers[0]}

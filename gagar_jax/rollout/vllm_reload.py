"""vLLM's in-place reload with the fix-ups its CPU build needs (vLLM 0.32), shared by the worker
extension (`vllm_extension`) and its fast delta apply (`vllm_fast_apply`).

`reload_tensors` runs the model runner's `reload_weights` on checkpoint tensors, then re-packs the
fused experts (the layerwise reload skips the CPU prepack) and copies in place the parameters the
reload missed (MiMo's `attention_sink_bias`). Imports no JAX, and vLLM only inside functions.
"""
from __future__ import annotations

from typing import Any

from gagar_jax.rollout import vllm_internals as internals


def expert_modules(model: Any) -> list:
    """Modules holding packed fused experts (vLLM's RoutedExperts: w13_weight + a kernel)."""
    out = []
    for name, mod in model.named_modules():
        kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
        fused = getattr(kernel, "fused_experts", None)
        if hasattr(mod, "w13_weight") and hasattr(fused, "process_weights_after_loading"):
            out.append((name, mod, fused))
    return out


def process_module(m: Any) -> None:
    """Runs a module's `process_weights_after_loading` as vLLM's reload does after loading it
    (online-quantization flag reset first, TP status reconciled after): the oneDNN handle,
    sgl packing or fused-experts layout made from its current tensors."""
    internals.process_weights(m)


def reload_group(name: str) -> str:
    """The part of the model a checkpoint tensor is reloaded with: `model.layers.<i>.<block>`
    (vLLM fuses tensors only within one: q/k/v, gate/up, a layer's experts) or the tensor's own
    module (embedding, final norm, lm_head)."""
    parts = name.split(".")
    return ".".join(parts[:4] if parts[:2] == ["model", "layers"] else parts[:-1])


def torch_tensor(t: Any) -> Any:
    """A `gagar_jax.rollout.delta.Tensor` as a torch tensor sharing its memory."""
    import torch
    x = torch.from_numpy(t.array)
    views = {"BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn}
    return x.view(views[t.dtype]) if t.dtype in views else x


def reload_tensors(model_runner: Any, tensors: dict, groups: set | None) -> dict:
    """Reloads the checkpoint tensors `tensors` (whole `reload_group`s: a layer given none keeps
    its weights; `groups` None: the whole model) with vLLM's reload, then its CPU fix-ups for
    those groups: re-packs their fused experts (vLLM's reload does not), copies parameters the
    reload missed (MiMo's attention sinks)."""
    import torch

    model = model_runner.model
    model_runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
    repacked = []
    for name, mod, fused in expert_modules(model):
        if groups is None or ".".join(name.split(".")[:4]) in groups:   # model.layers.<i>.mlp
            fused.process_weights_after_loading(mod)
            repacked.append(name)
    params = dict(model.named_parameters())
    copied = []
    with torch.no_grad():
        for name, w in tensors.items():
            p = params.get(name)
            if p is None or tuple(p.shape) != tuple(w.shape):
                continue
            w = w.to(p.dtype)
            if not torch.equal(p.data, w):
                p.data.copy_(w)
                copied.append(name)
    return {"tensors": len(tensors), "repacked": len(repacked), "copied": copied}

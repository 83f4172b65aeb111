"""Every private torch and vLLM API the rollout side uses, in one place (vLLM 0.32, torch 2.13).

A vLLM or torch upgrade that moves one of these touches this file only: vLLM's layerwise-reload
helpers (internal modules), the online-quantization flag its reload resets, its parallel state's
teardown, its structured-outputs parameters; torch's storage ids and use counts,
`TorchDispatchMode` (a private module), a module's non-persistent buffer set and buffer table,
an op's schema. Everything else in `rollout/` calls public methods (`LLM.generate`,
`collective_rpc`, `reload_weights`, `process_weights_after_loading`, the router's
`set_capture_fn`).

Imports neither JAX nor, at import time, torch or vLLM.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

# set by vLLM's loader once a module is processed; its reload deletes it to process again
_PROCESSED_FLAG = "_already_called_process_weights_after_loading"


def layerwise() -> SimpleNamespace:
    """vLLM's layerwise-reload helpers the fast apply shares with vLLM's own reload:
    `info(module)` (restore metadata), `to_meta(module, info)` (checkpoint format on the meta
    device), `skip` (tensors it never restores), `tensors(module)` (params and buffers by
    name), `kernel(module)` (the kernel tensors, (params, buffers)), `deferred(module)` (an
    attention layer processed after the others)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload import meta, utils
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    return SimpleNamespace(info=get_layerwise_info, to_meta=meta.restore_layer_on_meta,
                           skip=meta.SKIP_TENSORS,
                           tensors=utils.get_layer_tensors, kernel=utils.get_layer_params_buffers,
                           deferred=is_deferred_attention_layer)


def layerwise_info(module: Any) -> Any:
    """vLLM's restore metadata of a module (`restore_metadata`: checkpoint-format shapes)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    return get_layerwise_info(module)


def process_weights(module: Any) -> None:
    """A module's `process_weights_after_loading` as vLLM's reload runs it: the processed flag
    removed first, the tensor-parallel status reconciled after."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    qm = getattr(module, "quant_method", None)
    if isinstance(qm, QuantizeMethodBase):
        if hasattr(module, _PROCESSED_FLAG):
            delattr(module, _PROCESSED_FLAG)
        qm.process_weights_after_loading(module)
        if hasattr(module, "update_param_tp_status"):
            module.update_param_tp_status()


def shutdown_vllm() -> None:
    """Tears down vLLM's model-parallel groups and distributed environment in this process, so
    that another engine can start in it (the in-process engine core leaves them up)."""
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )
    destroy_model_parallel()
    destroy_distributed_environment()


def storage_id(t: Any) -> int:
    """An id of a tensor's storage (equal for views of one storage)."""
    return t.untyped_storage()._cdata


def storage_use_count(t: Any) -> int:
    """How many references hold the storage of `t` (torch's own count)."""
    import torch
    return torch._C._storage_Use_Count(storage_id(t))


def non_persistent_buffers(module: Any) -> set:
    """The names of a module's buffers registered with `persistent=False`."""
    return module._non_persistent_buffers_set


def has_buffer(module: Any, name: str) -> bool:
    """Whether `name` is a buffer registered on the module itself."""
    return name in module._buffers


def is_mutating(func: Any) -> bool:
    """Whether an aten op (as a dispatch mode sees it) writes into one of its arguments."""
    return func._schema.is_mutable


def dispatch_mode() -> type:
    """torch's `TorchDispatchMode` (a base class that sees every aten op run under it)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    return TorchDispatchMode


def structured_outputs(schema: dict) -> Any:
    """vLLM's `StructuredOutputsParams` for a JSON schema (its `sampling_params` module: not
    exported at the package's top level in 0.32). Free whitespace is a setting of the engine,
    not of the request (`vllm_engine.NO_FREE_WHITESPACE`)."""
    from vllm.sampling_params import StructuredOutputsParams
    return StructuredOutputsParams(json=schema)

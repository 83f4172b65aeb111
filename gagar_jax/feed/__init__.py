"""The external rollout/grading feed: records in, packed `Batch`es out (docs/feed.md).

Data flow: sources (files, spool, iterator) -> schema (decode) -> validate (reasons,
dead-letter) -> batcher (staleness, dynamic sampling, packing) -> `gagar_jax.batch.Batch`;
the ledger accounts for every group received.

The names below are imported lazily (a module `__getattr__`), so `gagar_jax.feed.schema` (the
record format a rollout worker writes) imports without JAX, etils or grain.
"""
import importlib

_EXPORTS = {
    "BatchInfo": "batcher", "Feed": "batcher", "make_source": "batcher",
    "FeedConfig": "config", "Ledger": "ledger",
    "first_fit_decreasing": "packing", "local_row_slice": "packing",
    "make_global_batch": "packing",
    "SCHEMA_VERSION": "schema", "Group": "schema", "Trajectory": "schema",
    "FileSource": "sources", "IteratorSource": "sources", "SpoolSource": "spool",
    "Reason": "validate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):  # PEP 562 module attribute hook
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_EXPORTS))

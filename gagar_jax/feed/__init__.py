"""The external rollout/grading feed: records in, packed `Batch`es out (docs/feed.md).

Data flow: sources (files, spool, iterator) -> schema (decode) -> validate (reasons,
dead-letter) -> batcher (staleness, dynamic sampling, packing) -> `gagar_jax.batch.Batch`;
the ledger accounts for every group received.
"""
from gagar_jax.feed.batcher import BatchInfo, Feed, make_source
from gagar_jax.feed.config import FeedConfig
from gagar_jax.feed.ledger import Ledger
from gagar_jax.feed.packing import first_fit_decreasing, local_row_slice, make_global_batch
from gagar_jax.feed.schema import SCHEMA_VERSION, Group, Trajectory
from gagar_jax.feed.sources import FileSource, IteratorSource, SpoolSource
from gagar_jax.feed.validate import Reason

__all__ = [
    "BatchInfo", "Feed", "FeedConfig", "FileSource", "Group", "IteratorSource", "Ledger",
    "Reason", "SCHEMA_VERSION", "SpoolSource", "Trajectory", "first_fit_decreasing",
    "local_row_slice", "make_global_batch", "make_source",
]

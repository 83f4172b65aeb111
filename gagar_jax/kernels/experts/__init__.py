"""Expert FFN kernels: one shard (local), expert parallelism (ep), megablox (Pallas TPU), \
the shared dispatch plan."""

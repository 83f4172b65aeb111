"""Attention kernels: blockwise (flash-style, any platform), splash (Pallas TPU), \
the context-parallel wrapper."""

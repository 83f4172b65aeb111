"""Ahead-of-time compiles for pod topologies, FLOPs and HLO statistics."""

"""The decoder-only MoE transformer: layers, layer pattern, MoE layer, router, log-prob head."""

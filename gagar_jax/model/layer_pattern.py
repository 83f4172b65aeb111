"""Layer patterns: which decoder layers are scanned together (pure functions of the config).

A `LayerStack` is a run of layers of one MLP kind (dense or MoE) whose attention kinds (full or
sliding) repeat a pattern R times; the model keeps one parameter stack per pattern position with a
leading axis R and scans over R. `layer_stacks(cfg)` chooses, from the first unassigned layer on,
the pattern (period <= `MAX_PATTERN`) that saves the most unrolled layers, p * (R - 1).
"""
from __future__ import annotations

import dataclasses
from typing import Any

MAX_PATTERN = 16  # longest layer-kind period looked for


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """Layers `first ...` of one MLP kind: `pattern` (True = sliding) repeated `repeats` times.

    The attribute `name` of the Transformer holds one Block stack (pattern length 1) or a
    `PatternStack` with stacks `p0`, `p1`, ... (one per pattern position, leading axis repeats).
    """
    name: str
    moe: bool
    first: int
    pattern: tuple
    repeats: int

    def layers(self, k: int) -> list:
        """Model layer indices of pattern position k, in scan order."""
        return [self.first + r * len(self.pattern) + k for r in range(self.repeats)]

    def paths(self) -> list:
        """(parameter path prefix, sliding, layer indices) per pattern position."""
        if len(self.pattern) == 1:
            return [(self.name, self.pattern[0], self.layers(0))]
        return [(f"{self.name}/p{k}", sl, self.layers(k)) for k, sl in enumerate(self.pattern)]


def _best_run(kinds: list) -> tuple:
    """(pattern, repeats) at the start of `kinds` saving the most unrolled layers, p * (r - 1)."""
    best, best_saved = (tuple(kinds[:1]), 1), 0
    for p in range(1, min(len(kinds), MAX_PATTERN) + 1):
        pat, r = kinds[:p], 1
        while kinds[r * p:(r + 1) * p] == pat:
            r += 1
        if p * (r - 1) > best_saved:
            best, best_saved = (tuple(pat), r), p * (r - 1)
    return best


def layer_stacks(cfg: Any) -> tuple:
    """The `LayerStack`s of `cfg` in layer order (dense ones first)."""
    out = []
    for moe, lo, hi in (
        (False, 0, cfg.num_dense_layers),
        (True, cfg.num_dense_layers, cfg.num_layers),
    ):
        kinds, i = [cfg.is_sliding(j) for j in range(lo, hi)], 0
        base = "moe_layers" if moe else "dense_layers"
        while i < len(kinds):
            pattern, repeats = _best_run(kinds[i:])
            name = base if i == 0 else f"{base}_{len([s for s in out if s.moe == moe])}"
            out.append(LayerStack(name, moe, lo + i, pattern, repeats))
            i += len(pattern) * repeats
    return tuple(out)

"""In-process trainer runs that share their compiled train step.

`train.run` builds its jitted step with `make_train_step` once per run: a new `jax.jit` object, so
every in-process run of a test traces and lowers the same step again (about 5 CPU-seconds on 2
cores) before the persistent cache returns the executable. `share_train_steps(monkeypatch)` makes
`train.make_train_step` return the step an earlier run of this process built for the same
config, mesh, shardings and model graph: a later run skips straight to dispatch. What a run does
with the step (donation, metrics, checkpoints) is unchanged; a test that wraps
`train.make_train_step` after this wraps the shared one.
"""
from __future__ import annotations

from typing import Any

import jax

_STEPS: dict = {}


def _key(cfg: Any, mesh: Any, state_shardings: Any, batch_shardings: Any, graphdef: Any) -> tuple:
    return (cfg, mesh, graphdef,
            jax.tree.structure(state_shardings), tuple(jax.tree.leaves(state_shardings)),
            jax.tree.structure(batch_shardings), tuple(jax.tree.leaves(batch_shardings)))


def share_train_steps(monkeypatch) -> None:
    """Within this test, `train.make_train_step` reuses a step built earlier in this process
    (by any test that called this) for equal arguments."""
    from gagar_jax.run import step, train

    def shared(cfg, mesh, state_shardings, batch_shardings, graphdef):
        key = _key(cfg, mesh, state_shardings, batch_shardings, graphdef)
        if key not in _STEPS:
            _STEPS[key] = step.make_train_step(cfg, mesh, state_shardings, batch_shardings,
                                               graphdef)
        return _STEPS[key]

    monkeypatch.setattr(train, "make_train_step", shared)

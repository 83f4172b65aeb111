"""Re-scores a feed's groups under a config's initial policy, so that they are on-policy at step 1.

    groups = rescore(groups, load_config_file("configs/tiny_cpu.py"))

A synthetic feed's behaviour log-probs are made up: under the learner's initial weights the
ratio of step 1 is far from 1, the clip fires on a third of the tokens and corrections mask
everything, which no real run looks like. Here every trajectory's generated tokens
(`loss_mask` 1) get the log-probs the learner computes at step 1 (`train_state` init with the
config's seed: the learner's own initial policy, no `init_from`), and records that carry
routed experts get the ones the policy itself chooses, so that replaying them (R3) changes
nothing. Tokens, masks, outcomes and every other field are kept.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
from flax import nnx

from gagar_jax.feed import schema
from gagar_jax.model.logprobs import token_logprobs
from gagar_jax.run.step import StepConfig, init_train_state
from gagar_jax.sharding import make_mesh

ROWS = 64        # trajectories scored per forward (one compiled shape)


def _initial_model(cfg: Any):
    step_cfg = StepConfig.from_config(cfg)
    mesh = make_mesh(cfg.mesh)
    state, graphdef, _ = init_train_state(step_cfg, mesh, jax.random.PRNGKey(int(cfg.seed)))
    return nnx.merge(graphdef, state.params, state.router_bias)


def _tokens(t: schema.Trajectory) -> np.ndarray:
    if not isinstance(t.tokens, list) or isinstance(t.routed_experts, schema.PackedArray):
        raise ValueError(f"trajectory {t.trajectory_id!r}: rescore takes list-encoded tokens "
                         "and routed_experts (convert compact records first)")
    return np.asarray(t.tokens, np.int64)


def rescore(groups: Sequence[schema.Group], cfg: Any, *, width: int = 0) -> list:
    """The groups with their generated tokens' log-probs (and routing) from `cfg`'s initial
    policy.

    Args:
      groups: feed records with list-encoded tokens and routed_experts.
      cfg: a locked ConfigDict (its model, mesh, seed).
      width: the padded length of one scored row (default: the longest trajectory).
    Returns:
      New `Group`s, in order; trajectories without generated tokens are unchanged.
    """
    model = _initial_model(cfg)
    todo = [(gi, ti, _tokens(t)) for gi, g in enumerate(groups)
            for ti, t in enumerate(g.trajectories) if sum(t.loss_mask)]
    S = width or max(len(x) for _, _, x in todo)

    @jax.jit
    def score(tokens_RxS: jax.Array, segments_RxS: jax.Array, positions_RxS: jax.Array):
        lp, _, aux = token_logprobs(model, tokens_RxS, segments_RxS, positions_RxS)
        return lp, aux.routed_experts_BxSxLxK

    results = {}
    for start in range(0, len(todo), ROWS):
        chunk = todo[start:start + ROWS]
        tok, seg = np.zeros((ROWS, S), np.int32), np.zeros((ROWS, S), np.int32)
        for r, (_, _, x) in enumerate(chunk):
            tok[r, :len(x)], seg[r, :len(x)] = x, 1
        pos = np.broadcast_to(np.arange(S, dtype=np.int32), (ROWS, S))
        lp, routed = jax.device_get(score(jnp.asarray(tok), jnp.asarray(seg), jnp.asarray(pos)))
        for r, (gi, ti, x) in enumerate(chunk):
            results[gi, ti] = (lp[r, :len(x)], routed[r, :len(x)])
    out = []
    for gi, g in enumerate(groups):
        trajs = []
        for ti, t in enumerate(g.trajectories):
            if (gi, ti) not in results:
                trajs.append(t)
                continue
            lp, routed = results[gi, ti]
            mask = np.asarray(t.loss_mask, bool)
            logprobs = [round(float(v), 6) if m else 0.0 for v, m in zip(lp, mask, strict=True)]
            rexp = t.routed_experts
            if rexp is not None:
                # Entry j: the forward that produced the j-th generated token, whose input is
                # the token before it (docs/feed.md, routed_experts).
                rexp = routed[np.flatnonzero(mask) - 1].astype(int).tolist()
            trajs.append(msgspec.structs.replace(t, logprobs=logprobs, routed_experts=rexp))
        out.append(msgspec.structs.replace(g, trajectories=trajs))
    return out

"""Per-step measurements of the miniature (round two): probe-set entropy, KL to the warm start,
credit per sequence and token-weighted.

  probe = ProbeSet(task_cfg, n=64)            # fixed teacher-forced demonstrations
  probe.entropy(model)                        # {"probe_entropy", "probe_entropy_note", ...}
  kl_to_reference(model_ref, records)         # k3 estimate of KL(pi || pi_0) on pi's samples
  credit_metrics(records, info, advantages_T) # net credit per sequence and sum_i A_i L_i
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gagar_jax.model.logprobs import token_logprobs
from gagar_jax.sim import demos
from gagar_jax.sim import task as task_lib

if TYPE_CHECKING:
    from gagar_jax.feed import schema
    from gagar_jax.feed.batcher import BatchInfo
    from gagar_jax.model.transformer import Transformer


@nnx.jit
def _teacher_forced(model: Transformer, tokens: jax.Array, segs: jax.Array, positions: jax.Array):
    lp, ent, _ = token_logprobs(model, tokens, segs, positions)
    return lp, ent


def _bucket(n: int, to: int = 32) -> int:
    return -(-n // to) * to


def _rows(tokens_list: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]], seq_len: int):
    B = len(tokens_list)
    tok = np.zeros((B, seq_len), np.int32)
    seg = np.zeros((B, seq_len), np.int32)
    mask = np.zeros((B, seq_len), np.float32)
    for b, (t, m) in enumerate(zip(tokens_list, loss_masks, strict=False)):
        n = min(len(t), seq_len)
        tok[b, :n], seg[b, :n], mask[b, :n] = t[:n], 1, m[:n]
    pos = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (B, seq_len)) * (seg > 0)
    return tok, seg, pos.astype(np.int32), mask


def _is_note(tok: np.ndarray):
    return (tok == task_lib.NOTE) | (tok >= task_lib.WORD_BASE)


class ProbeSet:
    """Fixed teacher-forced demonstrations (the warm start's recipe, tasks never used
    elsewhere): the policy's entropy and NLL on the same tokens at every step."""

    def __init__(self, task_cfg: task_lib.TaskConfig, n: int = 64,
                 recipe: demos.Recipe = demos.ROUND2_RECIPE):
        tasks = task_lib.make_tasks(task_cfg, 555_555, n, prefix="probe")
        eps = demos.make_demos(task_cfg, tasks, 555_555, recipe)
        seq = _bucket(max(len(e.tokens) for e in eps))
        self.tok, self.seg, self.pos, self.mask = _rows([e.tokens for e in eps],
                                                        [e.loss_mask for e in eps], seq)
        self.note = _is_note(self.tok) & (self.mask > 0)

    def entropy(self, model: Transformer) -> dict:
        lp, ent = (np.asarray(x) for x in _teacher_forced(
            model, jnp.asarray(self.tok), jnp.asarray(self.seg), jnp.asarray(self.pos)))
        m = self.mask > 0
        act = m & ~self.note
        return {"probe_entropy": float(ent[m].mean()),
                "probe_entropy_note": float(ent[self.note].mean()) if self.note.any() else math.nan,
                "probe_entropy_action": float(ent[act].mean()),
                "probe_nll": float(-lp[m].mean())}


def kl_to_reference(model_ref: Transformer, records: Sequence[schema.Group]) -> float:
    """k3 estimate of KL(pi || pi_ref) per generated token, on pi's own samples (`records`,
    whose behavior log-probs are pi's): mean of exp(d) - 1 - d, d = log pi_ref - log pi."""
    trajs = [t for g in records for t in g.trajectories]
    seq = _bucket(max(len(t.tokens) for t in trajs), 64)
    tok, seg, pos, mask = _rows([t.tokens for t in trajs], [t.loss_mask for t in trajs], seq)
    beh = np.zeros(tok.shape, np.float32)
    for b, t in enumerate(trajs):
        n = min(len(t.logprobs), seq)
        beh[b, :n] = t.logprobs[:n]
    lp_ref, _ = _teacher_forced(model_ref, jnp.asarray(tok), jnp.asarray(seg), jnp.asarray(pos))
    d = np.asarray(lp_ref, np.float64) - beh
    m = mask > 0
    return float(np.mean(np.expm1(d[m]) - d[m]))


def credit_metrics(records: Sequence[schema.Group], info: BatchInfo, advantages_T: np.ndarray,
                   outcome_advantages_T: np.ndarray | None = None) -> dict:
    """Net credit of the trained batch: per sequence (sum A_i / trained trajectories) and
    token-weighted (sum A_i L_i, L_i = generated tokens; and per generated token, the credit
    under token-mean aggregation of the whole batch); per note token (sum A_i N_i / sum N_i,
    N_i = generated note tokens: the credit the note positions see); with
    `outcome_advantages_T`, the binary outcome advantages' credit per generated token (what
    neither sum-preserving mode changes: the outcome's own length bias)."""
    lengths, notes = {}, {}
    for g in records:
        for t in g.trajectories:
            tok, m = np.asarray(t.tokens), np.asarray(t.loss_mask) > 0
            lengths[t.trajectory_id] = int(m.sum())
            notes[t.trajectory_id] = int((m & _is_note(tok)).sum())
    a_sum = al_sum = an_sum = ol_sum = 0.0
    n = toks = note_toks = 0
    for ids, slots in zip(info.trajectory_ids, info.traj_slots, strict=False):
        for tid, slot in zip(ids, slots, strict=False):
            a = float(advantages_T[slot])
            a_sum += a
            al_sum += a * lengths[tid]
            an_sum += a * notes[tid]
            if outcome_advantages_T is not None:
                ol_sum += float(outcome_advantages_T[slot]) * lengths[tid]
            n += 1
            toks += lengths[tid]
            note_toks += notes[tid]
    out = {"net_credit_per_seq": a_sum / max(n, 1), "net_credit_tokens": al_sum,
           "net_credit_per_token": al_sum / max(toks, 1),
           "net_credit_per_note_token": an_sum / note_toks if note_toks else math.nan}
    if outcome_advantages_T is not None:
        out["outcome_credit_per_token"] = ol_sum / max(toks, 1)
    return out

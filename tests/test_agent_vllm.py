"""The central invariant of agent rollouts, with vLLM: multi-turn records from the agent loop
(tests/support/agent_scenario.py, run in the test run's one vLLM engine per family:
tests/support/vllm_served.py) against the learner, both families, float32, weights randomised as
tests/test_vllm.py does. Two groups of two 4-turn trajectories move from version 1 to version 2
after turn 2; a third runs into the engine's context (truncated).

The records go through the learner's feed unchanged (validated, packed); the learner's log-probs
of the packed batch (`model/logprobs.py`, teacher-forced) at every `loss_mask = 1` position equal
the record's within 1e-4 under the weights of the version that generated the token, and the
experts the learner routes each input to equal the recorded ones (R3 across turns); the records
also train (`train.run` on them).
"""
import json
import os

import jsonschema
import numpy as np
import pytest
from flax import nnx
from support.vllm_served import CONFIGS, PROMPT

from gagar_jax.feed import Feed, FeedConfig, IteratorSource, schema
from gagar_jax.model.logprobs import token_logprobs

TOL = 1e-4
PROMPT_LEN = len(PROMPT)


@pytest.fixture(scope="module", params=list(CONFIGS))
def agent(request):
    """(family, model config, learner models per version, the scenario's answers, records)."""
    family, cfg, _, _, got, models = request.getfixturevalue("vllm_served")[request.param]
    recs = [schema.decode(r.encode(), "json") for r in got["agent"]["records"]]
    return family, cfg, models, got["agent"], recs


def turns(t):
    """[(start, end)] of each run of generated tokens."""
    m = np.asarray(t.loss_mask)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], m, [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def feed_batch(recs, cfg, tmp_path):
    """The learner's feed on the records as JSON lines: (batch, info, feed)."""
    fc = FeedConfig(path="", rows_per_batch=6, seq_len=64, max_traj_tokens=64, max_trajectories=8,
                    groups_per_batch=len(recs), max_staleness=10, routing_replay=True,
                    overlong="truncate", filter_uniform=False)
    feed = Feed(fc, str(tmp_path), vocab_size=cfg.vocab_size, num_moe_layers=cfg.num_moe_layers,
                top_k=cfg.top_k, num_experts=cfg.num_experts,
                source=IteratorSource([schema.encode(r, "json") for r in recs]))
    item = feed.next_batch(2)
    assert feed.ledger.quarantined == 0, feed.ledger.quarantined_by_reason
    return (*item, feed)


def test_records_are_multi_turn_span_two_versions_and_pass_the_validators(agent, tmp_path,
                                                                          repo_root):
    family, cfg, models, got, recs = agent
    assert [r.task_id for r in recs] == ["agent-a", "agent-b", "agent-c"]
    assert got["counts"]["reloads"] == 1 and got["version"] == 2
    with open(os.path.join(repo_root, "docs", "feed_schema.json")) as f:
        validator = jsonschema.Draft202012Validator(json.load(f))
    for r in recs:
        validator.validate(json.loads(schema.encode(r, "json")))
    a, b, c = recs
    for rec, passing in ((a, 0), (b, 1)):
        assert rec.policy_version == 2 and rec.sampling.engine == "vllm"
        assert [t.outcome for t in rec.trajectories] == [
            "pass" if j == passing else "fail" for j in range(2)]
        for t in rec.trajectories:
            runs = turns(t)
            assert len(runs) == 4 and runs[0][0] == PROMPT_LEN
            assert t.tokens[:PROMPT_LEN] == PROMPT and not t.truncated
            # turns 1-2 from version 1; after the move, turns 3-4 from version 2
            assert t.policy_version_spans == [[PROMPT_LEN, 1], [runs[2][0], 2]]
            assert len(t.routed_experts) == sum(e - s for s, e in runs)
    for t in c.trajectories:            # the context: 12 + 4 + 10 + 4 + 10 + 4 + 10 + 4 = 58
        assert t.truncated and len(t.tokens) <= 64 and len(turns(t)) >= 3
    assert got["infos"][2]["end_reasons"] == ["context_full"] * 2
    _, info, feed = feed_batch(recs, cfg, tmp_path)
    assert info.num_groups == 3 and feed.ledger.received == 3


def test_learner_logprobs_and_routing_equal_the_records_per_version(agent, tmp_path):
    """The central invariant: at every generated token of the packed batch, the learner on the
    weights of the token's version gives the record's log-prob (within 1e-4) and routes the
    token's input to the recorded experts (as sets: vLLM orders the top-k its own way)."""
    family, cfg, models, got, recs = agent
    print(f"{family}: the agent scenario took {got['s']:.1f} s in the engine fixture")
    batch, info, _ = feed_batch(recs, cfg, tmp_path)
    versions = {}                        # (group id, trajectory id) -> per-token version
    for r in recs:
        for t in r.trajectories:
            v = np.full(len(t.tokens), -1)
            spans = t.policy_version_spans
            for (s, ver), e in zip(spans, [x for x, _ in spans[1:]] + [len(v)], strict=True):
                v[s:e] = ver
            versions[r.group_id, t.trajectory_id] = v
    slot = {s: (info.group_ids[g], tid) for g in range(info.num_groups)
            for s, tid in zip(info.traj_slots[g], info.trajectory_ids[g], strict=True)}
    seg, pos = np.asarray(batch.segment_ids_BxS), np.asarray(batch.positions_BxS)
    idx = np.asarray(batch.traj_index_BxS)
    tok_version = np.full(seg.shape, -1)
    for b, s in zip(*np.nonzero(seg), strict=True):
        tok_version[b, s] = versions[slot[int(idx[b, s])]][pos[b, s]]
    mask = np.asarray(batch.loss_mask_BxS) > 0
    record_lp = np.asarray(batch.old_logprobs_BxS)
    record_routes = np.sort(np.asarray(batch.routed_experts_BxSxLxK), axis=-1)
    checked = {1: 0, 2: 0}
    for v in (1, 2):
        lp, _, aux = _logprobs(models[v], batch.tokens_BxS, batch.segment_ids_BxS,
                               batch.positions_BxS)
        at = mask & (tok_version == v)
        checked[v] = int(at.sum())
        diff = np.abs(np.asarray(lp)[at] - record_lp[at])
        print(f"{family} version {v}: {checked[v]} generated tokens, max |learner - record| "
              f"log-prob {diff.max():.2e}")           # docs/rollout.md quotes it (pytest -s)
        assert diff.max() < TOL, (family, v, diff.max())
        # generated token t was produced by the forward whose input is token t - 1
        inputs = np.roll(at, -1, axis=1)
        learner = np.sort(np.asarray(aux.routed_experts_BxSxLxK), axis=-1)
        np.testing.assert_array_equal(learner[inputs], record_routes[inputs])
    # every generated token was checked against its own version
    assert checked[1] + checked[2] == int(mask.sum()) and checked[1] > 0 and checked[2] > 0


@nnx.jit
def _logprobs(model, tokens, seg, pos):
    return token_logprobs(model, tokens, seg, pos)


def test_the_learner_trains_on_the_records(vllm_served, tmp_path, repo_root):
    """One learner step on the Qwen3-MoE records (the learner's own loop, `train.run`, on
    configs/tiny_vllm.py): the three mixed groups train, the ledger balances, the loss is finite
    (one family: the loop is the same for both, and each is a train-step compile)."""
    from gagar_jax.config import load_config_file
    from gagar_jax.run import train
    recs = vllm_served["qwen3_moe"][4]["agent"]["records"]
    c = load_config_file(os.path.join(repo_root, "configs", "tiny_vllm.py"))
    c.train.steps, c.train.publish_every = 1, 0
    c.feed.groups_per_batch, c.feed.max_future_versions = 3, 2     # the records are version 2
    c.feed.overlong = "truncate"                                   # group c's are truncated
    summary = train.run(c, str(tmp_path / "run"),
                        source=IteratorSource([r.encode() for r in recs]))
    led = summary["ledger"]
    assert led["balanced"] and led["trained"] == 3 and led["trained_partial"] == 3, led
    assert summary["steps"] == 1 and np.isfinite(summary["final_loss"]), summary

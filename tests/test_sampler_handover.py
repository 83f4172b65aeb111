"""Weights handed to the sampler in memory (`gagar_jax/sample/handover.py`), on 8 CPU devices.

The learner's parameters (tiny MiMo: sinks, window, router bias) live sharded on a learner mesh
of devices 0-3. A sampler on that mesh reading the very same arrays ("same"), and a sampler on
its own mesh of devices 4-7 given a `jax.device_put` copy ("reshard"), draw the same tokens,
log-probs and routing as a sampler loaded from the published directory of those weights. With
"same" the sampler drops the arrays before the train step donates them: after the step it serves
nothing until the new state is handed over, and a sampler that kept the donated arrays fails
loudly instead of sampling from freed buffers. A delta version moved to serves the full
publish's weights and answers.
"""
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx
from support.vllm_served import model_config, random_model

from gagar_jax import sharding as shd
from gagar_jax.hf import api as hf
from gagar_jax.rollout.engine import EngineOptions, Request, SamplingSpec
from gagar_jax.run import publish
from gagar_jax.sample import handover
from gagar_jax.sample.engine import JaxEngine, make_engine
from gagar_jax.sample.sampler import Sampler, SamplerConfig

SAMPLER = SamplerConfig(slots=4, page=4, max_len=32, decode_steps=4, max_chunk=16)
OPTIONS = EngineOptions(seed=0, max_model_len=32)
PROMPTS = [[5, 17, 33, 101, 7, 9, 200, 3, 44, 12], [9, 1, 77, 140, 2, 66]]


def _mesh(devices, **axes):
    cfg = {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1, **axes}
    return shd.make_mesh(SimpleNamespace(**cfg), devices)


def _answers(engine):
    greedy = SamplingSpec(top_k=1, max_tokens=6)
    hot = SamplingSpec(temperature=1.0, max_tokens=6)
    [[g0], [g1], [h0], [h1]] = engine.generate([Request(PROMPTS[0], greedy, seed=0),
                                                Request(PROMPTS[1], greedy, seed=0),
                                                Request(PROMPTS[0], hot, seed=5),
                                                Request(PROMPTS[1], hot, seed=6)])
    comps = [g0, g1, h0, h1]
    engine.cancel([c.sequence for c in comps])
    return comps


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.tokens == y.tokens and x.routed_experts == y.routed_experts
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)


@pytest.fixture(scope="module")
def learner(devices, tmp_path_factory):
    """(model, its state sharded on the learner mesh, the learner mesh, published dir)."""
    cfg = model_config("mimo_v2_flash")
    model = random_model(cfg, 4)
    mesh = _mesh(devices[:4], fsdp=2, tensor=2)
    state = jax.device_put(nnx.state(model), shd.state_shardings(nnx.state(model), mesh))
    path = str(tmp_path_factory.mktemp("handover") / "v3")
    hf.save_pretrained(model, path)
    return model, state, mesh, path


def test_same_and_resharded_hand_over_equal_the_published_sampler(learner, devices):
    model, state, mesh, path = learner
    want = _answers(make_engine(path, OPTIONS, SAMPLER))

    graphdef = nnx.graphdef(model)
    same = JaxEngine(Sampler(nnx.merge(graphdef, state), SAMPLER, mesh), "", OPTIONS, 0)
    info = handover.timed_hand_over(same, state, 3, "same")
    assert info["bytes"] == handover.state_bytes(nnx.state(model))
    assert same.sampler.state is state and same.version == 3      # the learner's own arrays
    _same(_answers(same), want)

    sampler_mesh = _mesh(devices[4:], fsdp=2, tensor=2)
    shardings = handover.sampler_shardings(state, sampler_mesh)
    first = handover.reshard(state, shardings)
    other = JaxEngine(Sampler(nnx.merge(graphdef, first), SAMPLER, sampler_mesh), "", OPTIONS, 0)
    info = handover.timed_hand_over(other, state, 3, "reshard", shardings)
    leaf = jax.tree.leaves(other.sampler.state)[0]
    assert set(leaf.devices()) == set(devices[4:]) and info["seconds"] > 0
    _same(_answers(other), want)


def test_same_mesh_holds_no_reference_across_the_donating_step(learner):
    model, state, mesh, _ = learner
    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 1.0, s), donate_argnums=0)
    live = jax.tree.map(lambda x: x * 1.0, state)            # the learner's current state
    engine = JaxEngine(Sampler(nnx.merge(nnx.graphdef(model), live), SAMPLER, mesh), "",
                       OPTIONS, 0)
    before = _answers(engine)
    engine.sampler.release_params()                          # what the colocated loop does
    live = step(live)                                        # donates the old buffers
    with pytest.raises(RuntimeError, match="holds no parameters"):
        _answers(engine)
    handover.timed_hand_over(engine, live, 4, "same")
    _same(_answers(engine), before)
    kept = live
    live = step(live)                                        # a sampler that kept them ...
    assert all(x.is_deleted() for x in jax.tree.leaves(kept))
    with pytest.raises(RuntimeError, match="deleted"):       # ... fails, loudly
        _answers(engine)


def test_move_to_a_delta_serves_its_step(learner, tmp_path):
    """A delta version (the chain materialised on the host) serves the same weights and answers
    as the full publish of its step."""
    model = learner[0]
    edited = random_model(model_config("mimo_v2_flash"), 4)       # the learner's weights, then
    nnx.update(edited, jax.tree_util.tree_map_with_path(            # a few head columns moved
        lambda p, x: x.at[:, :3].add(0.5) if "lm_head" in jax.tree_util.keystr(p) else x,
        nnx.state(edited)))
    chain = publish.Publisher(str(tmp_path / "chain"), keep=3, dtype="float32", full_every=8)
    base = chain.publish(model, 1)
    chain.wait()
    step2 = chain.publish(edited, 2)
    chain.wait()
    assert chain.last_delta.sparse == 1 and chain.last_delta.changed == 3 * 64   # one tensor
    full = publish.publish_weights(edited, 2, str(tmp_path / "full"),
                                   lambda m, d: hf.save_pretrained(m, d))
    engine = make_engine(str(base), OPTIONS, SAMPLER)
    assert engine.move_to(str(step2))["policy_version"] == engine.version == 2
    np.testing.assert_array_equal(engine.sampler.state["lm_head"][...], edited.lm_head[...])
    _same(_answers(engine), _answers(make_engine(full, OPTIONS, SAMPLER)))

"""vLLM (CPU build, .venv-vllm) serves what the learner publishes: both families, no shim.

One vLLM process for the test run (tests/support/vllm_served.py, shared with the engine
conformance test), one engine per family in it, each in-process, eager, with a 1 GiB KV cache: it
loads the published float32 step 2 as it is,
then reloads step 1 in place, then `latest` (step 2). Checked against the learner's own model
on the same weights: greedy tokens, generated and prompt log-probs, and the experts every token
was routed to (the extension's router hook); and the reload back to step 2 equals the fresh load
bit for bit.
"""
import json
import os

import numpy as np
import pytest
from support.vllm_served import CONFIGS, EDITS, GEN, PROMPT, TOL


@pytest.fixture(scope="module")
def engines(vllm_served):
    """Both families' published weights, learner answers and vLLM results (one engine per
    family for the test run: support/vllm_served.py)."""
    return {family: v[:5] for family, v in vllm_served.items()}


@pytest.fixture(params=list(CONFIGS))
def served(request, engines):
    """(family, model config, learner answers per step, published dirs, the engine's results)."""
    return engines[request.param]


def _max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.mark.parametrize("run,step", [("fresh", 2), ("step1", 1), ("reloaded", 2)])
def test_vllm_matches_learner(served, run, step):
    family, cfg, refs, dirs, got = served
    ref, r = refs[step], got[run]
    with open(os.path.join(dirs[step], "config.json")) as f:
        assert json.load(f)["model_type"] == family
    assert r["greedy"] == ref["greedy"], (family, run)
    assert _max_diff(r["gen_logprobs"], ref["gen_logprobs"]) < TOL
    assert _max_diff(r["prompt_logprobs"], ref["prompt_logprobs"]) < TOL


def test_reload_equals_fresh_load_bit_for_bit(served):
    family, cfg, refs, dirs, got = served
    assert got["reloaded"] == got["fresh"]
    assert got["step1"]["greedy"] != got["fresh"]["greedy"]      # the reloads changed the weights
    info = got["reload_info_2"]
    assert info["policy_version"] == 2 and info["repacked"] == cfg.num_moe_layers
    # MiMo's sinks are written past vLLM's reload machinery: the extension copies them.
    sinks = sorted(n for n in info["copied"] if n.endswith("attention_sink_bias"))
    want = [f"model.layers.{i}.self_attn.attention_sink_bias"
            for i in range(cfg.num_layers) if cfg.attention_sinks and cfg.is_sliding(i)]
    assert sinks == want


@pytest.mark.parametrize("run,step", [("fresh", 2), ("step1", 1)])
def test_captured_routing_equals_learner_routing(served, run, step):
    """The router hook's experts per input token and MoE layer = the learner's top-k (as sets:
    vLLM orders the top-k its own way), in float32."""
    family, cfg, refs, dirs, got = served
    engine = np.sort(np.asarray(got[run]["routes"]), axis=-1)
    learner = np.sort(np.asarray(refs[step]["routes"]), axis=-1)
    assert engine.shape == (len(PROMPT) + GEN - 1, cfg.num_moe_layers, cfg.top_k)
    np.testing.assert_array_equal(engine, learner)


def test_delta_apply_rebuilds_only_changed_modules_bit_for_bit(served):
    """The fast apply of a delta (`gagar_apply_version`) leaves the engine equal to a full
    reload of the same step: every parameter and buffer, every packed linear's output on a
    fixed input (`gagar_weights_digest`), greedy tokens and log-probs. It writes the changed
    elements straight into the kernel tensors of the modules the patch probes mapped (one
    element each here), re-processes in place the one that keeps a oneDNN handle beside its
    weight, rebuilds only the other modules whose tensors changed (handing them the host copy's
    loader-layout tiles the deltas wrote into), and leaves what it cannot trace to vLLM's
    reload."""
    family, cfg, refs, dirs, got = served
    d = got["delta"]
    assert d["info"]["deltas"] == 1 and d["info"]["changed"] == len(EDITS[family])
    assert d["digest_diff"] == [], family
    assert d["digest_outs"] >= 2 * cfg.num_layers + 2     # q/k/v + o per layer, embedding, head
    assert d["applied"] == d["reloaded"]
    assert d["applied"]["greedy"] != got["fresh"]["greedy"] or \
        d["applied"]["gen_logprobs"] != got["fresh"]["gen_logprobs"]
    for how in ("rebuilt", "patched"):
        assert d["info"][how] == sorted(e[2][0] for e in EDITS[family] if e[2] and e[2][1] == how)
    patched = [e for e in EDITS[family] if e[2] and e[2][1] == "patched"]
    assert d["info"]["patched_tensors"] == len(patched)
    assert len(patched) <= d["info"]["patched_elements"] < 10     # the elements, not the tensors
    assert d["info"]["reprocessed"] == (["lm_head"] if family == "qwen3_moe" else [])
    slow = [".".join(["model", "layers", "1", "mlp"])] if family == "mimo_v2_flash" else []
    assert d["info"]["slow_groups"] == slow
    # the kernel tensor handed over from the host copy's loader-layout tiles (no copy):
    # qkv_proj / gate_up_proj
    assert d["info"]["tiled"] == 1


def test_an_apply_after_a_patch_reads_the_engine_back(served):
    """After the fast apply (the patched tensors' entries went to the engine only), the next
    delta applied by vLLM's reload of the touched layers (`fast=False`, which reads the host
    copy) leaves the engine equal to a full reload of that step: the host copy was brought up
    to date from the engine first (it would miss the first delta's elements otherwise)."""
    family, cfg, refs, dirs, got = served
    d = got["delta"]
    assert d["info4"]["deltas"] == 1 and d["info4"]["reloaded"] > 0 and not d["info4"]["rebuilt"]
    assert d["digest_diff4"] == [], family
    assert d["applied4"] == d["reloaded4"] and d["applied4"] != d["reloaded"]

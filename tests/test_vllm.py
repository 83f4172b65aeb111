"""vLLM (CPU build, .venv-vllm) serves what the learner publishes: both families, no shim.

One vLLM process for the module (tests/support/vllm_parity_driver.py), one engine per family in it,
each in-process, eager, with a 1 GiB KV cache: it loads the published float32 step 2 as it is,
then reloads step 1 in place, then `latest` (step 2). Checked against the learner's own model
on the same weights: greedy tokens, generated and prompt log-probs, and the experts every token
was routed to (the extension's router hook); and the reload back to step 2 equals the fresh load
bit for bit.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.vllm_env import run_vllm

from gagar_jax.config import load_config_file
from gagar_jax.hf import api as hf
from gagar_jax.model.transformer import ModelConfig, Transformer
from gagar_jax.run import publish

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [5, 17, 33, 101, 7, 9, 200, 3, 44, 12, 250, 61]     # 12 tokens > the MiMo window (5)
GEN = 8
CONFIGS = {"qwen3_moe": "tiny_vllm", "mimo_v2_flash": "tiny_mimo_vllm"}
TOL = 2e-5                      # float32 end to end (measured: <= 5e-6)


def model_config(family):
    cfg = load_config_file(os.path.join(REPO, "configs", f"{CONFIGS[family]}.py"))
    return ModelConfig.from_config(cfg.model)


def randomize(model, seed):
    """Weights larger than the init (its logits are near uniform: greedy ties otherwise)."""
    rng = np.random.default_rng(seed)

    def draw(path, x):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        n = rng.standard_normal(x.shape).astype(np.float32)
        scale = {"norm": 0.1, "sinks": 1.0, "router_bias": 0.1}
        for key, s in scale.items():
            if key in name:
                return jnp.asarray((1.0 if key == "norm" else 0.0) + s * n)
        return jnp.asarray(0.15 * n)
    nnx.update(model, jax.tree_util.tree_map_with_path(draw, nnx.state(model)))


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


def learner_answers(model):
    """Greedy continuation of PROMPT, log-probs, and the learner's routing of every input token."""
    toks, n = list(PROMPT), len(PROMPT) + GEN
    for _ in range(GEN):        # one shape: causal, so the padding after the tokens is inert
        logits = _forward(model, jnp.asarray([toks + [0] * (n - len(toks))]))[0][0]
        toks.append(int(jnp.argmax(logits[len(toks) - 1])))
    logits, aux = _forward(model, jnp.asarray([toks]))
    lp = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))
    return {"greedy": toks[len(PROMPT):],
            "gen_logprobs": [float(lp[i - 1, toks[i]]) for i in range(len(PROMPT), len(toks))],
            "prompt_logprobs": [float(lp[i - 1, toks[i]]) for i in range(1, len(PROMPT))],
            # [S, L, K]: the experts each input token used; the last token is never an input
            "routes": np.asarray(aux.routed_experts_BxSxLxK[0, :-1]).tolist()}


# A few elements of a few tensors change between the delta chain's base (the step-1 draw) and
# its delta, step 3: (learner leaf, index, (the module vLLM must bring up to date, how), or None:
# left to vLLM's reload: MiMo's router bias is a kernel tensor vLLM does not restore on a
# reload). "patched": the changed elements are written into the kernel tensors in place (the
# experts' prepacked layout, the LM head's weight kept beside its oneDNN handle, the sinks);
# "rebuilt": the module is loaded and processed again (a oneDNN handle without the weight).
EDITS = {
    "qwen3_moe": [("moe_layers/attn/wq", (0, 3, 1, 5),
                   ("model.layers.0.self_attn.qkv_proj", "rebuilt")),
                  ("moe_layers/mlp/expert_gate", (1, 2, 7, 4),
                   ("model.layers.1.mlp.experts.routed_experts", "patched")),
                  ("lm_head", (9, 30), ("lm_head", "patched"))],
    "mimo_v2_flash": [("dense_layers/mlp/mlp_gate", (0, 5, 6),
                       ("model.layers.0.mlp.gate_up_proj", "rebuilt")),
                      ("moe_layers_1/attn/sinks", (0, 1), ("model.layers.2.self_attn", "patched")),
                      ("moe_layers/mlp/router_bias", (0, 2), None)],
}


def delta_chain(cfg, family, root):
    """Publishes the step-1 draw (float32, full), then it with EDITS as a delta (step 3), then
    EDITS again at the next element of each as a delta on that (step 4), and steps 3 and 4 in
    full elsewhere: {"base", "delta", "full", "delta4", "full4"} directories."""
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    randomize(model, 1)
    chain = publish.Publisher(str(root / "chain"), keep=3, dtype="float32", full_every=8)
    dirs = {"base": chain.publish(model, 1)}
    chain.wait()

    def edit(shift):
        def one(path, x):
            name = "/".join(str(getattr(k, "key", k)) for k in path[:-1])
            for leaf, index, _ in EDITS[family]:
                if name == leaf:
                    last = (index[-1] + shift) % x.shape[len(index) - 1]
                    x = x.at[index[:-1] + (last,)].add(0.5)
            return x
        return one
    full = publish.Publisher(str(root / "full"), keep=2, dtype="float32")
    for step, shift, key in ((3, 0, ""), (4, 1, "4")):
        nnx.update(model, jax.tree_util.tree_map_with_path(edit(shift), nnx.state(model)))
        dirs["delta" + key] = chain.publish(model, step)
        chain.wait()
        assert chain.last_delta is not None and chain.last_delta.changed == len(EDITS[family])
        dirs["full" + key] = full.publish(model, step)
        full.wait()
    return {k: str(v) for k, v in dirs.items()}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Publishes both families (two weight draws each) and runs the one vLLM subprocess."""
    work = tmp_path_factory.mktemp("vllm")
    learner, specs = {}, {}
    for family in CONFIGS:
        cfg = model_config(family)
        wd = str(work / family)
        refs, dirs = {}, {}
        for step in (1, 2):
            model = Transformer(cfg, rngs=nnx.Rngs(step))
            randomize(model, step)
            refs[step] = learner_answers(model)
            dirs[step] = publish.publish_weights(model, step, wd,
                                                 lambda m, d: hf.save_pretrained(m, d))
        assert publish.read_latest(wd)["step"] == 2
        learner[family] = (cfg, refs, dirs)
        specs[family] = {"workdir": wd, "step1": dirs[1], "step2": dirs[2], "prompt": PROMPT,
                         "gen": GEN, "delta": delta_chain(cfg, family, work / f"{family}_delta")}
    spec, out = str(work / "spec.json"), str(work / "vllm.json")
    with open(spec, "w") as f:
        json.dump(specs, f)
    driver = os.path.join(REPO, "tests", "support", "vllm_parity_driver.py")
    run_vllm([driver, spec, out], timeout=300)
    with open(out) as f:
        got = json.load(f)
    return {family: (family, *learner[family], got[family]) for family in CONFIGS}


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

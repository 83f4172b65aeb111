"""The vLLM engines of the test run: both families published by the learner, one vLLM subprocess
(tests/support/vllm_parity_driver.py) with one engine per family, shared by tests/test_vllm.py,
tests/test_engine_conformance.py, tests/test_sampler_vllm.py and tests/test_agent_vllm.py (a session
fixture, registered in conftest.py).

Each family: two weight draws (steps 1 and 2, float32), their learner answers (greedy tokens,
log-probs, routing), a delta chain (`delta_chain`), and the engine's answers: the parity runs of
test_vllm.py, then the conformance scenario (tests/support/engine_scenario.py).
"""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gagar_jax.config import load_config_file
from gagar_jax.hf import api as hf
from gagar_jax.model.transformer import ModelConfig, Transformer
from gagar_jax.run import publish
from support.paths import REPO
from support.vllm_env import run_vllm

PROMPT = [5, 17, 33, 101, 7, 9, 200, 3, 44, 12, 250, 61]     # 12 tokens > the MiMo window (5)
PROMPT_B = [9, 1, 77, 140, 2, 66, 31, 8, 190, 4]              # a second request beside it
GEN = 8
# 12 more prompts (random tokens, 6 to 17 long: most exceed the MiMo window) whose greedy
# continuations on step 2 vLLM reports too: 12 x GEN = 96 positions for the JAX sampler's
# teacher-forced argmax parity (tests/test_sampler_vllm.py).
PARITY_PROMPTS = [np.random.default_rng(100 + i).integers(0, 256, 6 + i).tolist()
                  for i in range(12)]
CONFIGS = {"qwen3_moe": "tiny_vllm", "mimo_v2_flash": "tiny_mimo_vllm"}
TOL = 2e-5                      # float32 end to end (measured: <= 5e-6)


def model_config(family):
    cfg = load_config_file(os.path.join(REPO, "configs", f"{CONFIGS[family]}.py"))
    return ModelConfig.from_config(cfg.model)


def randomize(model, seed):
    """Weights larger than the init (its logits are near uniform: greedy ties otherwise):
    N(0, 0.15^2) matrices, norms 1 + N(0, 0.01), router biases N(0, 0.01), sinks N(0, 1)."""
    rng = np.random.default_rng(seed)

    def draw(path, x):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        n = rng.standard_normal(x.shape).astype(np.float32)
        special = {"norm": 0.1, "sinks": 1.0, "router_bias": 0.1}
        for key, s in special.items():
            if key in name:
                return jnp.asarray((1.0 if key == "norm" else 0.0) + s * n)
        return jnp.asarray(0.15 * n)
    nnx.update(model, jax.tree_util.tree_map_with_path(draw, nnx.state(model)))


def random_model(cfg, seed):
    """`Transformer(cfg)` with `randomize(seed)`'s weights, built without running its init (every
    leaf is drawn again anyway: the eager init's compiles cost seconds per model)."""
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)))
    randomize(model, seed)
    return model


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


@pytest.fixture(scope="session")
def published_families(tmp_path_factory):
    """Both families published by the learner (float32): two weight draws each, `latest` naming
    step 2. Returns {family: (model config, learner answers per step, published dirs per step
    and the workdir under "workdir", learner models per step)}."""
    work = tmp_path_factory.mktemp("published")
    out = {}
    for family in CONFIGS:
        cfg = model_config(family)
        wd = str(work / family)
        refs, dirs, models = {}, {"workdir": wd}, {}
        for step in (1, 2):
            model = random_model(cfg, step)
            refs[step], models[step] = learner_answers(model), model
            dirs[step] = publish.publish_weights(model, step, wd,
                                                 lambda m, d: hf.save_pretrained(m, d))
        assert publish.read_latest(wd)["step"] == 2
        out[family] = (cfg, refs, dirs, models)
    return out


@pytest.fixture(scope="session")
def vllm_served(published_families, tmp_path_factory):
    """The one vLLM subprocess on `published_families` (plus a delta chain per family): one
    engine per family for the whole test run (test_vllm.py, test_engine_conformance.py and
    test_sampler_vllm.py read it; `make test` keeps them on one xdist worker, conftest.py).
    Returns {family: (family, model config, learner answers per step, published dirs, the
    engine's results, learner models per step)}."""
    work = tmp_path_factory.mktemp("vllm")
    specs = {}
    for family in CONFIGS:
        cfg, refs, dirs, models = published_families[family]
        specs[family] = {"workdir": dirs["workdir"], "step1": dirs[1], "step2": dirs[2],
                         "prompt": PROMPT, "prompt_b": PROMPT_B, "gen": GEN,
                         "parity_prompts": PARITY_PROMPTS,
                         "delta": delta_chain(cfg, family, work / f"{family}_delta")}
    specs["judge"] = judge_spec(work / "judge")
    spec, out = str(work / "spec.json"), str(work / "vllm.json")
    with open(spec, "w") as f:
        json.dump(specs, f)
    driver = os.path.join(REPO, "tests", "support", "vllm_parity_driver.py")
    run_vllm([driver, spec, out], timeout=600)
    with open(out) as f:
        got = json.load(f)
    served = {family: (family, *published_families[family][:3], got[family],
                       published_families[family][3]) for family in CONFIGS}
    served["judge"] = (specs["judge"], got["judge"])
    return served


# one ordering: the orderings on vLLM are scripts/check_grader_server.py's (3)
JUDGE = {"orderings": 1, "budget": 2600, "max_tokens": 160}


def judge_spec(root):
    """The offline judge's spec: the tiny qwen3_moe with the byte tokenizer's 257 ids (random
    weights) and the byte tokenizer beside them (`gagar_jax/hf/byte_tokenizer.py`), a planted
    group of the first repository task (reference fix with a long test log, sprawling fix,
    failure)."""
    from gagar_jax.hf import byte_tokenizer
    from gagar_jax.rollout.envs import repo_tasks
    from support import planted
    cfg = model_config("qwen3_moe")
    cfg = dataclasses.replace(cfg, vocab_size=byte_tokenizer.END_ID + 1)
    directory = str(root / "model")
    hf.save_pretrained(random_model(cfg, 3), directory)
    byte_tokenizer.save(directory)
    task = repo_tasks.load_tasks()[0]
    t, views = planted.group(task, str(root / "ws"), (("minimal", "pass"),
                                                     ("sprawling", "pass"), ("nothing", "fail")))
    tests = os.path.join(views[0]["workspace"], "tests")
    os.makedirs(tests, exist_ok=True)
    with open(os.path.join(tests, "run_001.log"), "w") as f:
        f.write("LOG-HEAD\n" + "ok\n" * 3000 + "LOG-TAIL 3 passed")
    views = [{k: v for k, v in view.items() if k not in ("tokens", "loss_mask")} for view in views]
    return {"dir": directory, "task": t, "views": views, **JUDGE}

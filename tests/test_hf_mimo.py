"""MiMo-V2-Flash parity with transformers (fp32, CPU), both directions: every feature of the family
in one tiny model, fused and per-expert layouts, packed rows, feature ablations, block-FP8."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from support.paths import TINY_CONFIG, load_config

from gagar_jax.hf import api as hf
from gagar_jax.hf import families as hf_families
from gagar_jax.model.transformer import Transformer

FAST = dict(expert_backend="dense", attention="plain")  # cheapest compile; math is the same
S = 12
TOKENS = np.random.default_rng(0).integers(0, 64, size=(2, S))
# 2 full (+ the dense first layer, also full) and 4 sliding layers; window 3 < S.
LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention",
               "sliding_attention", "sliding_attention", "full_attention"]


def _hf_config():
    from transformers import MiMoV2FlashConfig
    return MiMoV2FlashConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=12,
        v_head_dim=8,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        sliding_window=3,
        layer_types=LAYER_TYPES,
        attention_value_scale=0.707,
        rms_norm_eps=1e-5,
        rope_parameters={
            "full_attention": {
                "rope_type": "default",
                "rope_theta": 1000.0,
                "partial_rotary_factor": 0.334,
            },
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": 50.0,
                "partial_rotary_factor": 0.334,
            },
        },
    )


@pytest.fixture(scope="module")
def torch_model():
    import torch
    from transformers import MiMoV2FlashForCausalLM
    torch.manual_seed(0)
    m = MiMoV2FlashForCausalLM(_hf_config()).eval()
    with torch.no_grad():  # HF's 0.02 init gives near-uniform logits: use larger weights
        for name, p in m.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else
                    torch.randn_like(p) if "sinks" in name else 0.15 * torch.randn_like(p))
        for layer in m.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(8))
    return m


def _torch_logits(m, tokens=TOKENS):
    import torch
    with torch.no_grad():
        return m(torch.tensor(tokens)).logits.float().numpy()


@nnx.jit
def _forward(m, tokens, seg, pos, routed):
    return m(tokens, segment_ids_BxS=seg, positions_BxS=pos, routed_experts_BxSxLxK=routed)


def _our_logits(model, tokens=TOKENS, segment_ids_BxS=None, positions_BxS=None,
                routed_experts_BxSxLxK=None, aux=False):
    """Logits through one module-level jit (one compile per shape and graph, shared by tests)."""
    tokens = jnp.asarray(tokens)
    seg = jnp.ones(tokens.shape, jnp.int32) if segment_ids_BxS is None else segment_ids_BxS
    pos = (jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape) if positions_BxS is None
           else positions_BxS)
    logits, out_aux = _forward(model, tokens, seg, pos, routed_experts_BxSxLxK)
    return (np.asarray(logits), out_aux) if aux else np.asarray(logits)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def hf_dir(torch_model, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("mimo"))
    torch_model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def loaded(hf_dir, torch_model):
    # transformers wrote it: publish it back the way transformers reads it (docs/model.md)
    model, cfg = hf.from_pretrained(hf_dir, sliding_window_convention="transformers", **FAST)
    return model, cfg, _torch_logits(torch_model), _our_logits(model)


def test_config_reads_every_feature(loaded):
    _, cfg, _, _ = loaded
    assert cfg.layer_types == ("full", "sliding", "sliding", "full", "sliding", "sliding", "full")
    assert (cfg.sliding_window, cfg.num_kv_heads, cfg.sliding_kv_heads) == (3, 1, 2)
    assert (cfg.head_dim, cfg.value_head_dim, cfg.rotary_dim) == (12, 8, 4)
    assert (cfg.rope_theta, cfg.sliding_rope_theta, cfg.attention_value_scale) == (
        1000.0,
        50.0,
        0.707,
    )
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == (4, 2, 2.5)
    assert cfg.router == "sigmoid_bias" and cfg.attention_sinks and not cfg.qk_norm
    assert cfg.num_dense_layers == 1 and hf_families.resolve_family(cfg) == "mimo_v2_flash"


def test_transformers_checkpoint_loads_with_equal_logits(loaded):
    model, _, want, ours = loaded
    assert np.abs(want).max() > 0.5  # not trivially small
    assert _rel(ours, want) <= 1e-5
    # the layer pattern is scanned, not unrolled: MoE layers S S F S S F = (S S F) x 2
    assert [(s.name, s.pattern, s.repeats) for s in model.stacks] == [
        ("dense_layers", (False,), 1), ("moe_layers", (True, True, False), 2)]


def test_our_save_loads_in_transformers(loaded, tmp_path):
    import torch
    from transformers import MiMoV2FlashForCausalLM
    model, _, want, _ = loaded
    hf.save_pretrained(model, str(tmp_path))
    names = hf.read_header(str(tmp_path / "model.safetensors"))[0]
    assert names["model.layers.1.self_attn.attention_sink_bias"]["shape"] == [4]
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names  # per-expert layout
    reloaded = MiMoV2FlashForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert _rel(_torch_logits(reloaded), want) <= 1e-5
    # bf16 publishing: router weight and correction bias stay fp32, as transformers keeps them
    hf.save_pretrained(model, str(tmp_path / "bf16"), dtype="bfloat16")
    h = hf.read_header(str(tmp_path / "bf16" / "model.safetensors"))[0]
    assert h["model.layers.1.mlp.gate.weight"]["dtype"] == "F32"
    assert h["model.layers.1.mlp.gate.e_score_correction_bias"]["dtype"] == "F32"
    assert h["model.layers.1.self_attn.q_proj.weight"]["dtype"] == "BF16"
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    bf = MiMoV2FlashForCausalLM.from_pretrained(str(tmp_path / "bf16")).eval()
    assert bf.model.layers[1].mlp.gate.weight.dtype == torch.float32
    ours_bf, _ = hf.from_pretrained(str(tmp_path / "bf16"), **FAST)  # bf16 values, fp32 math
    assert _rel(_our_logits(ours_bf), _torch_logits(bf.float())) <= 1e-5


def test_fp32_round_trip_is_exact(loaded, tmp_path):
    model, _, _, ours = loaded
    hf.save_pretrained(model, str(tmp_path))
    again, _ = hf.from_pretrained(str(tmp_path), **FAST)
    for a, b in zip(
        jax.tree.leaves(nnx.state(again)), jax.tree.leaves(nnx.state(model)), strict=False
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fused_layout_in_memory_names_and_mtp_skipped(torch_model, hf_dir, loaded, tmp_path):
    import torch
    from safetensors.torch import save_file
    state = {k: v.contiguous() for k, v in torch_model.state_dict().items()}
    assert (
        "model.layers.1.mlp.experts.gate_up_proj" in state
        and "model.layers.1.self_attn.sinks" in state
    )
    state["model.mtp.layers.0.proj.weight"] = torch.randn(4, 4)  # multi-token prediction: skipped
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(os.path.join(hf_dir, "config.json")).read())
    model, _ = hf.from_pretrained(str(tmp_path), **FAST)
    assert _rel(_our_logits(model), loaded[2]) <= 1e-5
    out = tmp_path / "out"
    hf.save_pretrained(model, str(out), carry_from=str(tmp_path))  # ... and kept for publishing
    kept = hf._reader(str(out))("model.mtp.layers.0.proj.weight")
    np.testing.assert_array_equal(kept, state["model.mtp.layers.0.proj.weight"].numpy())


def test_packed_row_equals_sequences_alone(loaded):
    model, _, _, _ = loaded
    a, b = TOKENS[0, :7], TOKENS[1, :5]
    row = np.concatenate([a, b])[None]
    seg = jnp.asarray([[1] * 7 + [2] * 5])
    pos = jnp.asarray([list(range(7)) + list(range(5))])
    packed = _our_logits(model, row, segment_ids_BxS=seg, positions_BxS=pos)[0]
    alone = _our_logits(model, np.stack([np.concatenate([a, b]), np.concatenate([b, a])]))
    assert _rel(packed[:7], alone[0, :7]) <= 1e-5
    assert _rel(packed[7:], alone[1, :5]) <= 1e-5


def _ablate(model, **changes):
    cfg = dataclasses.replace(model.cfg, **changes)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, jax.tree.map(jnp.copy, nnx.state(model)))  # a copy: model untouched


@pytest.mark.parametrize("feature", ["window", "sinks", "value_scale", "partial_rotary",
                                     "sliding_theta", "n_group", "scaling", "bias"])
def test_each_feature_changes_logits(loaded, feature):
    model, _, want, _ = loaded
    if feature in ("sinks", "bias"):
        off = _ablate(model)
        for _, sub in nnx.iter_graph(off):
            if feature == "sinks" and hasattr(sub, "sinks") and isinstance(sub, nnx.Module):
                sub.sinks[...] = jnp.full_like(sub.sinks[...], -1e9)
            if feature == "bias" and hasattr(sub, "router_bias"):
                sub.router_bias[...] = jnp.zeros_like(sub.router_bias[...])
    else:
        changes = {"window": dict(sliding_window=S), "value_scale": dict(attention_value_scale=1.0),
                   "partial_rotary": dict(partial_rotary_factor=1.0),
                   "sliding_theta": dict(sliding_rope_theta=1000.0),
                   "n_group": dict(n_group=1, topk_group=1),
                   "scaling": dict(routed_scaling_factor=1.0)}[feature]
        off = _ablate(model, **changes)
    assert _rel(_our_logits(off), want) > 1e-3


def test_block_fp8_dequantization_by_hand():
    # a 130 x 260 weight: 2 x 3 blocks of 128 x 128, the last row and column blocks partial.
    q = np.zeros((130, 260), np.float32)
    q[0, 0], q[129, 0], q[0, 259], q[129, 259], q[127, 128] = 1.5, -2.0, 0.25, 448.0, 3.0
    q8 = q.astype(ml_dtypes.float8_e4m3fn)
    scale = np.array([[0.5, 2.0, 4.0], [8.0, 16.0, 0.125]], np.float32)
    w = hf.dequantize_block_fp8(q8, scale)
    assert w.dtype == np.float32 and w.shape == (130, 260)
    # worked by hand: block (i // 128, j // 128)
    assert w[0, 0] == 1.5 * 0.5 and w[129, 0] == -2.0 * 8.0
    assert w[0, 259] == 0.25 * 4.0 and w[129, 259] == 448.0 * 0.125 and w[127, 128] == 3.0 * 2.0
    assert np.count_nonzero(w) == 5
    with pytest.raises(ValueError, match="weight_scale_inv shape"):
        hf.dequantize_block_fp8(q8, scale[:, :2])


def test_block_fp8_checkpoint_loads(loaded, tmp_path):
    """Every q/k/v/o and expert weight stored e4m3 with per-block scales, as MiMo publishes."""
    model, _, _, _ = loaded
    src = tmp_path / "src"
    hf.save_pretrained(model, str(src))
    tensors = hf._reader(str(src))
    out, deq = {}, {}
    for name in sorted(tensors.names):
        w = tensors(name)
        if name.endswith("proj.weight"):
            scale = np.array([[np.abs(w).max() / 448.0]], np.float32)  # one (partial) block
            q8 = (w / scale[0, 0]).astype(ml_dtypes.float8_e4m3fn)
            out[name], out[name + "_scale_inv"] = q8, scale
            deq[name] = q8.astype(np.float32) * scale[0, 0]
        else:
            out[name] = deq[name] = w
    hf.write_safetensors(str(tmp_path / "model.safetensors"), out)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    fp8, _ = hf.from_pretrained(str(tmp_path), **FAST)
    ref = tmp_path / "ref"
    ref.mkdir()
    hf.write_safetensors(str(ref / "model.safetensors"), deq)
    (ref / "config.json").write_text((src / "config.json").read_text())
    want, _ = hf.from_pretrained(str(ref), **FAST)
    for a, b in zip(
        jax.tree.leaves(nnx.state(fp8)), jax.tree.leaves(nnx.state(want)), strict=False
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(deq["model.layers.1.self_attn.q_proj.weight"],
                              tensors("model.layers.1.self_attn.q_proj.weight"))  # really rounded


def test_unexpressible_configs_are_refused():
    from gagar_jax.hf.families import resolve_family
    from gagar_jax.model.config import ModelConfig
    base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=8, moe_intermediate_size=16, intermediate_size=48, num_experts=4, top_k=2)
    with pytest.raises(
        ValueError, match="hf_family='qwen3_moe' cannot express.*router='sigmoid_bias'"
    ):
        resolve_family(ModelConfig(**base, router="sigmoid_bias", hf_family="qwen3_moe"))
    with pytest.raises(ValueError, match="mimo_v2_flash' cannot express.*qk_norm=True"):
        resolve_family(ModelConfig(**base, router="sigmoid_bias", hf_family="mimo_v2_flash"))
    with pytest.raises(ValueError, match="twice the KV heads"):
        resolve_family(ModelConfig(**base, router="sigmoid_bias", qk_norm=False,
                                   layer_types=("full", "sliding"), sliding_window=4,
                                   attention_sinks=True, hf_family="mimo_v2_flash"))
    # "auto" lets it be built (training without publishing), but no family exports it.
    orphan = ModelConfig(**base, router="sigmoid_bias")
    assert resolve_family(orphan) is None
    with pytest.raises(ValueError, match="cannot be exported"):
        hf.config_to_hf(orphan)
    assert resolve_family(ModelConfig(**base)) == "qwen3_moe"
    assert (
        resolve_family(ModelConfig(**base, router="sigmoid_bias", qk_norm=False)) == "mimo_v2_flash"
    )


def test_unexportable_config_with_publishing_exits_2_before_compiling(
    capsys, tmp_path, monkeypatch
):
    from gagar_jax.run import cli, train
    calls = []
    monkeypatch.setattr(train, "init_train_state", lambda *a, **k: calls.append(1) / 0)
    code = cli.main(["gagar-train", "--config", TINY_CONFIG,
                     "--workdir", str(tmp_path), "--config.model.router=sigmoid_bias",
                     "--config.train.publish_every=1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "publish_every" in err, err
    assert "cannot be exported" in err and "Traceback" not in err
    assert not calls  # refused before the train state was built or anything compiled


def test_published_directory_carries_tokenizer_and_generation_config(loaded, tmp_path):
    from gagar_jax.run import publish
    model, _, _, _ = loaded
    src = tmp_path / "init"
    hf.save_pretrained(model, str(src))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (src / name).write_text(json.dumps({"name": name}))
    final = publish.publish_weights(model, 3, tmp_path / "work", publish.hf_save_fn(str(src)))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert open(os.path.join(final, name)).read() == json.dumps({"name": name})
    header = hf.read_header(os.path.join(final, "model.safetensors"))[0]
    assert header["model.layers.1.self_attn.q_proj.weight"]["dtype"] == "BF16"  # trainer default


def test_routing_replay_and_bias_update_follow_the_layer_pattern(loaded):
    from gagar_jax.model.moe import update_router_bias
    model, cfg, _, ours = loaded
    m = _ablate(model)  # a copy
    _, aux = _our_logits(m, aux=True)
    routed = aux.routed_experts_BxSxLxK
    assert routed.shape == (2, S, cfg.num_moe_layers, cfg.top_k)
    replayed = _our_logits(m, routed_experts_BxSxLxK=routed)
    assert _rel(replayed, ours) <= 1e-5
    # MoE layer l overloads expert l: after one update only (layer l, expert l) loses bias.
    load = np.full((cfg.num_moe_layers, 8), 1.0, np.float32)
    load[np.arange(6), np.arange(6)] = 5.0
    before = {id(b): np.asarray(b[...]) for b, _ in m.moe_router_biases()}
    update_router_bias(m, jnp.asarray(load), 0.1)
    for bias, rows in m.moe_router_biases():
        delta = np.asarray(bias[...]) - before[id(bias)]
        for r, layer in enumerate(rows):
            assert delta[r, layer] == pytest.approx(-0.1) and np.all(np.delete(delta[r], layer) > 0)


def test_init_from_refuses_a_checkpoint_of_another_router(tmp_path):
    """Same parameter shapes are not enough: a softmax (Qwen3) checkpoint must not load into a
    sigmoid-router config."""
    from gagar_jax.config import ConfigError, load_config_file
    from gagar_jax.model.config import ModelConfig
    from gagar_jax.run import init_weights
    from gagar_jax.run.step import StepConfig
    cfg = load_config_file(TINY_CONFIG)
    hf.save_pretrained(
        Transformer(ModelConfig.from_config(cfg.model), rngs=nnx.Rngs(0)), str(tmp_path)
    )
    with cfg.unlocked():
        cfg.model.router = "sigmoid_bias"
    with pytest.raises(ConfigError, match="does not match.*router='softmax'"):
        init_weights.load_hf_params(str(tmp_path), StepConfig.from_config(cfg), None, None)


# ----------------------------------------------------------------------------- engines' keys
HUB_KEYS = ("hybrid_layer_pattern", "moe_layer_freq", "swa_num_attention_heads",
            "swa_num_key_value_heads", "swa_head_dim", "swa_v_head_dim", "num_attention_heads",
            "num_key_value_heads", "head_dim", "v_head_dim", "sliding_window_size",
            "layernorm_epsilon", "add_swa_attention_sink_bias", "add_full_attention_sink_bias",
            "rope_theta", "swa_rope_theta", "partial_rotary_factor", "attention_value_scale",
            "routed_scaling_factor", "n_group", "topk_group", "n_routed_experts",
            "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "attention_bias",
            "hidden_act", "max_position_embeddings")


def test_published_config_carries_the_hub_keys_engines_read(loaded, tmp_path):
    model, cfg, _, _ = loaded
    hf.save_pretrained(model, str(tmp_path))
    c = json.loads((tmp_path / "config.json").read_text())
    assert not [k for k in HUB_KEYS if k not in c]
    assert c["hybrid_layer_pattern"] == [0, 1, 1, 0, 1, 1, 0]
    assert c["moe_layer_freq"] == [0, 1, 1, 1, 1, 1, 1]
    assert (
        c["swa_num_attention_heads"],
        c["swa_num_key_value_heads"],
        c["num_key_value_heads"],
    ) == (4, 2, 1)
    assert (c["swa_head_dim"], c["swa_v_head_dim"], c["head_dim"], c["v_head_dim"]) == (
        12,
        8,
        12,
        8,
    )
    assert (c["rope_theta"], c["swa_rope_theta"], c["partial_rotary_factor"]) == (
        1000.0,
        50.0,
        0.334,
    )
    assert c["add_swa_attention_sink_bias"] is True and c["layernorm_epsilon"] == 1e-5
    # the Hub dialect alone (what vLLM reads) gives the same model
    hub_only = {k: v for k, v in c.items() if k not in (
        "layer_types", "mlp_layer_types", "rope_parameters", "rms_norm_eps", "sliding_window")}
    assert (
        hf.config_from_hf(hub_only)
        == hf.config_from_hf(c)
        == dataclasses.replace(
            cfg,
            param_dtype="float32",
            compute_dtype="float32",
            expert_backend="auto",
            attention="auto",
        )
    )


@pytest.mark.parametrize("convention", ["vllm", "transformers"])
def test_window_convention_round_trips_and_matches_transformers(
    loaded, torch_model, tmp_path, caplog, convention
):
    """W=3 < S: each convention publishes sliding_window_size so that its engine sees W."""
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM
    model, _, want, ours = loaded
    m = _ablate(model, sliding_window_convention=convention)
    with caplog.at_level("WARNING"):
        hf.save_pretrained(m, str(tmp_path))
    c = json.loads((tmp_path / "config.json").read_text())
    assert c["sliding_window"] == 3 and c["gagar_sliding_window_convention"] == convention
    assert c["sliding_window_size"] == {"vllm": 3, "transformers": 2}[convention]
    other = {
        "vllm": "transformers 5.24 reads it as W=4",
        "transformers": "vLLM 0.32 reads it as W=2",
    }
    assert other[convention] in caplog.text
    again, cfg = hf.from_pretrained(str(tmp_path), **FAST)  # the file's convention is kept
    assert (cfg.sliding_window, cfg.sliding_window_convention) == (3, convention)
    assert _rel(_our_logits(again), ours) <= 1e-6
    tf = MiMoV2FlashForCausalLM.from_pretrained(str(tmp_path)).eval()
    if convention == "transformers":  # transformers sees the learner's window
        assert tf.config.sliding_window == 3 and _rel(_torch_logits(tf), want) <= 1e-5
    else:  # transformers sees one key more; told the window, it matches
        assert tf.config.sliding_window == 4 and _rel(_torch_logits(tf), want) > 1e-3
        told = MiMoV2FlashConfig.from_pretrained(str(tmp_path))
        told.sliding_window = 3
        tf = MiMoV2FlashForCausalLM.from_pretrained(str(tmp_path), config=told).eval()
        assert _rel(_torch_logits(tf), want) <= 1e-5
    # the other reading of the same file: one key more or less
    _, flipped = hf.from_pretrained(str(tmp_path), sliding_window_convention=(
        "transformers" if convention == "vllm" else "vllm"), **FAST)
    assert flipped.sliding_window == {"vllm": 4, "transformers": 2}[convention]


def test_hub_checkpoint_window_and_configs_keep_their_meaning():
    from gagar_jax.hf.config_json import window_of
    from gagar_jax.model.config import ModelConfig
    assert window_of({"sliding_window_size": 128}, "vllm") == 128
    assert window_of({"sliding_window_size": 128}, "transformers") == 129
    assert (
        window_of({"sliding_window": 7}, "vllm")
        == window_of({"sliding_window": 7}, "transformers")
        == 7
    )
    flash = ModelConfig.from_config(
        load_config("flash_310b").model
    )
    assert (flash.sliding_window, flash.sliding_window_convention) == (129, "transformers")
    assert hf.config_to_hf(flash)["sliding_window_size"] == 128  # the Hub checkpoint's value
    tiny = ModelConfig.from_config(
        load_config("tiny_mimo").model
    )
    assert (tiny.sliding_window, hf.config_to_hf(tiny)["sliding_window_size"]) == (32, 32)
    with pytest.raises(ValueError, match="sliding_window_convention"):
        dataclasses.replace(tiny, sliding_window_convention="sglang")


def test_published_config_keeps_the_source_keys(loaded, hf_dir, tmp_path):
    """A publish from `init_from` carries every config.json key the model does not set (here
    max_position_embeddings 4096 and bos_token_id 1, which a serving engine reads) and never
    the source's quantization; without a source, max_position_embeddings >= the feed's seq_len."""
    import shutil

    from gagar_jax.hf.config_json import published_config
    from gagar_jax.run import publish
    model, cfg, _, _ = loaded
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    base = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(
        {**base, "max_position_embeddings": 4096, "bos_token_id": 1, "serving_hint": "kept"}))
    pub = publish.Publisher(tmp_path / "w", init_from=str(src), min_positions=128)
    path = pub.publish(model, 1)
    pub.wait()
    out = json.loads((tmp_path / "w" / "published" / os.path.basename(path) / "config.json")
                     .read_text())
    assert (out["max_position_embeddings"], out["bos_token_id"], out["serving_hint"]) == (
        4096, 1, "kept")
    assert out["hidden_size"] == cfg.hidden_size and out["dtype"] == "bfloat16"
    fp8 = {**base, "quantization_config": {"quant_method": "fp8"}, "torch_dtype": "float8"}
    got = published_config(cfg, "bfloat16", fp8, min_positions=262144)
    assert "quantization_config" not in got and got["torch_dtype"] == "bfloat16"
    assert got["max_position_embeddings"] == base.get("max_position_embeddings", 262144)
    assert published_config(cfg, "bfloat16", None, 262144)["max_position_embeddings"] == 262144
    assert published_config(cfg, "bfloat16", None, 128)["max_position_embeddings"] == 131072

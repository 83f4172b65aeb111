"""Hugging Face Qwen3-MoE parity: transformers -> ours -> transformers, both config dialects,
fused and per-expert weight layouts, sharded index files."""
import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gagar_jax import sharding
from gagar_jax.hf import api as hf

# torch and transformers are imported where used: at module level they were ~7 s of every
# xdist worker's collection.
FAST = dict(expert_backend="dense", attention="plain")  # cheapest compile; math is the same
TOKENS = np.random.default_rng(0).integers(0, 64, size=(2, 12))


def _hf_config(**kw):
    from transformers import Qwen3MoeConfig
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, rms_norm_eps=1e-6)
    base.update(kw)
    return Qwen3MoeConfig(**base)


@pytest.fixture(scope="module")
def torch_model():
    import torch
    from transformers import Qwen3MoeForCausalLM
    torch.manual_seed(0)
    m = Qwen3MoeForCausalLM(_hf_config()).eval()
    with torch.no_grad():  # HF's 0.02 init gives near-uniform logits: use larger weights
        for name, p in m.named_parameters():
            p.copy_(
                1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p)
            )
    return m


def _torch_logits(m, tokens=TOKENS):
    import torch
    with torch.no_grad():
        return m(torch.tensor(tokens)).logits.float().numpy()


def _our_logits(model, tokens=TOKENS):
    return np.asarray(nnx.jit(lambda m, t: m(t)[0])(model, jnp.asarray(tokens)))


@pytest.fixture(scope="module")
def hf_dir(torch_model, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hf"))
    torch_model.save_pretrained(d)
    return d


def test_transformers_checkpoint_loads_with_equal_logits(torch_model, hf_dir):
    model, cfg = hf.from_pretrained(hf_dir, **FAST)
    assert (cfg.num_dense_layers, cfg.num_experts, cfg.top_k, cfg.rope_theta) == (1, 4, 2, 1000.0)
    want = _torch_logits(torch_model)
    assert np.abs(want).max() > 0.5  # not trivially small
    np.testing.assert_allclose(_our_logits(model), want, atol=1e-4)


def test_export_reloads_in_transformers(torch_model, hf_dir, tmp_path):
    from transformers import Qwen3MoeForCausalLM
    model, _ = hf.from_pretrained(hf_dir, **FAST)
    hf.save_pretrained(model, str(tmp_path), max_shard_bytes=40_000)  # force several shards
    assert os.path.exists(tmp_path / hf.INDEX_FILE)
    reloaded = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path)).eval()
    np.testing.assert_allclose(_torch_logits(reloaded), _torch_logits(torch_model), atol=1e-5)
    again, _ = hf.from_pretrained(str(tmp_path), **FAST)  # and our own sharded files load back
    np.testing.assert_allclose(_our_logits(again), _our_logits(model), atol=1e-6)


def test_export_of_host_numpy_weights(hf_dir, tmp_path):
    """A model whose state holds host numpy arrays (e.g. after nnx.update) exports too."""
    model, _ = hf.from_pretrained(hf_dir, **FAST)
    want = _our_logits(model)
    nnx.update(model, jax.tree.map(np.asarray, nnx.state(model)))
    hf.save_pretrained(model, str(tmp_path))
    again, _ = hf.from_pretrained(str(tmp_path), **FAST)
    np.testing.assert_allclose(_our_logits(again), want, atol=1e-6)


def test_load_onto_a_mesh_places_shards(hf_dir, devices):
    mesh = sharding.make_mesh(types.SimpleNamespace(data=1, fsdp=2, expert=2, tensor=2))
    model, _ = hf.from_pretrained(hf_dir, mesh=mesh, **FAST)
    gate = model.moe_layers.mlp.expert_gate[...]
    assert gate.sharding == NamedSharding(mesh, P(None, "expert", "fsdp", "tensor"))
    ref, _ = hf.from_pretrained(hf_dir, **FAST)
    np.testing.assert_array_equal(np.asarray(gate), np.asarray(ref.moe_layers.mlp.expert_gate[...]))


def test_fused_expert_layout_and_hub_style_config(torch_model, hf_dir, tmp_path):
    # transformers keeps experts fused in memory (experts.gate_up_proj); store that layout.
    from safetensors.torch import save_file
    state = {k: v.contiguous() for k, v in torch_model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    hub = {  # as published with Qwen3-30B-A3B: num_experts, rope_theta, no rope_parameters
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 64,
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
        "norm_topk_prob": True, "mlp_only_layers": [0], "decoder_sparse_step": 1,
        "rope_theta": 1000.0, "rope_scaling": None, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(hub))
    model, cfg = hf.from_pretrained(str(tmp_path), **FAST)
    assert cfg.num_experts == 4 and cfg.rope_theta == 1000.0
    np.testing.assert_allclose(_our_logits(model), _torch_logits(torch_model), atol=1e-4)


def test_config_errors_are_clear():
    good = hf.config_to_hf(hf.config_from_hf(_hf_config().to_dict()))
    with pytest.raises(ValueError, match="dense layers must come first"):
        hf.config_from_hf({**good, "mlp_only_layers": [], "decoder_sparse_step": 2})
    with pytest.raises(ValueError, match="RoPE"):
        hf.config_from_hf({**good, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="model_type"):
        hf.config_from_hf({**good, "model_type": "llama"})
    n = dict(good)
    del n["num_local_experts"], n["num_experts"]
    with pytest.raises(ValueError, match="num_experts"):
        hf.config_from_hf(n)


def test_tied_all_moe_model_exports_to_transformers(tmp_path):
    from transformers import Qwen3MoeForCausalLM

    from gagar_jax.model.transformer import ModelConfig, Transformer
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, moe_intermediate_size=16, intermediate_size=48, num_experts=4,
                      top_k=2, norm_topk_prob=False, tie_embeddings=True, rope_theta=500.0, **FAST)
    ours = Transformer(cfg, rngs=nnx.Rngs(3))
    ours.embedding[...] = 10 * ours.embedding[...]  # logits of order 1, not 0.1
    hf.save_pretrained(ours, str(tmp_path))
    theirs = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert theirs.config.tie_word_embeddings and theirs.config.mlp_only_layers == []
    want = _our_logits(ours)
    assert np.abs(want).max() > 0.5
    np.testing.assert_allclose(_torch_logits(theirs), want, atol=1e-4)

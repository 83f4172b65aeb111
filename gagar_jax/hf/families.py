"""Hugging Face checkpoint families as plain data: tensor names, transforms, fp32-kept tensors,
and what each family can express.

One `Family` per `config.json` `model_type`. The sharded loader and saver (`hf_load`, `hf_save`)
walk these tables, so names and transforms live here as data, not code.

A `TensorSpec` maps one of our parameters (its path inside a decoder layer, e.g. "attn/wq", or at
the top of the model, e.g. "embedding") to a checkpoint name. "{i}" in a name is the layer index,
"{e}" the expert index. Transforms (load: `load.view_of`, save: `save.save_transform`;
HF Linear weights are [out, in], ours [in, out] with heads split out):

  copy         same array (norm scales, embeddings, sinks, the correction bias)
  linear       [out, in] -> [in, out]
  heads_out    q/k/v_proj [H*Dh, D] -> [D, H, Dh]
  heads_in     o_proj [D, H*Dv] -> [H, Dv, D]
  per_expert   experts.{e}.X_proj.weight [out, in] for every e -> [E, in, out]
  fused_gate   experts.gate_up_proj [E, 2F, D], first F rows -> [E, D, F]
  fused_up     experts.gate_up_proj [E, 2F, D], last F rows -> [E, D, F]
  fused_down   experts.down_proj [E, D, F] -> [E, F, D]

`save_pretrained` writes `hf` names with the forward transform (the per-expert layout, which
transformers saves and vLLM / SGLang read); `from_pretrained` also accepts `load_aliases` and the
`fused` layout (what transformers holds in memory and may be handed as a checkpoint).
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    ours: str                  # our parameter path (inside a layer, or at the model's top)
    hf: str                    # checkpoint name; {i} = layer, {e} = expert
    transform: str             # one of the transforms listed above
    fp32: bool = False         # written float32 whatever the publishing dtype
    load_aliases: tuple = ()   # further names accepted on load
    fused: tuple = ()          # (name, transform) of the fused-expert layout, accepted on load


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    top: tuple                 # TensorSpecs outside the layers
    layer: tuple               # TensorSpecs of layer {i} (a spec applies where our parameter
                               # exists)
    zero_if_absent: tuple = ()  # our layer parameters the family does not store (filled with 0)
    carried_prefixes: tuple = ()  # skipped on load, copied into published directories (MTP)


_L = "model.layers.{i}."
_TOP = (
    TensorSpec("embedding", "model.embed_tokens.weight", "copy"),
    TensorSpec("final_norm/scale", "model.norm.weight", "copy"),
    TensorSpec("lm_head", "lm_head.weight", "linear"),
)
_COMMON = (
    TensorSpec("attn_norm/scale", _L + "input_layernorm.weight", "copy"),
    TensorSpec("mlp_norm/scale", _L + "post_attention_layernorm.weight", "copy"),
    TensorSpec("attn/wq", _L + "self_attn.q_proj.weight", "heads_out"),
    TensorSpec("attn/wk", _L + "self_attn.k_proj.weight", "heads_out"),
    TensorSpec("attn/wv", _L + "self_attn.v_proj.weight", "heads_out"),
    TensorSpec("attn/wo", _L + "self_attn.o_proj.weight", "heads_in"),
    TensorSpec("mlp/mlp_gate", _L + "mlp.gate_proj.weight", "linear"),
    TensorSpec("mlp/mlp_up", _L + "mlp.up_proj.weight", "linear"),
    TensorSpec("mlp/mlp_down", _L + "mlp.down_proj.weight", "linear"),
    TensorSpec("mlp/expert_gate", _L + "mlp.experts.{e}.gate_proj.weight", "per_expert",
               fused=(_L + "mlp.experts.gate_up_proj", "fused_gate")),
    TensorSpec("mlp/expert_up", _L + "mlp.experts.{e}.up_proj.weight", "per_expert",
               fused=(_L + "mlp.experts.gate_up_proj", "fused_up")),
    TensorSpec("mlp/expert_down", _L + "mlp.experts.{e}.down_proj.weight", "per_expert",
               fused=(_L + "mlp.experts.down_proj", "fused_down")),
)

QWEN3_MOE = Family(
    model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", top=_TOP,
    layer=_COMMON + (
        TensorSpec("attn/q_norm/scale", _L + "self_attn.q_norm.weight", "copy"),
        TensorSpec("attn/k_norm/scale", _L + "self_attn.k_norm.weight", "copy"),
        TensorSpec("mlp/router", _L + "mlp.gate.weight", "linear"),
    ),
    zero_if_absent=("mlp/router_bias",))

MIMO_V2_FLASH = Family(
    model_type="mimo_v2_flash", architecture="MiMoV2FlashForCausalLM", top=_TOP,
    layer=_COMMON + (
        TensorSpec("attn/sinks", _L + "self_attn.attention_sink_bias", "copy",
                   load_aliases=(_L + "self_attn.sinks",)),
        # transformers keeps the router and its correction bias in float32 (any model dtype).
        TensorSpec("mlp/router", _L + "mlp.gate.weight", "linear", fp32=True),
        TensorSpec("mlp/router_bias", _L + "mlp.gate.e_score_correction_bias", "copy", fp32=True),
    ),
    carried_prefixes=("model.mtp.",))

FAMILIES = {f.model_type: f for f in (QWEN3_MOE, MIMO_V2_FLASH)}  # "auto" tries them in this order


def _qwen3_moe_refusals(cfg: Any) -> list:
    out = []
    if cfg.router != "softmax":
        out.append(f"router={cfg.router!r} (Qwen3-MoE routes by softmax)")
    if cfg.has_sliding:
        out.append("sliding-window layers")
    if cfg.value_head_dim != cfg.head_dim:
        out.append(f"v_head_dim={cfg.v_head_dim} != head_dim")
    if not cfg.qk_norm:
        out.append("qk_norm=False")
    for name, default in (("attention_value_scale", 1.0), ("partial_rotary_factor", 1.0),
                          ("n_group", 1), ("topk_group", 1), ("routed_scaling_factor", 1.0)):
        if getattr(cfg, name) != default:
            out.append(f"{name}={getattr(cfg, name)}")
    return out


def _mimo_v2_flash_refusals(cfg: Any) -> list:
    out = []
    if cfg.router != "sigmoid_bias":
        out.append(
            f"router={cfg.router!r} (MiMo-V2-Flash routes by sigmoid with a correction bias)"
        )
    if cfg.qk_norm:
        out.append("qk_norm=True (MiMo-V2-Flash has no q/k norm)")
    if cfg.has_sliding and not cfg.attention_sinks:
        out.append("sliding layers without attention_sinks (every MiMo sliding layer has sinks)")
    if cfg.has_sliding and cfg.sliding_kv_heads != 2 * cfg.num_kv_heads:
        out.append(f"sliding_num_kv_heads={cfg.sliding_kv_heads} != 2 * num_kv_heads "
                   f"(MiMo sliding layers have twice the KV heads)")
    return out


REFUSALS = {"qwen3_moe": _qwen3_moe_refusals, "mimo_v2_flash": _mimo_v2_flash_refusals}


def refusals(cfg: Any, family: str) -> list:
    """Reasons `family` cannot express the ModelConfig `cfg` (empty: it can)."""
    return REFUSALS[family](cfg)


def resolve_family(cfg: Any) -> str | None:
    """The export family of `cfg` (a model_type) or None where "auto" finds none.

    Raises:
      ValueError: `cfg.hf_family` names an unknown family or one that cannot express `cfg`.
    """
    if cfg.hf_family == "auto":
        return next((name for name in FAMILIES if not refusals(cfg, name)), None)
    if cfg.hf_family not in FAMILIES:
        raise ValueError(f"model.hf_family must be 'auto' or one of {sorted(FAMILIES)}, "
                         f"got {cfg.hf_family!r}")
    reasons = refusals(cfg, cfg.hf_family)
    if reasons:
        raise ValueError(f"model.hf_family={cfg.hf_family!r} cannot express this config: "
                         + "; ".join(reasons))
    return cfg.hf_family


def export_error(cfg: Any) -> str:
    """One line saying why no family can express `cfg` ("" if one can)."""
    if resolve_family(cfg) is not None:
        return ""
    why = "; ".join(f"{name}: {', '.join(refusals(cfg, name))}" for name in FAMILIES)
    return f"model cannot be exported to any Hugging Face family ({why})"

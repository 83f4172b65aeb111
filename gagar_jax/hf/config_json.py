"""config.json <-> ModelConfig for each Hugging Face family (`hf_families.FAMILIES`).

Qwen3-MoE: both the layout current transformers writes (`num_local_experts`, `rope_parameters`)
and the one published with Hub checkpoints (`num_experts`, `rope_theta`).
MiMo-V2-Flash: transformers' `MiMoV2FlashConfig` (absent keys take its defaults, `MIMO_DEFAULTS`),
and the Hub checkpoint's (what vLLM and SGLang read: `hybrid_layer_pattern`, `swa_*`,
`sliding_window_size`, ...; null `routed_scaling_factor`). Writing gives both sets of keys, so
transformers and vLLM load one directory. How `sliding_window_size` maps to the window is
`ModelConfig.sliding_window_convention` (`window_of`, `hub_window_size`; docs/model.md).
"""
from __future__ import annotations

from gagar_jax.hf import families as hf_families
from gagar_jax.model.config import SLIDING_WINDOW_CONVENTIONS, ModelConfig

CONVENTION_KEY = "gagar_sliding_window_convention"  # written by publishing, read on load

# transformers 5.24 MiMoV2FlashConfig defaults (read from its configuration file).
MIMO_DEFAULTS = dict(
    vocab_size=152576, hidden_size=4096, intermediate_size=16384, num_hidden_layers=48,
    num_attention_heads=64, num_key_value_heads=4, rms_norm_eps=1e-5, tie_word_embeddings=False,
    moe_intermediate_size=2048, num_experts_per_tok=8, n_routed_experts=256,
    routed_scaling_factor=1.0, n_group=1, topk_group=1, norm_topk_prob=True, head_dim=192,
    v_head_dim=128, sliding_window=129, attention_value_scale=0.707, max_position_embeddings=131072)
MIMO_ROPE_DEFAULTS = {
    "full_attention": {
        "rope_type": "default",
        "rope_theta": 5_000_000.0,
        "partial_rotary_factor": 0.334,
    },
    "sliding_attention": {
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "partial_rotary_factor": 0.334,
    },
}
_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


def _common_checks(hf: dict) -> None:
    if hf.get("attention_bias", False):
        raise ValueError("config.json attention_bias=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={hf['hidden_act']!r}; only 'silu' is supported")


def _dense_prefix(is_moe: list, why: str) -> int:
    num_dense = is_moe.index(True) if any(is_moe) else len(is_moe)
    if any(is_moe[:num_dense]) or not all(is_moe[num_dense:]):
        raise ValueError(f"dense layers must come first; {why} gives MoE layers {is_moe}")
    return num_dense


def _qwen3_from_hf(hf: dict) -> dict:
    if hf.get("use_sliding_window", False):
        raise ValueError(
            "config.json use_sliding_window=true is not supported by the Qwen3-MoE port"
        )
    rope = hf.get("rope_parameters") or {}
    if (rope.get("rope_type") or "default") != "default" or hf.get("rope_scaling"):
        raise ValueError(f"only default RoPE is supported, got rope_parameters={rope}, "
                         f"rope_scaling={hf.get('rope_scaling')}")
    n_layers = hf["num_hidden_layers"]
    num_experts = hf.get("num_local_experts", hf.get("num_experts"))
    if not num_experts:
        raise ValueError("config.json has neither num_local_experts nor num_experts")
    mlp_only, step = set(hf.get("mlp_only_layers") or []), hf.get("decoder_sparse_step", 1)
    is_moe = [i not in mlp_only and (i + 1) % step == 0 for i in range(n_layers)]
    heads = hf["num_attention_heads"]
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        moe_intermediate_size=hf["moe_intermediate_size"],
        intermediate_size=hf["intermediate_size"],
        num_dense_layers=_dense_prefix(
            is_moe, f"mlp_only_layers={sorted(mlp_only)}, decoder_sparse_step={step}"
        ),
        num_experts=num_experts,
        top_k=hf["num_experts_per_tok"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 1e-3)),
        hf_family="qwen3_moe",
    )


def _hub_pattern(hf: dict, key: str, n: int) -> list | None:
    """A Hub per-layer 0/1 list (`hybrid_layer_pattern`, `moe_layer_freq`), None if absent."""
    v = hf.get(key)
    if v is None:
        return None
    if isinstance(v, int):  # vLLM reads an int moe_layer_freq as "no MoE layer"
        v = [0] * n
    if len(v) != n or set(v) - {0, 1}:
        raise ValueError(f"config.json {key} must list {n} zeros and ones, got {v}")
    return list(v)


def window_of(hf: dict, convention: str) -> int:
    """W (keys a query sees counting itself) of a MiMo config.json under `convention`.

    `sliding_window_size` (Hub, the key vLLM and SGLang read) N gives W = N under "vllm" and
    N + 1 under "transformers"; without it, transformers' own `sliding_window` is W.
    """
    if convention not in SLIDING_WINDOW_CONVENTIONS:
        raise ValueError(f"sliding_window_convention must be one of {SLIDING_WINDOW_CONVENTIONS}, "
                         f"got {convention!r}")
    if hf.get("sliding_window_size") is not None:
        return int(hf["sliding_window_size"]) + (1 if convention == "transformers" else 0)
    return int(hf.get("sliding_window") or MIMO_DEFAULTS["sliding_window"])


def _mimo_from_hf(hf: dict, convention: str = "vllm") -> dict:
    """Both dialects: transformers' keys where present, else the Hub's (what vLLM reads)."""
    h = {**MIMO_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    n = h["num_hidden_layers"]
    hybrid = _hub_pattern(hf, "hybrid_layer_pattern", n)
    types = hf.get("layer_types") or (
        ["sliding_attention" if b else "full_attention" for b in hybrid] if hybrid is not None else
        ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)])
    bad = sorted(set(types) - set(_TYPES))
    if bad or len(types) != n:
        raise ValueError(f"config.json layer_types must list {n} of {sorted(_TYPES)}, got {types}")
    moe_freq = _hub_pattern(hf, "moe_layer_freq", n)
    mlp_types = hf.get("mlp_layer_types") or (
        ["sparse" if b else "dense" for b in moe_freq] if moe_freq is not None else
        ["dense"] + ["sparse"] * (n - 1))
    rope = hf.get("rope_parameters")
    if not rope and hf.get("rope_theta") is not None:  # Hub dialect: flat rope keys
        f = float(hf.get("partial_rotary_factor", 1.0))  # vLLM's default
        rope = {"full_attention": {"rope_type": "default", "rope_theta": hf["rope_theta"],
                                   "partial_rotary_factor": f},
                "sliding_attention": {"rope_type": "default", "partial_rotary_factor": f,
                                      "rope_theta": hf.get("swa_rope_theta", hf["rope_theta"])}}
    rope = rope or MIMO_ROPE_DEFAULTS
    for t in set(types):
        r = rope.get(t) or {}
        if (r.get("rope_type") or "default") != "default":
            raise ValueError(f"only default RoPE is supported, got rope_parameters[{t!r}]={r}")
    factors = {float((rope.get(t) or {}).get("partial_rotary_factor", 0.334)) for t in set(types)}
    if len(factors) != 1:
        raise ValueError(f"full and sliding layers with different partial_rotary_factor {factors} "
                         "are not supported")
    has_sliding = "sliding_attention" in types
    kv = h["num_key_value_heads"]
    swa_kv = h.get("swa_num_key_value_heads", 2 * kv)  # transformers: twice, hard-coded
    for key, full in (
        ("swa_num_attention_heads", "num_attention_heads"),
        ("swa_head_dim", "head_dim"),
        ("swa_v_head_dim", "v_head_dim"),
    ):
        if has_sliding and h.get(key) is not None and h[key] != h[full]:
            raise ValueError(f"config.json {key}={h[key]} != {full}={h[full]} is not supported")
    if has_sliding and hf.get("add_swa_attention_sink_bias") is False:
        raise ValueError("config.json add_swa_attention_sink_bias=false is not supported "
                         "(every MiMo sliding layer has sinks)")
    theta = lambda t: float((rope.get(t) or MIMO_ROPE_DEFAULTS[t])["rope_theta"])
    eps = hf.get("rms_norm_eps", hf.get("layernorm_epsilon", MIMO_DEFAULTS["rms_norm_eps"]))
    return dict(
        vocab_size=h["vocab_size"], hidden_size=h["hidden_size"], num_layers=n,
        num_heads=h["num_attention_heads"], num_kv_heads=kv,
        sliding_num_kv_heads=swa_kv if has_sliding else 0,
        head_dim=h["head_dim"], v_head_dim=h["v_head_dim"],
        moe_intermediate_size=h["moe_intermediate_size"], intermediate_size=h["intermediate_size"],
        num_dense_layers=_dense_prefix([t == "sparse" for t in mlp_types], "mlp_layer_types"),
        num_experts=hf.get("n_routed_experts", hf.get("num_local_experts", h["n_routed_experts"])),
        top_k=h["num_experts_per_tok"], norm_topk_prob=bool(h["norm_topk_prob"]),
        router="sigmoid_bias", n_group=h["n_group"], topk_group=h["topk_group"],
        routed_scaling_factor=float(h["routed_scaling_factor"]),
        layer_types=tuple(_TYPES[t] for t in types),
        sliding_window=window_of(hf, convention) if has_sliding else 0,
        sliding_window_convention=convention,
        attention_sinks=has_sliding, qk_norm=False,
        attention_value_scale=float(h["attention_value_scale"]),
        partial_rotary_factor=factors.pop(), rope_theta=theta("full_attention"),
        sliding_rope_theta=theta("sliding_attention") if has_sliding else 0.0,
        rms_norm_eps=float(eps), tie_embeddings=bool(h["tie_word_embeddings"]),
        hf_family="mimo_v2_flash")


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """ModelConfig from a config.json dict; `overrides` set our runtime-only fields.

    MiMo's `sliding_window_convention` (how `sliding_window_size` maps to the window) is the
    override's if given, else the file's `gagar_sliding_window_convention` (written by our
    publishing), else "vllm".
    """
    model_type = hf.get("model_type", "qwen3_moe")
    if model_type not in ("qwen3_moe", "mimo_v2_flash"):
        raise ValueError(f"config.json model_type is {model_type!r}, expected one of "
                         f"['mimo_v2_flash', 'qwen3_moe']")
    _common_checks(hf)
    if model_type == "mimo_v2_flash":
        kw = _mimo_from_hf(hf, overrides.get("sliding_window_convention")
                           or hf.get(CONVENTION_KEY) or "vllm")
    else:
        kw = _qwen3_from_hf(hf)
    kw.update(overrides)
    return ModelConfig(**kw)


def _qwen3_to_hf(cfg: ModelConfig) -> dict:
    return {
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_local_experts": cfg.num_experts,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k,
        "norm_topk_prob": cfg.norm_topk_prob,
        "mlp_only_layers": list(range(cfg.num_dense_layers)),
        "decoder_sparse_step": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,
        "use_sliding_window": False,
        "max_position_embeddings": 32768,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
    }


def hub_window_size(cfg: ModelConfig) -> int:
    """`sliding_window_size` to publish for the learner's window W under its convention."""
    w = cfg.sliding_window or MIMO_DEFAULTS["sliding_window"]
    return w - 1 if cfg.sliding_window_convention == "transformers" else w


def _mimo_to_hf(cfg: ModelConfig) -> dict:
    """transformers' keys and, beside them, the Hub checkpoint's (read by vLLM and SGLang)."""
    rope = lambda theta: {"rope_type": "default", "rope_theta": theta,
                          "partial_rotary_factor": cfg.partial_rotary_factor}
    types = [cfg.is_sliding(i) for i in range(cfg.num_layers)]
    swa_theta = cfg.sliding_rope_theta or cfg.rope_theta
    return {
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "v_head_dim": cfg.value_head_dim,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k,
        "norm_topk_prob": cfg.norm_topk_prob,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "layer_types": ["sliding_attention" if t else "full_attention" for t in types],
        "mlp_layer_types": ["dense"] * cfg.num_dense_layers + ["sparse"] * cfg.num_moe_layers,
        "sliding_window": cfg.sliding_window or MIMO_DEFAULTS["sliding_window"],
        "attention_value_scale": cfg.attention_value_scale,
        "rope_parameters": {
            "full_attention": rope(cfg.rope_theta),
            "sliding_attention": rope(swa_theta),
        },
        "max_position_embeddings": MIMO_DEFAULTS["max_position_embeddings"],
        # The Hub checkpoint's keys (vLLM 0.32 mimo_v2.py, SGLang); transformers ignores them,
        # except sliding_window_size, which transformers 5.24 reads as N + 1 (`window_of`).
        "hybrid_layer_pattern": [int(t) for t in types],
        "moe_layer_freq": [0] * cfg.num_dense_layers + [1] * cfg.num_moe_layers,
        "swa_num_attention_heads": cfg.num_heads,
        "swa_num_key_value_heads": cfg.sliding_kv_heads,
        "swa_head_dim": cfg.head_dim,
        "swa_v_head_dim": cfg.value_head_dim,
        "sliding_window_size": hub_window_size(cfg),
        CONVENTION_KEY: cfg.sliding_window_convention,
        "add_swa_attention_sink_bias": bool(cfg.has_sliding and cfg.attention_sinks),
        "add_full_attention_sink_bias": False,
        "layernorm_epsilon": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "swa_rope_theta": swa_theta,
        "partial_rotary_factor": cfg.partial_rotary_factor,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_shared_experts": None,
        "moe_router_dtype": "float32",
    }


def engine_warnings(cfg: ModelConfig) -> list:
    """What a published directory of `cfg` makes an engine run differently from the learner
    (docs/model.md, "vLLM, transformers and this project"); empty when nothing."""
    if hf_families.resolve_family(cfg) != "mimo_v2_flash":
        return []
    out = []
    if cfg.has_sliding:
        n, w = hub_window_size(cfg), cfg.sliding_window
        if cfg.sliding_window_convention == "vllm":
            out.append(f"sliding window: the learner trains W={w} keys counting the query "
                       f"(sliding_window_convention='vllm'); vLLM and SGLang read the published "
                       f"sliding_window_size={n} as W={w}, but transformers 5.24 reads it as "
                       f"W={n + 1}")
        else:
            out.append(f"sliding window: the learner trains W={w} keys counting the query "
                       f"(sliding_window_convention='transformers'); transformers 5.24 reads the "
                       f"published sliding_window_size={n} as W={w}, but vLLM 0.32 reads it as "
                       f"W={n}")
    if cfg.routed_scaling_factor != 1.0:
        out.append(f"routed_scaling_factor={cfg.routed_scaling_factor}: vLLM 0.32 mimo_v2 ignores "
                   "it (runs 1.0)")
    if cfg.value_head_dim != cfg.head_dim:
        out.append(f"v_head_dim={cfg.value_head_dim} != head_dim={cfg.head_dim}: vLLM 0.32's CPU "
                   "build cannot run it (TRITON_ATTN_DIFFKV needs triton)")
    return out


def config_to_hf(cfg: ModelConfig, dtype: str = "") -> dict:
    """config.json dict of `cfg`'s export family, in the layout transformers writes.

    Raises:
      ValueError: no family can express `cfg` (the message says why for each).
    """
    family = hf_families.resolve_family(cfg)
    if family is None:
        raise ValueError(hf_families.export_error(cfg))
    writer = {"qwen3_moe": _qwen3_to_hf, "mimo_v2_flash": _mimo_to_hf}[family]
    return {
        "architectures": [hf_families.FAMILIES[family].architecture], "model_type": family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu", "attention_bias": False, "dtype": dtype or cfg.param_dtype,
        **writer(cfg),
    }


# Keys of a source config.json never carried into a published one: the published weights are
# not quantized (block-FP8 is dequantized on load), and `auto_map` names remote-code files the
# published directory does not hold.
NOT_CARRIED = ("quantization_config", "auto_map")


def published_config(cfg: ModelConfig, dtype: str = "", source: dict | None = None,
                     min_positions: int = 0) -> dict:
    """The config.json to publish: `config_to_hf(cfg, dtype)` over the source checkpoint's.

    Every key of `source` (the `init_from` config.json) that the model does not set is carried
    over unchanged (`bos_token_id`, `eos_token_id`, `max_position_embeddings`, ...), except
    `NOT_CARRIED`; a source `torch_dtype` is set to the published dtype. Without a source
    `max_position_embeddings`, it is the family's default but at least `min_positions` (the
    feed's seq_len), so an engine never refuses the lengths the learner trained on.
    """
    ours = config_to_hf(cfg, dtype)
    src = {k: v for k, v in (source or {}).items() if k not in NOT_CARRIED}
    out = {**src, **ours}
    if src.get("max_position_embeddings"):
        out["max_position_embeddings"] = src["max_position_embeddings"]
    else:
        out["max_position_embeddings"] = max(int(ours["max_position_embeddings"]),
                                             int(min_positions))
    if "torch_dtype" in src:
        out["torch_dtype"] = ours["dtype"]
    return out


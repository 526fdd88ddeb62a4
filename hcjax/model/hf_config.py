"""Hugging Face `config.json` <-> `ModelConfig` for the open families we load and export.

The one place that owns the architecture mapping both ways (`from_hf_config`, `to_hf_config`), so
import and export cannot drift apart; tensor names and layouts live with the weight converter. It
never guesses: a key or value these families' models cannot honour is a ValueError naming it.
Absent keys take the default of the transformers config class (5.x) of that model_type.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hcjax.model.config import ModelConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3", "kimi_k2")

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",  # Kimi K2 ships DeepSeek-V3's modelling code
}

# The defaults of transformers' config classes, for the keys we read. None where the class derives
# the value (head_dim = hidden_size // num_attention_heads, num_key_value_heads = heads).
_COMMON_DEFAULTS = {
    "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
    "rope_theta": 10_000.0,
}
_DEEPSEEK_DEFAULTS = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": None, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_interleave": True,
    # Not fields of transformers' class: its DeepseekV3 always routes this way.
    "moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
}
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
        "head_dim": None, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "mlp_bias": False,
    },
    "qwen3": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "head_dim": 128, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "use_sliding_window": False, "layer_types": None,
    },
    "qwen3_moe": {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": None, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "use_sliding_window": False, "decoder_sparse_step": 1, "moe_intermediate_size": 768,
        "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False,
        "mlp_only_layers": None, "layer_types": None,
    },
    "gpt_oss": {
        "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4,
        "sliding_window": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True, "layer_types": None,
        "rope_theta": 150000.0,
    },
    "deepseek_v3": _DEEPSEEK_DEFAULTS,
    "kimi_k2": _DEEPSEEK_DEFAULTS,
}
# RoPE scaling when a config has neither rope_parameters nor rope_scaling (GPT-OSS's class fills
# in its YaRN setting; the others use plain RoPE).
_DEFAULT_ROPE = {
    "gpt_oss": {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096,
    },
}
_LAYER_KINDS = {"sliding_attention": "local", "full_attention": "global"}
_ROPE_TYPES = {"default": "none", "llama3": "llama3", "yarn": "yarn"}

# Keys `to_hf_config` owns: the architecture is written from the ModelConfig, never a `base`'s.
_OWNED_KEYS = frozenset(
    {k for defaults in _HF_DEFAULTS.values() for k in defaults}
    | set(_COMMON_DEFAULTS)
    | {
        "architectures", "model_type", "dtype", "torch_dtype", "rope_parameters", "rope_scaling",
        "rope_theta", "partial_rotary_factor", "num_experts", "num_local_experts",
        "experts_per_token", "sliding_window", "qk_head_dim",
        "quantization_config",  # we export unquantised weights
        "transformers_version",  # this file is not written by transformers
    }
)


# --- config.json -> ModelConfig ---------------------------------------------------------------


class _Reader:
    """Reads one config.json: absent keys fall back to the model_type's transformers default."""

    def __init__(self, hf: dict, model_type: str):
        self.hf = hf
        self.model_type = model_type
        self.defaults = {**_COMMON_DEFAULTS, **_HF_DEFAULTS[model_type]}

    def __call__(self, key: str) -> Any:
        return self.hf[key] if key in self.hf else self.defaults[key]

    def require(self, key: str, expected: Any) -> None:
        if self(key) != expected:
            raise ValueError(
                f"{self.model_type} config {key}={self(key)!r} is not supported (expected "
                f"{expected!r})"
            )


def _rope_fields(read: _Reader) -> dict[str, Any]:
    """ModelConfig's rope_* fields from `rope_parameters` or the older rope_theta + rope_scaling."""
    hf = read.hf
    # transformers gives an old-style rope_scaling priority over rope_parameters; so do we.
    params = hf.get("rope_scaling") or hf.get("rope_parameters")
    params = dict(params or _DEFAULT_ROPE.get(read.model_type, {}))
    if {"full_attention", "sliding_attention"} & set(params):
        raise ValueError(f"per-layer-type rope_parameters are not supported: {params!r}")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial!r} is not supported (expected 1.0)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(_ROPE_TYPES)})"
        )
    fields: dict[str, Any] = {
        "rope_theta": float(params.get("rope_theta", read("rope_theta"))),
        "rope_scaling": _ROPE_TYPES[rope_type],
    }
    if rope_type == "default":
        return fields
    if params.get("factor") is None:
        raise ValueError(f"rope type {rope_type!r} needs a factor; got {params!r}")
    fields["rope_factor"] = float(params["factor"])
    original = int(params.get("original_max_position_embeddings") or 0)
    if rope_type == "llama3":
        # transformers reads an absent pre-extension length as max_position_embeddings.
        fields["rope_original_max_len"] = original or int(read("max_position_embeddings"))
        fields["rope_low_freq_factor"] = float(params["low_freq_factor"])
        fields["rope_high_freq_factor"] = float(params["high_freq_factor"])
    else:  # yarn
        fields["rope_original_max_len"] = original
        fields["rope_beta_fast"] = float(params.get("beta_fast", 32.0))
        fields["rope_beta_slow"] = float(params.get("beta_slow", 1.0))
        fields["rope_truncate"] = bool(params.get("truncate", True))
        fields["rope_attention_factor"] = float(params.get("attention_factor") or 0.0)
        fields["rope_mscale"] = float(params.get("mscale") or 0.0)
        fields["rope_mscale_all_dim"] = float(params.get("mscale_all_dim") or 0.0)
    return fields


def _common_fields(read: _Reader, dtype: str) -> dict[str, Any]:
    """Shapes every family shares, and the switches all of them set the same way."""
    d_model = int(read("hidden_size"))
    num_heads = int(read("num_attention_heads"))
    num_kv_heads = read("num_key_value_heads")
    max_len = int(read("max_position_embeddings"))
    return {
        "vocab_size": int(read("vocab_size")),
        "d_model": d_model,
        "num_layers": int(read("num_hidden_layers")),
        "num_heads": num_heads,
        "num_kv_heads": num_heads if num_kv_heads is None else int(num_kv_heads),
        "max_seq_len": max_len,
        "attention_pattern": ("global",),
        "window": max_len,
        "norm_eps": float(read("rms_norm_eps")),
        "tie_embeddings": bool(read("tie_word_embeddings")),
        "dtype": dtype,
        "scale_logits": False,
        "rope_global": True,
        "attention_output_norm": False,
        **_rope_fields(read),
    }


def _gqa_head_dim(read: _Reader) -> int:
    head_dim = read("head_dim")
    if head_dim is None:  # transformers derives it
        return int(read("hidden_size")) // int(read("num_attention_heads"))
    return int(head_dim)


def _no_sliding(read: _Reader) -> None:
    read.require("use_sliding_window", False)
    layer_types = read("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"{read.model_type} config layer_types={layer_types!r} is not supported (expected "
            "full_attention only)"
        )


def _read_llama(read: _Reader) -> dict[str, Any]:
    read.require("hidden_act", "silu")
    read.require("attention_bias", False)
    read.require("mlp_bias", False)
    return {
        "head_dim": _gqa_head_dim(read),
        "ffn_pattern": ("dense",),
        "d_ff": int(read("intermediate_size")),
    }


def _read_qwen3(read: _Reader) -> dict[str, Any]:
    read.require("hidden_act", "silu")
    read.require("attention_bias", False)
    _no_sliding(read)
    return {
        "head_dim": _gqa_head_dim(read),
        "qk_norm": True,
        "ffn_pattern": ("dense",),
        "d_ff": int(read("intermediate_size")),
    }


def _num_experts(read: _Reader, *keys: str) -> int:
    """The expert count, under whichever of its aliases the file uses (they must agree)."""
    present = {k: read.hf[k] for k in keys if k in read.hf}
    if len(set(present.values())) > 1:
        raise ValueError(f"{read.model_type} config disagrees on the expert count: {present!r}")
    default = next(read.defaults[k] for k in keys if k in read.defaults)
    return int(next(iter(present.values()), default))


def _read_qwen3_moe(read: _Reader) -> dict[str, Any]:
    fields = _read_qwen3(read)
    if read("mlp_only_layers"):
        raise ValueError(
            f"qwen3_moe config mlp_only_layers={read('mlp_only_layers')!r} is not supported "
            "(expected [])"
        )
    num_experts = _num_experts(read, "num_local_experts", "num_experts")
    step = int(read("decoder_sparse_step"))
    if step < 1:
        raise ValueError(f"qwen3_moe config decoder_sparse_step={step} must be >= 1")
    # transformers: layer i is sparse iff (i + 1) % decoder_sparse_step == 0 (and experts exist).
    ffn_pattern = ("dense",) * (step - 1) + ("moe",) if num_experts > 0 else ("dense",)
    fields.update(
        ffn_pattern=ffn_pattern,
        moe_type="plain",
        router_type="softmax",
        router_renormalize=bool(read("norm_topk_prob")),
    )
    if num_experts > 0:
        fields.update(
            num_experts=num_experts,
            experts_per_token=int(read("num_experts_per_tok")),
            moe_d_ff=int(read("moe_intermediate_size")),
        )
    return fields


def _smallest_period(items: list) -> tuple:
    for period in range(1, len(items) + 1):
        if all(items[i] == items[i % period] for i in range(len(items))):
            return tuple(items[:period])
    raise ValueError("layer_types is empty")


def _read_gpt_oss(read: _Reader) -> dict[str, Any]:
    num_layers = int(read("num_hidden_layers"))
    layer_types = read("layer_types")
    if layer_types is None:  # transformers' default: sliding, full, sliding, full, ...
        layer_types = ["sliding_attention", "full_attention"] * ((num_layers + 1) // 2)
        layer_types = layer_types[:num_layers]
    if len(layer_types) != num_layers or any(t not in _LAYER_KINDS for t in layer_types):
        raise ValueError(
            f"gpt_oss config layer_types={layer_types!r} is not supported (expected "
            f"{num_layers} entries from {sorted(_LAYER_KINDS)})"
        )
    # Every list is periodic within its own length, so the pattern is exact layer for layer.
    attention_pattern = _smallest_period([_LAYER_KINDS[t] for t in layer_types])
    fields: dict[str, Any] = {"attention_pattern": attention_pattern}
    if "local" in attention_pattern:
        if read("sliding_window") is None:
            raise ValueError("gpt_oss config has sliding_attention layers but sliding_window=None")
        fields["window"] = int(read("sliding_window"))
    if "experts_per_token" in read.hf and read.hf["experts_per_token"] != read(
        "num_experts_per_tok"
    ):
        # transformers reads num_experts_per_tok only; a disagreeing alias means a broken file.
        raise ValueError(
            f"gpt_oss config experts_per_token={read.hf['experts_per_token']!r} disagrees with "
            f"num_experts_per_tok={read('num_experts_per_tok')!r}"
        )
    expert_hidden = int(read("intermediate_size"))
    fields.update(
        head_dim=_gqa_head_dim(read),
        attention_bias=bool(read("attention_bias")),
        attention_sinks=True,
        ffn_pattern=("moe",),
        d_ff=expert_hidden,  # unused: every layer is MoE
        num_experts=_num_experts(read, "num_local_experts", "num_experts"),
        experts_per_token=int(read("num_experts_per_tok")),
        moe_d_ff=expert_hidden,
        moe_type="plain",
        # Softmax over the top-k router logits = softmax over all, renormalised over the top-k.
        router_type="softmax",
        router_renormalize=True,
        router_bias=True,
        expert_bias=True,
        expert_activation="clamped_swiglu",
        swiglu_limit=float(read("swiglu_limit")),
        swiglu_alpha=float(read("swiglu_alpha")),
    )
    return fields


def _read_deepseek(read: _Reader) -> dict[str, Any]:
    read.require("hidden_act", "silu")
    read.require("attention_bias", False)
    read.require("moe_layer_freq", 1)
    read.require("scoring_func", "sigmoid")
    # transformers' DeepseekV3 always routes as noaux_tc (sigmoid, correction bias, groups).
    read.require("topk_method", "noaux_tc")
    # Interleaved RoPE pairs are permuted into halves when the weights are loaded.
    read.require("rope_interleave", True)
    num_heads = int(read("num_attention_heads"))
    kv_heads = read("num_key_value_heads")
    if kv_heads is not None and int(kv_heads) != num_heads:
        raise ValueError(
            f"{read.model_type} config num_key_value_heads={kv_heads} is not supported (MLA "
            f"expects num_attention_heads={num_heads})"
        )
    nope, rope = int(read("qk_nope_head_dim")), int(read("qk_rope_head_dim"))
    return {
        "attention_type": "mla",
        "num_kv_heads": num_heads,
        "head_dim": nope + rope,
        "q_lora_rank": int(read("q_lora_rank") or 0),
        "kv_lora_rank": int(read("kv_lora_rank")),
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": int(read("v_head_dim")),
        "ffn_pattern": ("moe",),
        "first_dense_layers": int(read("first_k_dense_replace")),
        "d_ff": int(read("intermediate_size")),
        "num_experts": int(read("n_routed_experts")),
        "experts_per_token": int(read("num_experts_per_tok")),
        "moe_d_ff": int(read("moe_intermediate_size")),
        "moe_type": "plain",
        "router_type": "sigmoid",
        "router_renormalize": bool(read("norm_topk_prob")),
        "router_correction_bias": True,
        "router_groups": int(read("n_group")),
        "router_topk_groups": int(read("topk_group")),
        "routed_scaling": float(read("routed_scaling_factor")),
        "num_shared_experts": int(read("n_shared_experts") or 0),
    }


_READERS = {
    "llama": _read_llama,
    "qwen3": _read_qwen3,
    "qwen3_moe": _read_qwen3_moe,
    "gpt_oss": _read_gpt_oss,
    "deepseek_v3": _read_deepseek,
    "kimi_k2": _read_deepseek,
}


def _check_model_type(model_type: Any) -> str:
    if model_type not in _READERS:
        raise ValueError(
            f"model_type={model_type!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return model_type


def from_hf_config(hf: dict, dtype: str = "float32") -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json (a dict), for SUPPORTED_MODEL_TYPES."""
    model_type = _check_model_type(hf.get("model_type"))
    read = _Reader(hf, model_type)
    fields = _common_fields(read, dtype)
    fields.update(_READERS[model_type](read))
    # Every field explicit: a ModelConfig built while gin bindings are active would otherwise take
    # bound values (e.g. the tiny model's sizes) for the fields this family leaves alone.
    return ModelConfig(**{**class_defaults(), **fields})


def class_defaults() -> dict:
    """ModelConfig's own field defaults, whatever gin has bound."""
    return {f.name: f.default for f in dataclasses.fields(ModelConfig)}


# --- ModelConfig -> config.json ---------------------------------------------------------------


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling == "none":
        return params
    params.update(rope_type=cfg.rope_scaling, factor=cfg.rope_factor)
    if cfg.rope_original_max_len:
        params["original_max_position_embeddings"] = cfg.rope_original_max_len
    if cfg.rope_scaling == "llama3":
        params.update(
            low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor
        )
    else:  # yarn
        params.update(beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow)
        # Written only when they differ from transformers' reading of an absent key.
        optional = {
            "truncate": None if cfg.rope_truncate else False,
            "attention_factor": cfg.rope_attention_factor or None,
            "mscale": cfg.rope_mscale or None,
            "mscale_all_dim": cfg.rope_mscale_all_dim or None,
        }
        params.update({k: v for k, v in optional.items() if v is not None})
    return params


def _write_common(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    return {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "dtype": cfg.dtype,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": _rope_parameters(cfg),
        "hidden_act": "silu",
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "intermediate_size": cfg.d_ff,
    }


def _write_llama(cfg: ModelConfig) -> dict[str, Any]:
    return {"mlp_bias": False}


def _write_qwen3(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "layer_types": ["full_attention"] * cfg.num_layers,
        "use_sliding_window": False,
        "sliding_window": None,
    }


def _write_qwen3_moe(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe_layers
    if not moe:
        raise ValueError(
            f"ModelConfig.ffn_pattern={cfg.ffn_pattern!r} has no MoE layer; a qwen3_moe "
            "config.json needs one (export it as qwen3)"
        )
    return {
        "use_sliding_window": False,
        "sliding_window": None,
        "decoder_sparse_step": moe[0] + 1,
        "mlp_only_layers": [],
        # transformers 5 saves num_local_experts; 4.x (and vLLM) read num_experts.
        "num_experts": cfg.num_experts,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "moe_intermediate_size": cfg.moe_d_ff,
        "norm_topk_prob": cfg.router_renormalize,
    }


def _write_gpt_oss(cfg: ModelConfig) -> dict[str, Any]:
    kinds = [cfg.attention_kind(i) for i in range(cfg.num_layers)]
    return {
        "intermediate_size": cfg.moe_d_ff,
        "layer_types": [
            "sliding_attention" if kind == "local" else "full_attention" for kind in kinds
        ],
        "sliding_window": cfg.window if "local" in kinds else None,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "swiglu_limit": cfg.swiglu_limit,
        "swiglu_alpha": cfg.swiglu_alpha,
    }


def _write_deepseek(cfg: ModelConfig) -> dict[str, Any]:
    kinds = [cfg.ffn_kind(i) for i in range(cfg.num_layers)]
    leading_dense = next((i for i, kind in enumerate(kinds) if kind == "moe"), cfg.num_layers)
    return {
        # transformers derives both from the MLA dims: head_dim is the RoPE part.
        "head_dim": cfg.qk_rope_head_dim,
        "qk_head_dim": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
        "q_lora_rank": cfg.q_lora_rank or None,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "rope_interleave": True,  # our halves layout is permuted back to pairs on export
        "first_k_dense_replace": leading_dense,
        "moe_intermediate_size": cfg.moe_d_ff,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "n_shared_experts": cfg.num_shared_experts,
        "routed_scaling_factor": cfg.routed_scaling,
        "n_group": cfg.router_groups,
        "topk_group": cfg.router_topk_groups,
        "norm_topk_prob": cfg.router_renormalize,
        # Not read by transformers' DeepseekV3; the original modelling code (Kimi K2's too),
        # vLLM and SGLang read them.
        "moe_layer_freq": 1,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
    }


_WRITERS = {
    "llama": _write_llama,
    "qwen3": _write_qwen3,
    "qwen3_moe": _write_qwen3_moe,
    "gpt_oss": _write_gpt_oss,
    "deepseek_v3": _write_deepseek,
    "kimi_k2": _write_deepseek,
}


def infer_model_type(cfg: ModelConfig) -> str:
    """The Hugging Face family a ModelConfig exports as when none is named."""
    if cfg.attention_type == "mla":
        return "deepseek_v3"
    if cfg.moe_layers:
        return "gpt_oss" if cfg.expert_activation == "clamped_swiglu" else "qwen3_moe"
    return "qwen3" if cfg.qk_norm else "llama"


def _check_has_hf_equivalent(cfg: ModelConfig) -> None:
    """The MAI-only switches, named before any family is tried."""
    if cfg.moe_layers and cfg.moe_type == "latent":
        raise ValueError("ModelConfig.moe_type='latent' (LatentMoE) has no Hugging Face equivalent")
    for name in ("scale_logits", "attention_output_norm"):
        if getattr(cfg, name):
            raise ValueError(f"ModelConfig.{name}=True has no Hugging Face equivalent")
    if not cfg.rope_global and "global" in cfg.attention_pattern:
        raise ValueError(
            "ModelConfig.rope_global=False (NoPE global layers) has no Hugging Face equivalent"
        )


def canonical(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with layouts spelled out per layer and every field the model never reads reset.

    Two configs with equal canonical forms build the same model; `to_hf_config` uses this to tell
    a field the family cannot express from one that does not matter.
    """
    default = ModelConfig(**class_defaults())
    n = cfg.num_layers
    ffn = tuple(cfg.ffn_kind(i) for i in range(n))
    attention = tuple(cfg.attention_kind(i) for i in range(n))
    unused: set[str] = {"moe_impl", "attention_impl", "dropout_rate"}
    if "local" not in attention:
        unused.add("window")
    if "dense" not in ffn:
        unused.add("d_ff")
    if "moe" not in ffn:
        unused |= {
            "num_experts", "experts_per_token", "moe_latent_dim", "moe_d_ff", "moe_type",
            "router_type", "router_renormalize", "router_bias", "router_correction_bias",
            "router_groups", "router_topk_groups", "routed_scaling", "num_shared_experts",
            "expert_bias", "expert_activation", "swiglu_limit", "swiglu_alpha",
        }
    if cfg.moe_type == "plain":
        unused.add("moe_latent_dim")
    if cfg.expert_activation != "clamped_swiglu":
        unused |= {"swiglu_limit", "swiglu_alpha"}
    if cfg.attention_type != "mla":
        unused |= {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                   "v_head_dim"}
    if cfg.rope_scaling != "llama3":
        unused |= {"rope_low_freq_factor", "rope_high_freq_factor"}
    if cfg.rope_scaling != "yarn":
        unused |= {"rope_beta_fast", "rope_beta_slow", "rope_truncate", "rope_attention_factor",
                   "rope_mscale", "rope_mscale_all_dim"}
    if cfg.rope_scaling == "none":
        unused |= {"rope_factor", "rope_original_max_len"}
    if "global" not in attention:
        unused.add("rope_global")
    reset = {name: getattr(default, name) for name in unused}
    # window must stay valid (positive); max_seq_len is what "no sliding window" means.
    if "window" in reset:
        reset["window"] = cfg.max_seq_len
    return dataclasses.replace(
        cfg, attention_pattern=attention, ffn_pattern=ffn, first_dense_layers=0, **reset
    )


def to_hf_config(
    cfg: ModelConfig, model_type: str | None = None, base: dict | None = None
) -> dict[str, Any]:
    """A Hugging Face config.json (the newer `rope_parameters` form) that rebuilds `cfg`'s model.

    `model_type` defaults to `infer_model_type(cfg)`; keys of `base` (the source config.json) that
    do not describe the architecture (token ids, generation and remote-code settings) are kept.
    """
    _check_has_hf_equivalent(cfg)
    model_type = _check_model_type(model_type or infer_model_type(cfg))
    out = {k: v for k, v in (base or {}).items() if k not in _OWNED_KEYS}
    out.update(_write_common(cfg, model_type))
    out.update(_WRITERS[model_type](cfg))
    # Whatever the family cannot express comes back different: name the first such field.
    mine, back = canonical(cfg), canonical(from_hf_config(out, dtype=cfg.dtype))
    for field in dataclasses.fields(ModelConfig):
        if getattr(mine, field.name) != getattr(back, field.name):
            shown = field.name
            if field.name in ("attention_pattern", "ffn_pattern"):
                shown = f"{field.name} (per layer)"
            raise ValueError(
                f"ModelConfig.{shown}={getattr(mine, field.name)!r} has no equivalent in a "
                f"{model_type!r} config.json (it would read back as {getattr(back, field.name)!r})"
            )
    return dict(sorted(out.items()))

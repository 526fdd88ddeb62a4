"""`hf_config`: Hugging Face config.json <-> ModelConfig, on the fixtures and published configs."""

import copy
import dataclasses
import json
import pathlib

import gin
import pytest

from hcjax.model.config import ModelConfig
from hcjax.model.hf_config import (
    SUPPORTED_MODEL_TYPES,
    canonical,
    from_hf_config,
    infer_model_type,
    to_hf_config,
)

FIXTURES = pathlib.Path("/work/shared/fixtures/hf")
MODEL_GIN = pathlib.Path(__file__).resolve().parents[1] / "configs" / "models"
FAMILIES = ("llama3", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3")

# What each fixture must read as, written out by hand from its config.json.
HF_CONVENTIONS = dict(
    scale_logits=False, rope_global=True, attention_output_norm=False, dtype="float32"
)
EXPECTED = {
    "llama3": dict(
        vocab_size=512, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        attention_type="gqa", attention_pattern=("global",), window=256, max_seq_len=256,
        ffn_pattern=("dense",), d_ff=128, norm_eps=1e-5, tie_embeddings=False, qk_norm=False,
        attention_bias=False, attention_sinks=False, rope_theta=500000.0, rope_scaling="llama3",
        rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
        rope_original_max_len=16,
    ),
    "qwen3": dict(
        vocab_size=512, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        attention_pattern=("global",), window=256, ffn_pattern=("dense",), d_ff=128,
        norm_eps=1e-6, tie_embeddings=True, qk_norm=True, attention_bias=False,
        rope_theta=1e6, rope_scaling="none",
    ),
    "qwen3_moe": dict(
        vocab_size=512, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        attention_pattern=("global",), ffn_pattern=("moe",), first_dense_layers=0, d_ff=128,
        tie_embeddings=False, qk_norm=True, moe_type="plain", num_experts=8,
        experts_per_token=2, moe_d_ff=32, router_type="softmax", router_renormalize=True,
        router_bias=False, router_correction_bias=False, num_shared_experts=0,
        expert_bias=False, expert_activation="swiglu", rope_theta=1e6, rope_scaling="none",
    ),
    "gpt_oss": dict(
        vocab_size=512, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        attention_pattern=("local", "global"), window=8, max_seq_len=131072,
        attention_bias=True, attention_sinks=True, qk_norm=False, ffn_pattern=("moe",),
        moe_type="plain", num_experts=8, experts_per_token=2, moe_d_ff=32,
        router_type="softmax", router_renormalize=True, router_bias=True, expert_bias=True,
        expert_activation="clamped_swiglu", swiglu_limit=7.0, swiglu_alpha=1.702,
        norm_eps=1e-5, tie_embeddings=False, rope_theta=150000.0, rope_scaling="yarn",
        rope_factor=32.0, rope_original_max_len=4096, rope_beta_fast=32.0, rope_beta_slow=1.0,
        rope_truncate=False, rope_attention_factor=0.0, rope_mscale=0.0,
        rope_mscale_all_dim=0.0,
    ),
    "deepseek_v3": dict(
        vocab_size=512, d_model=64, num_layers=3, num_heads=4, num_kv_heads=4, head_dim=24,
        attention_type="mla", q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, attention_pattern=("global",), window=256,
        first_dense_layers=1, ffn_pattern=("moe",), d_ff=128, moe_type="plain",
        num_experts=8, experts_per_token=2, moe_d_ff=32, num_shared_experts=1,
        router_type="sigmoid", router_correction_bias=True, router_renormalize=True,
        router_groups=2, router_topk_groups=1, routed_scaling=2.5, norm_eps=1e-6,
        tie_embeddings=False, rope_theta=10000.0, rope_scaling="none",
    ),
}
MODEL_TYPES = {
    "llama3": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "gpt_oss": "gpt_oss",
    "deepseek_v3": "deepseek_v3",
}


def fixture(family: str) -> dict:
    return json.loads((FIXTURES / family / "config.json").read_text())


def old_rope_form(hf: dict) -> dict:
    """The pre-transformers-5 spelling: top-level rope_theta, rope_scaling with `type` or null."""
    old = {k: v for k, v in hf.items() if k != "rope_parameters"}
    params = dict(hf["rope_parameters"])
    old["rope_theta"] = params.pop("rope_theta")
    rope_type = params.pop("rope_type")
    old["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **params}
    return old


# --- the fixtures ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_fixture_reads_as_expected(family):
    cfg = from_hf_config(fixture(family))
    for name, value in {**HF_CONVENTIONS, **EXPECTED[family]}.items():
        assert getattr(cfg, name) == value, name
    # Layer layout, spelled out.
    if family == "gpt_oss":
        assert [cfg.attention_kind(i) for i in range(2)] == ["local", "global"]
    if family == "deepseek_v3":
        assert [cfg.ffn_kind(i) for i in range(3)] == ["dense", "moe", "moe"]


@pytest.mark.parametrize("family", FAMILIES)
def test_fixture_round_trips(family):
    hf = fixture(family)
    cfg = from_hf_config(hf)
    out = to_hf_config(cfg)
    assert out["model_type"] == MODEL_TYPES[family] == infer_model_type(cfg)
    assert out["architectures"] == hf["architectures"]
    assert from_hf_config(out) == cfg
    # Every key both files have carries the same value (no exceptions among the fixtures).
    differing = {k: (hf[k], out[k]) for k in out.keys() & hf.keys() if hf[k] != out[k]}
    assert differing == {}
    # The architecture keys the fixture has are all written (token ids etc. come from `base`).
    not_architecture = {
        "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
        "transformers_version", "pretraining_tp", "output_router_logits",
        "router_aux_loss_coef", "max_window_layers", "num_nextn_predict_layers",
    }
    assert hf.keys() - out.keys() <= not_architecture


@pytest.mark.parametrize("family", FAMILIES)
def test_base_keys_are_carried_over(family):
    hf = fixture(family)
    cfg = from_hf_config(hf)
    out = to_hf_config(cfg, base=hf)
    assert from_hf_config(out) == cfg
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range"):
        assert out[key] == hf[key]
    # A base's architecture keys never leak through: its old rope spelling would win in
    # transformers, and a different shape must not survive.
    stale = {**old_rope_form(hf), "hidden_size": 4096, "quantization_config": {"bits": 4}}
    out = to_hf_config(cfg, base=stale)
    assert "rope_scaling" not in out and "rope_theta" not in out
    assert "quantization_config" not in out and out["hidden_size"] == 64


@pytest.mark.parametrize("family", FAMILIES)
def test_old_rope_form_reads_the_same(family):
    hf = fixture(family)
    old = old_rope_form(hf)
    assert "rope_parameters" not in old
    assert from_hf_config(old) == from_hf_config(hf)


def test_old_rope_form_with_rope_type_key():
    hf = old_rope_form(fixture("llama3"))
    hf["rope_scaling"]["rope_type"] = hf["rope_scaling"].pop("type")  # Llama 3.1's spelling
    assert from_hf_config(hf) == from_hf_config(fixture("llama3"))


def test_dtype_comes_from_the_argument():
    hf = fixture("qwen3")
    assert from_hf_config(hf, dtype="bfloat16").dtype == "bfloat16"
    assert to_hf_config(from_hf_config(hf, dtype="bfloat16"))["dtype"] == "bfloat16"


# --- family details -------------------------------------------------------------------------


def test_absent_keys_take_the_transformers_defaults():
    hf = fixture("llama3")
    for key in ("head_dim", "num_key_value_heads", "tie_word_embeddings", "attention_bias"):
        del hf[key]
    cfg = from_hf_config(hf)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.tie_embeddings) == (16, 4, False)
    # GPT-OSS's class fills in its YaRN RoPE (theta 150000) when no rope key is present, and
    # keeps that YaRN under a bare top-level rope_theta.
    hf = fixture("gpt_oss")
    del hf["rope_parameters"]
    assert from_hf_config(hf) == from_hf_config(fixture("gpt_oss"))
    hf.update(rope_theta=7.0, rope_scaling=None)
    expected = dataclasses.replace(from_hf_config(fixture("gpt_oss")), rope_theta=7.0)
    assert from_hf_config(hf) == expected


def test_deepseek_without_q_lora_and_kimi_k2():
    hf = fixture("deepseek_v3")
    hf["q_lora_rank"] = None
    cfg = from_hf_config(hf)
    assert cfg.q_lora_rank == 0
    assert to_hf_config(cfg)["q_lora_rank"] is None
    out = to_hf_config(cfg)
    assert out["rope_interleave"] is True
    assert (out["head_dim"], out["qk_head_dim"]) == (8, 24)  # transformers' meanings
    hf["model_type"] = "kimi_k2"
    assert from_hf_config(hf) == cfg
    kimi = to_hf_config(cfg, model_type="kimi_k2")
    assert kimi["model_type"] == "kimi_k2"
    assert kimi["architectures"] == ["DeepseekV3ForCausalLM"]
    assert from_hf_config(kimi) == cfg


def test_qwen3_moe_sparse_step_and_expert_key():
    hf = fixture("qwen3_moe")
    hf["decoder_sparse_step"] = 3
    hf["num_experts"] = hf.pop("num_local_experts")  # transformers 4's key
    hf["num_hidden_layers"] = 6
    cfg = from_hf_config(hf)
    assert cfg.ffn_pattern == ("dense", "dense", "moe")
    assert cfg.moe_layers == (2, 5)  # (i + 1) % 3 == 0
    out = to_hf_config(cfg)
    assert out["decoder_sparse_step"] == 3
    assert out["num_experts"] == out["num_local_experts"] == 8
    assert from_hf_config(out) == cfg


def test_gpt_oss_layer_types_smallest_period():
    hf = fixture("gpt_oss")
    hf["num_hidden_layers"] = 6
    hf["layer_types"] = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    cfg = from_hf_config(hf)
    assert cfg.attention_pattern == ("local", "local", "global")
    assert to_hf_config(cfg)["layer_types"] == hf["layer_types"]
    # A list with no shorter period is its own pattern: still exact, layer for layer.
    hf["layer_types"] = ["sliding_attention"] * 5 + ["full_attention"]
    assert from_hf_config(hf).attention_pattern == ("local",) * 5 + ("global",)
    # Absent: transformers' default alternation.
    del hf["layer_types"]
    assert from_hf_config(hf).attention_pattern == ("local", "global")


# --- errors ---------------------------------------------------------------------------------


def edited(family: str, **changes) -> dict:
    hf = fixture(family)
    hf.update(changes)
    return hf


@pytest.mark.parametrize(
    "hf, message",
    [
        (edited("llama3", model_type="mistral"), "model_type='mistral' is not supported"),
        (edited("llama3", attention_bias=True), "attention_bias=True is not supported"),
        (edited("llama3", mlp_bias=True), "mlp_bias=True is not supported"),
        (edited("llama3", hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        (edited("qwen3", use_sliding_window=True), "use_sliding_window=True is not supported"),
        (
            edited("qwen3", layer_types=["sliding_attention", "full_attention"]),
            "layer_types=.* is not supported",
        ),
        (edited("qwen3_moe", mlp_only_layers=[0]), r"mlp_only_layers=\[0\] is not supported"),
        (
            edited("qwen3_moe", num_experts=16),
            "disagrees on the expert count",
        ),
        (edited("deepseek_v3", moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
        (edited("deepseek_v3", scoring_func="softmax"), "scoring_func='softmax' is not supported"),
        (edited("deepseek_v3", topk_method="greedy"), "topk_method='greedy' is not supported"),
        (
            edited("deepseek_v3", topk_method="group_limited_greedy"),
            "topk_method='group_limited_greedy' is not supported",
        ),
        (edited("deepseek_v3", rope_interleave=False), "rope_interleave=False is not supported"),
        (edited("deepseek_v3", num_key_value_heads=2), "num_key_value_heads=2 is not supported"),
        (
            edited("gpt_oss", layer_types=["sliding_attention"] * 3),
            "layer_types=.* is not supported",
        ),
        (
            edited("gpt_oss", layer_types=["chunked_attention", "full_attention"]),
            "layer_types=.* is not supported",
        ),
        (edited("gpt_oss", experts_per_token=4), "experts_per_token=4 disagrees"),
        (
            edited("llama3", rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5}),
            "partial_rotary_factor=0.5 is not supported",
        ),
        (edited("llama3", partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    ],
)
def test_unsupported_configs_name_the_field(hf, message):
    with pytest.raises(ValueError, match=message):
        from_hf_config(hf)


def test_unknown_model_type_lists_the_supported_ones():
    with pytest.raises(ValueError) as error:
        from_hf_config({"model_type": "gemma3"})
    for model_type in SUPPORTED_MODEL_TYPES:
        assert model_type in str(error.value)


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "longrope", "ntk"])
@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
def test_unsupported_rope_types_are_named(rope_type, spelling):
    hf = old_rope_form(fixture("llama3")) if spelling == "rope_scaling" else fixture("llama3")
    hf[spelling] = {"rope_theta": 1e4, "type" if spelling == "rope_scaling" else "rope_type":
                    rope_type, "factor": 2.0}
    with pytest.raises(ValueError, match=f"rope type '{rope_type}' is not supported"):
        from_hf_config(hf)


def mai_like(**changes) -> ModelConfig:
    """A fixture's config with MAI-only switches turned on."""
    cfg = from_hf_config(fixture("qwen3_moe"))
    return dataclasses.replace(cfg, **changes)


@pytest.mark.parametrize(
    "cfg, model_type, message",
    [
        (mai_like(moe_type="latent"), None, "moe_type='latent'"),
        (mai_like(scale_logits=True), None, "scale_logits=True"),
        (mai_like(attention_output_norm=True), None, "attention_output_norm=True"),
        (mai_like(rope_global=False), None, "rope_global=False"),
        (mai_like(attention_sinks=True), None, "attention_sinks=True has no equivalent"),
        (mai_like(router_type="sigmoid"), None, "router_type='sigmoid' has no equivalent"),
        (mai_like(num_shared_experts=1), None, "num_shared_experts=1 has no equivalent"),
        # Layers dense, moe, moe: no decoder_sparse_step gives that.
        (mai_like(first_dense_layers=1, num_layers=3), None, r"ffn_pattern \(per layer\)"),
        (mai_like(qk_norm=False), None, "qk_norm=False has no equivalent in a 'qwen3_moe'"),
        (from_hf_config(fixture("qwen3")), "llama", "qk_norm=True has no equivalent in a 'llama'"),
        (mai_like(), "llama", r"ffn_pattern \(per layer\)=\('moe', 'moe'\)"),
        (mai_like(), "mistral", "model_type='mistral' is not supported"),
        (from_hf_config(fixture("qwen3")), "qwen3_moe", "has no MoE layer"),
        (ModelConfig(), None, "moe_type='latent'"),
    ],
)
def test_configs_without_an_hf_equivalent_name_the_field(cfg, model_type, message):
    with pytest.raises(ValueError, match=message):
        to_hf_config(cfg, model_type)


def test_fields_the_model_never_reads_do_not_block_export():
    cfg = from_hf_config(fixture("llama3"))
    # A dense model's MoE fields, and the window of a model without sliding layers, are unused.
    odd = dataclasses.replace(
        cfg, num_experts=64, moe_d_ff=7, window=3, moe_impl="dense", attention_impl="auto"
    )
    assert canonical(odd) == canonical(cfg)
    assert to_hf_config(odd) == to_hf_config(cfg)


# --- configs/models/*.gin: the published configs ---------------------------------------------

LLAMA31_ROPE = {
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192, "rope_type": "llama3",
}


def llama31(hidden: int, intermediate: int, layers: int, heads: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": 8, "hidden_act": "silu",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": LLAMA31_ROPE, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def qwen3_moe(hidden: int, intermediate: int, moe: int, layers: int, heads: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": hidden, "intermediate_size": intermediate,
        "moe_intermediate_size": moe, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": None, "use_sliding_window": False, "sliding_window": None,
        "attention_bias": False, "tie_word_embeddings": False,
    }


def gpt_oss(layers: int, experts: int) -> dict:
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
        "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": layers,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": experts, "num_experts_per_tok": 4, "experts_per_token": 4,
        "sliding_window": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "rope_theta": 150000, "rope_scaling": {
            "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False,
        },
        "swiglu_limit": 7.0, "attention_bias": True, "tie_word_embeddings": False,
    }


DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
    "attention_bias": False, "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
}
KIMI_K2 = {
    **DEEPSEEK_V3, "model_type": "kimi_k2", "vocab_size": 163840, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_routed_experts": 384, "routed_scaling_factor": 2.827,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "max_position_embeddings": 131072, "rope_theta": 50000.0, "rope_scaling": {
        "beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn",
    },
    "num_nextn_predict_layers": 0,
}
PUBLISHED = {
    "llama3_8b": llama31(4096, 14336, 32, 32),
    "llama3_70b": llama31(8192, 28672, 80, 64),
    "qwen3_8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "rope_scaling": None, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": 36, "attention_bias": False,
        "tie_word_embeddings": False,
    },
    "qwen3_30b_a3b": qwen3_moe(2048, 6144, 768, 48, 32),
    "qwen3_235b_a22b": qwen3_moe(4096, 12288, 1536, 94, 64),
    "gpt_oss_20b": gpt_oss(24, 32),
    "gpt_oss_120b": gpt_oss(36, 128),
    "deepseek_v3_671b": DEEPSEEK_V3,
    "kimi_k2_1t": KIMI_K2,
}


def test_every_model_gin_has_a_published_config():
    assert sorted(p.stem for p in MODEL_GIN.glob("*.gin")) == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_model_gin_matches_the_published_config(name):
    gin.parse_config_files_and_bindings([str(MODEL_GIN / f"{name}.gin")], [])
    bound = ModelConfig()
    gin.clear_config()
    expected = from_hf_config(copy.deepcopy(PUBLISHED[name]), dtype="bfloat16")
    for field in dataclasses.fields(ModelConfig):
        assert getattr(bound, field.name) == getattr(expected, field.name), field.name
    # And it exports back to the same family.
    model_type = PUBLISHED[name]["model_type"]
    out = to_hf_config(bound, model_type=model_type)
    assert from_hf_config(out, dtype="bfloat16") == bound
    assert infer_model_type(bound) == ("deepseek_v3" if model_type == "kimi_k2" else model_type)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_model_gin_after_base_gin_keeps_the_model(name):
    """The files' promise: base.gin first (impl "auto", mesh), then the model, gives the model."""
    import hcjax.sharding  # noqa: F401  (registers MeshConfig, which base.gin binds)

    gin.parse_config_files_and_bindings([str(MODEL_GIN / f"{name}.gin")], [])
    alone = ModelConfig()
    gin.clear_config()
    gin.parse_config_files_and_bindings(
        [str(MODEL_GIN.parent / "base.gin"), str(MODEL_GIN / f"{name}.gin")], []
    )
    layered = ModelConfig()
    gin.clear_config()
    assert (layered.moe_impl, layered.attention_impl) == ("auto", "auto")
    impl = {"moe_impl": alone.moe_impl, "attention_impl": alone.attention_impl}
    assert dataclasses.replace(layered, **impl) == alone

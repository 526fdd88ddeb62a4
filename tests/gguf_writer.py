"""Writes a Hugging Face folder as a GGUF file the way llama.cpp's converter lays it out, for tests.

Tensor names and shapes as llama.cpp's files have them (q/k rows of Llama files permuted for its
interleaved rope, experts stacked [E, out, in], Llama 3's rope scaling as `rope_freqs.weight`),
the tokenizer as `tokenizer.ggml.*` metadata, each tensor in the encoding `types(name)` picks.
Encodings the gguf library can quantise are quantised from the weights; the K-quants, which it
can only decode, get random blocks with small finite scales. Test-only: hcjax never writes GGUF.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

import gguf
import numpy as np

from hcjax.model.safetensors_io import SafetensorsCheckpoint

ARCH = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}
# Byte offsets of the float16 scale(s) inside one block of each K-quant (llama.cpp's block
# structs): random blocks get small finite scales there.
_K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def permute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation: per head, rows [half 1 | half 2] -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_divisors(cfg: dict, head_dim: int) -> np.ndarray:
    """What llama.cpp's converter stores in rope_freqs.weight for Llama 3 rope scaling."""
    p = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    theta = p.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor, lf, hf = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / hf:
            out.append(1.0)
        elif wavelen > old / lf:
            out.append(factor)
        else:
            smooth = (old / wavelen - lf) / (hf - lf)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def encode(w: np.ndarray, type_name: str, rng: np.random.Generator) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    qtype = gguf.GGMLQuantizationType[type_name]
    w = np.ascontiguousarray(w, np.float32)
    if type_name == "F32":
        return w, qtype
    if type_name == "F16":
        return w.astype(np.float16), qtype
    if type_name in _K_SCALES:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        assert w.shape[-1] % block == 0, (w.shape, type_name)
        n_blocks = w.size // block
        raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
        for off in _K_SCALES[type_name]:
            raw[:, off:off + 2] = np.full((n_blocks, 1), 0.002, np.float16).view(np.uint8)
        return raw.reshape(*w.shape[:-1], w.shape[-1] // block * size), qtype
    return gguf.quants.quantize(w, qtype), qtype


def _tensors(cfg: dict, ckpt: SafetensorsCheckpoint) -> dict[str, np.ndarray]:
    model_type = cfg["model_type"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    out = {"token_embd.weight": ckpt.read("model.embed_tokens.weight"),
           "output_norm.weight": ckpt.read("model.norm.weight")}
    if "lm_head.weight" in ckpt:
        out["output.weight"] = ckpt.read("lm_head.weight")
    for i in range(cfg["num_hidden_layers"]):
        h, g = f"model.layers.{i}.", f"blk.{i}."
        q, k = ckpt.read(h + "self_attn.q_proj.weight"), ckpt.read(h + "self_attn.k_proj.weight")
        if model_type == "llama":
            q, k = permute_rope_rows(q, heads), permute_rope_rows(k, kv)
        out.update({
            g + "attn_norm.weight": ckpt.read(h + "input_layernorm.weight"),
            g + "ffn_norm.weight": ckpt.read(h + "post_attention_layernorm.weight"),
            g + "attn_q.weight": q, g + "attn_k.weight": k,
            g + "attn_v.weight": ckpt.read(h + "self_attn.v_proj.weight"),
            g + "attn_output.weight": ckpt.read(h + "self_attn.o_proj.weight"),
        })
        if model_type != "llama":
            out[g + "attn_q_norm.weight"] = ckpt.read(h + "self_attn.q_norm.weight")
            out[g + "attn_k_norm.weight"] = ckpt.read(h + "self_attn.k_norm.weight")
        if model_type == "qwen3_moe":
            n = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
            out[g + "ffn_gate_inp.weight"] = ckpt.read(h + "mlp.gate.weight")
            for proj, name in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                               ("down_proj", "ffn_down_exps")):
                out[g + name + ".weight"] = np.stack(
                    [ckpt.read(f"{h}mlp.experts.{e}.{proj}.weight") for e in range(n)])
        else:
            for proj, name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"),
                               ("down_proj", "ffn_down")):
                out[g + name + ".weight"] = ckpt.read(f"{h}mlp.{proj}.weight")
    return {k: np.asarray(v, np.float32) for k, v in out.items()}


def _tokenizer(w: gguf.GGUFWriter, folder: str, pre: str, model: str) -> None:
    tok = json.load(open(os.path.join(folder, "tokenizer.json")))
    tcfg = json.load(open(os.path.join(folder, "tokenizer_config.json")))
    vocab = dict(tok["model"]["vocab"])
    special = {}
    for a in tok["added_tokens"]:
        vocab[a["content"]] = a["id"]
        special[a["id"]] = a["special"]
    tokens = [None] * (max(vocab.values()) + 1)
    for t, i in vocab.items():
        tokens[i] = t
    types = [gguf.TokenType.CONTROL if special.get(i) else
             gguf.TokenType.USER_DEFINED if i in special else gguf.TokenType.NORMAL
             for i in range(len(tokens))]
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    for key, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id),
                     ("pad_token", w.add_pad_token_id)):
        if tcfg.get(key):
            add(vocab[tcfg[key]])
    template_path = os.path.join(folder, "chat_template.jinja")
    template = open(template_path).read() if os.path.isfile(template_path) else tcfg.get("chat_template")
    if template:
        w.add_chat_template(template)


def write_gguf(path: str, folder: str, *, types: Callable[[str], str] = lambda name: "F32",
               arch: str | None = None, pre: str = "gpt2", tokenizer_model: str = "gpt2",
               edit: Callable[[dict], None] | None = None, seed: int = 0) -> str:
    """The Hugging Face folder `folder` as a GGUF file at `path`. `edit` may change the tensor
    dict (GGUF names -> float32 arrays) before writing, e.g. to add, drop or poison one."""
    cfg = json.load(open(os.path.join(folder, "config.json")))
    ckpt = SafetensorsCheckpoint.open(folder)
    arch = arch or ARCH[cfg["model_type"]]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_vocab_size(cfg["vocab_size"])
    if cfg["model_type"] == "qwen3_moe":
        w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    _tokenizer(w, folder, pre, tokenizer_model)
    tensors = _tensors(cfg, ckpt)
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_divisors(cfg, head_dim)
    if edit is not None:
        edit(tensors)
    rng = np.random.default_rng(seed)
    for name, value in tensors.items():
        data, qtype = encode(value, "F32" if value.ndim == 1 else types(name), rng)
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

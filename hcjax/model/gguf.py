"""GGUF files (llama.cpp's one-file format) read as a Hugging Face checkpoint.

A `.gguf` file is accepted wherever a Hugging Face folder is: `hf_config` gives the config.json
its metadata describes, `GGUFCheckpoint` serves its tensors under their Hugging Face names and
layouts (dequantised by the `gguf` library's own dequantisers; the rotary row permutation
llama.cpp's converter applies to Llama-family q/k weights undone), and `side_files` adds the
config to the tokenizer files `hcjax.data.gguf_file` derives. Supported: the architectures whose
metadata describes one of our families completely (Llama 3 / SmolLM2, Qwen3, Qwen3-MoE).
Anything else is a ValueError naming it; nothing here guesses or writes GGUF.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from hcjax.data.gguf_file import GGUFFile, is_gguf, open_file, tokenizer_files
from hcjax.model.config import ModelConfig
from hcjax.model.layers import rope_frequencies

__all__ = ["GGUFCheckpoint", "GGUFFile", "hf_config", "is_gguf", "open_file", "side_files"]


# --- config.json ---------------------------------------------------------------------------------


def _head_dim(f: GGUFFile) -> int:
    d, heads = int(f.require("embedding_length")), int(f.require("attention.head_count"))
    key_len = int(f.get("attention.key_length") or d // heads)
    value_len = int(f.get("attention.value_length") or key_len)
    if value_len != key_len:
        raise ValueError(
            f"{f.path!r}: attention.value_length={value_len} differs from key_length={key_len}"
        )
    rope_dims = int(f.get("rope.dimension_count") or key_len)
    if rope_dims != key_len:
        raise ValueError(
            f"{f.path!r}: rope.dimension_count={rope_dims} is a partial rotary embedding of a "
            f"{key_len}-wide head, which is not supported"
        )
    return key_len


def _rope_config(f: GGUFFile, head_dim: int, theta: float) -> dict[str, Any]:
    """rope_parameters: plain RoPE, or Llama 3's scaling recovered from `rope_freqs.weight`
    (llama.cpp's converter stores the per-frequency divisors instead of the parameters)."""
    scaling = f.get("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"{f.path!r}: rope.scaling.type={scaling!r} is not supported")
    if "rope_freqs.weight" not in f.tensors:
        return {"rope_type": "default", "rope_theta": theta}
    divisors = f.dequantize("rope_freqs.weight").astype(np.float64)
    return _llama3_rope_from_divisors(divisors, head_dim, theta, f.path)


def _llama3_rope_from_divisors(divisors: np.ndarray, head_dim: int, theta: float,
                               where: str) -> dict[str, Any]:
    """Llama 3 rope parameters that give exactly these per-frequency divisors.

    Llama 3's rule depends on the wavelength bounds old_len/low_freq_factor and
    old_len/high_freq_factor only (scaling all three alike changes nothing), and in between on a
    blend s = (1/w - 1/W_low) / (1/W_high - 1/W_low). Two or more blended frequencies fix both
    bounds; with fewer, any bounds between the neighbouring frequencies give the same divisors.
    The result is checked by recomputing the divisors."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if divisors.shape != inv_freq.shape:
        raise ValueError(f"{where!r}: rope_freqs.weight has {divisors.shape[0]} entries; a "
                         f"{head_dim}-wide head has {inv_freq.shape[0]} frequencies")
    factor = float(divisors.max())
    if math.isclose(factor, 1.0, rel_tol=1e-6):
        return {"rope_type": "default", "rope_theta": theta}
    u = inv_freq / (2 * math.pi)  # 1 / wavelength
    high = np.isclose(divisors, 1.0, rtol=1e-6)
    low = np.isclose(divisors, factor, rtol=1e-6)
    mid = ~(high | low)
    u_low_max = float(u[low].max()) if low.any() else 0.0
    u_high_min = float(u[high].min()) if high.any() else float(u.max()) * 2 + 1.0
    smooth = (1.0 / divisors[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
    if mid.sum() >= 2:
        slope, a_over = np.polyfit(u[mid], smooth, 1)  # s = slope*u + intercept
        a = -a_over / slope  # 1/W_low
        b = a + 1.0 / slope  # 1/W_high
    elif mid.sum() == 1:
        u1, s1 = float(u[mid][0]), float(smooth[0])
        a = (u_low_max + u1) / 2
        b = a + (u1 - a) / s1
    else:
        a = u_low_max + (u_high_min - u_low_max) / 3
        b = u_low_max + 2 * (u_high_min - u_low_max) / 3
    old_len = max(1, round(1.0 / a))
    params = {
        "rope_type": "llama3", "rope_theta": theta, "factor": factor,
        "original_max_position_embeddings": old_len,
        "low_freq_factor": old_len * a, "high_freq_factor": old_len * b,
    }
    check = ModelConfig(rope_theta=theta, rope_scaling="llama3", rope_factor=factor,
                        rope_original_max_len=old_len, rope_low_freq_factor=old_len * a,
                        rope_high_freq_factor=old_len * b)
    got, _ = rope_frequencies(check, head_dim)
    if not np.allclose(inv_freq / got, divisors, rtol=1e-5, atol=0):
        raise ValueError(
            f"{where!r}: rope_freqs.weight {np.round(divisors, 4).tolist()} is not Llama 3's "
            "frequency scaling; other per-frequency factors are not supported"
        )
    return params


def hf_config(f: GGUFFile) -> dict[str, Any]:
    """The Hugging Face config.json that the file's metadata describes."""
    head_dim = _head_dim(f)
    theta = f.get_float("rope.freq_base", 10_000.0)
    tokens = f.meta.get("tokenizer.ggml.tokens")
    vocab = int(f.get("vocab_size") or (len(tokens) if tokens is not None else 0)
                or f.shape("token_embd.weight")[0])
    cfg: dict[str, Any] = {
        "model_type": f.arch.model_type,
        "hidden_size": int(f.require("embedding_length")),
        "intermediate_size": int(f.require("feed_forward_length")),
        "num_hidden_layers": int(f.require("block_count")),
        "num_attention_heads": int(f.require("attention.head_count")),
        "num_key_value_heads": int(f.get("attention.head_count_kv")
                                   or f.require("attention.head_count")),
        "head_dim": head_dim,
        "rms_norm_eps": f.get_float("attention.layer_norm_rms_epsilon",
                                    f.require("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(f.require("context_length")),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "rope_parameters": _rope_config(f, head_dim, theta),
        "hidden_act": "silu",
        "attention_bias": False,
    }
    if f.arch.model_type == "llama":
        cfg["mlp_bias"] = False
    if f.arch.moe:
        n_experts = int(f.require("expert_count"))
        cfg.update({
            "num_experts": n_experts,
            "num_experts_per_tok": int(f.require("expert_used_count")),
            "moe_intermediate_size": int(f.require("expert_feed_forward_length")),
            # llama.cpp's qwen3moe graph always renormalises the top-k weights.
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        })
    for key, meta_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                          ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                          ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if f.meta.get(meta_key) is not None:
            cfg[key] = int(f.meta[meta_key])
    cfg["architectures"] = [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                             "qwen3_moe": "Qwen3MoeForCausalLM"}[f.arch.model_type]]
    cfg["gguf_source"] = {"file": os.path.basename(f.path),
                          "name": f.meta.get("general.name"),
                          "file_type": f.meta.get("general.file_type")}
    return cfg


# --- Tensors under Hugging Face names ------------------------------------------------------------


def unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: within each head its rows were reordered from
    [first half | second half] to interleaved pairs (row 2i from i, 2i+1 from i + half)."""
    rows = w.shape[0]
    return (w.reshape(heads, rows // heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


@dataclasses.dataclass(frozen=True)
class _Source:
    gguf_name: str
    expert: int | None = None
    transform: Callable[[np.ndarray], np.ndarray] | None = None


def _layer_sources(f: GGUFFile, cfg: dict[str, Any]) -> dict[str, _Source]:
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    q_fix = (lambda w: unpermute_rope_rows(w, heads)) if f.arch.permuted_qk else None
    k_fix = (lambda w: unpermute_rope_rows(w, kv_heads)) if f.arch.permuted_qk else None
    out: dict[str, _Source] = {
        "model.embed_tokens.weight": _Source("token_embd.weight"),
        "model.norm.weight": _Source("output_norm.weight"),
    }
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = _Source("output.weight")
    for i in range(cfg["num_hidden_layers"]):
        g, h = f"blk.{i}.", f"model.layers.{i}."
        out.update({
            h + "input_layernorm.weight": _Source(g + "attn_norm.weight"),
            h + "post_attention_layernorm.weight": _Source(g + "ffn_norm.weight"),
            h + "self_attn.q_proj.weight": _Source(g + "attn_q.weight", transform=q_fix),
            h + "self_attn.k_proj.weight": _Source(g + "attn_k.weight", transform=k_fix),
            h + "self_attn.v_proj.weight": _Source(g + "attn_v.weight"),
            h + "self_attn.o_proj.weight": _Source(g + "attn_output.weight"),
        })
        if f.arch.qk_norm:
            out[h + "self_attn.q_norm.weight"] = _Source(g + "attn_q_norm.weight")
            out[h + "self_attn.k_norm.weight"] = _Source(g + "attn_k_norm.weight")
        if f.arch.moe:
            out[h + "mlp.gate.weight"] = _Source(g + "ffn_gate_inp.weight")
            for e in range(cfg["num_experts"]):
                for proj, name in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                                   ("down_proj", "ffn_down_exps")):
                    out[f"{h}mlp.experts.{e}.{proj}.weight"] = _Source(g + name + ".weight", e)
        else:
            for proj, name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"),
                               ("down_proj", "ffn_down")):
                out[f"{h}mlp.{proj}.weight"] = _Source(g + name + ".weight")
    return out


class GGUFCheckpoint:
    """A GGUF file's tensors as a Hugging Face checkpoint: `names`, `info(name).shape`, `read`
    (float32, HF layout) and `nbytes`, the subset of `SafetensorsCheckpoint` the HF loader reads.

    Every tensor of the file must be used (as a weight, or `rope_freqs.weight` by the config):
    one that maps to nothing is an error naming it, as for a safetensors folder."""

    def __init__(self, file: GGUFFile, cfg: dict[str, Any] | None = None):
        self.file = file
        self.source = file.path
        cfg = cfg if cfg is not None else hf_config(file)
        self._sources = _layer_sources(file, cfg)
        used = {s.gguf_name for s in self._sources.values()} | {"rope_freqs.weight"}
        missing = sorted({s.gguf_name for s in self._sources.values()} - set(file.tensors))
        if missing:
            raise ValueError(f"{file.path!r}: tensor {missing[0]!r} is missing from the GGUF file "
                             f"({len(missing)} missing)")
        unknown = sorted(set(file.tensors) - used)
        if unknown:
            raise ValueError(
                f"{file.path!r}: {len(unknown)} GGUF tensor(s) map to no parameter of a "
                f"{file.arch_name!r} model, e.g. {unknown[:3]}"
            )
        self._cache: tuple[str, np.ndarray] | None = None

    @property
    def names(self) -> list[str]:
        return list(self._sources)

    def __contains__(self, name: object) -> bool:
        return name in self._sources

    def info(self, name: str) -> _Info:
        src = self._sources[name]
        shape = self.file.shape(src.gguf_name)
        return _Info(self.source, "F32", shape if src.expert is None else shape[1:])

    def nbytes(self, name: str) -> int:
        return int(np.prod(self.info(name).shape)) * 4

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` as float32 in the Hugging Face layout."""
        src = self._sources[name]
        w = self.file.dequantize(src.gguf_name, src.expert)
        return w if src.transform is None else np.ascontiguousarray(src.transform(w))

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self._sources:
            yield name, self.read(name)


class _Info(tuple):
    """(file, dtype, shape), indexable like safetensors_io.TensorInfo."""

    def __new__(cls, file: str, dtype: str, shape: tuple[int, ...]):
        return super().__new__(cls, (file, dtype, tuple(shape)))

    @property
    def shape(self) -> tuple[int, ...]:
        return self[2]


def side_files(f: GGUFFile) -> dict[str, dict[str, Any]]:
    """The Hugging Face files a model folder would carry beside its weights: config.json and,
    when the metadata holds a tokenizer, tokenizer.json, tokenizer_config.json (special tokens,
    chat template) and generation_config.json; JSON objects by file name."""
    return {"config.json": hf_config(f), **tokenizer_files(f)}

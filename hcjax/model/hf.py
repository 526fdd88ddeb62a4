"""Hugging Face checkpoints in and out: one name-and-layout mapping used both ways.

`load(path)` reads a Hugging Face model folder (config.json, *.safetensors with or without an
index) into the NNX `Transformer`; `save(model, path)` writes a folder transformers loads. The
mapping below relates every parameter of ours to the Hugging Face tensors it comes from, with the
layout change for each direction side by side, so import and export cannot drift apart.

Loading streams: parameters are built one at a time with `jax.make_array_from_callback`, each
device shard reading only the Hugging Face tensors (and, for stacked experts, only the experts) it
needs, so neither the whole model nor one whole stacked parameter is ever in host memory.
Quantised releases are dequantised as they are read: FP8 with 128x128 block scales
(DeepSeek-V3's `weight_scale_inv`) and MXFP4 (GPT-OSS's `*_blocks` / `*_scales`).
This module knows files and names; it must not know about RL or mesh sizes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from hcjax.finite import check_finite_array
from hcjax.model import gguf, quant
from hcjax.model.config import ModelConfig
from hcjax.model.hf_config import from_hf_config, to_hf_config
from hcjax.model.safetensors_io import SafetensorsCheckpoint, write_safetensors
from hcjax.model.transformer import (
    Transformer,
    abstract_model,
    param_shardings,
    stack_layers,
    unstack_layers,
)

Array = np.ndarray

# Layouts: (hf -> ours, ours -> hf), on whole numpy arrays ----------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    to_ours: Callable[[Array], Array]
    to_hf: Callable[[Array], Array]


IDENTITY = Layout(lambda w: w, lambda p: p)
# nn.Linear stores [out, in]; ours are [in, out].
TRANSPOSE = Layout(lambda w: w.T, lambda p: p.T)


def in_heads(heads: int, head_dim: int, perm: Array | None = None) -> Layout:
    """[heads*head_dim, in] (HF) <-> [in, heads, head_dim] (ours), optionally permuting head_dim."""
    inv = None if perm is None else np.argsort(perm)

    def to_ours(w):
        p = w.T.reshape(w.shape[1], heads, head_dim)
        return p if perm is None else p[..., perm]

    def to_hf(p):
        p = p if inv is None else p[..., inv]
        return p.reshape(p.shape[0], heads * head_dim).T

    return Layout(to_ours, to_hf)


def out_heads(heads: int, head_dim: int) -> Layout:
    """o_proj: [out, heads*head_dim] (HF) <-> [heads, head_dim, out] (ours)."""
    return Layout(
        lambda w: w.T.reshape(heads, head_dim, w.shape[0]),
        lambda p: p.reshape(heads * head_dim, p.shape[-1]).T,
    )


def heads_vector(heads: int, head_dim: int) -> Layout:
    """A bias [heads*head_dim] <-> [heads, head_dim]."""
    return Layout(lambda w: w.reshape(heads, head_dim), lambda p: p.reshape(heads * head_dim))


def transposed_permuted(perm: Array) -> Layout:
    """nn.Linear [out, in] <-> ours [in, out] with the out features reordered by `perm`."""
    inv = np.argsort(perm)
    return Layout(lambda w: w.T[..., perm], lambda p: p[..., inv].T)


def rope_interleave_perm(dim: int) -> Array:
    """DeepSeek rotates pairs (2i, 2i+1); ours rotates halves (i, i + dim/2). Reordering the RoPE
    features as [0, 2, 4, ..., 1, 3, 5, ...] at load makes the two identical (q·k is unchanged
    because queries and keys are reordered alike)."""
    return np.concatenate([np.arange(0, dim, 2), np.arange(1, dim, 2)])


# Rules: which of our parameters come from which HF tensors ---------------------------------------


@dataclasses.dataclass(frozen=True)
class One:
    """One parameter of ours <-> one HF tensor."""

    ours: str
    hf: str
    layout: Layout = IDENTITY


@dataclasses.dataclass(frozen=True)
class Experts:
    """A stacked [E, ...] parameter of ours <-> E per-expert HF tensors (`{e}` in the name)."""

    ours: str
    hf: str
    num: int
    layout: Layout = TRANSPOSE

    def names(self) -> list[str]:
        return [self.hf.format(e=e) for e in range(self.num)]


@dataclasses.dataclass(frozen=True)
class Interleaved:
    """GPT-OSS's fused gate_up tensor: gate on even, up on odd last-axis entries <-> two of ours."""

    gate: str
    up: str
    hf: str


Rule = One | Experts | Interleaved


def mapping(cfg: ModelConfig) -> list[Rule]:
    """Every parameter of the model `cfg` describes, with its HF source."""
    latent = cfg.num_moe_layers > 0 and cfg.moe_type == "latent"
    if latent or cfg.scale_logits or cfg.attention_output_norm or not cfg.rope_global:
        raise ValueError(
            "this ModelConfig has no Hugging Face equivalent: moe_type='latent', scale_logits, "
            "attention_output_norm and rope_global=False (NoPE layers) are MAI-only"
        )
    rules: list[Rule] = [One("embed", "model.embed_tokens.weight"), One("final_norm/scale", "model.norm.weight")]
    if not cfg.tie_embeddings:
        rules.append(One("lm_head", "lm_head.weight"))
    h, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    for i in range(cfg.num_layers):
        ours, hf = f"blocks/{i}/", f"model.layers.{i}."
        rules += [
            One(ours + "attn_norm/scale", hf + "input_layernorm.weight"),
            One(ours + "ffn_norm/scale", hf + "post_attention_layernorm.weight"),
        ]
        a, ha = ours + "attn/", hf + "self_attn."
        if cfg.attention_type == "mla":
            nope, rd, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
            perm = np.concatenate([np.arange(nope), nope + rope_interleave_perm(rd)])
            if cfg.q_lora_rank:
                rules += [
                    One(a + "wq_a", ha + "q_a_proj.weight", TRANSPOSE),
                    One(a + "q_norm/scale", ha + "q_a_layernorm.weight"),
                    One(a + "wq_b", ha + "q_b_proj.weight", in_heads(h, nope + rd, perm)),
                ]
            else:
                rules.append(One(a + "wq", ha + "q_proj.weight", in_heads(h, nope + rd, perm)))
            rules += [
                One(
                    a + "wkv_a", ha + "kv_a_proj_with_mqa.weight",
                    transposed_permuted(
                        np.concatenate(
                            [np.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + rope_interleave_perm(rd)]
                        )
                    ),
                ),
                One(a + "kv_norm/scale", ha + "kv_a_layernorm.weight"),
                One(a + "wkv_b", ha + "kv_b_proj.weight", in_heads(h, nope + vd)),
                One(a + "wo", ha + "o_proj.weight", out_heads(h, vd)),
            ]
        else:
            rules += [
                One(a + "wq", ha + "q_proj.weight", in_heads(h, hd)),
                One(a + "wk", ha + "k_proj.weight", in_heads(hkv, hd)),
                One(a + "wv", ha + "v_proj.weight", in_heads(hkv, hd)),
                One(a + "wo", ha + "o_proj.weight", out_heads(h, hd)),
            ]
            if cfg.attention_bias:
                rules += [
                    One(a + "bq", ha + "q_proj.bias", heads_vector(h, hd)),
                    One(a + "bk", ha + "k_proj.bias", heads_vector(hkv, hd)),
                    One(a + "bv", ha + "v_proj.bias", heads_vector(hkv, hd)),
                    One(a + "bo", ha + "o_proj.bias"),
                ]
            if cfg.qk_norm:
                rules += [
                    One(a + "q_norm/scale", ha + "q_norm.weight"),
                    One(a + "k_norm/scale", ha + "k_norm.weight"),
                ]
            if cfg.attention_sinks:
                rules.append(One(a + "sinks", ha + "sinks"))
        f, hm = ours + "ffn/", hf + "mlp."
        if cfg.ffn_kind(i) == "dense":
            rules += _dense_mlp(f, hm)
        elif cfg.expert_activation == "clamped_swiglu":  # GPT-OSS
            rules += [
                One(f + "router", hm + "router.weight", TRANSPOSE),
                One(f + "w_out", hm + "experts.down_proj"),
                Interleaved(f + "w_gate", f + "w_up", hm + "experts.gate_up_proj"),
            ]
            if cfg.router_bias:
                rules.append(One(f + "router_bias", hm + "router.bias"))
            if cfg.expert_bias:
                rules += [
                    Interleaved(f + "b_gate", f + "b_up", hm + "experts.gate_up_proj_bias"),
                    One(f + "b_out", hm + "experts.down_proj_bias"),
                ]
        else:  # Qwen3-MoE, DeepSeek-V3: per-expert nn.Linear tensors
            e = cfg.num_experts
            rules += [
                One(f + "router", hm + "gate.weight", TRANSPOSE),
                Experts(f + "w_gate", hm + "experts.{e}.gate_proj.weight", e),
                Experts(f + "w_up", hm + "experts.{e}.up_proj.weight", e),
                Experts(f + "w_out", hm + "experts.{e}.down_proj.weight", e),
            ]
            if cfg.router_correction_bias:
                rules.append(One(f + "correction_bias", hm + "gate.e_score_correction_bias"))
            if cfg.num_shared_experts:
                rules += _dense_mlp(f + "shared/", hm + "shared_experts.")
            if cfg.router_bias or cfg.expert_bias:
                raise ValueError("router_bias / expert_bias are GPT-OSS's; no HF tensor holds them here")
    return rules


def _dense_mlp(ours: str, hf: str) -> list[Rule]:
    return [
        One(ours + "w_gate", hf + "gate_proj.weight", TRANSPOSE),
        One(ours + "w_up", hf + "up_proj.weight", TRANSPOSE),
        One(ours + "w_down", hf + "down_proj.weight", TRANSPOSE),
    ]


def hf_names(rule: Rule) -> list[str]:
    return rule.names() if isinstance(rule, Experts) else [rule.hf]


# Reading HF tensors (dequantising on the way) -----------------------------------------------------


class HFReader:
    """Reads HF tensors by name as float32, dequantising FP8-block and MXFP4 storage."""

    def __init__(self, ckpt: SafetensorsCheckpoint, block: tuple[int, int] = (128, 128)):
        self.ckpt = ckpt
        self.names = set(ckpt.names)
        self.block = block

    def stored_as(self, name: str) -> list[str] | None:
        """The stored tensors that make up logical tensor `name`, or None if absent."""
        if name in self.names:
            scale = name + "_scale_inv"
            return [name, scale] if scale in self.names else [name]
        if name + "_blocks" in self.names and name + "_scales" in self.names:
            return [name + "_blocks", name + "_scales"]
        return None

    def shape(self, name: str) -> tuple[int, ...]:
        stored = self.stored_as(name)
        if stored is None:
            raise KeyError(name)
        shape = tuple(self.ckpt.info(stored[0])[2])
        if stored[0].endswith("_blocks"):  # [*prefix, rows, G, 16] -> [*prefix, G*32, rows]
            return (*shape[:-3], shape[-2] * shape[-1] * 2, shape[-3])
        return shape

    def read(self, name: str) -> Array:
        """Tensor `name` as float32; NonFiniteWeights if it holds NaN or Inf (one pass over the
        values just read)."""
        stored = self.stored_as(name)
        if stored is None:
            raise KeyError(name)
        if stored[0].endswith("_blocks"):
            w = quant.dequant_mxfp4(self.ckpt.read(stored[0]), self.ckpt.read(stored[1]))
            # GPT-OSS stores experts as [E, out, in] blocks; the unquantised layout is [E, in, out].
            w = np.ascontiguousarray(np.swapaxes(w, -1, -2))
        elif len(stored) == 2:
            w = quant.dequant_fp8_blocks(self.ckpt.read(name), self.ckpt.read(stored[1]),
                                         self.block)
        else:
            w = np.asarray(self.ckpt.read(name), dtype=np.float32)
        check_finite_array(name, w, f"Hugging Face checkpoint {self.ckpt.source}")
        return w


# Config and checks before any compute ------------------------------------------------------------


def read_hf_config(path: str) -> dict:
    """config.json of the Hugging Face folder `path`, or the one a `.gguf` file's metadata
    describes (`hcjax.model.gguf`)."""
    if gguf.is_gguf(path):
        return gguf.hf_config(gguf.open_file(path))
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Hugging Face model folder {path!r} does not exist")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json; is it a Hugging Face model folder?")
    with open(cfg_path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path} is not valid JSON: {e}") from e


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def check_coverage(
    rules: list[Rule], reader: HFReader, cfg: ModelConfig, hf_config: dict, abstract
) -> dict:
    """Every rule's tensors exist with the expected shapes, and every stored tensor maps somewhere.

    Returns what was deliberately left out (DeepSeek's multi-token-prediction layers, which
    transformers does not load either, and rotary caches).
    """
    shapes = {"/".join(str(p) for p in path): v.shape for path, v in _flat(abstract)}
    used: set[str] = set()
    for rule in rules:
        ours = [rule.gate, rule.up] if isinstance(rule, Interleaved) else [rule.ours]
        for o in ours:
            if o not in shapes:
                raise ValueError(f"mapping names parameter {o!r}, which the model does not have")
        for name in hf_names(rule):
            stored = reader.stored_as(name)
            if stored is None:
                raise ValueError(
                    f"tensor {name!r} (for parameter {ours[0]!r}) is missing from the checkpoint"
                )
            used.update(stored)
        expect = shapes[ours[0]]
        try:
            got = _ours_shape(rule, reader)
        except (TypeError, ValueError):  # the layout itself cannot apply to this shape
            got = None
        if got is None or tuple(got) != tuple(expect):
            stored = reader.shape(hf_names(rule)[0])
            raise ValueError(
                f"tensor {hf_names(rule)[0]!r} has shape {tuple(stored)}, which does not give "
                f"parameter {ours[0]!r} the shape {tuple(expect)} the config implies"
            )
    mapped_params = {o for r in rules for o in ([r.gate, r.up] if isinstance(r, Interleaved) else [r.ours])}
    unmapped = sorted(set(shapes) - mapped_params)
    if unmapped:
        raise ValueError(f"parameters with no Hugging Face source: {unmapped[:5]}")
    mtp = int(hf_config.get("num_nextn_predict_layers") or 0)
    skipped, unknown = [], []
    for name in sorted(reader.names - used):
        m = _LAYER_RE.match(name)
        if mtp and m and cfg.num_layers <= int(m.group(1)) < cfg.num_layers + mtp:
            skipped.append(name)
        elif name.endswith(_IGNORED_SUFFIXES):
            skipped.append(name)
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(
            f"{len(unknown)} checkpoint tensor(s) map to no parameter of a "
            f"{hf_config.get('model_type')!r} model, e.g. {unknown[:3]}"
        )
    return {"skipped_tensors": len(skipped), "multi_token_prediction_layers": mtp if skipped else 0}


def _ours_shape(rule: Rule, reader: HFReader) -> tuple[int, ...]:
    """Shape our parameter gets from the rule, from HF shapes alone (no data read)."""
    shape = reader.shape(hf_names(rule)[0])
    if isinstance(rule, Interleaved):
        return (*shape[:-1], shape[-1] // 2)
    out = _layout_shape(rule.layout.to_ours, shape)
    return (rule.num, *out) if isinstance(rule, Experts) else out


def _layout_shape(fn: Callable[[Array], Array], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape `fn` gives an array of `shape`, traced abstractly (no data allocated)."""
    return tuple(jax.eval_shape(fn, jax.ShapeDtypeStruct(shape, np.float32)).shape)


def _flat(state) -> Iterator[tuple[tuple, Any]]:
    leaves = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda v: isinstance(v, nnx.Variable)
    )[0]
    for path, var in leaves:
        yield tuple(getattr(p, "key", getattr(p, "idx", p)) for p in path), var


# Load ---------------------------------------------------------------------------------------------


def _shard_reader(rule: Rule, which: int, reader: HFReader) -> Callable[[tuple], Array]:
    """index (tuple of slices of our parameter) -> that block of the parameter, as float32."""
    if isinstance(rule, Experts):

        def read(index):
            experts = range(rule.num)[index[0]]
            return np.stack([rule.layout.to_ours(reader.read(rule.names()[e]))[index[1:]] for e in experts])

        return read
    if isinstance(rule, Interleaved):
        return lambda index: reader.read(rule.hf)[..., which::2][index]
    return lambda index: rule.layout.to_ours(reader.read(rule.hf))[index]


def _index_key(index: tuple) -> tuple:
    return tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in index)


@dataclasses.dataclass
class LoadReport:
    """What `load` did: tensors read, what it skipped, and its host-memory peak."""

    parameters: int = 0
    skipped_tensors: int = 0
    multi_token_prediction_layers: int = 0
    largest_tensor_bytes: int = 0
    peak_host_bytes: int = 0

    @property
    def peak_over_largest(self) -> float:
        return self.peak_host_bytes / max(self.largest_tensor_bytes, 1)


def load(
    path: str,
    dtype: str = "float32",
    mesh: Mesh | None = None,
    *,
    rules: dict | None = None,
    param_dtype=np.float32,
    progress: Callable[[str], None] | None = None,
    report: LoadReport | None = None,
    **config_overrides,
) -> tuple[Transformer, ModelConfig]:
    """(model, config) from a Hugging Face folder; parameters born in their sharding on `mesh`.

    `dtype` is the compute dtype; parameters are `param_dtype` (fp32 masters by default).
    `config_overrides` replace ModelConfig fields (e.g. moe_impl="dense"). Errors (unknown
    model_type, a missing tensor, a tensor that maps nowhere, a shape mismatch) are raised before
    any parameter is read. `report`, if given, is filled with counts and the host-memory peak
    (numpy allocations, measured with tracemalloc).
    """
    hf_config = read_hf_config(path)
    cfg = from_hf_config(hf_config, dtype=dtype)
    if config_overrides:
        cfg = dataclasses.replace(cfg, **config_overrides)
    if cfg.scan_layers:
        return _load_scanned(path, cfg, dtype, mesh, rules=rules, param_dtype=param_dtype,
                             progress=progress, report=report, **config_overrides)
    ckpt = open_checkpoint(path, hf_config)
    reader = HFReader(ckpt, quant.fp8_block_size(hf_config.get("quantization_config")))
    table = mapping(cfg)
    graphdef, abstract = abstract_model(cfg)
    info = check_coverage(table, reader, cfg, hf_config, abstract)
    shardings = _target_shardings(abstract, mesh, rules)
    by_param: dict[str, tuple[Rule, int]] = {}
    for rule in table:
        if isinstance(rule, Interleaved):
            by_param[rule.gate], by_param[rule.up] = (rule, 0), (rule, 1)
        else:
            by_param[rule.ours] = (rule, 0)

    tracing = not tracemalloc.is_tracing()
    if tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    sharding_leaves = dict(_flat_shardings(shardings))

    def build(path, var):
        name = "/".join(str(p) for p in path)
        rule, which = by_param[name]
        read = _shard_reader(rule, which, reader)
        cache: dict[tuple, Array] = {}

        def callback(index):
            key = _index_key(index)
            if key not in cache:
                cache.clear()  # devices ask block by block; keep only the latest block
                cache[key] = np.asarray(read(index), dtype=param_dtype)
            return cache[key]

        if progress is not None:
            progress(name)
        return var.replace(
            jax.make_array_from_callback(var.shape, sharding_leaves[name], callback)
        )

    state = nnx.map_state(build, abstract)
    peak = tracemalloc.get_traced_memory()[1] - base
    if tracing:
        tracemalloc.stop()
    if report is not None:
        report.parameters = len(by_param)
        report.skipped_tensors = info["skipped_tensors"]
        report.multi_token_prediction_layers = info["multi_token_prediction_layers"]
        report.largest_tensor_bytes = max(ckpt.nbytes(n) for n in ckpt.names)
        report.peak_host_bytes = peak
    return nnx.merge(graphdef, state), cfg


def open_checkpoint(path: str, hf_config: dict | None = None
                    ) -> SafetensorsCheckpoint | gguf.GGUFCheckpoint:
    """The tensors of a Hugging Face folder, or of a `.gguf` file under Hugging Face names."""
    if gguf.is_gguf(path):
        return gguf.GGUFCheckpoint(gguf.open_file(path), hf_config)
    return SafetensorsCheckpoint.open(path)


def _target_shardings(abstract, mesh: Mesh | None, rules):
    """Each parameter's sharding on `mesh` by the logical rules, or the first device."""
    if mesh is not None:
        return param_shardings(abstract, mesh, rules)
    device = SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: device, abstract)


def _load_scanned(path, cfg, dtype, mesh, *, rules, **kwargs):
    """Load in the unrolled layout, then stack the layers into the scanned one on the target
    shardings (one transient extra copy of the layer parameters, on the devices)."""
    overrides = {k: v for k, v in kwargs.items()
                 if k not in ("param_dtype", "progress", "report")}
    overrides["scan_layers"] = False
    flat, _ = load(path, dtype, mesh, rules=rules, param_dtype=kwargs["param_dtype"],
                   progress=kwargs["progress"], report=kwargs["report"], **overrides)
    graphdef, abstract = abstract_model(cfg)
    out_shardings = _target_shardings(abstract, mesh, rules)
    stacked = jax.jit(lambda st: stack_layers(st, cfg), out_shardings=out_shardings)(
        nnx.state(flat))
    return nnx.merge(graphdef, stacked), cfg


def _flat_shardings(shardings) -> Iterator[tuple[str, Any]]:
    for path, s in jax.tree_util.tree_flatten_with_path(
        shardings, is_leaf=lambda v: isinstance(v, jax.sharding.Sharding | nnx.Variable)
    )[0]:
        keys = tuple(getattr(p, "key", getattr(p, "idx", p)) for p in path)
        if keys and keys[-1] == "value":
            keys = keys[:-1]
        value = s.get_value() if isinstance(s, nnx.Variable) else s
        yield "/".join(str(k) for k in keys), value


# Save ---------------------------------------------------------------------------------------------

def save(
    model: Transformer,
    path: str,
    *,
    hf_config: dict | None = None,
    dtype: str = "float32",
    max_shard_bytes: int = 5 * 2**30,
    progress: Callable[[str, int], None] | None = None,
) -> None:
    """Write `model` as a Hugging Face folder: config.json and (sharded) safetensors.

    `hf_config` is the source config.json, whose extra keys (token ids, names) are carried over.
    Parameters are fetched from the devices one HF tensor at a time (per expert for stacked ones).
    """
    cfg = model.config
    if cfg.scan_layers:  # save in the unrolled layout, whose names map one layer at a time
        flat_cfg = dataclasses.replace(cfg, scan_layers=False)
        graphdef, _ = abstract_model(flat_cfg)
        model = nnx.merge(graphdef, unstack_layers(nnx.state(model), cfg))
        cfg = flat_cfg
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"save: dtype={dtype!r} must be 'float32' or 'bfloat16'")
    out_dtype = np.dtype(np.float32) if dtype == "float32" else np.dtype(ml_dtypes.bfloat16)
    config = to_hf_config(cfg, base=hf_config)
    config["dtype"] = dtype
    config.pop("torch_dtype", None)
    params = dict((("/".join(str(p) for p in path)), var) for path, var in _flat(nnx.state(model, nnx.Param)))

    def value(name, index=()):
        return np.asarray(params[name][...][index], dtype=np.float32)

    tensors = []
    for rule in mapping(cfg):
        if isinstance(rule, Experts):
            for e, name in enumerate(rule.names()):
                shape = _layout_shape(rule.layout.to_hf, params[rule.ours].shape[1:])
                fetch = (lambda r=rule, e=e: r.layout.to_hf(value(r.ours, (e,))).astype(out_dtype))
                tensors.append((name, shape, out_dtype, fetch))
        elif isinstance(rule, Interleaved):
            gshape = params[rule.gate].shape
            shape = (*gshape[:-1], 2 * gshape[-1])

            def fetch(r=rule, shape=shape):
                out = np.empty(shape, np.float32)
                out[..., 0::2], out[..., 1::2] = value(r.gate), value(r.up)
                return out.astype(out_dtype)

            tensors.append((rule.hf, shape, out_dtype, fetch))
        else:
            shape = _layout_shape(rule.layout.to_hf, params[rule.ours].shape)
            fetch = (lambda r=rule: np.ascontiguousarray(r.layout.to_hf(value(r.ours))).astype(out_dtype))
            tensors.append((rule.hf, shape, out_dtype, fetch))
    os.makedirs(path, exist_ok=True)
    write_safetensors(path, tensors, max_shard_bytes=max_shard_bytes, progress=progress)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


# Files of an HF folder that travel with the weights (tokenizer, templates, generation defaults).
HF_SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "chat_template.jinja", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt",
)


def copy_side_files(src: str, dst: str, skip: Sequence[str] = ()) -> list[str]:
    """Copy the HF folder's config and tokenizer files (not the weights) from `src` to `dst`; for
    a `.gguf` file, write the ones its metadata describes."""
    os.makedirs(dst, exist_ok=True)
    copied = []
    if gguf.is_gguf(src):
        for name, content in gguf.side_files(gguf.open_file(src)).items():
            if name not in skip:
                with open(os.path.join(dst, name), "w", encoding="utf-8") as f:
                    json.dump(content, f, indent=2, ensure_ascii=False)
                copied.append(name)
        return copied
    for name in HF_SIDE_FILES:
        if name not in skip and os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
            copied.append(name)
    return copied

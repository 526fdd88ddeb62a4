"""The planner's cost model: model FLOPs of a step by part, the FLOPs a compiled step executes,
the roofline bound and estimate of its time and MFU, and how many sequences fit in a decode
mesh's HBM. Plain arithmetic over a step record (hcjax.planner.hlo's counts, XLA's memory
analysis) and the chip table (hcjax.hardware); it compiles nothing."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from hcjax.hardware import CHIPS, LINKS
from hcjax.model import ModelConfig

__all__ = ["DeviceSpec", "account_flops", "active_params", "attention_flops_per_token",
           "causal_mean_ctx", "kv_fit", "model_flops_split", "roofline"]


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One compile-only device's peaks as the roofline reads them (bytes and bytes/s): a chip, or
    one of the TensorCores a v4 chip exposes as devices (each an equal share of the chip)."""

    peak_flops: float  # bf16: the steps' matmuls run in bf16
    hbm_bytes: float
    hbm_bytes_per_s: float
    ici_bytes_per_s: float  # all ICI links of the device together

    @classmethod
    def of(cls, chip: str, devices_per_chip: int = 1) -> DeviceSpec:
        """The spec of one of `devices_per_chip` devices of a `chip` from hcjax.hardware."""
        c, n = CHIPS[chip], devices_per_chip
        return cls(c.peak_flops["bfloat16"] / n, c.hbm_bytes / n, c.hbm_bytes_per_s / n,
                   LINKS[f"{chip}-ici"].bytes_per_s / n)


def active_params(model_cfg: ModelConfig, params) -> float:
    """Parameters in matmuls per token: expert weights count k/E of their size; the embedding
    counts once when tied (it is the output head), not at all when untied (a lookup)."""
    frac = model_cfg.experts_per_token / model_cfg.num_experts
    total = 0.0
    for path, var in nnx.to_flat_state(params):
        if path[0] == "embed" and not model_cfg.tie_embeddings:
            continue
        axes = var.get_metadata().get("logical_axes") or ()
        n = math.prod(var.shape)
        total += n * frac if "experts" in axes else n
    return total


def attention_flops_per_token(model_cfg: ModelConfig, ctx_global: float, ctx_local: float) -> float:
    """Forward QKᵀ and AV FLOPs of one token summed over layers: 2·H·ctx·(d_qk + d_v) each."""
    if model_cfg.attention_type == "mla":
        d_qk, d_v = model_cfg.qk_nope_head_dim + model_cfg.qk_rope_head_dim, model_cfg.v_head_dim
    else:
        d_qk = d_v = model_cfg.head_dim
    total = 0.0
    for layer in range(model_cfg.num_layers):
        ctx = ctx_local if model_cfg.attention_kind(layer) == "local" else ctx_global
        total += 2 * model_cfg.num_heads * ctx * (d_qk + d_v)
    return total


def causal_mean_ctx(seq: int, window: int) -> tuple[float, float]:
    """Mean keys attended per query in a full causal row: global, and local (sliding window)."""
    glob = (seq + 1) / 2
    loc = glob if seq <= window else window - window * (window - 1) / (2 * seq)
    return glob, loc


def model_flops_split(model_cfg: ModelConfig, params, tokens: int, ctx_global: float,
                      ctx_local: float, train: bool) -> dict[str, float]:
    """Model FLOPs of a step by part: routed experts, attention scores (QKᵀ and AV) and the rest
    (projections, dense MLPs, router, head). Training counts forward + backward (3x forward)."""
    passes = 3 if train else 1
    frac = model_cfg.experts_per_token / model_cfg.num_experts
    expert_params = sum(math.prod(v.shape) * frac for _, v in nnx.to_flat_state(params)
                        if "experts" in (v.get_metadata().get("logical_axes") or ()))
    experts = passes * 2 * tokens * expert_params
    attention = passes * tokens * attention_flops_per_token(model_cfg, ctx_global, ctx_local)
    total = passes * 2 * tokens * active_params(model_cfg, params) + attention
    return {"total": total, "experts": experts, "attention": attention,
            "other": total - experts - attention}


def account_flops(step: dict, split: dict[str, float], devices: int, remat_factor: float) -> None:
    """Executed FLOPs per chip = the XLA-lowered matmuls (counted in the HLO) + the model FLOPs of
    the parts that run in Pallas kernels (their declared cost is the dropless worst case of the
    buffers they get, not the work done), times the recompute of rematerialisation.
    `flops_ratio` = XLA matmul FLOPs / (the model FLOPs of the parts XLA runs x remat_factor):
    1.0 is no waste beyond remat."""
    kernels = step.get("pallas_kernels", {})
    in_kernels = 0.0
    if any("gmm" in k for k in kernels):
        in_kernels += split["experts"]
    if any(s in k for k in kernels for s in ("splash", "flash", "decode_attention")):
        in_kernels += split["attention"]
    step["model_flops_split"] = split
    step["model_flops_in_kernels"] = in_kernels
    step["remat_factor"] = remat_factor
    step["flops_per_chip"] = step["xla_flops_per_chip"] + in_kernels * remat_factor / devices
    in_xla = (split["total"] - in_kernels) * remat_factor
    step["flops_ratio"] = step["xla_flops_per_chip"] * devices / in_xla if in_xla else 0.0


# Collectives that exchange a layer's activations (expert-parallel dispatch and combine, ring
# shifts): the layer's compute waits on them. The rest (weight all-gathers, gradient reductions)
# move data the compute does not need at once and XLA's scheduler can prefetch or defer.
_EXPOSED_COLLECTIVES = ("all-to-all", "ragged-all-to-all", "collective-permute")


def roofline(step: dict, spec: DeviceSpec, devices: int, model_flops: float) -> None:
    """Two step times and the MFU of each (MFU = model FLOPs / (devices · peak · step time)).

    `bound_step_s` / `mfu_upper_bound`: max(compute, HBM, collectives), each at its peak and all
    perfectly overlapped -- a lower bound on the step, so an upper bound on MFU, not a forecast.
    compute = executed FLOPs (`account_flops`) / peak (bf16); HBM = the compulsory traffic
    (arguments and outputs once, temporaries written and read once) / HBM bandwidth (the HLO's
    upper bound, `hlo.hlo_costs`: every unfused op's operands and results, is `hbm_upper_s`);
    collectives = collective bytes / ICI bandwidth of one chip (several slices: the data axis's
    all-reduce crosses DCN, which is slower).

    `estimated_step_s` / `estimated_mfu`: the same parts without assuming perfect overlap:
    compute + HBM + the exposed collectives (`_EXPOSED_COLLECTIVES`: activation exchanges the
    layer waits on) + whatever of the other collectives (weight gathers, gradient reductions,
    overlappable with compute) exceeds the compute time. Still optimistic about kernels (each at
    peak) and pessimistic about HBM (never hidden under compute)."""
    colls = step.get("collectives", {})
    exposed = sum(v["bytes"] for k, v in colls.items() if k in _EXPOSED_COLLECTIVES)
    parts = {
        "compute_s": step["flops_per_chip"] / spec.peak_flops,
        "hbm_s": step["hbm_bytes_accessed_per_chip"] / spec.hbm_bytes_per_s,
        "collective_s": step["collective_bytes_per_chip"] / spec.ici_bytes_per_s,
    }
    bound_s = max(parts.values())
    step.update(parts)
    step["hbm_upper_s"] = step.get("hbm_bytes_upper_bound_per_chip", 0.0) / spec.hbm_bytes_per_s
    step["bound_by"] = max(parts, key=parts.get).removesuffix("_s")
    step["model_flops"] = model_flops
    step["bound_step_s"] = bound_s
    step["mfu_upper_bound"] = model_flops / (devices * spec.peak_flops * bound_s) if bound_s else 0.0
    exposed_s = exposed / spec.ici_bytes_per_s
    overlappable_s = parts["collective_s"] - exposed_s
    step["exposed_collective_s"] = exposed_s + max(0.0, overlappable_s - parts["compute_s"])
    est = parts["compute_s"] + parts["hbm_s"] + step["exposed_collective_s"]
    step["estimated_step_s"] = est
    step["estimated_mfu"] = model_flops / (devices * spec.peak_flops * est) if est else 0.0


def _chip_bytes(x) -> int:
    """Bytes of one device's shard of an abstract array (the whole array without a sharding)."""
    sharding = getattr(x, "sharding", None)
    shape = x.shape if sharding is None else sharding.shard_shape(x.shape)
    return math.prod(shape) * jnp.dtype(x.dtype).itemsize


def kv_fit(state, params, hbm_bytes: float, max_len: int, mean_len: int,
           page_size: int) -> dict:
    """Sequences that fit in the decode mesh at most `max_len` and on average `mean_len` tokens
    each: slot caches (every global layer holds max_len positions a sequence) against the paged
    layout (`Engine(kv_layout="paged")`: pages for the tokens held, mean_len plus one page of
    slack a sequence, a page-table row per global layer, and one max_len sequence of pages per
    batch shard kept back, the engine's guarantee that some sequence can always finish).

    From the abstract, sharded decode state and weights the compiled step takes: a chip holds
    its shard of the weights and of its batch shard's sequences; what HBM leaves after the
    weights is divided by one sequence's bytes on that chip (global-layer cache entries, which
    grow with the length, plus the rest: local rings, logits, sampling state), times the batch
    shards. The step's temporaries are left out for both layouts alike.
    """
    weights = sum(_chip_bytes(x) for x in jax.tree.leaves(params))
    batch = state.active.shape[0]
    ways = batch // state.active.sharding.shard_shape(state.active.shape)[0]
    per_chip = batch // ways
    total = sum(_chip_bytes(x) for x in jax.tree.leaves(state))
    glob = pos = layers = 0
    for layer in state.cache:
        if layer["pos"].shape[-1] != max_len:  # a ring buffer of a local layer
            continue
        layers += math.prod(layer["pos"].shape[:-2])
        pos += _chip_bytes(layer["pos"])
        glob += sum(_chip_bytes(x) for name, x in layer.items() if name != "pos")
    rest = (total - glob - pos) / per_chip
    per_token = glob / per_chip / max_len
    max_pages = -(-max_len // page_size)
    slot_seq = (glob + pos) / per_chip + rest
    paged_seq = per_token * (mean_len + page_size) + layers * max_pages * 4 + rest
    free = hbm_bytes - weights
    reserve = per_token * max_len
    slot = ways * max(0, int(free // slot_seq))
    paged = ways * max(0, int((free - reserve) // paged_seq))
    return {
        "max_len": max_len, "mean_len": mean_len, "page_size": page_size,
        "batch_shards": ways, "weight_bytes_per_chip": weights, "free_bytes_per_chip": free,
        "global_kv_bytes_per_token_per_chip": per_token,
        "slot_bytes_per_sequence_per_chip": slot_seq,
        "paged_bytes_per_sequence_per_chip": paged_seq,
        "slot_sequences": slot, "paged_sequences": paged,
        "paged_over_slot": paged / slot if slot else float("inf"),
    }

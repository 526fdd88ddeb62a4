"""`ModelConfig`: every shape and switch of the MAI-style MoE transformer (RECIPE §2), gin-bound.

Defaults describe a small model; `configs/*.gin` bind the tiny CPU model and the flagship. Invalid
combinations fail in `__post_init__` with the field named, before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import math

import gin
import jax.numpy as jnp

from pallas_kernels.expert_mlp import IMPLS as EXPERT_MLP_IMPLS
from pallas_kernels.self_attention import IMPLS as SELF_ATTENTION_IMPLS

ATTENTION_KINDS = ("local", "global")
FFN_KINDS = ("moe", "dense")
ATTENTION_TYPES = ("gqa", "mla")  # grouped-query, or DeepSeek's multi-head latent attention
ROPE_SCALINGS = ("none", "llama3", "yarn")
MOE_TYPES = ("latent", "plain")  # LatentMoE (RECIPE §2), or experts on the model width
ROUTER_TYPES = ("softmax", "sigmoid")
EXPERT_ACTIVATIONS = ("swiglu", "clamped_swiglu")  # clamped_swiglu: GPT-OSS's (limit, alpha)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# The implementations of the routed experts' MLP and of the full forward's self-attention are the
# kernel package's (`pallas_kernels.expert_mlp`, `pallas_kernels.self_attention`, where each is
# described): "auto" = the Pallas kernels on TPU/GPU and the XLA forms measured fastest on CPU
# (`pallas_kernels._dispatch.AUTO`); "pallas" forces the kernels (interpret mode on CPU, for
# tests); the others name one XLA form.
MOE_IMPLS = EXPERT_MLP_IMPLS
# Expert parallelism for the routed experts (hcjax/model/moe.py), used when the context mesh
# (`jax.set_mesh`) has an `expert` axis larger than 1: "all_to_all" sends each assignment to the
# device holding its expert (ragged all-to-all), "all_gather" gathers the tokens over the expert
# axis and reduce-scatters the outputs back; "none" keeps the global (GSPMD) dispatch.
EXPERT_PARALLEL_MODES = ("none", "all_to_all", "all_gather")
# Attention of the full forward: "reference" is dense masked attention over the whole row, "blocked"
# the same in query blocks that skip keys no query of the block can see (causal upper triangle,
# keys behind the window); "auto" is the Pallas kernels on TPU/GPU and "blocked" elsewhere.
ATTENTION_IMPLS = SELF_ATTENTION_IMPLS
# Rematerialisation of each layer (hcjax/model/transformer.py): "none" keeps every activation,
# "full" saves nothing (recomputes the layer in the backward pass), "dots" saves the outputs of
# matmuls without batch dimensions (the weight matmuls, not attention scores), "minimal" saves
# only the activations tagged with `checkpoint_name` (each layer's attention and FFN outputs).
REMAT_POLICIES = ("none", "full", "full_compute", "dots", "minimal")
# The policies that keep only each layer's input and recompute the whole layer (what
# `accumulate_in_scan` and the planner's remat factor assume).
FULL_REMAT = ("full", "full_compute")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    d_model: int = 256
    num_layers: int = 6
    num_heads: int = 8
    num_kv_heads: int = 8
    head_dim: int = 32
    # Repeated cyclically over layers: default 5 local sliding-window layers per global layer.
    attention_pattern: tuple[str, ...] = ("local",) * 5 + ("global",)
    window: int = 512
    rope_theta: float = 10_000.0
    # Repeated cyclically over layers: default alternating sparse MoE and dense SwiGLU.
    ffn_pattern: tuple[str, ...] = ("moe", "dense")
    d_ff: int = 1024  # dense SwiGLU hidden size
    num_experts: int = 8
    experts_per_token: int = 2
    moe_latent_dim: int = 128  # LatentMoE: experts run in this compressed space
    moe_d_ff: int = 256  # each expert's SwiGLU hidden size (in the latent space)
    dtype: str = "bfloat16"  # compute dtype; parameters are fp32 masters
    dropout_rate: float = 0.0
    max_seq_len: int = 4096
    moe_impl: str = "ragged"
    expert_parallel: str = "none"  # one of EXPERT_PARALLEL_MODES
    # Expert-parallel dispatch in this many sequential chunks of each device's tokens: the dropless
    # receive buffer (sized for the worst case, every peer's assignments on one device) shrinks by
    # the same factor. Results are identical; 1 = one exchange per layer.
    expert_parallel_chunks: int = 1
    attention_impl: str = "reference"
    norm_eps: float = 1e-6
    # Scale: layers after `first_dense_layers` run under one `jax.lax.scan` over whole periods of
    # the layer pattern (parameters stacked on a leading "layers" axis), and each layer is
    # rematerialised by `remat_policy` (one of REMAT_POLICIES): "full" saves each layer's input
    # (the fp32 residual stream) and recomputes the layer in the backward; "full_compute" the same
    # with the saved input rounded to the compute dtype (half the bytes; the forward unchanged,
    # gradients within the tolerance tests/test_model.py states of "full").
    scan_layers: bool = False
    remat_policy: str = "none"
    # Training with micro-batches over scanned layers rematerialised "full" or "full_compute": the
    # backward adds each layer's parameter gradients into the step's running sum in place (one
    # gradient-sized buffer instead of two; same numbers). False: each micro-batch's gradients are
    # a new buffer added to the sum after its backward (the plain `jax.grad` form).
    accumulate_in_scan: bool = True

    # --- Switches the open model families need (defaults are the MAI flagship's choices). ---
    # Embeddings and output head.
    tie_embeddings: bool = True
    scale_logits: bool = True  # logits *= d_model**-0.5 (MAI); HF families use plain logits
    # Attention.
    attention_type: str = "gqa"
    rope_global: bool = False  # MAI's global layers use no positional encoding (NoPE)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    attention_bias: bool = False  # GPT-OSS: q/k/v/o biases
    attention_sinks: bool = False  # GPT-OSS: one learned softmax sink logit per query head
    attention_output_norm: bool = True  # MAI: zero-initialised RMSNorm on the attention branch
    # Multi-head latent attention (attention_type="mla"; DeepSeek-V3, Kimi K2).
    q_lora_rank: int = 0  # 0: queries projected directly from d_model
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # RoPE frequency scaling (as in the Hugging Face rope_type of the same name).
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_original_max_len: int = 0  # the pre-extension context ("original_max_position_embeddings")
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_beta_fast: float = 32.0  # yarn
    rope_beta_slow: float = 1.0  # yarn
    rope_truncate: bool = True  # yarn: floor/ceil the correction range
    rope_attention_factor: float = 0.0  # yarn: cos/sin scale; 0 = derived from the factor
    rope_mscale: float = 0.0  # yarn (DeepSeek): mscale
    rope_mscale_all_dim: float = 0.0  # yarn (DeepSeek): mscale_all_dim, also scales MLA's softmax
    # Feed-forward layers.
    first_dense_layers: int = 0  # DeepSeek's first_k_dense_replace: these layers are dense
    moe_type: str = "latent"
    router_type: str = "softmax"  # softmax over experts, or DeepSeek's sigmoid scores
    router_renormalize: bool = True  # gates renormalised over the chosen experts
    router_bias: bool = False  # GPT-OSS: router logits have a bias
    router_correction_bias: bool = False  # DeepSeek: bias added for the choice only
    router_groups: int = 1  # DeepSeek grouped top-k: experts in this many groups ...
    router_topk_groups: int = 1  # ... of which the best this many are eligible
    routed_scaling: float = 1.0  # DeepSeek's routed_scaling_factor on the gates
    num_shared_experts: int = 0  # DeepSeek: always-on experts of moe_d_ff each (one fused MLP)
    expert_bias: bool = False  # GPT-OSS: biases in the experts' projections
    expert_activation: str = "swiglu"
    swiglu_limit: float = 7.0  # clamped_swiglu
    swiglu_alpha: float = 1.702  # clamped_swiglu

    # --- Exact mode (bitwise on-policy). ---
    # Every reduction over a token's features runs in an order fixed by the operation, not by
    # how many tokens share the call (`pallas_kernels.batch_invariant`): matmuls on fixed tiles of
    # `invariant_tile` rows, sums as fixed trees over the index, attention over keys at index =
    # position. The engine's decode and prefill and the learner's forward then give a token the
    # same logits to the bit, so the learner's log-prob of a sampled token equals the sampler's.
    # The engine keeps local layers' keys at their positions (no ring buffer) and the learner
    # packs each rollout at an offset aligned to its power-of-two length.
    batch_invariant: bool = False
    invariant_tile: int = 64

    def __post_init__(self) -> None:
        # gin may hand lists where tuples are declared; normalise so the config stays hashable.
        object.__setattr__(self, "attention_pattern", tuple(self.attention_pattern))
        object.__setattr__(self, "ffn_pattern", tuple(self.ffn_pattern))
        positive = (
            "vocab_size d_model num_layers num_heads num_kv_heads head_dim window d_ff "
            "num_experts experts_per_token moe_latent_dim moe_d_ff max_seq_len"
        ).split()
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"ModelConfig.experts_per_token={self.experts_per_token} exceeds "
                f"num_experts={self.num_experts}"
            )
        if not self.attention_pattern or any(
            a not in ATTENTION_KINDS for a in self.attention_pattern
        ):
            raise ValueError(
                f"ModelConfig.attention_pattern={self.attention_pattern!r}: entries must be in "
                f"{ATTENTION_KINDS}"
            )
        if not self.ffn_pattern or any(f not in FFN_KINDS for f in self.ffn_pattern):
            raise ValueError(
                f"ModelConfig.ffn_pattern={self.ffn_pattern!r}: entries must be in {FFN_KINDS}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelConfig.dtype={self.dtype!r} must be one of {sorted(DTYPES)}")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"ModelConfig.moe_impl={self.moe_impl!r} must be one of {MOE_IMPLS}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"ModelConfig.attention_impl={self.attention_impl!r} must be one of "
                f"{ATTENTION_IMPLS}"
            )
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"ModelConfig.dropout_rate={self.dropout_rate} must be in [0, 1)")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even (RoPE pairs)")
        choices = {
            "attention_type": ATTENTION_TYPES,
            "rope_scaling": ROPE_SCALINGS,
            "moe_type": MOE_TYPES,
            "router_type": ROUTER_TYPES,
            "expert_activation": EXPERT_ACTIVATIONS,
            "expert_parallel": EXPERT_PARALLEL_MODES,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"ModelConfig.{name}={getattr(self, name)!r} must be one of {allowed}"
                )
        non_negative = "q_lora_rank first_dense_layers num_shared_experts rope_original_max_len"
        for name in non_negative.split():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelConfig.{name}={value!r} must be a non-negative integer")
        if self.attention_type == "mla":
            for name in "kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim".split():
                value = getattr(self, name)
                if not isinstance(value, int) or value <= 0:
                    raise ValueError(f"ModelConfig.{name}={value!r} must be a positive integer")
            if self.qk_rope_head_dim % 2:
                raise ValueError(
                    f"ModelConfig.qk_rope_head_dim={self.qk_rope_head_dim} must be even"
                )
            if self.num_kv_heads != self.num_heads:
                raise ValueError(
                    f"ModelConfig.num_kv_heads={self.num_kv_heads} must equal num_heads="
                    f"{self.num_heads} for attention_type='mla' (every head has its own K/V)"
                )
            for name in ("qk_norm", "attention_bias"):
                if getattr(self, name):
                    raise ValueError(f"ModelConfig.{name}=True is not supported with MLA")
        if self.num_experts % self.router_groups:
            raise ValueError(
                f"ModelConfig.num_experts={self.num_experts} is not a multiple of "
                f"router_groups={self.router_groups}"
            )
        if not 1 <= self.router_topk_groups <= self.router_groups:
            raise ValueError(
                f"ModelConfig.router_topk_groups={self.router_topk_groups} must be in "
                f"[1, router_groups={self.router_groups}]"
            )
        if self.router_groups > 1 and (
            self.num_experts // self.router_groups * self.router_topk_groups
            < self.experts_per_token
        ):
            raise ValueError(
                f"ModelConfig.router_topk_groups={self.router_topk_groups} groups of "
                f"{self.num_experts // self.router_groups} experts cannot hold "
                f"experts_per_token={self.experts_per_token}"
            )
        if self.rope_scaling != "none" and self.rope_factor <= 0:
            raise ValueError(f"ModelConfig.rope_factor={self.rope_factor} must be positive")
        if self.rope_scaling == "llama3" and not (
            self.rope_original_max_len > 0 and self.rope_high_freq_factor > self.rope_low_freq_factor
        ):
            raise ValueError(
                "ModelConfig.rope_scaling='llama3' needs rope_original_max_len > 0 and "
                f"rope_high_freq_factor={self.rope_high_freq_factor} > rope_low_freq_factor="
                f"{self.rope_low_freq_factor}"
            )
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"ModelConfig.remat_policy={self.remat_policy!r} must be one of {REMAT_POLICIES}"
            )
        if not isinstance(self.expert_parallel_chunks, int) or self.expert_parallel_chunks < 1:
            raise ValueError(
                f"ModelConfig.expert_parallel_chunks={self.expert_parallel_chunks!r} must be a "
                "positive integer"
            )
        scanned = self.num_layers - self.first_dense_layers
        if self.scan_layers and scanned < self.layer_period:
            raise ValueError(
                f"ModelConfig.num_layers={self.num_layers} cannot be scanned: the {scanned} layers "
                f"after first_dense_layers={self.first_dense_layers} hold no whole period of the "
                f"layer pattern ({self.layer_period} layers: lcm of the attention_pattern and "
                f"ffn_pattern lengths)"
            )
        if not isinstance(self.invariant_tile, int) or self.invariant_tile < 1:
            raise ValueError(f"ModelConfig.invariant_tile={self.invariant_tile!r} must be a "
                             "positive integer (rows per batch-invariant matmul tile)")
        if self.batch_invariant and self.expert_parallel != "none":
            raise ValueError(
                f"ModelConfig.batch_invariant=True runs the routed experts on one program's "
                f"tokens; expert_parallel={self.expert_parallel!r} is not supported in exact mode "
                "(use expert_parallel='none')")
        if self.batch_invariant and self.dropout_rate:
            raise ValueError(
                f"ModelConfig.batch_invariant=True needs dropout_rate=0 (got "
                f"{self.dropout_rate}): dropout in the learner's forward changes the log-probs")
        if self.attention_impl == "pallas" and self.attention_sinks:
            raise ValueError(
                "ModelConfig.attention_impl='pallas' has no attention sinks (the flash kernel "
                "lacks them); run them on attention_impl='blocked', 'reference' or 'auto'"
            )

    # Layer layout ---------------------------------------------------------------------------
    @property
    def layer_period(self) -> int:
        """Layers after which the (attention, ffn) pattern repeats: the unit of the layer scan."""
        return math.lcm(len(self.attention_pattern), len(self.ffn_pattern))

    def attention_kind(self, layer: int) -> str:
        return self.attention_pattern[layer % len(self.attention_pattern)]

    def ffn_kind(self, layer: int) -> str:
        if layer < self.first_dense_layers:
            return "dense"
        return self.ffn_pattern[layer % len(self.ffn_pattern)]

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.ffn_kind(i) == "moe")

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def exact_tile(self) -> int | None:
        """Rows per batch-invariant tile in exact mode, None otherwise."""
        return self.invariant_tile if self.batch_invariant else None

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

"""`ModelConfig`: every shape and switch of the MAI-style MoE transformer (RECIPE §2), gin-bound.

Defaults describe a small model; `configs/*.gin` bind the tiny CPU model and the flagship. Invalid
combinations fail in `__post_init__` with the field named, before anything is compiled.
"""

from __future__ import annotations

import dataclasses

import gin
import jax.numpy as jnp

ATTENTION_KINDS = ("local", "global")
FFN_KINDS = ("moe", "dense")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# "auto" = the Pallas kernels on TPU/GPU, the XLA path on CPU ("blocked" for the MoE, which is the
# fastest there); "pallas" forces the kernels (interpret mode on CPU, for tests);
# "reference"/"ragged"/"blocked"/"dense" are XLA-only paths.
MOE_IMPLS = ("ragged", "blocked", "dense", "pallas", "auto")
ATTENTION_IMPLS = ("reference", "pallas", "auto")


def use_pallas(impl: str) -> bool:
    """Whether an implementation switch selects our Pallas kernels on this backend."""
    import jax

    return impl == "pallas" or (impl == "auto" and jax.default_backend() in ("gpu", "tpu"))


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
    attention_impl: str = "reference"
    norm_eps: float = 1e-6

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

    # Layer layout ---------------------------------------------------------------------------
    def attention_kind(self, layer: int) -> str:
        return self.attention_pattern[layer % len(self.attention_pattern)]

    def ffn_kind(self, layer: int) -> str:
        return self.ffn_pattern[layer % len(self.ffn_pattern)]

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.ffn_kind(i) == "moe")

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

"""Small models with non-degenerate weights for rollout tests, benchmarks and the standalone server.

A freshly initialised Transformer zeroes every attention branch (RMSNorm gain 0), so its output
ignores the context; these helpers add noise to every weight so generation depends on it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from hcjax.model import ModelConfig, Transformer

__all__ = ["TINY_TEST_CONFIG", "perturbed", "tiny_model"]

# Window 8 < typical prompt + response, so the local layers' ring buffers wrap in every test.
TINY_TEST_CONFIG = ModelConfig(
    vocab_size=64, d_model=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
    attention_pattern=("local", "global"), window=8, ffn_pattern=("moe", "dense"), d_ff=64,
    num_experts=4, experts_per_token=2, moe_latent_dim=16, moe_d_ff=32, dtype="float32",
    max_seq_len=64,
)


def perturbed(state: nnx.State, seed: int, scale: float = 0.3) -> nnx.State:
    """`state` with N(0, scale^2) noise added to every floating-point leaf."""
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [
        x + scale * jax.random.normal(k, x.shape, x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating) else x
        for x, k in zip(leaves, keys)
    ]
    return jax.tree.unflatten(treedef, noisy)


def tiny_model(seed: int = 0, cfg: ModelConfig | None = None, **overrides) -> Transformer:
    """A Transformer (TINY_TEST_CONFIG unless `cfg` is given, plus overrides), weights perturbed."""
    cfg = dataclasses.replace(cfg or TINY_TEST_CONFIG, **overrides)
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)))
    return nnx.merge(graphdef, perturbed(state, seed + 1))

"""Gaussian noise on a model's weights, for a model served or measured without a checkpoint.

A freshly initialised Transformer zeroes every attention branch (RMSNorm gain 0), so its output
ignores the context; noise on every weight makes generation depend on it. `python -m hcjax.serve
--init_noise` and the rollout benchmarks use it; it never changes a loaded checkpoint's weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["add_weight_noise"]


def add_weight_noise(state: nnx.State, seed: int, scale: float = 0.3) -> nnx.State:
    """`state` with N(0, scale^2) noise (drawn from `seed`) added to every floating-point leaf;
    integer leaves are returned as they are."""
    if not scale >= 0:
        raise ValueError(f"scale={scale!r} must be >= 0")
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [
        x + scale * jax.random.normal(k, x.shape, x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating) else x
        for x, k in zip(leaves, keys)
    ]
    return jax.tree.unflatten(treedef, noisy)

"""Small building blocks of the transformer: parameters with logical axes, RMSNorm, RoPE, SwiGLU.

Every parameter is an fp32 `nnx.Param` carrying `logical_axes` metadata; `hcjax.sharding` maps those
names to mesh axes. Nothing here knows about meshes or RL.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def param(rngs: nnx.Rngs, shape, axes, *, std: float | None = None, value: float | None = None):
    """An fp32 parameter with logical axis names; normal(0, std) (default 1/sqrt(fan_in)) or const."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {shape}")
    if value is not None:
        init = jnp.full(shape, value, jnp.float32)
    else:
        std = std if std is not None else shape[0] ** -0.5
        init = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(init, logical_axes=tuple(axes))


class RMSNorm(nnx.Module):
    """RMSNorm in fp32 with a learnt gain (no bias). `init_gain=0` zero-initialises a branch."""

    def __init__(self, dim: int, *, eps: float, init_gain: float = 1.0, rngs: nnx.Rngs):
        self.scale = param(rngs, (dim,), ("norm",), value=init_gain)
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        return x32 * jax.lax.rsqrt(var + self.eps) * self.scale[...]


def rope(x_bthd, positions_bt, theta: float):
    """Rotary position embedding on the last axis (pairs of halves), computed in fp32."""
    d = x_bthd.shape[-1]
    freqs = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) / (d // 2))
    angles = positions_bt.astype(jnp.float32)[..., None] * freqs  # [B,T,D/2]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x = x_bthd.astype(jnp.float32)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bthd.dtype)


def swiglu(x, w_gate, w_up, w_down, dtype):
    """SwiGLU MLP: (silu(x Wg) * x Wu) Wd, in the compute dtype."""
    x = x.astype(dtype)
    h = jax.nn.silu(x @ w_gate.astype(dtype)) * (x @ w_up.astype(dtype))
    return h @ w_down.astype(dtype)


class DenseMLP(nnx.Module):
    """Dense SwiGLU feed-forward layer without biases."""

    def __init__(self, d_model: int, d_ff: int, *, dtype, rngs: nnx.Rngs):
        self.w_gate = param(rngs, (d_model, d_ff), ("embed", "mlp"))
        self.w_up = param(rngs, (d_model, d_ff), ("embed", "mlp"))
        self.w_down = param(rngs, (d_ff, d_model), ("mlp", "embed"))
        self.dtype = dtype

    def __call__(self, x_btd):
        return swiglu(x_btd, self.w_gate[...], self.w_up[...], self.w_down[...], self.dtype)


def dropout(x, rate: float, rng):
    """Inverted dropout; identity when rng is None or rate is 0."""
    if rng is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)

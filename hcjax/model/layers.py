"""Small building blocks of the transformer: parameters with logical axes, RMSNorm, RoPE, SwiGLU.

Every parameter is an fp32 `nnx.Param` carrying `logical_axes` metadata; `hcjax.sharding` maps those
names to mesh axes, and `hcjax.sharding.constrain` applies the activation names to whatever mesh the
caller put in context (none: no-op). Nothing here knows about mesh sizes or RL.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hcjax import sharding as shd
from pallas_kernels import _dispatch
from pallas_kernels import batch_invariant as bi
from pallas_kernels.projection import project as pallas_project
from pallas_kernels.swiglu import swiglu as pallas_swiglu


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


def project(x, w, n_in: int = 1, *, tile: int | None = None, out_dtype=None):
    """x contracted with w over w's first `n_in` axes: the kernel package's projection, or in
    exact mode (`tile`, ModelConfig.exact_tile) its batch-invariant form. Where that form is the
    Pallas kernel (GPU, TPU) under a mesh, it runs on each device's rows (`shard_map` over the
    activation batch axes, the weight whole): XLA cannot partition a Pallas call."""
    if tile is None:
        y = pallas_project(x, w, n_in)
        return y if out_dtype is None else y.astype(out_dtype)
    mesh = jax.sharding.get_abstract_mesh()
    impl = _dispatch.choose("auto", "batch_invariant_project", bi.PROJECT_IMPLS)
    if impl != "pallas" or mesh.empty or not mesh.auto_axes or mesh.size == 1 or x.ndim < 2:
        return bi.project(x, w, n_in, tile=tile, out_dtype=out_dtype)
    batch = shd.activation_spec(x.shape[:1], ("activation_batch",), mesh)[0]
    P = jax.sharding.PartitionSpec
    rows = P(batch, *([None] * (x.ndim - n_in - 1 + w.ndim - n_in)))
    return jax.shard_map(
        lambda x, w: bi.project(x, w, n_in, tile=tile, out_dtype=out_dtype), mesh=mesh,
        in_specs=(P(batch, *([None] * (x.ndim - 1))), P()), out_specs=rows,
        check_vma=False)(x, w)


class RMSNorm(nnx.Module):
    """RMSNorm in fp32 with a learnt gain (no bias). `init_gain=0` zero-initialises a branch;
    `exact` sums the squares as a batch-invariant tree (exact mode)."""

    def __init__(self, dim: int, *, eps: float, init_gain: float = 1.0, exact: bool = False,
                 rngs: nnx.Rngs):
        self.scale = param(rngs, (dim,), ("norm",), value=init_gain)
        self.eps = eps
        self.exact = exact

    def __call__(self, x):
        if self.exact:
            return bi.rms_norm(x, self.eps, self.scale[...])
        x32 = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        return x32 * jax.lax.rsqrt(var + self.eps) * self.scale[...]


def rope_frequencies(cfg, dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dim/2] and the cos/sin scale of RoPE under `cfg.rope_scaling`.

    "none": theta^(-2i/dim). "llama3": long wavelengths divided by the factor, short ones kept,
    a smooth blend between (Llama 3.1). "yarn": per-frequency blend of interpolated and
    extrapolated frequencies over the correction range of (beta_fast, beta_slow) rotations, and an
    attention factor 0.1·ln(factor) + 1 (or the mscale ratio) on cos/sin (YaRN, as used by GPT-OSS
    and DeepSeek-V3). Computed once in float64 numpy: these are constants of the model.
    """
    base = cfg.rope_theta
    inv_freq = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if cfg.rope_scaling == "llama3":
        factor, old_len = cfg.rope_factor, cfg.rope_original_max_len
        low_wavelen = old_len / cfg.rope_low_freq_factor
        high_wavelen = old_len / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
        )
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, blended, scaled), 1.0
    if cfg.rope_scaling == "yarn":
        # The declared factor, as transformers 5 uses it (not max_seq_len / original length, so
        # shortening max_seq_len for an engine leaves the frequencies alone).
        factor = cfg.rope_factor
        old_len = cfg.rope_original_max_len or cfg.max_seq_len

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if cfg.rope_attention_factor:
            attention_factor = cfg.rope_attention_factor
        elif cfg.rope_mscale and cfg.rope_mscale_all_dim:
            attention_factor = mscale(factor, cfg.rope_mscale) / mscale(
                factor, cfg.rope_mscale_all_dim
            )
        else:
            attention_factor = mscale(factor)

        def correction_dim(rotations: float) -> float:
            return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
        if cfg.rope_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolate = 1 - ramp
        inv_freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
        return inv_freq, attention_factor
    return inv_freq, 1.0


def rope(x_bthd, positions_bt, inv_freq, scale: float = 1.0, exact: bool = False):
    """Rotary position embedding on the last axis (pairs of halves), computed in fp32.

    `inv_freq` is [D/2] (a theta for the plain form, or the table of `rope_frequencies`); `scale`
    multiplies cos and sin (YaRN's attention factor). `exact` (exact mode): no product is
    contracted into the add or sine that consumes it (`batch_invariant.unfused`).
    """
    mul = bi.product if exact else jnp.multiply
    d = x_bthd.shape[-1]
    if isinstance(inv_freq, int | float):
        inv_freq = rope_frequencies_plain(inv_freq, d)
    freqs = jnp.asarray(inv_freq, jnp.float32)
    angles = mul(positions_bt.astype(jnp.float32)[..., None], freqs)  # [B,T,D/2]
    sin = (jnp.sin(angles) * scale)[:, :, None, :]
    cos = (jnp.cos(angles) * scale)[:, :, None, :]
    x = x_bthd.astype(jnp.float32)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    out = jnp.concatenate([mul(x1, cos) - mul(x2, sin), mul(x2, cos) + mul(x1, sin)], axis=-1)
    return out.astype(x_bthd.dtype)


def rope_frequencies_plain(theta: float, dim: int) -> np.ndarray:
    return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def swiglu(x, w_gate, w_up, w_down, dtype, tile: int | None = None):
    """SwiGLU MLP: (silu(x Wg) * x Wu) Wd, in the compute dtype, the hidden split over the tensor
    axis (`pallas_kernels.swiglu`; "auto" picks its backward by platform). In exact mode
    (`tile`) each product is a batch-invariant projection."""
    if tile is not None:
        x = x.astype(dtype)
        g = project(x, w_gate.astype(dtype), tile=tile)
        u = project(x, w_up.astype(dtype), tile=tile)
        h = _constrain_hidden(jax.nn.silu(g) * u)
        return project(h, w_down.astype(dtype), tile=tile)
    return pallas_swiglu(x.astype(dtype), w_gate.astype(dtype), w_up.astype(dtype),
                         w_down.astype(dtype), constrain_hidden=_constrain_hidden)


def _constrain_hidden(h):
    """[B, T, F] (or [N, F] for flattened tokens): the hidden is split over the tensor axis."""
    axes = ("activation_batch",) + ("activation_length",) * (h.ndim - 2) + ("activation_mlp",)
    return shd.constrain(h, axes)


class DenseMLP(nnx.Module):
    """Dense SwiGLU feed-forward layer without biases."""

    def __init__(self, d_model: int, d_ff: int, *, dtype, exact_tile: int | None = None,
                 rngs: nnx.Rngs):
        self.w_gate = param(rngs, (d_model, d_ff), ("embed", "mlp"))
        self.w_up = param(rngs, (d_model, d_ff), ("embed", "mlp"))
        self.w_down = param(rngs, (d_ff, d_model), ("mlp", "embed"))
        self.dtype = dtype
        self.exact_tile = exact_tile

    def __call__(self, x_btd):
        return swiglu(x_btd, self.w_gate[...], self.w_up[...], self.w_down[...], self.dtype,
                      self.exact_tile)


def dropout(x, rate: float, rng):
    """Inverted dropout; identity when rng is None or rate is 0."""
    if rng is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)

"""Quantisers for the tests: small FP8 block-scaled and MXFP4 tensors built by the releases'
rules (DeepSeek-V3's block quantiser; OCP Microscaling), to check hcjax.model.quant's
dequantisers and the Hugging Face reader against. Not used to train or serve anything."""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np

from hcjax.model.quant import (
    DEFAULT_FP8_BLOCK,
    E2M1_VALUES,
    MXFP4_GROUP,
    _fp8_scale_shape,
)

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def quant_fp8_blocks(w_f32: np.ndarray, block: Sequence[int] = DEFAULT_FP8_BLOCK
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn weight, float32 scale_inv) with scale_inv = amax / 448 per block.

    The rule of DeepSeek-V3's block quantiser; an all-zero block gets scale_inv 0.
    """
    w = np.asarray(w_f32, dtype=np.float32)
    scale_shape = _fp8_scale_shape(w.shape, block)
    if not np.all(np.isfinite(w)):
        raise ValueError("cannot FP8-quantise a tensor with non-finite values")
    bo, bi = block
    nbo, nbi = scale_shape[-2:]
    pad = [(0, 0)] * (w.ndim - 2) + [(0, nbo * bo - w.shape[-2]), (0, nbi * bi - w.shape[-1])]
    blocks = np.pad(np.abs(w), pad).reshape(*w.shape[:-2], nbo, bo, nbi, bi)
    scale_inv = (blocks.max(axis=(-3, -1)) / np.float32(FP8_E4M3_MAX)).astype(np.float32)
    divisor = np.where(scale_inv > 0, scale_inv, np.float32(1.0))
    divisor = np.repeat(np.repeat(divisor, bo, axis=-2), bi, axis=-1)
    divisor = divisor[..., : w.shape[-2], : w.shape[-1]]
    q = np.clip(w / divisor, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.astype(ml_dtypes.float8_e4m3fn), scale_inv


def _round_to_e2m1(q: np.ndarray) -> np.ndarray:
    """Nearest E2M1 code for |q| <= 6, ties to the even code (round-half-to-even mantissa)."""
    magnitudes = E2M1_VALUES[:8].astype(np.float64)
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2
    a = np.abs(q)
    lo = np.searchsorted(midpoints, a, side="left")
    hi = np.searchsorted(midpoints, a, side="right")
    code = np.where(lo != hi, lo + lo % 2, lo)  # on a midpoint: candidates lo, lo + 1
    return (code + 8 * np.signbit(q)).astype(np.uint8)


def quant_mxfp4(w_f32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., K] floats -> (uint8 blocks [..., K/32, 16], uint8 E8M0 scales [..., K/32]).

    Per 32-element group the exponent e is the smallest with max|w| <= 6 * 2**e (so nothing
    clips), clamped to E8M0's range; w / 2**e is rounded to the nearest E2M1 value. An all-zero
    group gets e = 0.
    """
    w = np.asarray(w_f32, dtype=np.float64)  # exact for float32 input; scaling by 2**-e stays exact
    if w.ndim < 1 or w.shape[-1] % MXFP4_GROUP:
        raise ValueError(f"MXFP4 input shape {w.shape}: last dim must be a multiple of "
                         f"{MXFP4_GROUP}")
    if not np.all(np.isfinite(w)):
        raise ValueError("cannot MXFP4-quantise a tensor with non-finite values")
    groups = w.reshape(*w.shape[:-1], -1, MXFP4_GROUP)
    amax = np.abs(groups).max(axis=-1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.ceil(np.log2(amax / 6.0)), 0.0)
    # log2 can be off by one ulp near powers of two; make e exactly the smallest that fits.
    e = np.where(amax > np.ldexp(6.0, e.astype(np.int64)), e + 1, e)
    e = np.where((amax > 0) & (amax <= np.ldexp(6.0, e.astype(np.int64) - 1)), e - 1, e)
    e = np.clip(e, -127, 127).astype(np.int64)
    q = groups * np.ldexp(1.0, -e)[..., None]
    codes = _round_to_e2m1(np.clip(q, -6.0, 6.0))
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.astype(np.uint8), (e + 127).astype(np.uint8)

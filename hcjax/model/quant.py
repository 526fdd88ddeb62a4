"""Dequantisation of released quantised checkpoints (FP8 block-scaled, MXFP4), plus quantisers.

Pure numpy functions of arrays: the checkpoint reader hands tensors in, the converter decides
names and layouts. The quantisers exist so tests can build small quantised tensors; they follow
the releases' rules but are not used to train or serve anything.

- FP8 block-scaled (DeepSeek-V3): `W` is float8_e4m3fn [..., out, in] with `W_scale_inv` float32
  [..., ceil(out/bo), ceil(in/bi)]; W_f32[i, j] = float(W[i, j]) * scale_inv[i // bo, j // bi].
- MXFP4 (GPT-OSS, OCP Microscaling): `<name>_blocks` uint8 [..., G, 16], two FP4 E2M1 values per
  byte (low nibble first), and `<name>_scales` uint8 [..., G], E8M0 exponents with bias 127;
  W_f32[..., 32 g + k] = E2M1[nibble k of group g] * 2**(scales[..., g] - 127).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import ml_dtypes
import numpy as np
import numpy.typing as npt

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
DEFAULT_FP8_BLOCK = (128, 128)
MXFP4_GROUP = 32  # elements sharing one E8M0 scale
_CHUNK_ELEMENTS = 1 << 22  # output elements dequantised per step, to bound temporaries

# FP4 E2M1 code -> value: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa.
E2M1_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
# byte -> (value of low nibble, value of high nibble): one gather decodes a whole byte.
_BYTE_TO_PAIR = np.stack([E2M1_VALUES[np.arange(256) & 0xF], E2M1_VALUES[np.arange(256) >> 4]],
                         axis=-1)
# E8M0 byte -> 2**(s - 127); 0xFF is NaN in the OCP MX spec (v1.0, section 5.4.1).
_E8M0_SCALE = np.append(np.ldexp(np.float32(1.0), np.arange(255, dtype=np.int32) - 127),
                        np.float32(np.nan)).astype(np.float32)


def fp8_block_size(quantization_config: Mapping | None) -> tuple[int, int]:
    """`weight_block_size` from an HF `quantization_config`, default (128, 128)."""
    block = (quantization_config or {}).get("weight_block_size") or DEFAULT_FP8_BLOCK
    if len(block) != 2 or not all(int(b) == b and b > 0 for b in block):
        raise ValueError(f"weight_block_size={block!r} is not two positive ints")
    return int(block[0]), int(block[1])


def _fp8_scale_shape(w_shape: tuple[int, ...], block: Sequence[int]) -> tuple[int, ...]:
    if len(w_shape) < 2:
        raise ValueError(f"FP8 weight shape {w_shape} needs at least 2 dims [..., out, in]")
    if len(block) != 2 or min(block) <= 0:
        raise ValueError(f"block={tuple(block)} is not two positive ints")
    return (*w_shape[:-2], -(-w_shape[-2] // block[0]), -(-w_shape[-1] // block[1]))


def dequant_fp8_blocks(w: np.ndarray, scale_inv: np.ndarray,
                       block: Sequence[int] = DEFAULT_FP8_BLOCK,
                       dtype: npt.DTypeLike = np.float32) -> np.ndarray:
    """float(w) * scale_inv broadcast over (bo, bi) blocks; edge blocks may be partial.

    `w` [..., out, in] (float8_e4m3fn in DeepSeek-V3's release), `scale_inv` float32
    [..., ceil(out/bo), ceil(in/bi)]. The product is taken in float32, one block row at a time,
    then cast to `dtype`.
    """
    w, scale_inv = np.asarray(w), np.asarray(scale_inv)
    if w.dtype.kind in "biu":
        raise ValueError(f"FP8 weight has integer dtype {w.dtype}; view raw bytes as "
                         "ml_dtypes.float8_e4m3fn first")
    expected = _fp8_scale_shape(w.shape, block)
    if scale_inv.shape != expected:
        raise ValueError(f"scale_inv shape {scale_inv.shape} does not match weight shape "
                         f"{w.shape} with block {tuple(block)}: expected {expected}")
    bo, bi = block
    n_in = w.shape[-1]
    scale = scale_inv.astype(np.float32)
    out = np.empty(w.shape, dtype=dtype)
    for r in range(scale.shape[-2]):
        rows = slice(r * bo, (r + 1) * bo)
        scale_row = np.repeat(scale[..., r, :], bi, axis=-1)[..., None, :n_in]  # [..., 1, in]
        out[..., rows, :] = w[..., rows, :].astype(np.float32) * scale_row
    return out


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


def dequant_mxfp4(blocks: np.ndarray, scales: np.ndarray,
                  dtype: npt.DTypeLike = np.float32) -> np.ndarray:
    """MXFP4 [..., G, 16] bytes + [..., G] E8M0 scales -> [..., G * 32] values.

    Native orientation: the last axis is the packed one. GPT-OSS's HF conversion then swaps the
    last two axes of the expert tensors (e.g. `mlp1_weight` [E, 2 F, D] -> `gate_up_proj`
    [E, D, 2 F]); that is the caller's job. Every value is a 2-significant-bit number times a power
    of two, so `dtype=ml_dtypes.bfloat16` is exact too (half the memory). Scale byte 255 is NaN.
    """
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != MXFP4_GROUP // 2:
        raise ValueError(f"MXFP4 blocks shape {blocks.shape} must end in 16 bytes per group")
    if scales.shape != blocks.shape[:-1]:
        raise ValueError(f"MXFP4 scales shape {scales.shape} does not match blocks shape "
                         f"{blocks.shape}: expected {blocks.shape[:-1]}")
    *prefix, groups, _ = blocks.shape
    rows = math.prod(prefix)
    out = np.empty((rows, groups * MXFP4_GROUP), dtype=dtype)
    blocks_2d, scales_2d = blocks.reshape(rows, groups, 16), scales.reshape(rows, groups)
    step = max(1, _CHUNK_ELEMENTS // max(1, groups * MXFP4_GROUP))
    for r in range(0, rows, step):
        values = _BYTE_TO_PAIR[blocks_2d[r:r + step]].reshape(-1, groups, MXFP4_GROUP)
        values *= _E8M0_SCALE[scales_2d[r:r + step]][..., None]
        out[r:r + step] = values.reshape(-1, groups * MXFP4_GROUP)
    return out.reshape(*prefix, groups * MXFP4_GROUP)


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

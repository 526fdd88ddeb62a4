"""Dequantisation of released quantised checkpoints (FP8 block-scaled, MXFP4).

Pure numpy functions of arrays: the checkpoint reader hands tensors in, the converter decides
names and layouts. (The quantisers that build small quantised tensors for the tests live in
tests/quantisers.py: nothing here trains or serves in these formats.)

- FP8 block-scaled (DeepSeek-V3): `W` is float8_e4m3fn [..., out, in] with `W_scale_inv` float32
  [..., ceil(out/bo), ceil(in/bi)]; W_f32[i, j] = float(W[i, j]) * scale_inv[i // bo, j // bi].
- MXFP4 (GPT-OSS, OCP Microscaling): `<name>_blocks` uint8 [..., G, 16], two FP4 E2M1 values per
  byte (low nibble first), and `<name>_scales` uint8 [..., G], E8M0 exponents with bias 127;
  W_f32[..., 32 g + k] = E2M1[nibble k of group g] * 2**(scales[..., g] - 127).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

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

"""Decode attention: one new query token per slot against a KV cache with ragged per-slot lengths.

GQA, full-cache and ring-buffer (sliding-window) layouts; a plain-jnp reference and Pallas kernels
for GPU (Triton, split over the cache like flash-decoding) and TPU (Mosaic). Must not import hcjax.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _dispatch

_NEG = -0.7 * float(np.finfo(np.float32).max)
_SQ = pl.squeezed


def _resolve_ring(ring: bool | None, window: int | None, cache_len: int) -> bool:
    """ring=None infers the ring-buffer layout from window == cache length.

    That inference is safe: a full cache with window == S holds at most S positions, so for it
    "s < length and s >= length - window" and the ring rule "s < min(length, S)" pick the same
    slots.
    """
    if ring is None:
        return window is not None and window == cache_len
    if ring and window is not None and window != cache_len:
        raise ValueError(f"ring=True needs window == cache length {cache_len}, got window={window}")
    return bool(ring)


def _validate(q, k_cache, v_cache, lengths, window) -> None:
    if q.ndim != 3:
        raise ValueError(f"q.shape={q.shape} is not [batch, q_heads, head_dim]")
    b, hq, d = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache.shape={k_cache.shape} differs from v_cache.shape={v_cache.shape}"
        )
    if k_cache.ndim != 4 or k_cache.shape[0] != b or k_cache.shape[3] != d:
        raise ValueError(
            f"k_cache.shape={k_cache.shape} is not [batch={b}, cache_len, kv_heads, head_dim={d}]"
        )
    hkv = k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"num q heads={hq} is not a multiple of num kv heads={hkv}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths.shape={lengths.shape} is not [batch={b}]")
    if window is not None and (not isinstance(window, int | np.integer) or window < 1):
        raise ValueError(f"window={window!r} is not a positive int or None")


def _valid_range(lengths, cache_len: int, window: int | None, ring: bool):
    """Slots [lo, hi) of the cache that hold positions the new token may attend to."""
    hi = jnp.minimum(lengths, cache_len)
    if ring or window is None:
        return jnp.zeros_like(hi), hi
    return jnp.maximum(0, lengths - window), hi


def decode_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    window: int | None = None,
    ring: bool | None = None,
) -> jax.Array:
    """Softmax over the valid slots in fp32; slots with length 0 return zeros."""
    _validate(q, k_cache, v_cache, lengths, window)
    b, hq, d = q.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    lo, hi = _valid_range(lengths.astype(jnp.int32), s, window, _resolve_ring(ring, window, s))
    slots = jnp.arange(s)
    valid = (slots[None] >= lo[:, None]) & (slots[None] < hi[:, None])  # [B, S]
    valid = valid[:, None, None, :]
    q_bhgd = q.reshape(b, hkv, hq // hkv, d)
    scores = jnp.einsum("bhgd,bshd->bhgs", q_bhgd, k_cache, preferred_element_type=jnp.float32)
    scores = jnp.where(valid, scores / math.sqrt(d), _NEG)
    p = jnp.where(valid, jnp.exp(scores - scores.max(-1, keepdims=True)), 0.0)
    denom = p.sum(-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("bhgs,bshd->bhgd", p, v_cache.astype(jnp.float32))
    return out.reshape(b, hq, d).astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# GPU (Pallas Triton) kernel. Grid (slot, kv head, split): each program walks only the key blocks
# of its split that intersect the slot's valid range, so work follows the ragged lengths, and
# the `group` query heads of a kv head share each K/V load. Splits are merged afterwards with
# their log-sum-exp statistics.


@dataclasses.dataclass(frozen=True)
class _Config:
    cache_len: int  # true length S; the arrays may be padded past it
    num_blocks: int
    window: int | None
    ring: bool
    block_k: int
    scale: float
    blocks_per_split: int = 1  # GPU only: key blocks per split of the grid


def _decode_kernel(len_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *, cfg: _Config):
    length = len_ref[pl.program_id(0)]
    lo, hi = _valid_range(length, cfg.cache_len, cfg.window, cfg.ring)
    bk = cfg.block_k
    split_lo = pl.program_id(2) * cfg.blocks_per_split
    split_hi = jnp.minimum(cfg.num_blocks, split_lo + cfg.blocks_per_split)
    j_lo = jnp.maximum(lo // bk, split_lo)
    j_hi = jnp.minimum(pl.cdiv(hi, bk), split_hi)
    q = q_ref[...]  # [G, D]: the query heads of this kv head, padded to >= 16 rows (tl.dot)
    # fp32 caches stay fp32 in the dots (IEEE, not TF32); bf16 ones run bf16 x bf16 -> fp32.
    exact = jax.lax.Precision.HIGHEST
    dtype = jnp.promote_types(q.dtype, k_ref.dtype)  # a cache in another dtype than q
    q = q.astype(dtype)

    def body(j, carry):
        m, denom, acc = carry
        k0 = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(k0, bk), :].astype(dtype)
        v = v_ref[pl.ds(k0, bk), :].astype(dtype)
        slots = k0 + jnp.arange(bk)
        valid = ((slots >= lo) & (slots < hi))[None, :]
        s = _dispatch.dot_nt(q, k, exact) * cfg.scale  # [G, bk]
        s = jnp.where(valid, s, _NEG)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
        denom = denom * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + _dispatch.dot_nn(p.astype(v.dtype), v, exact)
        return m_new, denom, acc

    g = q.shape[0]
    init = (jnp.full((g,), _NEG, jnp.float32), jnp.zeros((g,), jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    m, denom, acc = jax.lax.fori_loop(j_lo, j_hi, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = denom



def merge_splits(acc, m, denom, group: int, d: int) -> jax.Array:
    """One result from the GPU kernels' key splits ([b, hkv, splits, gp, dp] sums, [.., gp]
    maxima and denominators): each split's sums rescaled to the common max (empty splits have
    denom = 0); returns [b, hkv, group, d] in f32."""
    m_max = m.max(axis=2, keepdims=True)
    w = jnp.exp(m - m_max)
    l_tot = (denom * w).sum(axis=2)
    out = (acc * w[..., None]).sum(axis=2) / jnp.where(l_tot == 0, 1.0, l_tot)[..., None]
    return out[:, :, :group, :d]

def _decode_gpu(
    q,
    k_cache,
    v_cache,
    lengths,
    *,
    window,
    ring,
    block_k,
    num_splits,
    interpret,
    num_warps,
    num_stages,
):
    b, hq, d = q.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    # The cache is read in place when its length has a power-of-2 divisor >= 16 and head_dim is a
    # power of 2 (the usual case); otherwise it is zero-padded, which costs a copy per call.
    block_k = max(16, block_k)  # tl.dot needs >= 16 keys a block
    bk = next((x for x in (block_k, 256, 128, 64, 32, 16) if x <= block_k and s % x == 0), None)
    sp = s if bk is not None else _dispatch.round_up(s, 16)
    bk = bk or 16
    dp = max(16, _dispatch.next_power_of_2(d))
    if (sp, dp) != (s, d):
        pad = ((0, 0), (0, sp - s), (0, 0), (0, dp - d))
        k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)
    # The group's query heads are the rows of the kernel's matmuls: at least 16 (tl.dot), the
    # padding rows are zeros and dropped after. (A broadcast-multiply-reduce over [G, bk, D]
    # instead, 64k fp32 values for 128 threads, ran 62 ms vs the reference's 2.1 ms at B=64,
    # S=8192 on an H200: register spills by that count, not profiled.)
    gp = max(16, _dispatch.next_power_of_2(group))
    q = jnp.pad(q.reshape(b, hkv, group, d), ((0, 0), (0, 0), (0, gp - group), (0, dp - d)))
    num_blocks = sp // bk
    if num_splits is None:  # enough programs to fill a GPU's SMs at small batch
        num_splits = max(1, min(num_blocks, 256 // max(1, b * hkv)))
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} is not >= 1")
    blocks_per_split = pl.cdiv(num_blocks, num_splits)
    num_splits = pl.cdiv(num_blocks, blocks_per_split)
    cfg = _Config(
        cache_len=s,
        num_blocks=num_blocks,
        window=None if window is None else int(window),
        ring=ring,
        block_k=bk,
        scale=1.0 / math.sqrt(d),
        blocks_per_split=blocks_per_split,
    )
    stat_spec = pl.BlockSpec((_SQ, _SQ, _SQ, gp), lambda bi, h, j: (bi, h, j, 0))
    kv_spec = pl.BlockSpec((_SQ, sp, _SQ, dp), lambda bi, h, j: (bi, 0, h, 0))
    acc, m, denom = pl.pallas_call(
        functools.partial(_decode_kernel, cfg=cfg),
        grid=(b, hkv, num_splits),
        in_specs=[
            pl.BlockSpec((b,), lambda bi, h, j: (0,)),
            pl.BlockSpec((_SQ, _SQ, gp, dp), lambda bi, h, j: (bi, h, 0, 0)),
            kv_spec,
            kv_spec,
        ],
        out_specs=[
            pl.BlockSpec((_SQ, _SQ, _SQ, gp, dp), lambda bi, h, j: (bi, h, j, 0, 0)),
            stat_spec,
            stat_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, num_splits, gp, dp), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, num_splits, gp), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, num_splits, gp), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="decode_attention",
    )(lengths.astype(jnp.int32), q, k_cache, v_cache)
    return merge_splits(acc, m, denom, group, d).reshape(b, hq, d).astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# TPU (Mosaic) kernel. Grid (slot, key block) with the lengths prefetched into SMEM: the index map
# clamps a slot's key-block index into its valid range, so blocks past the length repeat the last
# block index (the pipeline does not fetch a block again) and `pl.when` skips their compute. A
# block holds all kv heads, (block, Hkv, D), so its two minor dims are whole and Mosaic accepts
# any block length; softmax statistics live in VMEM scratch across the key-block axis.


def _decode_tpu_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc, *, cfg, group):
    j = pl.program_id(1)
    bk = cfg.block_k
    lo, hi = _valid_range(len_ref[pl.program_id(0)], cfg.cache_len, cfg.window, cfg.ring)

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, _NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    # lax.div, not //: the operands are non-negative, and floor division lowers through `sign`,
    # which Mosaic cannot lower without a TPU attached (it breaks cross-platform export tests).
    @pl.when((j >= jax.lax.div(lo, bk)) & (j * bk < hi))
    def _():
        slots = j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        valid = (slots >= lo) & (slots < hi)
        for h in range(k_ref.shape[1]):
            rows = slice(h * group, (h + 1) * group)
            q = q_ref[rows, :].astype(jnp.float32)  # [group, D]
            k = k_ref[:, h, :].astype(jnp.float32)  # [bk, D]
            s = jax.lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
            s = jnp.where(valid, s * cfg.scale, _NEG)
            m_prev = m_sc[rows, :]
            m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_new)
            p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
            l_sc[rows, :] = l_sc[rows, :] * alpha + p.sum(axis=1, keepdims=True)
            pv = jax.lax.dot_general(
                p,
                v_ref[:, h, :].astype(jnp.float32),
                (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32,
            )
            acc_sc[rows, :] = acc_sc[rows, :] * alpha + pv
            m_sc[rows, :] = m_new

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        denom = l_sc[...]
        o_ref[...] = (acc_sc[...] / jnp.where(denom == 0, 1.0, denom)).astype(o_ref.dtype)


def _decode_tpu(q, k_cache, v_cache, lengths, *, window, ring, block_k, interpret):
    from jax.experimental.pallas import tpu as pltpu

    b, hq, d = q.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    bk = next(
        (x for x in (block_k, 512, 256, 128, 64, 32, 16, 8) if x <= block_k and s % x == 0), 0
    )
    sp = s if bk else _dispatch.round_up(s, 8)
    bk = bk or 8
    if sp != s:  # cache length without a divisor >= 8: pad (a copy per call)
        pad = ((0, 0), (0, sp - s), (0, 0), (0, 0))
        k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)
    cfg = _Config(
        cache_len=s,
        num_blocks=sp // bk,
        window=None if window is None else int(window),
        ring=ring,
        block_k=bk,
        scale=1.0 / math.sqrt(d),
    )

    def kv_index(bi, j, len_ref):
        lo, hi = _valid_range(len_ref[bi], s, cfg.window, ring)
        first = jax.lax.div(lo, bk)
        last = jnp.maximum(first, jax.lax.div(hi + bk - 1, bk) - 1)
        return bi, jnp.clip(j, first, last), 0, 0

    kv_spec = pl.BlockSpec((_SQ, bk, hkv, d), kv_index)
    q_spec = pl.BlockSpec((_SQ, hq, d), lambda bi, j, len_ref: (bi, 0, 0))
    return pl.pallas_call(
        functools.partial(_decode_tpu_kernel, cfg=cfg, group=hq // hkv),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, sp // bk),
            in_specs=[q_spec, kv_spec, kv_spec],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((hq, 1), jnp.float32),
                pltpu.VMEM((hq, 1), jnp.float32),
                pltpu.VMEM((hq, d), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="decode_attention_tpu",
    )(lengths.astype(jnp.int32), q, k_cache, v_cache)


def decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    window: int | None = None,
    ring: bool | None = None,
    impl: str = "auto",
    interpret: bool | None = None,
    lowering: str | None = None,
    block_k: int = 128,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """Attention of one new token per slot, q [B,Hq,D] (RoPE applied), over caches [B,S,Hkv,D].

    lengths [B] counts the tokens written for each slot, the current one included. Layouts:
    full cache (ring=False): slot s holds position s and is valid iff s < length and, with a
    window, s >= length - window. Ring buffer (ring=True, sliding-window layers with S == window):
    position p sits in slot p % S, so the valid slots are s < min(length, S). ring=None infers the
    ring layout iff window == S (both rules agree there). Slots with length 0 return zeros.

    impl: "auto" (Pallas on TPU/GPU, reference on CPU) | "pallas" | "reference". lowering: "gpu"
    (Triton; num_splits, num_warps, num_stages tune it) or "tpu" (Mosaic), default by backend.
    Both loop only over the key blocks inside a slot's valid range. interpret=None interprets iff
    on CPU.
    """
    _validate(q, k_cache, v_cache, lengths, window)
    ring = _resolve_ring(ring, window, k_cache.shape[1])
    if _dispatch.resolve_impl(impl, "decode_attention") == "reference":
        return decode_attention_reference(q, k_cache, v_cache, lengths, window=window, ring=ring)
    if block_k < 8 or block_k & (block_k - 1):
        raise ValueError(f"block_k={block_k} is not a power of 2 >= 8")
    interpret = _dispatch.resolve_interpret(interpret)
    if _dispatch.resolve_lowering(lowering, "decode_attention") == "tpu":
        return _decode_tpu(
            q,
            k_cache,
            v_cache,
            lengths,
            window=window,
            ring=ring,
            block_k=block_k,
            interpret=interpret,
        )
    return _decode_gpu(
        q,
        k_cache,
        v_cache,
        lengths,
        window=window,
        ring=ring,
        block_k=block_k,
        num_splits=num_splits,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )

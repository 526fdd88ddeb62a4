"""Paged decode attention: one new query token per slot against KV pages from one shared pool.

A slot's keys live in fixed-size pages of a pool [num_pages, page_size, Hkv, D]; its page table
row [max_pages] lists them in position order (position p is at page_table[p // page_size], row
p % page_size), and `lengths` counts the positions written, the current one included. So a
sequence holds pages for the tokens it has, not for the longest allowed response. GQA, ragged
lengths, an optional sliding window; a plain-jnp reference (gather the pages, then
`decode_attention_reference`) and Pallas kernels for GPU (Triton) and TPU (Mosaic) that read the
pages in place through the page table. Must not import hcjax.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _dispatch
from pallas_kernels.decode_attention import (
    _NEG,
    _SQ,
    _Config,
    _decode_tpu_kernel,
    _valid_range,
    decode_attention_reference,
    merge_splits,
)


def _validate(q, k_pages, v_pages, page_table, lengths, window) -> None:
    if q.ndim != 3:
        raise ValueError(f"q.shape={q.shape} is not [batch, q_heads, head_dim]")
    b, hq, d = q.shape
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages.shape={k_pages.shape} differs from v_pages.shape={v_pages.shape}")
    if k_pages.ndim != 4 or k_pages.shape[3] != d:
        raise ValueError(
            f"k_pages.shape={k_pages.shape} is not [num_pages, page_size, kv_heads, head_dim={d}]"
        )
    if hq % k_pages.shape[2]:
        raise ValueError(f"num q heads={hq} is not a multiple of num kv heads={k_pages.shape[2]}")
    if page_table.ndim != 2 or page_table.shape[0] != b:
        raise ValueError(f"page_table.shape={page_table.shape} is not [batch={b}, max_pages]")
    if lengths.shape != (b,):
        raise ValueError(f"lengths.shape={lengths.shape} is not [batch={b}]")
    if window is not None and (not isinstance(window, int | np.integer) or window < 1):
        raise ValueError(f"window={window!r} is not a positive int or None")


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """[B, max_pages * page_size, ...]: each slot's pages in position order (a copy)."""
    b, p = page_table.shape
    out = pages[page_table]  # [B, P, page_size, ...]
    return out.reshape(b, p * pages.shape[1], *pages.shape[2:])


def paged_decode_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    window: int | None = None,
) -> jax.Array:
    """The slots' pages gathered into full caches, then the full-cache decode reference."""
    _validate(q, k_pages, v_pages, page_table, lengths, window)
    k = gather_pages(k_pages, page_table)
    v = gather_pages(v_pages, page_table)
    return decode_attention_reference(q, k, v, lengths, window=window, ring=False)


# ---------------------------------------------------------------------------------------------
# GPU (Pallas Triton). Grid (slot, kv head, split) as in decode_attention's GPU kernel; a key
# block is one page, read in place from the flattened pool [num_pages * page_size, Hkv, D] at
# the row its page-table entry gives.


def _paged_gpu_kernel(len_ref, pt_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *, cfg,
                      max_pages):
    bi = pl.program_id(0)
    lo, hi = _valid_range(len_ref[bi], cfg.cache_len, cfg.window, False)
    ps = cfg.block_k
    split_lo = pl.program_id(2) * cfg.blocks_per_split
    split_hi = jnp.minimum(cfg.num_blocks, split_lo + cfg.blocks_per_split)
    j_lo = jnp.maximum(lo // ps, split_lo)
    j_hi = jnp.minimum(pl.cdiv(hi, ps), split_hi)
    q = q_ref[...]
    exact = jax.lax.Precision.HIGHEST
    dtype = jnp.promote_types(q.dtype, k_ref.dtype)
    q = q.astype(dtype)

    def body(j, carry):
        m, denom, acc = carry
        row0 = pl.multiple_of(pt_ref[bi * max_pages + j] * ps, ps)
        k = k_ref[pl.ds(row0, ps), :].astype(dtype)
        v = v_ref[pl.ds(row0, ps), :].astype(dtype)
        slots = j * ps + jnp.arange(ps)
        valid = ((slots >= lo) & (slots < hi))[None, :]
        s = _dispatch.dot_nt(q, k, exact) * cfg.scale
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


def _paged_gpu(q, k_pages, v_pages, page_table, lengths, *, window, num_splits, interpret,
               num_warps, num_stages):
    b, hq, d = q.shape
    n, ps, hkv, _ = k_pages.shape
    p = page_table.shape[1]
    if ps < 16 or ps & (ps - 1):
        raise ValueError(f"page_size={ps} must be a power of 2 >= 16 for the GPU kernel")
    group = hq // hkv
    dp = max(16, _dispatch.next_power_of_2(d))
    k_flat = k_pages.reshape(n * ps, hkv, d)
    v_flat = v_pages.reshape(n * ps, hkv, d)
    if dp != d:  # head_dim not a power of 2: padded (a copy of the pool per call)
        pad = ((0, 0), (0, 0), (0, dp - d))
        k_flat, v_flat = jnp.pad(k_flat, pad), jnp.pad(v_flat, pad)
    gp = max(16, _dispatch.next_power_of_2(group))
    q = jnp.pad(q.reshape(b, hkv, group, d), ((0, 0), (0, 0), (0, gp - group), (0, dp - d)))
    if num_splits is None:
        num_splits = max(1, min(p, 256 // max(1, b * hkv)))
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} is not >= 1")
    blocks_per_split = pl.cdiv(p, num_splits)
    num_splits = pl.cdiv(p, blocks_per_split)
    cfg = _Config(cache_len=p * ps, num_blocks=p, window=None if window is None else int(window),
                  ring=False, block_k=ps, scale=1.0 / math.sqrt(d),
                  blocks_per_split=blocks_per_split)
    stat_spec = pl.BlockSpec((_SQ, _SQ, _SQ, gp), lambda bi, h, j: (bi, h, j, 0))
    kv_spec = pl.BlockSpec((n * ps, _SQ, dp), lambda bi, h, j: (0, h, 0))
    acc, m, denom = pl.pallas_call(
        functools.partial(_paged_gpu_kernel, cfg=cfg, max_pages=p),
        grid=(b, hkv, num_splits),
        in_specs=[
            pl.BlockSpec((b,), lambda bi, h, j: (0,)),
            pl.BlockSpec((b * p,), lambda bi, h, j: (0,)),
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
        name="paged_decode_attention",
    )(lengths.astype(jnp.int32), page_table.astype(jnp.int32).reshape(-1), q, k_flat, v_flat)
    return merge_splits(acc, m, denom, group, d).reshape(b, hq, d).astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# TPU (Mosaic). decode_attention's TPU kernel body over grid (slot, page): lengths and the
# flattened page table are prefetched into SMEM, and the K/V index map turns (slot, page index)
# into the pool page to fetch, clamped into the slot's valid range so pages past the length
# repeat the last fetched one (no new DMA) and their compute is skipped.


def _paged_tpu(q, k_pages, v_pages, page_table, lengths, *, window, interpret):
    from jax.experimental.pallas import tpu as pltpu

    b, hq, d = q.shape
    _, ps, hkv, _ = k_pages.shape
    p = page_table.shape[1]
    s = p * ps
    cfg = _Config(cache_len=s, num_blocks=p, window=None if window is None else int(window),
                  ring=False, block_k=ps, scale=1.0 / math.sqrt(d))

    def kv_index(bi, j, len_ref, pt_ref):
        lo, hi = _valid_range(len_ref[bi], s, cfg.window, False)
        first = jax.lax.div(lo, ps)
        last = jnp.maximum(first, jax.lax.div(hi + ps - 1, ps) - 1)
        return pt_ref[bi * p + jnp.clip(j, first, last)], 0, 0, 0

    def kernel(len_ref, pt_ref, *refs):
        _decode_tpu_kernel(len_ref, *refs, cfg=cfg, group=hq // hkv)

    kv_spec = pl.BlockSpec((_SQ, ps, hkv, d), kv_index)
    q_spec = pl.BlockSpec((_SQ, hq, d), lambda bi, j, len_ref, pt_ref: (bi, 0, 0))
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, p),
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
        name="paged_decode_attention_tpu",
    )(lengths.astype(jnp.int32), page_table.astype(jnp.int32).reshape(-1), q, k_pages, v_pages)


def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    window: int | None = None,
    impl: str = "auto",
    interpret: bool | None = None,
    lowering: str | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """Attention of one new token per slot, q [B, Hq, D] (RoPE applied), over paged K/V.

    k_pages, v_pages [num_pages, page_size, Hkv, D]: the pool. page_table [B, max_pages] int32:
    slot b's position p is at page page_table[b, p // page_size], row p % page_size; entries at
    or past a slot's length are never read by the kernels but must be valid page ids. lengths
    [B]: positions written, the current token's included; the new token sees positions
    [max(0, length - window), length). Slots with length 0 return zeros.

    impl: "auto" (`_dispatch.AUTO["paged_decode_attention"]`) | "pallas" | "reference".
    lowering: "gpu" (Triton; page_size a power of 2 >= 16) or "tpu" (Mosaic), by backend when
    None. interpret=None interprets iff on CPU. Both kernels visit only the pages inside a slot's
    valid range.
    """
    _validate(q, k_pages, v_pages, page_table, lengths, window)
    if _dispatch.resolve_impl(impl, "paged_decode_attention") == "reference":
        return paged_decode_attention_reference(q, k_pages, v_pages, page_table, lengths,
                                                window=window)
    interpret = _dispatch.resolve_interpret(interpret)
    if _dispatch.resolve_lowering(lowering, "paged_decode_attention") == "tpu":
        return _paged_tpu(q, k_pages, v_pages, page_table, lengths, window=window,
                          interpret=interpret)
    return _paged_gpu(q, k_pages, v_pages, page_table, lengths, window=window,
                      num_splits=num_splits, interpret=interpret, num_warps=num_warps,
                      num_stages=num_stages)

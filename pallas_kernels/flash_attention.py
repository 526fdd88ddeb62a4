"""Causal GQA flash attention with an optional sliding window and segment ids, forward and backward;
values may be narrower than queries and keys and the softmax scale is a parameter (MLA).

A plain-jnp reference, a Pallas kernel written for GPU (Triton) that skips fully-masked blocks, and
on TPU JAX's splash attention behind the same interface. Must not import hcjax.
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

# Finite "minus infinity": exp(_NEG - m) underflows to 0 without inf - inf = nan when a whole row
# of a block is masked.
_NEG = -0.7 * float(np.finfo(np.float32).max)
_SQ = pl.squeezed


def _validate(q, k, v, causal, window, segment_ids, scale=None) -> None:
    if q.ndim != 4:
        raise ValueError(f"q.shape={q.shape} is not [batch, seq, q_heads, head_dim]")
    b, t, hq, d = q.shape
    if k.ndim != 4 or (k.shape[0], k.shape[1], k.shape[3]) != (b, t, d):
        raise ValueError(f"k.shape={k.shape} is not [batch={b}, seq={t}, kv_heads, head_dim={d}]")
    if v.ndim != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v.shape={v.shape} is not [batch={b}, seq={t}, kv_heads={k.shape[2]}, "
                         f"v_head_dim]")
    if scale is not None and not (isinstance(scale, float | int) and scale > 0):
        raise ValueError(f"scale={scale!r} is not a positive number or None")
    hkv = k.shape[2]
    if hq % hkv:
        raise ValueError(f"num q heads={hq} is not a multiple of num kv heads={hkv}")
    if window is not None:
        if not isinstance(window, int | np.integer) or window < 1:
            raise ValueError(f"window={window!r} is not a positive int or None")
        if not causal:
            raise ValueError(f"window={window} needs causal=True (it lets i see i-window+1..i)")
    if segment_ids is not None and segment_ids.shape != (b, t):
        raise ValueError(f"segment_ids.shape={segment_ids.shape} is not [batch={b}, seq={t}]")


def _visible(q_pos, k_pos, q_seg, k_seg, *, causal, window, seq_len):
    """Which keys each query may attend to: [len(q_pos), len(k_pos)] bool."""
    mask = k_pos[None, :] < seq_len  # keys in the padding past the true length
    if causal:
        mask &= k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    if q_seg is not None:
        mask &= q_seg[:, None] == k_seg[None, :]
    return mask


def flash_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Materialises the [T, T] scores in fp32 (times `scale`, default 1/sqrt(D)); rows with no
    visible key return zeros. v may have its own head size Dv: the output is [B, T, Hq, Dv]."""
    _validate(q, k, v, causal, window, segment_ids, scale)
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    q_bthgd = q.reshape(b, t, hkv, hq // hkv, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q_bthgd, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(d) if scale is None else scale)
    pos = jnp.arange(t)
    mask = _visible(pos, pos, None, None, causal=causal, window=window, seq_len=t)[None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    mask = mask[:, None, None]  # [B, 1, 1, Tq, Tk]
    scores = jnp.where(mask, scores, _NEG)
    p = jnp.where(mask, jnp.exp(scores - scores.max(-1, keepdims=True)), 0.0)
    denom = p.sum(-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32))
    return out.reshape(b, t, hq, v.shape[-1]).astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# GPU (Pallas Triton) kernel. Layout stays [B, T, H, D]; heads are picked by the BlockSpecs, and
# a query head reads kv head h // group, so K/V are never repeated in memory.


@dataclasses.dataclass(frozen=True)
class _Config:
    causal: bool
    window: int | None
    seq_len: int  # true length; the arrays are padded to a multiple of the blocks
    block_q: int
    block_k: int
    scale: float
    has_segments: bool
    interpret: bool
    num_warps: int
    num_stages: int

    def visible(self, q_pos, k_pos, q_seg, k_seg):
        return _visible(
            q_pos, k_pos, q_seg, k_seg, causal=self.causal, window=self.window, seq_len=self.seq_len
        )

    def kv_block_range(self, q_start):
        """Key blocks a query block needs: blocks outside it are fully masked and never loaded."""
        hi = pl.cdiv(self.seq_len, self.block_k)
        if self.causal:
            hi = jnp.minimum(hi, pl.cdiv(q_start + self.block_q, self.block_k))
        lo = 0
        if self.window is not None:
            lo = jnp.maximum(0, q_start - self.window + 1) // self.block_k
        return lo, hi

    def q_block_range(self, k_start):
        """Query blocks that see some key of a key block (query i sees keys i-window+1..i)."""
        hi = pl.cdiv(self.seq_len, self.block_q)
        if self.window is not None:
            hi = jnp.minimum(hi, pl.cdiv(k_start + self.block_k + self.window - 1, self.block_q))
        lo = k_start // self.block_q if self.causal else 0
        return lo, hi

    def compiler_params(self):
        return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, cfg: _Config):
    if cfg.has_segments:
        q_seg_ref, k_seg_ref, o_ref, lse_ref = refs
    else:
        o_ref, lse_ref = refs
    bq, bk = cfg.block_q, cfg.block_k
    q_start = pl.program_id(2) * bq
    q_pos = q_start + jnp.arange(bq)
    q_seg = q_seg_ref[...] if cfg.has_segments else None
    q = q_ref[...]

    def body(j, carry):
        m, denom, acc = carry
        k_start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(k_start, bk), :]
        v = v_ref[pl.ds(k_start, bk), :]
        k_seg = k_seg_ref[pl.ds(k_start, bk)] if cfg.has_segments else None
        mask = cfg.visible(q_pos, k_start + jnp.arange(bk), q_seg, k_seg)
        s = jnp.where(mask, _dispatch.dot_nt(q, k) * cfg.scale, _NEG)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        denom = denom * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + _dispatch.dot_nn(p.astype(v.dtype), v)
        return m_new, denom, acc

    init = (
        jnp.full((bq,), _NEG, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
        jnp.zeros((bq, v_ref.shape[-1]), jnp.float32),
    )
    lo, hi = cfg.kv_block_range(q_start)
    m, denom, acc = jax.lax.fori_loop(lo, hi, body, init)
    l_safe = jnp.where(denom == 0, 1.0, denom)  # rows that saw no key output zeros
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l_safe)


def _forward(q, k, v, seg, cfg: _Config):
    b, tp, hq, d = q.shape
    dv = v.shape[-1]
    group = hq // k.shape[2]
    bq = cfg.block_q
    q_spec = pl.BlockSpec((_SQ, bq, _SQ, d), lambda bi, h, i: (bi, i, h, 0))
    o_spec = pl.BlockSpec((_SQ, bq, _SQ, dv), lambda bi, h, i: (bi, i, h, 0))
    k_spec = pl.BlockSpec((_SQ, tp, _SQ, d), lambda bi, h, i: (bi, 0, h // group, 0))
    v_spec = pl.BlockSpec((_SQ, tp, _SQ, dv), lambda bi, h, i: (bi, 0, h // group, 0))
    in_specs, args = [q_spec, k_spec, v_spec], [q, k, v]
    if cfg.has_segments:
        in_specs += [
            pl.BlockSpec((_SQ, bq), lambda bi, h, i: (bi, i)),
            pl.BlockSpec((_SQ, tp), lambda bi, h, i: (bi, 0)),
        ]
        args += [seg, seg]
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg),
        grid=(b, hq, tp // bq),
        in_specs=in_specs,
        out_specs=[o_spec, pl.BlockSpec((_SQ, _SQ, bq), lambda bi, h, i: (bi, h, i))],
        out_shape=[
            jax.ShapeDtypeStruct((b, tp, hq, dv), q.dtype),
            jax.ShapeDtypeStruct((b, hq, tp), jnp.float32),
        ],
        compiler_params=cfg.compiler_params(),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(*args)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg: _Config):
    if cfg.has_segments:
        q_seg_ref, k_seg_ref, dq_ref = refs
    else:
        (dq_ref,) = refs
    bq, bk = cfg.block_q, cfg.block_k
    q_start = pl.program_id(2) * bq
    q_pos = q_start + jnp.arange(bq)
    q_seg = q_seg_ref[...] if cfg.has_segments else None
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def body(j, dq):
        k_start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(k_start, bk), :]
        v = v_ref[pl.ds(k_start, bk), :]
        k_seg = k_seg_ref[pl.ds(k_start, bk)] if cfg.has_segments else None
        mask = cfg.visible(q_pos, k_start + jnp.arange(bk), q_seg, k_seg)
        p = jnp.where(mask, jnp.exp(_dispatch.dot_nt(q, k) * cfg.scale - lse[:, None]), 0.0)
        ds = p * (_dispatch.dot_nt(do, v) - delta[:, None])  # softmax backward: dS = P (dP - rowsum(dO O))
        return dq + _dispatch.dot_nn(ds.astype(k.dtype), k)

    lo, hi = cfg.kv_block_range(q_start)
    dq = jax.lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg: _Config, group: int):
    if cfg.has_segments:
        q_seg_ref, k_seg_ref, dk_ref, dv_ref = refs
    else:
        dk_ref, dv_ref = refs
    bq, bk = cfg.block_q, cfg.block_k
    k_start = pl.program_id(2) * bk
    k_pos = k_start + jnp.arange(bk)
    k_seg = k_seg_ref[...] if cfg.has_segments else None
    k, v = k_ref[...], v_ref[...]
    lo, hi = cfg.q_block_range(k_start)
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    # One program owns a kv head's block and sums over the `group` query heads that read it, so
    # dK/dV are written once, without atomics and without a [.., Hq, ..] intermediate.
    for g in range(group):

        def body(i, carry, g=g):
            dk, dv = carry
            q_start = pl.multiple_of(i * bq, bq)
            q = q_ref[pl.ds(q_start, bq), g, :]
            do = do_ref[pl.ds(q_start, bq), g, :]
            lse = lse_ref[g, pl.ds(q_start, bq)]
            delta = delta_ref[g, pl.ds(q_start, bq)]
            q_seg = q_seg_ref[pl.ds(q_start, bq)] if cfg.has_segments else None
            mask = cfg.visible(q_start + jnp.arange(bq), k_pos, q_seg, k_seg)
            p = jnp.where(mask, jnp.exp(_dispatch.dot_nt(q, k) * cfg.scale - lse[:, None]), 0.0)
            dv = dv + _dispatch.dot_tn(p.astype(do.dtype), do)
            ds = p * (_dispatch.dot_nt(do, v) - delta[:, None])
            dk = dk + _dispatch.dot_tn(ds.astype(q.dtype), q)
            return dk, dv

        dk, dv = jax.lax.fori_loop(lo, hi, body, (dk, dv))
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward(q, k, v, seg, o, lse, do, cfg: _Config):
    b, tp, hq, d = q.shape
    dv = v.shape[-1]
    hkv = k.shape[2]
    group = hq // hkv
    bq, bk = cfg.block_q, cfg.block_k
    delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))

    q_blk = pl.BlockSpec((_SQ, bq, _SQ, d), lambda bi, h, i: (bi, i, h, 0))
    do_blk = pl.BlockSpec((_SQ, bq, _SQ, dv), lambda bi, h, i: (bi, i, h, 0))
    k_full = pl.BlockSpec((_SQ, tp, _SQ, d), lambda bi, h, i: (bi, 0, h // group, 0))
    v_full = pl.BlockSpec((_SQ, tp, _SQ, dv), lambda bi, h, i: (bi, 0, h // group, 0))
    stat_blk = pl.BlockSpec((_SQ, _SQ, bq), lambda bi, h, i: (bi, h, i))
    in_specs = [q_blk, k_full, v_full, do_blk, stat_blk, stat_blk]
    args = [q, k, v, do, lse, delta]
    if cfg.has_segments:
        in_specs += [
            pl.BlockSpec((_SQ, bq), lambda bi, h, i: (bi, i)),
            pl.BlockSpec((_SQ, tp), lambda bi, h, i: (bi, 0)),
        ]
        args += [seg, seg]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid=(b, hq, tp // bq),
        in_specs=in_specs,
        out_specs=q_blk,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=cfg.compiler_params(),
        interpret=cfg.interpret,
        name="flash_attention_dq",
    )(*args)

    # The query-side operands of kv head h are the `group` consecutive q heads h*group..: one
    # block of size `group` along the head axis.
    q_full = pl.BlockSpec((_SQ, tp, group, d), lambda bi, h, j: (bi, 0, h, 0))
    do_full = pl.BlockSpec((_SQ, tp, group, dv), lambda bi, h, j: (bi, 0, h, 0))
    k_blk = pl.BlockSpec((_SQ, bk, _SQ, d), lambda bi, h, j: (bi, j, h, 0))
    v_blk = pl.BlockSpec((_SQ, bk, _SQ, dv), lambda bi, h, j: (bi, j, h, 0))
    stat_full = pl.BlockSpec((_SQ, group, tp), lambda bi, h, j: (bi, h, 0))
    in_specs = [q_full, k_blk, v_blk, do_full, stat_full, stat_full]
    args = [q, k, v, do, lse, delta]
    if cfg.has_segments:
        in_specs += [
            pl.BlockSpec((_SQ, tp), lambda bi, h, j: (bi, 0)),
            pl.BlockSpec((_SQ, bk), lambda bi, h, j: (bi, j)),
        ]
        args += [seg, seg]
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, group=group),
        grid=(b, hkv, tp // bk),
        in_specs=in_specs,
        out_specs=[k_blk, v_blk],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=cfg.compiler_params(),
        interpret=cfg.interpret,
        name="flash_attention_dkv",
    )(*args)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash_gpu(q, k, v, seg, cfg: _Config):
    return _forward(q, k, v, seg, cfg)[0]


def _flash_gpu_fwd(q, k, v, seg, cfg: _Config):
    o, lse = _forward(q, k, v, seg, cfg)
    return o, (q, k, v, seg, o, lse)


def _flash_gpu_bwd(cfg: _Config, res, do):
    q, k, v, seg, o, lse = res
    dq, dk, dv = _backward(q, k, v, seg, o, lse, do, cfg)
    return dq, dk, dv, None


_flash_gpu.defvjp(_flash_gpu_fwd, _flash_gpu_bwd)


def _flash_attention_gpu(
    q, k, v, segment_ids, *, causal, window, scale, block_q, block_k, interpret, num_warps,
    num_stages
):
    b, t, _, d = q.shape
    dv = v.shape[-1]
    for name, blk in (("block_q", block_q), ("block_k", block_k)):
        if blk < 1 or blk & (blk - 1):
            raise ValueError(f"{name}={blk} is not a power of 2")
    # Triton tiles are powers of 2 and tl.dot needs >= 16 rows; short sequences shrink the tiles.
    bq = max(16, min(block_q, _dispatch.next_power_of_2(t)))
    bk = max(16, min(block_k, _dispatch.next_power_of_2(t)))
    tp = _dispatch.round_up(t, max(bq, bk))
    # Zero-padded features change no dot product; v's own head size pads on its own (MLA's
    # 192-wide q/k pad to 256, its 128-wide values not at all).
    def pad(x):
        width = x.shape[-1]
        return jnp.pad(x, ((0, 0), (0, tp - t), (0, 0),
                           (0, max(16, _dispatch.next_power_of_2(width)) - width)))

    q, k, v = pad(q), pad(k), pad(v)
    seg = None
    if segment_ids is not None:
        seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, tp - t)))
    cfg = _Config(
        causal=causal,
        window=None if window is None else int(window),
        seq_len=t,
        block_q=bq,
        block_k=bk,
        scale=1.0 / math.sqrt(d) if scale is None else float(scale),
        has_segments=seg is not None,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return _flash_gpu(q, k, v, seg, cfg)[:, :t, :, :dv]


# ---------------------------------------------------------------------------------------------
# TPU: JAX's splash attention (its own Mosaic kernels and custom VJP), with our window as a
# LocalMask and our [B, T, H, D] layout and scale applied around it. Splash takes values with
# their own head size (its output blocks are [.., Dv]), so MLA's 128-wide values run unpadded
# beside its 192-wide queries and keys.


def _flash_attention_tpu(q, k, v, segment_ids, *, causal, window, scale, interpret):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as masks,
    )

    b, t, hq, d = q.shape
    tp = _dispatch.round_up(t, 128)  # Mosaic tiles are multiples of 128 along the sequence
    block = next(s for s in (512, 256, 128) if tp % s == 0)
    shape = (tp, tp)
    if causal and window is not None:
        head_mask = masks.LocalMask(shape, window_size=(int(window) - 1, 0), offset=0)
    elif causal:
        head_mask = masks.CausalMask(shape)
    else:
        head_mask = masks.FullMask(shape)
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    kernel = splash.make_splash_mha(
        masks.MultiHeadMask([head_mask] * hq),
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
    )
    # Causal masking already hides padded keys from real queries; without it, padding gets its
    # own segment id.
    if segment_ids is None and not causal and tp != t:
        segment_ids = jnp.zeros((b, t), jnp.int32)
    dtype = q.dtype
    # Splash has no scale argument: the scale is folded into q (in fp32, then q's dtype).
    q = (q.astype(jnp.float32) * (1.0 / math.sqrt(d) if scale is None else scale)).astype(dtype)
    q, k, v = (
        jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, 0))).transpose(0, 2, 1, 3) for x in (q, k, v)
    )
    if segment_ids is None:
        out = jax.vmap(kernel)(q, k, v)
    else:
        seg = segment_ids.astype(jnp.int32)
        seg = jnp.where(jnp.arange(tp) < t, jnp.pad(seg, ((0, 0), (0, tp - t))), seg.max() + 1)
        out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s)))(
            q, k, v, seg
        )
    return out.transpose(0, 2, 1, 3)[:, :t].astype(dtype)


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
    scale: float | None = None,
    impl: str = "auto",
    interpret: bool | None = None,
    block_q: int = 64,
    block_k: int = 64,
    lowering: str | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """Attention of q [B,T,Hq,D] over k [B,T,Hkv,D], v [B,T,Hkv,Dv] -> [B,T,Hq,Dv] in q.dtype.

    window=W lets position i see positions i-W+1..i (needs causal=True); segment_ids [B,T] keeps
    packed sequences apart. Scores are q·k times `scale` (default 1/sqrt(D); MLA passes its
    YaRN-corrected one) in fp32, as are the softmax statistics; rows that see no key return
    zeros. Dv may differ from D (MLA: 192-wide q/k, 128-wide values). Differentiable in every
    impl (the Pallas paths via custom VJPs).

    impl: "auto" (Pallas on TPU/GPU, reference on CPU), "pallas" or "reference".
    lowering (Pallas only): "gpu" runs this module's Triton kernel, which loops only over the key
    blocks a query block can see (cost ~ T * window); "tpu" runs JAX's splash attention with a
    LocalMask. Default: "tpu" on TPU, else "gpu". interpret=None interprets iff on CPU.
    block_q, block_k, num_warps, num_stages tune the GPU kernel only.
    """
    _validate(q, k, v, causal, window, segment_ids, scale)
    if _dispatch.resolve_impl(impl, "flash_attention") == "reference":
        return flash_attention_reference(
            q, k, v, causal=causal, window=window, segment_ids=segment_ids, scale=scale
        )
    interpret = _dispatch.resolve_interpret(interpret)
    if _dispatch.resolve_lowering(lowering, "flash_attention") == "tpu":
        return _flash_attention_tpu(
            q, k, v, segment_ids, causal=causal, window=window, scale=scale, interpret=interpret
        )
    return _flash_attention_gpu(
        q,
        k,
        v,
        segment_ids,
        causal=causal,
        window=window,
        scale=scale,
        block_q=block_q,
        block_k=block_k,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )

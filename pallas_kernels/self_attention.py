"""Self-attention of packed rows by token position: the dense masked reference, the blocked form
(query blocks that skip the keys none of their queries can see, with flash attention's backward
written by hand) and `self_attention`, which chooses among them and the flash kernel.

`attention_mask` and `gqa_attention` are also the reference for any mask (cached attention).
Scores and softmax statistics are fp32; K/V are never repeated per query head. Must not import
hcjax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _dispatch
from pallas_kernels.flash_attention import flash_attention

IMPLS = ("auto", "reference", "blocked", "pallas")
_MASKED = -1e30  # finite, so a fully masked row (a padding query) gives no NaN


def attention_mask(q_pos: jax.Array, k_pos: jax.Array, q_seg: jax.Array | None,
                   k_seg: jax.Array | None, window: int | None) -> jax.Array:
    """[B, T, S] bool: key visible to query. Positions < 0 are padding / empty cache slots."""
    visible = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] >= 0)
    if window is not None:
        visible &= q_pos[:, :, None] - k_pos[:, None, :] < window
    if q_seg is not None:
        visible &= q_seg[:, :, None] == k_seg[:, None, :]
    return visible


def gqa_attention(q_bthd: jax.Array, k_bshd: jax.Array, v_bshd: jax.Array, mask_bts: jax.Array,
                  *, scale: float | None = None, sinks_h: jax.Array | None = None) -> jax.Array:
    """Softmax attention with grouped K/V heads; fp32 scores and statistics.

    `scale` defaults to head_dim**-0.5. `sinks_h` ([Hq] logits, GPT-OSS) join every row's softmax
    as one extra key that has no value: they only enlarge the denominator. V may have its own head
    size (MLA).
    """
    b, t, hq, d = q_bthd.shape
    hkv = k_bshd.shape[2]
    g = hq // hkv
    q = q_bthd.reshape(b, t, hkv, g, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k_bshd, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5 if scale is None else scale)
    scores = jnp.where(mask_bts[:, None, None], scores, _MASKED)
    if sinks_h is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink = sinks_h.astype(jnp.float32).reshape(1, hkv, g, 1, 1)
        top = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
        e = jnp.exp(scores - top)
        probs = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_bshd.dtype), v_bshd)
    return out.reshape(b, t, hq, v_bshd.shape[-1])


def _block_ranges(t: int, block: int, window: int | None):
    """Query blocks [s, e) and the first key lo each can see: 0 on global layers, s - (window - 1)
    on local ones."""
    return [(s, min(t, s + block), 0 if window is None else max(0, s - (window - 1)))
            for s in range(0, t, block)]


def _block_mask(positions_bt, segment_ids_bt, window, s, e, lo):
    """[B, 1, 1, e - s, e - lo]: `attention_mask` of one query block against its key range."""
    seg_q = None if segment_ids_bt is None else segment_ids_bt[:, s:e]
    seg_k = None if segment_ids_bt is None else segment_ids_bt[:, lo:e]
    mask = attention_mask(positions_bt[:, s:e], positions_bt[:, lo:e], seg_q, seg_k, window)
    return mask[:, None, None]


def _head_major(q_bthd, k_bshd, v_bshd):
    """q [B, Hkv, G, T, D], k and v [B, Hkv, S, D]: batch and KV head lead, so each block's score
    and value matmuls contract the last axis with no per-block transpose."""
    b, t, hq, d = q_bthd.shape
    hkv = k_bshd.shape[2]
    q = q_bthd.reshape(b, t, hkv, hq // hkv, d).transpose(0, 2, 3, 1, 4)
    return q, k_bshd.transpose(0, 2, 1, 3), v_bshd.transpose(0, 2, 1, 3)


def _blocked_forward(q, k, v, positions_bt, segment_ids_bt, sinks_h, window, block, scale):
    """Per query block: fp32 scores over its key range, softmax (with sinks in the denominator),
    values. Returns out [B, Hkv, G, T, Dv] (in v's dtype) and the log-normaliser [B, Hkv, G, T]."""
    b, hkv, g, t, _ = q.shape
    outs, lses = [], []
    for s, e, lo in _block_ranges(t, block, window):
        scores = jnp.einsum("bkgtd,bksd->bkgts", q[:, :, :, s:e], k[:, :, lo:e],
                            preferred_element_type=jnp.float32) * scale
        scores = jnp.where(_block_mask(positions_bt, segment_ids_bt, window, s, e, lo), scores,
                           _MASKED)
        top = jnp.max(scores, axis=-1)
        if sinks_h is not None:
            sink = sinks_h.astype(jnp.float32).reshape(1, hkv, g, 1)
            top = jnp.maximum(top, sink)
        p = jnp.exp(scores - top[..., None])
        total = jnp.sum(p, axis=-1)
        if sinks_h is not None:
            total = total + jnp.exp(sink - top)
        o = jnp.einsum("bkgts,bksd->bkgtd", p.astype(v.dtype), v[:, :, lo:e],
                       preferred_element_type=jnp.float32)
        outs.append((o / total[..., None]).astype(v.dtype))
        lses.append(top + jnp.log(total))
    return jnp.concatenate(outs, axis=3), jnp.concatenate(lses, axis=3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _blocked_attention(q, k, v, sinks_h, positions_bt, segment_ids_bt, window, block, scale):
    return _blocked_forward(q, k, v, positions_bt, segment_ids_bt, sinks_h, window, block,
                            scale)[0]


def _blocked_attention_fwd(q, k, v, sinks_h, positions_bt, segment_ids_bt, window, block, scale):
    out, lse = _blocked_forward(q, k, v, positions_bt, segment_ids_bt, sinks_h, window, block,
                                scale)
    return out, (q, k, v, sinks_h, positions_bt, segment_ids_bt, out, lse)


def _blocked_attention_bwd(window, block, scale, res, d_out):
    """Flash-attention's backward per block: probabilities rebuilt from the saved log-normaliser,
    dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O)), zero where masked (as the forward's `where`
    gives); key and value gradients added into their block's range in place."""
    q, k, v, sinks_h, positions_bt, segment_ids_bt, out, lse = res
    b, hkv, g, t, _ = q.shape
    d_out = d_out.astype(jnp.float32)
    delta = jnp.sum(d_out * out.astype(jnp.float32), axis=-1)  # [B, Hkv, G, T]
    # Key and value gradients are accumulated transposed ([B, Hkv, D, S]): dKᵀ = Qᵀ dS and
    # dVᵀ = dOᵀ P then contract the probabilities in their own layout, and only the small
    # [.., T, D] operands are transposed, not the [.., T, S] probabilities.
    dk_t = jnp.zeros((b, hkv, k.shape[-1], t), jnp.float32)
    dv_t = jnp.zeros((b, hkv, v.shape[-1], t), jnp.float32)
    q_t = jnp.moveaxis(q, -1, 2).astype(jnp.float32)  # [B, Hkv, D, G, T]
    do_t = jnp.moveaxis(d_out, -1, 2)
    dqs = []
    for s, e, lo in _block_ranges(t, block, window):
        mask = _block_mask(positions_bt, segment_ids_bt, window, s, e, lo)
        q_blk, k_blk, v_blk = q[:, :, :, s:e], k[:, :, lo:e], v[:, :, lo:e]
        scores = jnp.einsum("bkgtd,bksd->bkgts", q_blk, k_blk,
                            preferred_element_type=jnp.float32) * scale
        p = jnp.exp(jnp.where(mask, scores, _MASKED) - lse[:, :, :, s:e, None])
        do = d_out[:, :, :, s:e]
        dv_t = dv_t.at[:, :, :, lo:e].add(jnp.einsum("bkdgt,bkgts->bkds", do_t[..., s:e], p))
        dp = jnp.einsum("bkgtd,bksd->bkgts", do, v_blk.astype(jnp.float32))
        ds = jnp.where(mask, p * (dp - delta[:, :, :, s:e, None]), 0.0) * scale
        dqs.append(jnp.einsum("bkgts,bksd->bkgtd", ds, k_blk.astype(jnp.float32)))
        dk_t = dk_t.at[:, :, :, lo:e].add(jnp.einsum("bkdgt,bkgts->bkds", q_t[..., s:e], ds))
    dk, dv = jnp.swapaxes(dk_t, 2, 3), jnp.swapaxes(dv_t, 2, 3)
    d_sinks = None
    if sinks_h is not None:
        # A sink only enlarges the denominator: dL/dsink = -Σ_t p_sink(t) · rowsum(dO ∘ O)(t).
        sink = sinks_h.astype(jnp.float32).reshape(1, hkv, g, 1)
        d_sinks = -jnp.sum(jnp.exp(sink - lse) * delta, axis=(0, 3)).reshape(sinks_h.shape)
        d_sinks = d_sinks.astype(sinks_h.dtype)
    dq = jnp.concatenate(dqs, axis=3).astype(q.dtype)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), d_sinks, None, None


_blocked_attention.defvjp(_blocked_attention_fwd, _blocked_attention_bwd)


def self_attention_reference(q_bthd: jax.Array, k_bshd: jax.Array, v_bshd: jax.Array,
                             positions_bt: jax.Array, segment_ids_bt: jax.Array | None,
                             window: int | None, *, sinks_h: jax.Array | None = None,
                             scale: float | None = None) -> jax.Array:
    """Dense masked attention over the whole row: every T x T score, `attention_mask` applied."""
    mask = attention_mask(positions_bt, positions_bt, segment_ids_bt, segment_ids_bt, window)
    return gqa_attention(q_bthd, k_bshd, v_bshd, mask, scale=scale, sinks_h=sinks_h)


def blocked_attention(q_bthd: jax.Array, k_bshd: jax.Array, v_bshd: jax.Array,
                      positions_bt: jax.Array, segment_ids_bt: jax.Array | None,
                      window: int | None, *, block: int = 64,
                      sinks_h: jax.Array | None = None, scale: float | None = None) -> jax.Array:
    """Self-attention of a packed row in query blocks that skip the keys no query in them can see.

    Query block [s, e) attends keys [lo, e): lo = 0 on global layers and s - (window - 1) on local
    ones, so the upper triangle and the keys behind the window are never multiplied (dense masked
    attention computes all T x T scores, 2-5x the useful work at the tiny config). Each block's
    softmax is over its own key range with the mask of `attention_mask`, so for every visible key
    the result equals `self_attention_reference`. Valid when positions increase along the row
    within each segment (packed rows; the same index-causal bound the Pallas flash kernel uses);
    a query that sees no key (padding) gets an average over its range instead of the row.

    The blocks run head-major ([B, Hkv, G, T, D]: one transpose of q, k and v for the whole row,
    not one per block) with a hand-written backward (flash attention's: probabilities rebuilt
    from the saved log-normaliser, key and value gradients added into their ranges in place);
    XLA:CPU's autodiff of the per-block slices and einsums spent more on transposes, padded
    gradient copies and their sums than on the matmuls. A row of at most `block` tokens is one
    block: the reference.
    """
    if block < 1:
        raise ValueError(f"block={block} is not a positive number of query rows")
    b, t, hq, d = q_bthd.shape
    if t <= block:
        return self_attention_reference(q_bthd, k_bshd, v_bshd, positions_bt, segment_ids_bt,
                                        window, sinks_h=sinks_h, scale=scale)
    q, k, v = _head_major(q_bthd, k_bshd, v_bshd)
    out = _blocked_attention(q, k, v, sinks_h, positions_bt, segment_ids_bt, window, block,
                             d**-0.5 if scale is None else float(scale))
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, v_bshd.shape[-1])


def self_attention_impl(impl: str, *, sinks: bool = False) -> str:
    """The implementation `self_attention` runs for `impl`: "auto" is `_dispatch.AUTO
    ["self_attention"]` for the platform built for ("blocked" on CPU, "pallas" on GPU/TPU), and
    "blocked" where there are sinks, which the flash kernel lacks."""
    chosen = _dispatch.choose(impl, "self_attention", IMPLS)
    if chosen == "pallas" and sinks:
        if impl == "pallas":
            raise ValueError("self_attention: impl='pallas' (the flash kernel) has no attention "
                             "sinks; use 'blocked', 'reference' or 'auto'")
        return "blocked"
    return chosen


def self_attention(q_bthd: jax.Array, k_bshd: jax.Array, v_bshd: jax.Array,
                   positions_bt: jax.Array | None, segment_ids_bt: jax.Array | None, *,
                   window: int | None = None, sinks_h: jax.Array | None = None,
                   scale: float | None = None, impl: str = "auto", block: int = 64,
                   interpret: bool | None = None) -> jax.Array:
    """Causal self-attention of packed rows: q [B, T, Hq, D], k [B, T, Hkv, D], v [B, T, Hkv, Dv]
    -> [B, T, Hq, Dv] in the inputs' dtype; scores are q·k times `scale`, default D**-0.5 (MLA
    passes its own, and its values are narrower than its queries and keys: Dv != D in every impl).

    A key is visible to a query when its position is at most the query's (and within `window`
    positions on local layers), in the same segment, and not padding (position < 0). `sinks_h`
    ([Hq] logits, GPT-OSS) enlarge each row's softmax denominator.

    impl (`self_attention_impl`): "reference" (dense masked), "blocked" (`blocked_attention`, `block`
    query rows a block), "pallas" (`flash_attention`, which masks by index within segments, so
    positions must count up from each segment's start, as in packed rows; positions may be None
    there; `interpret` as for the kernel), or "auto". Differentiable in every impl.
    """
    chosen = self_attention_impl(impl, sinks=sinks_h is not None)
    if chosen == "pallas":
        return flash_attention(q_bthd, k_bshd, v_bshd, causal=True, window=window,
                               segment_ids=segment_ids_bt, scale=scale, impl="pallas",
                               interpret=interpret)
    if positions_bt is None:
        raise ValueError(f"self_attention: impl={chosen!r} masks by position; positions_bt is None")
    if chosen == "blocked":
        return blocked_attention(q_bthd, k_bshd, v_bshd, positions_bt, segment_ids_bt, window,
                                 block=block, sinks_h=sinks_h, scale=scale)
    return self_attention_reference(q_bthd, k_bshd, v_bshd, positions_bt, segment_ids_bt, window,
                                    sinks_h=sinks_h, scale=scale)

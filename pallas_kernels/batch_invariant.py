"""Batch-invariant forms: each token's result has the same bits whatever else is in the call.

A decode step multiplies a few rows by each weight; a training forward multiplies thousands.
Libraries pick their reduction order by shape (XLA:CPU's dot changes kernel with the row count,
its row reductions change strategy below eight rows), so the same token gets different bits in
the two. The forms here fix the order by the operation instead:

- `tree_sum`: the pairwise sum of adjacent entries, level by level, over the axis padded with
  zeros to a power of two. Only elementwise adds, so a row's sum does not depend on the other
  rows; and entries past the last non-zero add exact zeros, so the sum of a prefix is the same
  whatever the padded length (a decode step's cache and a training row differ in length).
- `project`: a matmul run on fixed tiles of `tile` rows (`jax.lax.map` over [n, tile, K]), so
  every call, whatever its row count, runs the one [tile, K] x [K, N] product the compiler
  chose for that shape. Its backward is the plain one (gradients need no invariance).
- `rms_norm`, `logsumexp`, `softmax`: their sums are `tree_sum`s, their maxima `tree_max`s
  (exact in any order, but kept free of reduce operations, see `tree_max`).
- `product`: a multiply the compiler may not contract into the add that consumes it (`unfused`);
  every product here that feeds a sum, and the model's elementwise products that feed adds
  (RoPE, norms before a residual add, the experts' gates), go through it.
- `attention`: scores as `tree_sum` over the head dimension, one key block at a time; the
  softmax's sum and the weighted sum of values as `tree_sum`s over key index. A query's keys
  must sit at index = position within an aligned power-of-two span (a cache slot p holds
  position p; a packed training row starts each segment at a multiple of its power-of-two
  length): then its sums are the same in a decode step and a training forward. The backward
  is `gqa_attention`'s.

The references are the plain forms (`jnp.sum`, a matmul, `gqa_attention`); tests check that
these forms agree with them to rounding and that a row's bits do not move with the batch.
Must not import hcjax.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import _dispatch
from pallas_kernels.invariant_matmul import invariant_matmul
from pallas_kernels.self_attention import gqa_attention

DEFAULT_TILE = 64  # rows per tile of `project`
PROJECT_IMPLS = ("auto", "tiles", "pallas")
DEFAULT_KEY_BLOCK = 16  # keys per step of `attention` (a power of two)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@jax.custom_jvp
def unfused(x: jax.Array) -> jax.Array:
    """x, behind an integer operation the compiler cannot see through, so a multiply producing
    x and an add consuming it are never contracted into one fused multiply-add. XLA:CPU's code
    generator contracts them where they meet in one fused loop, and which meet depends on the
    shapes (measured: the same query's attention scores differed by 1 ulp between 1 and 11
    queries; with FMA disabled they did not). The operation flips the lowest bit of one NaN
    pattern only (all exponent and mantissa bits set), which stays a NaN: every value passes
    unchanged."""
    utype = {2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(x.dtype).itemsize]
    bits = jax.lax.bitcast_convert_type(x, utype)
    ones = jnp.array(jnp.iinfo(utype).max >> 1, utype)  # all bits but the sign
    flip = ((bits & ones) == ones).astype(utype)
    return jax.lax.bitcast_convert_type(bits ^ flip, x.dtype)


@unfused.defjvp
def _unfused_jvp(primals, tangents):
    return unfused(primals[0]), tangents[0]


def product(a: jax.Array, b: jax.Array) -> jax.Array:
    """a * b, never contracted into an add that consumes it (`unfused`)."""
    return unfused(a * b)


def _tree(x: jax.Array, axis: int, combine, empty: float) -> jax.Array:
    axis = axis % x.ndim
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    if n == 0:
        return jnp.full(x.shape[:-1], empty, x.dtype)
    size = _next_pow2(n)
    if size != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - n)], constant_values=empty)
    while x.shape[-1] > 1:
        pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
        x = combine(pairs[..., 0], pairs[..., 1])
    return x[..., 0]


def tree_sum(x: jax.Array, axis: int = -1) -> jax.Array:
    """Sum over `axis` as an aligned binary tree: pad to a power of two with zeros, then add
    entries 2i and 2i+1 until one is left. The order is fixed by the index alone."""
    return _tree(x, axis, jnp.add, 0.0)


def tree_max(x: jax.Array, axis: int = -1) -> jax.Array:
    """The maximum over `axis` by the same tree of elementwise maxima. A maximum is exact in any
    order, but a reduce operation is not safe here: XLA:CPU may hand it to YNNPACK together
    with the exp that follows it, whose exp then differs from XLA's own (measured: rows of 8
    or fewer and rows of 33 or more got different bits)."""
    return _tree(x, axis, jnp.maximum, -jnp.inf)


def ordered_sum(x: jax.Array, axis: int = -1) -> jax.Array:
    """Sum over a short `axis` left to right (e.g. the k experts of a token)."""
    x = jnp.moveaxis(x, axis % x.ndim, 0)
    total = x[0]
    for i in range(1, x.shape[0]):
        total = total + x[i]
    return total


def _tiled_rows(fn, x2: jax.Array, tile: int) -> jax.Array:
    """fn([tile, K]) -> [tile, N] over the rows of x2 [M, K], `tile` rows at a time (one loop
    body, the same program for every tile; XLA keeps the loop even for one tile)."""
    m = x2.shape[0]
    n = -(-m // tile)
    padded = jnp.pad(x2, ((0, n * tile - m), (0, 0))) if n * tile != m else x2
    out = jax.lax.map(fn, padded.reshape(n, tile, x2.shape[1]))
    return out.reshape(n * tile, *out.shape[2:])[:m]


def _check_tile(tile: int) -> None:
    if not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile={tile!r} must be a positive int (rows per batch-invariant tile)")


def _block(n: int) -> int:
    """A Pallas block along a weight axis: 128 where it divides, else the whole axis."""
    return 128 if n % 128 == 0 else n


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _project(x2, w2, tile, out_dtype, impl):
    return _project_fwd(x2, w2, tile, out_dtype, impl)[0]


def _project_fwd(x2, w2, tile, out_dtype, impl):
    if impl == "pallas":
        y = invariant_matmul(x2, w2, block_m=tile, block_n=_block(w2.shape[1]),
                             block_k=_block(w2.shape[0]), out_dtype=out_dtype)
    else:
        y = _tiled_rows(lambda t: jnp.dot(t, w2, preferred_element_type=out_dtype), x2, tile)
    return y, (x2, w2)


def _project_bwd(tile, out_dtype, impl, res, dy):
    x2, w2 = res
    dy = dy.astype(x2.dtype)
    return (dy @ w2.T).astype(x2.dtype), (x2.T @ dy).astype(w2.dtype)


_project.defvjp(_project_fwd, _project_bwd)


def project(x: jax.Array, w: jax.Array, n_in: int = 1, *, tile: int = DEFAULT_TILE,
            out_dtype=None, impl: str = "auto") -> jax.Array:
    """x [..., *in] contracted with w [*in, *out] over w's first `n_in` axes, each token's row
    computed on a fixed [tile, in] x [in, out] product: the XLA dot per row tile ("tiles") or
    the batch-invariant Pallas matmul ("pallas"); "auto" by platform. out_dtype defaults to
    x's dtype."""
    _check_tile(tile)
    impl = _dispatch.choose(impl, "batch_invariant_project", PROJECT_IMPLS)
    if not 1 <= n_in <= min(x.ndim, w.ndim) or x.shape[x.ndim - n_in:] != w.shape[:n_in]:
        raise ValueError(f"x.shape={x.shape} does not end with w's first {n_in} axes "
                         f"(w.shape={w.shape})")
    lead, outs = x.shape[: x.ndim - n_in], w.shape[n_in:]
    size_in = math.prod(w.shape[:n_in])
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    x2 = x.reshape(-1, size_in)
    if x2.shape[0] == 0:
        return jnp.zeros((*lead, *outs), out_dtype)
    y = _project(x2, w.astype(x.dtype).reshape(size_in, -1), tile, out_dtype, impl)
    return y.reshape(*lead, *outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _grouped_tiles(buffer, w, tile_group, group_sizes, tile):
    tiles = buffer.reshape(-1, tile, buffer.shape[-1])
    out = jax.lax.map(lambda a: jnp.dot(a[0], w[a[1]], preferred_element_type=buffer.dtype),
                      (tiles, tile_group))
    return out.reshape(buffer.shape[0], w.shape[-1])


def _grouped_tiles_fwd(buffer, w, tile_group, group_sizes, tile):
    return _grouped_tiles(buffer, w, tile_group, group_sizes, tile), (buffer, w, group_sizes)


def _grouped_tiles_bwd(tile, res, dy):
    buffer, w, group_sizes = res
    _, vjp = jax.vjp(lambda b, w: jax.lax.ragged_dot(b, w, group_sizes), buffer, w)
    db, dw = vjp(dy.astype(buffer.dtype))
    return db, dw, None, None


_grouped_tiles.defvjp(_grouped_tiles_fwd, _grouped_tiles_bwd)


def grouped_layout(group_a: jax.Array, num_groups: int, tile: int):
    """Where each of A rows goes in a buffer of whole tiles, each tile one group's: rows sorted
    by group (in row order within one), every group padded to a multiple of `tile`. Returns
    (dest [A] row index in the buffer, tile_group [n_tiles], group_sizes [G] rows of each group
    in the buffer, the last group also holding the unused tail), n_tiles = ceil(A / tile) + G
    (static)."""
    _check_tile(tile)
    a = group_a.shape[0]
    n_tiles = -(-a // tile) + num_groups
    onehot = (group_a[:, None] == jnp.arange(num_groups)[None, :]).astype(jnp.int32)
    counts = jnp.sum(onehot, axis=0)
    rank = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), group_a[:, None], axis=1)[:, 0] - 1
    padded = -(-counts // tile) * tile
    start = jnp.cumsum(padded) - padded
    dest = start[group_a] + rank
    ends = jnp.cumsum(padded)
    tile_group = jnp.minimum(
        jnp.searchsorted(ends, jnp.arange(n_tiles) * tile, side="right"), num_groups - 1)
    sizes = padded.at[num_groups - 1].add(n_tiles * tile - ends[-1])
    return dest, tile_group.astype(jnp.int32), sizes.astype(jnp.int32)


def grouped_project(x_ak: jax.Array, w_gkn: jax.Array, layout, *, tile: int) -> jax.Array:
    """Row a of x [A, K] times its group's weight w[g] [K, N] -> [A, N], each row on a fixed
    [tile, K] x [K, N] product of its group's tile (`grouped_layout`'s layout). The backward
    is `jax.lax.ragged_dot`'s."""
    dest, tile_group, sizes = layout
    n_rows = tile_group.shape[0] * tile
    buffer = jnp.zeros((n_rows, x_ak.shape[1]), x_ak.dtype).at[dest].set(x_ak)
    out = _grouped_tiles(buffer, w_gkn.astype(x_ak.dtype), tile_group, sizes, tile)
    return out[dest]


def rms_norm(x: jax.Array, eps: float, scale: jax.Array | None = None) -> jax.Array:
    """x / sqrt(mean(x²) + eps) (times `scale`) in fp32 over the last axis, the mean a
    `tree_sum`; the result `unfused` (a residual add may consume it)."""
    x32 = x.astype(jnp.float32)
    mean = tree_sum(product(x32, x32)) / x32.shape[-1]
    y = x32 * jax.lax.rsqrt(mean + eps)[..., None]
    return unfused(y if scale is None else y * scale)


def logsumexp(x: jax.Array, axis: int = -1) -> jax.Array:
    """log Σ exp(x) over `axis`: the maximum (exact in any order) shifted out, the sum a
    `tree_sum`. -inf entries add exact zeros; a row of -inf gives -inf."""
    top = jnp.expand_dims(tree_max(x, axis), axis)
    shift = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
    total = tree_sum(jnp.exp(x - shift), axis)
    return jnp.log(total) + jnp.squeeze(shift, axis)


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    top = jax.lax.stop_gradient(jnp.expand_dims(tree_max(x, axis), axis))
    e = jnp.exp(x - top)
    return e / jnp.expand_dims(tree_sum(e, axis), axis)


def _attention_forward(q, k, v, mask, sinks, scale, block):
    """q [B, T, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv], mask [B, T, S] -> [B, T, Hq, Dv]."""
    b, t, hq, d = q.shape
    s, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hkv
    n_blocks = -(-s // block)
    pad = n_blocks * block - s
    if pad:
        k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad)))
    qf = q.astype(jnp.float32).reshape(b, t, hkv, g, d)
    # Key blocks lead: [n, B, block, Hkv, D].
    kb = k.astype(jnp.float32).reshape(b, n_blocks, block, hkv, d).transpose(1, 0, 2, 3, 4)
    vb = v.astype(jnp.float32).reshape(b, n_blocks, block, hkv, dv).transpose(1, 0, 2, 3, 4)

    def scores_of(k_blk):  # [B, block, Hkv, D] -> [B, Hkv, G, T, block]
        prod = product(qf[:, :, :, :, None, :],
                       k_blk.transpose(0, 2, 1, 3)[:, None, :, None, :, :])
        return tree_sum(prod).transpose(0, 2, 3, 1, 4)

    scores = jax.lax.map(scores_of, kb)  # [n, B, Hkv, G, T, block]
    scores = product(scores.transpose(1, 2, 3, 4, 0, 5).reshape(b, hkv, g, t, n_blocks * block),
                     jnp.float32(scale))
    visible = mask[:, None, None]
    scores = jnp.where(visible, scores, -jnp.inf)
    top = tree_max(scores)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, hkv, g, 1)
        top = jnp.maximum(top, sink)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    p = jnp.where(visible, jnp.exp(scores - top[..., None]), 0.0)
    total = tree_sum(p)
    if sinks is not None:
        total = total + jnp.exp(sink - top)
    pb = p.reshape(b, hkv, g, t, n_blocks, block).transpose(4, 0, 1, 2, 3, 5)

    def values_of(xs):  # one block's weighted values, summed as the tree's lower levels
        p_blk, v_blk = xs  # [B, Hkv, G, T, block], [B, block, Hkv, Dv]
        prod = product(p_blk[..., None], v_blk.transpose(0, 2, 1, 3)[:, :, None, None, :, :])
        return tree_sum(prod, axis=-2)  # [B, Hkv, G, T, Dv]

    partial = jax.lax.map(values_of, (pb, vb))  # [n, B, Hkv, G, T, Dv]
    out = tree_sum(partial, axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, dv).astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(q, k, v, mask, sinks, scale, block):
    return _attention_forward(q, k, v, mask, sinks, scale, block)


def _attention_fwd(q, k, v, mask, sinks, scale, block):
    return _attention_forward(q, k, v, mask, sinks, scale, block), (q, k, v, mask, sinks)


def _attention_bwd(scale, block, res, dout):
    q, k, v, mask, sinks = res
    if sinks is None:
        _, vjp = jax.vjp(lambda q, k, v: gqa_attention(q, k, v, mask, scale=scale), q, k, v)
        return (*vjp(dout), None, None)
    _, vjp = jax.vjp(lambda q, k, v, s: gqa_attention(q, k, v, mask, scale=scale, sinks_h=s),
                     q, k, v, sinks)
    dq, dk, dv, ds = vjp(dout)
    return dq, dk, dv, None, ds


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask_bts: jax.Array, *,
              scale: float | None = None, sinks_h: jax.Array | None = None,
              block: int = DEFAULT_KEY_BLOCK) -> jax.Array:
    """Batch-invariant softmax attention (`gqa_attention`'s contract): q [B, T, Hq, D],
    k [B, S, Hkv, D], v [B, S, Hkv, Dv], mask [B, T, S] bool; fp32 arithmetic, out in v's dtype.
    Keys must lie at index = position (see the module docstring)."""
    if block < 1 or block & (block - 1):
        raise ValueError(f"block={block} must be a power of two (keys per attention step)")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} are not a multiple of KV heads {k.shape[2]}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _attention(q, k, v, mask_bts, sinks_h, float(scale), int(block))

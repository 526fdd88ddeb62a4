"""Batch-invariant forms: each token's result has the same bits whatever else is in the call.

A decode step multiplies a few rows by each weight; a training forward multiplies thousands.
Libraries pick their reduction order by shape (XLA:CPU's dot changes kernel with the row count,
its row reductions change strategy below eight rows), so the same token gets different bits in
the two. The forms here fix the order by the operation instead:

- `tree_sum`: a binary tree over the axis padded with zeros to a power of two, each level adding
  the upper half onto the lower half. Only elementwise adds, so a row's sum does not depend on
  the other rows; and entries past the last non-zero add exact zeros, so the sum of a prefix is
  the same whatever the padded length (a decode step's cache and a training row differ in
  length), as is the sum of an aligned span (length a power of two, offset a multiple of it)
  with zeros around it.
- `project`: a matmul run on fixed tiles of `tile` rows (`jax.lax.map` over [n, tile, K]), so
  every call, whatever its row count, runs the one [tile, K] x [K, N] product the compiler
  chose for that shape. Its backward is the plain one (gradients need no invariance).
- `rms_norm`, `logsumexp`, `softmax`: their sums are `tree_sum`s, their maxima `tree_max`s
  (exact in any order, but kept free of reduce operations, see `tree_max`).
- `product`: a multiply the compiler may not contract into the add that consumes it (`unfused`);
  every product here that feeds a sum, and the model's elementwise products that feed adds
  (RoPE, norms before a residual add, the experts' gates), go through it. `product_sum` is
  Σ a·b: chunks of 8 products added left to right, the chunks' sums a `tree_sum` (the same
  prefix and aligned-span properties, without storing every product).
- `attention`: scores as `product_sum` over the head dimension, the softmax's sum a `tree_sum`
  and the weighted sum of values a `product_sum` over key index, queries in chunks (a query's
  sums never involve another query). A query's keys must sit at index = position within an
  aligned power-of-two span (a cache slot p holds position p; a packed training row starts each
  segment at a multiple of its power-of-two length): then its sums are the same in a decode
  step and a training forward. The backward is any form with the same value (the caller's
  blocked attention, else `gqa_attention`).

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
PRODUCT_CHUNK = 8  # entries `product_sum` adds left to right before its tree


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
    n = x.shape[axis]
    if n == 0:
        return jnp.full(x.shape[:axis] + x.shape[axis + 1:], empty, x.dtype)
    size = _next_pow2(n)
    if size != n:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, size - n)
        x = jnp.pad(x, pad, constant_values=empty)
    while x.shape[axis] > 1:
        half = x.shape[axis] // 2
        x = combine(jax.lax.slice_in_dim(x, 0, half, axis=axis),
                    jax.lax.slice_in_dim(x, half, 2 * half, axis=axis))
    return jnp.squeeze(x, axis)


def tree_sum(x: jax.Array, axis: int = -1) -> jax.Array:
    """Sum over `axis` as a binary tree fixed by the index alone: pad to a power of two with
    zeros, then add the upper half onto the lower half, entry by entry, until one is left
    (contiguous halves: no strided reads, no transposes)."""
    return _tree(x, axis, jnp.add, 0.0)


def tree_max(x: jax.Array, axis: int = -1) -> jax.Array:
    """The maximum over `axis` by the same tree of elementwise maxima. A maximum is exact in any
    order, but a reduce operation is not safe here: XLA:CPU may hand it to YNNPACK together
    with the exp that follows it, whose exp then differs from XLA's own (measured: rows of 8
    or fewer and rows of 33 or more got different bits)."""
    return _tree(x, axis, jnp.maximum, -jnp.inf)


def product_sum(a: jax.Array, b: jax.Array, axis: int = -1, chunk: int = PRODUCT_CHUNK
                ) -> jax.Array:
    """Σ a·b over `axis` (a and b broadcast against each other, the same rank): the products
    `unfused`, added left to right within chunks of `chunk` entries, the chunks' sums a
    `tree_sum`. Each product is read once, so the compiler keeps the chunk in one loop instead
    of storing every product. The order is fixed by the index: entries past the last non-zero,
    or zeros around an aligned span (as in `tree_sum`), add exact zeros."""
    axis = axis % a.ndim
    n = max(a.shape[axis], b.shape[axis])
    if n == 0:
        shape = jnp.broadcast_shapes(a.shape, b.shape)
        return jnp.zeros(shape[:axis] + shape[axis + 1:], jnp.result_type(a, b))
    chunk = min(chunk, _next_pow2(n))
    size = chunk * _next_pow2(-(-n // chunk))

    # A term is one slice of the summed axis. Along the last axis that slice is strided, so the
    # axis is moved first (each term one contiguous block); along another it is kept in place.
    at = 0 if axis == a.ndim - 1 else axis

    def split(x):  # pad the summed axis to `size`, then [.., size / chunk, chunk, ..] at `at`
        x = jnp.moveaxis(x, axis, at)
        if x.shape[at] == 1:
            return jnp.expand_dims(x, at)
        if x.shape[at] != size:
            pad = [(0, 0)] * x.ndim
            pad[at] = (0, size - x.shape[at])
            x = jnp.pad(x, pad)
        return x.reshape(*x.shape[:at], size // chunk, chunk, *x.shape[at + 1:])

    def term(x, j):
        return jax.lax.index_in_dim(x, min(j, x.shape[at + 1] - 1), at + 1, keepdims=False)

    a, b = split(a), split(b)
    total = None
    for j in range(chunk):
        t = product(term(a, j), term(b, j))
        total = t if total is None else total + t
    return tree_sum(total, at)


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_tiles(buffer, w, tile_group, tile):
    tiles = buffer.reshape(-1, tile, buffer.shape[-1])
    out = jax.lax.map(lambda a: jnp.dot(a[0], w[a[1]], preferred_element_type=buffer.dtype),
                      (tiles, tile_group))
    return out.reshape(buffer.shape[0], w.shape[-1])


def _grouped_tiles_fwd(buffer, w, tile_group, tile):
    return _grouped_tiles(buffer, w, tile_group, tile), (buffer, w, tile_group)


def _grouped_tiles_bwd(tile, res, dy):
    """Per tile (each one group's rows): d buffer = dy @ w[g]ᵀ, d w[g] += tileᵀ @ dy. The work
    is the forward's; a ragged dot's backward on CPU runs every group over every row."""
    buffer, w, tile_group = res
    tiles = buffer.reshape(-1, tile, buffer.shape[-1])
    dy = dy.astype(buffer.dtype).reshape(tiles.shape[0], tile, w.shape[-1])
    db = jnp.einsum("tmn,tkn->tmk", dy, w[tile_group]).reshape(buffer.shape)
    dw = jax.ops.segment_sum(jnp.einsum("tmk,tmn->tkn", tiles, dy), tile_group,
                             num_segments=w.shape[0])
    return db, dw.astype(w.dtype), None


_grouped_tiles.defvjp(_grouped_tiles_fwd, _grouped_tiles_bwd)


def grouped_layout(group_a: jax.Array, num_groups: int, tile: int):
    """Where each of A rows goes in a buffer of whole tiles, each tile one group's: rows sorted
    by group (in row order within one), every group padded to a multiple of `tile`. Returns
    (dest [A] row index in the buffer, tile_group [n_tiles] the group of each tile; the unused
    tail's tiles count as the last group's), n_tiles = ceil(A / tile) + G (static)."""
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
    return dest, tile_group.astype(jnp.int32)


def grouped_project(x_ak: jax.Array, w_gkn: jax.Array, layout, *, tile: int) -> jax.Array:
    """Row a of x [A, K] times its group's weight w[g] [K, N] -> [A, N], each row on a fixed
    [tile, K] x [K, N] product of its group's tile (`grouped_layout`'s layout). The backward
    runs on the same tiles."""
    dest, tile_group = layout
    n_rows = tile_group.shape[0] * tile
    buffer = jnp.zeros((n_rows, x_ak.shape[1]), x_ak.dtype).at[dest].set(x_ak)
    out = _grouped_tiles(buffer, w_gkn.astype(x_ak.dtype), tile_group, tile)
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


def _query_block(b: int, t: int, hq: int, s: int, causal: bool) -> int:
    """Queries per chunk of `attention`. Chunks never change a query's bits (its sums run over
    keys only); they bound the scores held at once (about 2**22 of them) and, when causal,
    let each chunk stop at its last query's keys. At most 16 chunks (one program each)."""
    per_query = max(1, b * hq * s)
    rows = max(1, (1 << 22) // per_query)
    if causal:
        rows = min(rows, max(16, -(-t // 4)))
    return max(rows, -(-t // 16))


def _attention_forward(q, k, v, mask, sinks, scale, causal):
    """q [B, T, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv], mask [B, T, S] -> [B, T, Hq, Dv]."""
    b, t, hq, d = q.shape
    s, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hkv
    if causal:  # no key past the query's index (what lets a chunk stop at its last query)
        mask = mask & (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None])[None]
    # `unfused` pins q, k and v to their own dtype's bits: XLA may otherwise keep a bf16
    # producer's fp32 value when it fuses it into the fp32 arithmetic below (excess precision),
    # and whether it fuses depends on the program.
    q, k, v = unfused(q), unfused(k), unfused(v)
    qf = q.astype(jnp.float32).reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4)  # [B,Hkv,G,T,D]
    kf = k.astype(jnp.float32).transpose(0, 2, 1, 3)[:, :, None, None]  # [B,Hkv,1,1,S,D]
    vf = v.astype(jnp.float32).transpose(0, 2, 1, 3)[:, :, None, None]  # [B,Hkv,1,1,S,Dv]
    rows = _query_block(b, t, hq, s, causal)
    outs = []
    for lo in range(0, t, rows):
        hi = min(t, lo + rows)
        # Causal: keys past the chunk's last query are masked, so they add exact zeros; the
        # tree over the first `keys` (a power of two) has the full axis's bits.
        keys = min(s, _next_pow2(hi)) if causal else s
        scores = product_sum(qf[:, :, :, lo:hi, None, :], kf[..., :keys, :])
        scores = product(scores, jnp.float32(scale))  # [B, Hkv, G, rows, keys]
        visible = mask[:, None, None, lo:hi, :keys]
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
        weighted = product_sum(p[..., None], vf[..., :keys, :], axis=-2)
        outs.append(weighted / jnp.where(total > 0, total, 1.0)[..., None])
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)  # [B,Hkv,G,T,Dv]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, dv).astype(v.dtype)


def _dense_grad(q, k, v, sinks, mask, *, scale):
    """The backward form `attention` uses when the caller names none: `gqa_attention`."""
    return gqa_attention(q, k, v, mask, scale=scale, sinks_h=sinks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _attention(q, k, v, mask, sinks, grad_args, scale, causal, grad_form):
    return _attention_forward(q, k, v, mask, sinks, scale, causal)


def _attention_fwd(q, k, v, mask, sinks, grad_args, scale, causal, grad_form):
    out = _attention_forward(q, k, v, mask, sinks, scale, causal)
    return out, (q, k, v, mask, sinks, grad_args)


def _attention_bwd(scale, causal, grad_form, res, dout):
    q, k, v, mask, sinks, grad_args = res
    no_grads = tuple(None for _ in grad_args)
    if grad_form is None:
        grad_form, grad_args = functools.partial(_dense_grad, scale=scale), (mask,)
    if sinks is None:
        _, vjp = jax.vjp(lambda q, k, v: grad_form(q, k, v, None, *grad_args), q, k, v)
        return (*vjp(dout), None, None, no_grads)
    _, vjp = jax.vjp(lambda q, k, v, s: grad_form(q, k, v, s, *grad_args), q, k, v, sinks)
    dq, dk, dv, ds = vjp(dout)
    return dq, dk, dv, None, ds, no_grads


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask_bts: jax.Array, *,
              scale: float | None = None, sinks_h: jax.Array | None = None,
              causal: bool = False, grad_form=None, grad_args: tuple = ()) -> jax.Array:
    """Batch-invariant softmax attention (`gqa_attention`'s contract): q [B, T, Hq, D],
    k [B, S, Hkv, D], v [B, S, Hkv, Dv], mask [B, T, S] bool; fp32 arithmetic, out in v's dtype.
    Keys must lie at index = position (see the module docstring). `causal`: query t sees
    no key past index t (a training row; the mask is cut there), so chunks of queries skip the
    keys after them. The backward is `grad_form(q, k, v, sinks, *grad_args)`'s (any form with
    the same value, e.g. the blocked attention over positions and segment ids; gradients need
    no invariance), by default `gqa_attention`'s over the mask."""
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} are not a multiple of KV heads {k.shape[2]}")
    if causal and k.shape[1] != q.shape[1]:
        raise ValueError(f"causal=True needs as many keys as queries (got {k.shape[1]} keys "
                         f"for {q.shape[1]} queries)")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _attention(q, k, v, mask_bts, sinks_h, tuple(grad_args), float(scale), bool(causal),
                      grad_form)

"""A batch-invariant matmul: each row of x [M, K] @ w [K, N] comes out with the same bits whatever
the other rows of the call are, how many there are, and at which row it sits.

It is for an exact mode in which the sampler's log-probability of a token (a decode step: a few
rows per matmul) equals the learner's (a training forward: thousands of rows). The reduction
order is fixed by the operation, never by the shape: an fp32 accumulator, K cut into `block_k`
chunks added in order, each chunk one dot of a fixed tile shape (block_m rows, padded with zeros);
no split-K, and no tile size chosen from M. Two calls agree bit for bit when they use the same
implementation, lowering and block sizes. Not differentiable by design (the caller owns the
gradients); must not import hcjax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _dispatch

IMPLS = ("pallas", "reference")


def _validate(x, w, block_k: int, block_n: int | None = None, block_m: int | None = None) -> None:
    if x.ndim != 2:
        raise ValueError(f"x.shape={x.shape} is not [M, K]")
    if w.ndim != 2:
        raise ValueError(f"w.shape={w.shape} is not [K, N]")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"x.shape={x.shape} and w.shape={w.shape} disagree on K: "
                         f"x is [M, K={x.shape[1]}], w must be [K={x.shape[1]}, N]")
    if x.dtype != w.dtype:
        raise ValueError(f"x.dtype={x.dtype} differs from w.dtype={w.dtype}")
    blocks = {"block_k": block_k, "block_n": block_n, "block_m": block_m}
    for name, b in blocks.items():
        if b is not None and (not isinstance(b, int) or b < 1):
            raise ValueError(f"{name}={b!r} is not a positive int")
    # K is not padded: every chunk is full, the kernel's and the reference's alike.
    k, n = w.shape
    if k % block_k:
        raise ValueError(f"K={k} is not a multiple of block_k={block_k}")
    if block_n is not None and n % block_n:
        raise ValueError(f"N={n} is not a multiple of block_n={block_n}")


def invariant_matmul_reference(
    x: jax.Array,
    w: jax.Array,
    *,
    block_k: int = 128,
    block_m: int = 128,
    out_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] in `out_dtype` (default x.dtype): the kernel's computation in
    plain jnp. x's rows go in zero-padded tiles of block_m, one tile at a time; per tile acc = 0
    (fp32), then for each K chunk kb in order acc = acc + x_tile[:, kb] @ w[kb] (one
    fp32-accumulated dot); then the cast.

    The tiles are what makes it batch-invariant: XLA picks a dot's algorithm by its shape (on CPU a
    one-row dot is a vector-matrix product that sums in another order than a matrix product), so
    here every dot has the shape [block_m, block_k] @ [block_k, N] whatever M is.
    """
    _validate(x, w, block_k, block_m=block_m)
    (m, k), n = x.shape, w.shape[1]
    padded = _dispatch.round_up(m, block_m)
    tiles = jnp.pad(x, ((0, padded - m), (0, 0))).reshape(padded // block_m, block_m, k)

    def tile_matmul(x_tile):  # [block_m, K] -> [block_m, N]
        acc = jnp.zeros((block_m, n), jnp.float32)
        for k0 in range(0, k, block_k):
            kb = slice(k0, k0 + block_k)
            acc = acc + jnp.dot(x_tile[:, kb], w[kb, :], preferred_element_type=jnp.float32)
        return acc

    out = jax.lax.map(tile_matmul, tiles).reshape(padded, n)[:m]
    return out.astype(x.dtype if out_dtype is None else out_dtype)


# ---------------------------------------------------------------------------------------------
# TPU (Mosaic) kernel: grid (M tiles, N tiles, K tiles), K innermost and sequential, the fp32
# accumulator a VMEM scratch tile that lives across the K steps of one output tile.


def _tpu_kernel(x_ref, w_ref, o_ref, acc_ref):
    kt = pl.program_id(2)

    @pl.when(kt == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    acc_ref[...] = acc_ref[...] + jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

    @pl.when(kt == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _invariant_matmul_tpu(x, w, out_dtype, block_m, block_n, block_k, interpret):
    (m, k), n = x.shape, w.shape[1]
    return pl.pallas_call(
        _tpu_kernel,
        grid=(m // block_m, n // block_n, k // block_k),
        in_specs=[
            pl.BlockSpec((block_m, block_k), lambda i, j, kt: (i, kt)),
            pl.BlockSpec((block_k, block_n), lambda i, j, kt: (kt, j)),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, kt: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="invariant_matmul_tpu",
    )(x, w)


# ---------------------------------------------------------------------------------------------
# GPU (Triton) kernel: Triton's programs are independent, so no grid axis can carry an
# accumulator; grid (M tiles, N tiles) and each program walks K's chunks in order in a loop, the
# same reduction as the TPU kernel's K axis. x and w stay whole (any K, not only powers of 2).


def _gpu_kernel(x_ref, w_ref, o_ref, *, block_m, block_n, block_k):
    row0 = pl.multiple_of(pl.program_id(0) * block_m, block_m)
    col0 = pl.multiple_of(pl.program_id(1) * block_n, block_n)

    def step(kt, acc):
        k0 = pl.multiple_of(kt * block_k, block_k)
        a = x_ref[pl.ds(row0, block_m), pl.ds(k0, block_k)]
        b = w_ref[pl.ds(k0, block_k), pl.ds(col0, block_n)]
        return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(
        0, x_ref.shape[1] // block_k, step, jnp.zeros((block_m, block_n), jnp.float32)
    )
    o_ref[...] = acc.astype(o_ref.dtype)


def _invariant_matmul_gpu(x, w, out_dtype, block_m, block_n, block_k, interpret):
    (m, _), n = x.shape, w.shape[1]
    num_warps = 8 if block_m * block_n >= 128 * 128 else 4  # as gmm: a 128x128 fp32 tile
    return pl.pallas_call(
        functools.partial(_gpu_kernel, block_m=block_m, block_n=block_n, block_k=block_k),
        grid=(m // block_m, n // block_n),
        in_specs=[
            pl.BlockSpec(x.shape, lambda i, j: (0, 0)),
            pl.BlockSpec(w.shape, lambda i, j: (0, 0)),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=3),
        interpret=interpret,
        name="invariant_matmul",
    )(x, w)


def _check_tiles_compile(lowering, w, block_m, block_n, block_k) -> None:
    """The tile shapes each compiler accepts (interpret mode takes any)."""
    if lowering == "gpu":
        for name, b in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
            if b < 16 or b & (b - 1):
                raise ValueError(f"lowering='gpu': {name}={b} is not a power of 2 >= 16 (tl.dot)")
        return
    # Pallas TPU blocks: the last two dimensions multiples of (8, 128) or whole. libtpu compiles
    # bf16 tiles of 8 rows too (tests/test_kernels_invariant_matmul.py compiles for v5e).
    if block_m % 8:
        raise ValueError(f"lowering='tpu': block_m={block_m} is not a multiple of 8")
    k, n = w.shape
    for name, b, dim in (("block_k", block_k, k), ("block_n", block_n, n)):
        if b % 128 and b != dim:
            raise ValueError(f"lowering='tpu': {name}={b} is neither a multiple of 128 nor all of "
                             f"{name[-1].upper()}={dim}")


def invariant_matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    block_m: int = 128,
    block_n: int = 128,
    block_k: int = 128,
    out_dtype: jnp.dtype | None = None,
    impl: str = "pallas",
    interpret: bool | None = None,
    lowering: str | None = None,
) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] in `out_dtype` (default x.dtype), each row's bits independent
    of M and of the row's position: fp32 accumulation over K in `block_k` chunks, in order.

    Any M (rows are padded with zeros to a multiple of block_m and the padding dropped); K and N
    must be multiples of block_k and block_n (K is not padded: the chunks stay where the reference
    puts them). Keep the block sizes the same in the calls that must agree: block_k fixes the
    rounding, block_m the tile each dot sees. The defaults, 128 each, are tiles both compilers
    take; fp32 inputs run as TF32 on Triton. jit-able; no gradient.

    impl: "pallas" or "reference" (the same tiles and order in jnp, one row tile after another:
    XLA's form for CPU, where Pallas can only interpret). lowering: "tpu" (Mosaic: grid (M, N, K
    tiles) with a VMEM accumulator) or "gpu" (Triton: grid (M, N tiles), K in a loop), default by
    backend. interpret=None interprets iff on CPU.
    """
    _validate(x, w, block_k, block_n, block_m)
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if _dispatch.choose(impl, "invariant_matmul", IMPLS) == "reference":
        return invariant_matmul_reference(
            x, w, block_k=block_k, block_m=block_m, out_dtype=out_dtype
        )
    lowering = _dispatch.resolve_lowering(lowering, "invariant_matmul")
    interpret = _dispatch.resolve_interpret(interpret)
    if not interpret:
        _check_tiles_compile(lowering, w, block_m, block_n, block_k)
    m = x.shape[0]
    if m == 0:
        return jnp.zeros((0, w.shape[1]), out_dtype)
    # Zero rows are rows like any other: they change no real row's bits.
    x = jnp.pad(x, ((0, _dispatch.round_up(m, block_m) - m), (0, 0)))
    kernel = _invariant_matmul_tpu if lowering == "tpu" else _invariant_matmul_gpu
    return kernel(x, w, out_dtype, block_m, block_n, block_k, interpret)[:m]

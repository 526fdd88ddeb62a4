"""Grouped matmul (gmm) and its transposed form (tgmm) for a dropless MoE, forward and backward.

`jax.lax.ragged_dot` is the reference; the Pallas paths are a Triton kernel written here (GPU) and
JAX's megablox kernels (TPU). Must not import hcjax.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _dispatch

_SQ = pl.squeezed


def _validate(lhs, rhs, group_sizes, group_offset, *, rhs_groups: bool = True) -> None:
    if lhs.ndim != 2:
        raise ValueError(f"lhs.shape={lhs.shape} is not [m, k]")
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"group_sizes has shape={group_sizes.shape} dtype={group_sizes.dtype}, "
            "expected a 1-d integer array"
        )
    if rhs_groups:
        if rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]:
            raise ValueError(f"rhs.shape={rhs.shape} is not [groups, k={lhs.shape[1]}, n]")
        if rhs.shape[0] > group_sizes.shape[0]:
            raise ValueError(
                f"rhs has {rhs.shape[0]} groups, more than len(group_sizes)={group_sizes.shape[0]}"
            )
        if group_offset is None and rhs.shape[0] != group_sizes.shape[0]:
            raise ValueError(
                f"rhs has {rhs.shape[0]} groups but len(group_sizes)={group_sizes.shape[0]}; "
                "pass group_offset when rhs holds a shard of the groups"
            )
    elif rhs.ndim != 2 or rhs.shape[0] != lhs.shape[0]:
        raise ValueError(f"grad.shape={rhs.shape} is not [m={lhs.shape[0]}, n]")


def _local_bounds(group_sizes, group_offset, num_local: int):
    """First and one-past-last row of each local group [offset, offset + num_local)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    starts = ends - group_sizes.astype(jnp.int32)
    offset = jnp.asarray(0 if group_offset is None else group_offset, jnp.int32).reshape(())
    return (
        jax.lax.dynamic_slice_in_dim(starts, offset, num_local),
        jax.lax.dynamic_slice_in_dim(ends, offset, num_local),
    )


def _local_sizes_with_sentinels(group_sizes, group_offset, num_local: int):
    """Sizes [rows before the shard, local groups..., rows after]: the shard as a ragged_dot."""
    starts, ends = _local_bounds(group_sizes, group_offset, num_local)
    total = jnp.sum(group_sizes.astype(jnp.int32))
    return jnp.concatenate([starts[:1], ends - starts, (total - ends[-1])[None]])


def gmm_reference(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    group_offset: int | jax.Array | None = None,
    preferred_element_type: jnp.dtype | None = None,
) -> jax.Array:
    """`jax.lax.ragged_dot`; rows of groups outside [offset, offset + G_local) give zeros."""
    _validate(lhs, rhs, group_sizes, group_offset)
    if group_offset is None:
        return jax.lax.ragged_dot(
            lhs, rhs, group_sizes.astype(jnp.int32), preferred_element_type=preferred_element_type
        )
    # Zero matrices stand in for the groups held by other shards.
    zero = jnp.zeros((1, *rhs.shape[1:]), rhs.dtype)
    sizes = _local_sizes_with_sentinels(group_sizes, group_offset, rhs.shape[0])
    return jax.lax.ragged_dot(
        lhs,
        jnp.concatenate([zero, rhs, zero]),
        sizes,
        preferred_element_type=preferred_element_type,
    )


def tgmm_reference(
    lhs: jax.Array,
    grad: jax.Array,
    group_sizes: jax.Array,
    *,
    group_offset: int | jax.Array | None = None,
    num_groups: int | None = None,
    preferred_element_type: jnp.dtype | None = None,
) -> jax.Array:
    """out[g] = lhs_g^T @ grad_g for each local group: [G_local, K, N] (empty groups give 0)."""
    _validate(lhs, grad, group_sizes, group_offset, rhs_groups=False)
    num_local = group_sizes.shape[0] if num_groups is None else num_groups
    if group_offset is None and num_local == group_sizes.shape[0]:
        sizes = group_sizes.astype(jnp.int32)
    else:
        sizes = _local_sizes_with_sentinels(group_sizes, group_offset, num_local)
    out = _ragged_contract(lhs, grad, sizes, jnp.dtype(preferred_element_type or lhs.dtype))
    return out if sizes.shape[0] == num_local else out[1:-1]


# JAX cannot differentiate ragged_dot_general with a ragged contracting dimension, so the
# reference spells out its VJP with two ragged_dots (same maths as gmm's backward).
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ragged_contract(lhs, grad, sizes, out_dtype):
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    return jax.lax.ragged_dot_general(lhs, grad, sizes, dims, preferred_element_type=out_dtype)


def _ragged_contract_fwd(lhs, grad, sizes, out_dtype):
    return _ragged_contract(lhs, grad, sizes, out_dtype), (lhs, grad, sizes)


def _ragged_contract_bwd(out_dtype, res, dout):
    lhs, grad, sizes = res
    dlhs = jax.lax.ragged_dot(
        grad, dout.transpose(0, 2, 1), sizes, preferred_element_type=lhs.dtype
    )
    dgrad = jax.lax.ragged_dot(lhs, dout, sizes, preferred_element_type=grad.dtype)
    return dlhs, dgrad, None


_ragged_contract.defvjp(_ragged_contract_fwd, _ragged_contract_bwd)


# ---------------------------------------------------------------------------------------------
# GPU (Pallas Triton) kernels.
#
# gmm: rows are sorted by group, so each group is a contiguous row range that may start and end
# inside an m-tile. A "work item" is one (group, m-tile) pair that overlaps; there are at most
# cdiv(M, tm) + G - 1 of them, a static bound, so the grid is static and the unused items idle.
# A tile shared by two groups is computed twice, each time with its own group's weights, and each
# program stores only its group's rows (masked store), so no program overwrites another's rows.


@dataclasses.dataclass(frozen=True)
class _Tiling:
    tm: int
    tk: int
    tn: int
    interpret: bool
    num_stages: int = 3

    def compiler_params(self):
        # A 128x128 fp32 accumulator is 64 registers per thread over 8 warps; smaller tiles need 4.
        num_warps = 8 if self.tm * self.tn >= 128 * 128 else 4
        return plgpu.CompilerParams(num_warps=num_warps, num_stages=self.num_stages)


def _work_items(starts, ends, num_items: int, tm: int):
    sizes = ends - starts
    first = starts // tm
    tiles = jnp.where(sizes > 0, (ends - 1) // tm - first + 1, 0)
    cum = jnp.cumsum(tiles)
    w = jnp.arange(num_items, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(cum, w, side="right"), starts.shape[0] - 1)
    tile = first[group] + w - (cum[group] - tiles[group])
    active = (w < cum[-1]).astype(jnp.int32)
    return group.astype(jnp.int32), tile.astype(jnp.int32), active


def _gmm_kernel(
    group_ref,
    tile_ref,
    active_ref,
    starts_ref,
    ends_ref,
    lhs_ref,
    rhs_ref,
    _,
    out_ref,
    *,
    t: _Tiling,
    k: int,
    transpose_rhs: bool,
):
    w, nt = pl.program_id(0), pl.program_id(1)

    @pl.when(active_ref[w] == 1)
    def _():
        g = group_ref[w]
        row0 = pl.multiple_of(tile_ref[w] * t.tm, t.tm)
        col0 = pl.multiple_of(nt * t.tn, t.tn)

        def body(kb, acc):
            k0 = pl.multiple_of(kb * t.tk, t.tk)
            a = lhs_ref[pl.ds(row0, t.tm), pl.ds(k0, t.tk)]
            if transpose_rhs:  # rhs [G, N, K]
                b = rhs_ref[g, pl.ds(col0, t.tn), pl.ds(k0, t.tk)]
                dims = (((1,), (1,)), ((), ()))
            else:
                b = rhs_ref[g, pl.ds(k0, t.tk), pl.ds(col0, t.tn)]
                dims = (((1,), (0,)), ((), ()))
            return acc + jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, k // t.tk, body, jnp.zeros((t.tm, t.tn), jnp.float32))
        rows = row0 + jnp.arange(t.tm)
        in_group = (rows >= starts_ref[g]) & (rows < ends_ref[g])
        plgpu.store(
            out_ref.at[pl.ds(row0, t.tm), pl.ds(col0, t.tn)],
            acc.astype(out_ref.dtype),
            mask=jnp.broadcast_to(in_group[:, None], acc.shape),
        )


def _pad_to(x, axis: int, multiple: int):
    extra = _dispatch.round_up(x.shape[axis], multiple) - x.shape[axis]
    if not extra:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return jnp.pad(x, pad)


def _gmm_gpu(lhs, rhs, starts, ends, out_dtype, t: _Tiling, transpose_rhs: bool):
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    lhs = _pad_to(_pad_to(lhs, 0, t.tm), 1, t.tk)
    rhs = _pad_to(_pad_to(rhs, 2 if transpose_rhs else 1, t.tk), 1 if transpose_rhs else 2, t.tn)
    mp, kp = lhs.shape
    np_ = _dispatch.round_up(n, t.tn)
    num_items = mp // t.tm + starts.shape[0] - 1
    meta = (*_work_items(starts, ends, num_items, t.tm), starts, ends)
    # Rows in no local group (other shards' groups, or past sum(group_sizes)) stay zero: the output
    # starts as zeros (aliased) and only in-group rows are ever stored.
    zeros = jnp.zeros((mp, np_), out_dtype)
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, t=t, k=kp, transpose_rhs=transpose_rhs),
        grid=(num_items, np_ // t.tn),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        input_output_aliases={7: 0},
        compiler_params=t.compiler_params(),
        interpret=t.interpret,
        name="gmm",
    )(*meta, lhs, rhs, zeros)
    return out[:m, :n]


def _tgmm_kernel(starts_ref, ends_ref, lhs_ref, grad_ref, out_ref, *, t: _Tiling):
    g, kt, nt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = starts_ref[g], ends_ref[g]
    k0 = pl.multiple_of(kt * t.tk, t.tk)
    n0 = pl.multiple_of(nt * t.tn, t.tn)

    def body(i, acc):
        row0 = start + i * t.tm  # groups start anywhere: the row blocks are not tile-aligned
        rows = row0 + jnp.arange(t.tm)
        a = lhs_ref[pl.ds(row0, t.tm), pl.ds(k0, t.tk)]
        b = grad_ref[pl.ds(row0, t.tm), pl.ds(n0, t.tn)]
        a = jnp.where((rows < end)[:, None], a, jnp.zeros_like(a))
        dims = (((0,), (0,)), ((), ()))
        return acc + jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(
        0, pl.cdiv(end - start, t.tm), body, jnp.zeros((t.tk, t.tn), jnp.float32)
    )
    out_ref[...] = acc.astype(out_ref.dtype)


def _tgmm_gpu(lhs, grad, starts, ends, out_dtype, t: _Tiling):
    m, k = lhs.shape
    n = grad.shape[1]
    num_local = starts.shape[0]
    # tm spare zero rows let the last, unaligned row block of a group be read without clamping.
    lhs = jnp.pad(_pad_to(lhs, 1, t.tk), ((0, t.tm), (0, 0)))
    grad = jnp.pad(_pad_to(grad, 1, t.tn), ((0, t.tm), (0, 0)))
    kp, np_ = lhs.shape[1], grad.shape[1]
    out = pl.pallas_call(
        functools.partial(_tgmm_kernel, t=t),
        grid=(num_local, kp // t.tk, np_ // t.tn),
        in_specs=[
            pl.BlockSpec((num_local,), lambda g, i, j: (0,)),
            pl.BlockSpec((num_local,), lambda g, i, j: (0,)),
            pl.BlockSpec(lhs.shape, lambda g, i, j: (0, 0)),
            pl.BlockSpec(grad.shape, lambda g, i, j: (0, 0)),
        ],
        out_specs=pl.BlockSpec((_SQ, t.tk, t.tn), lambda g, i, j: (g, i, j)),
        out_shape=jax.ShapeDtypeStruct((num_local, kp, np_), out_dtype),
        compiler_params=t.compiler_params(),
        interpret=t.interpret,
        name="tgmm",
    )(starts, ends, lhs, grad)
    return out[:, :k, :n]


# ---------------------------------------------------------------------------------------------
# TPU: JAX's megablox kernels. They leave rows outside the local groups unwritten, so those rows
# are zeroed here.


def _megablox():
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _tpu_tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    def tile(x, pref):
        return next((s for s in (pref, 256, 128) if s <= pref and x % s == 0), x)

    return min(512, _dispatch.round_up(m, 128)), tile(k, 512), tile(n, 512)


def _gmm_tpu(lhs, rhs, group_sizes, offset, num_local, out_dtype, interpret, transpose_rhs):
    m = lhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tiling = _tpu_tiling(m, lhs.shape[1], n)
    out = _megablox().gmm(
        _pad_to(lhs, 0, tiling[0]),  # megablox needs M % tm == 0; padded rows are in no group
        rhs,
        group_sizes.astype(jnp.int32),
        preferred_element_type=out_dtype,
        tiling=tiling,
        group_offset=offset,
        transpose_rhs=transpose_rhs,
        interpret=interpret,
    )
    starts, ends = _local_bounds(group_sizes, offset, num_local)
    rows = jnp.arange(m)
    in_shard = (rows >= starts[0]) & (rows < ends[-1])
    return jnp.where(in_shard[:, None], out[:m], 0).astype(out_dtype)


def _tgmm_tpu(lhs, grad, group_sizes, offset, num_local, out_dtype, interpret):
    m, k = lhs.shape
    tiling = _tpu_tiling(m, k, grad.shape[1])
    return (
        _megablox()
        .tgmm(
            _pad_to(lhs, 0, tiling[0]).T,
            _pad_to(grad, 0, tiling[0]),
            group_sizes.astype(jnp.int32),
            preferred_element_type=out_dtype,
            tiling=tiling,
            group_offset=offset,
            num_actual_groups=num_local,
            interpret=interpret,
        )
        .astype(out_dtype)
    )


# ---------------------------------------------------------------------------------------------
# Differentiable Pallas gmm / tgmm: the backward of one is built from the other.


@dataclasses.dataclass(frozen=True)
class _Plan:
    lowering: str
    tiling: _Tiling
    out_dtype: jnp.dtype


def _gmm_raw(lhs, rhs, group_sizes, offset, plan: _Plan, transpose_rhs=False, out_dtype=None):
    num_local = rhs.shape[0]
    out_dtype = plan.out_dtype if out_dtype is None else out_dtype
    if plan.lowering == "tpu":
        return _gmm_tpu(
            lhs,
            rhs,
            group_sizes,
            offset,
            num_local,
            out_dtype,
            plan.tiling.interpret,
            transpose_rhs,
        )
    starts, ends = _local_bounds(group_sizes, offset, num_local)
    return _gmm_gpu(lhs, rhs, starts, ends, out_dtype, plan.tiling, transpose_rhs)


def _tgmm_raw(lhs, grad, group_sizes, offset, num_local, plan: _Plan, out_dtype=None):
    out_dtype = plan.out_dtype if out_dtype is None else out_dtype
    if plan.lowering == "tpu":
        return _tgmm_tpu(
            lhs, grad, group_sizes, offset, num_local, out_dtype, plan.tiling.interpret
        )
    starts, ends = _local_bounds(group_sizes, offset, num_local)
    return _tgmm_gpu(lhs, grad, starts, ends, out_dtype, plan.tiling)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _gmm_pallas(lhs, rhs, group_sizes, offset, plan: _Plan):
    return _gmm_raw(lhs, rhs, group_sizes, offset, plan)


def _gmm_pallas_fwd(lhs, rhs, group_sizes, offset, plan):
    return _gmm_raw(lhs, rhs, group_sizes, offset, plan), (lhs, rhs, group_sizes, offset)


def _gmm_pallas_bwd(plan, res, dout):
    lhs, rhs, group_sizes, offset = res
    # out_g = lhs_g @ rhs_g  =>  dlhs_g = dout_g @ rhs_g^T,  drhs_g = lhs_g^T @ dout_g.
    dlhs = _gmm_raw(dout, rhs, group_sizes, offset, plan, transpose_rhs=True, out_dtype=lhs.dtype)
    drhs = _tgmm_raw(lhs, dout, group_sizes, offset, rhs.shape[0], plan, out_dtype=rhs.dtype)
    return dlhs, drhs, None, None


_gmm_pallas.defvjp(_gmm_pallas_fwd, _gmm_pallas_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _tgmm_pallas(lhs, grad, group_sizes, offset, num_local, plan: _Plan):
    return _tgmm_raw(lhs, grad, group_sizes, offset, num_local, plan)


def _tgmm_pallas_fwd(lhs, grad, group_sizes, offset, num_local, plan):
    out = _tgmm_raw(lhs, grad, group_sizes, offset, num_local, plan)
    return out, (lhs, grad, group_sizes, offset)


def _tgmm_pallas_bwd(num_local, plan, res, dout):
    lhs, grad, group_sizes, offset = res
    # out_g = lhs_g^T @ grad_g  =>  dlhs_g = grad_g @ dout_g^T,  dgrad_g = lhs_g @ dout_g.
    dlhs = _gmm_raw(grad, dout, group_sizes, offset, plan, transpose_rhs=True, out_dtype=lhs.dtype)
    dgrad = _gmm_raw(lhs, dout, group_sizes, offset, plan, out_dtype=grad.dtype)
    return dlhs, dgrad, None, None


_tgmm_pallas.defvjp(_tgmm_pallas_fwd, _tgmm_pallas_bwd)


def _plan(lowering, interpret, out_dtype, tiling, kernel) -> _Plan:
    tm, tk, tn = tiling
    for name, x in (("tm", tm), ("tk", tk), ("tn", tn)):
        if x < 16 or x & (x - 1):
            raise ValueError(f"{kernel}: tiling {name}={x} is not a power of 2 >= 16")
    return _Plan(
        lowering=_dispatch.resolve_lowering(lowering, kernel),
        tiling=_Tiling(tm, tk, tn, _dispatch.resolve_interpret(interpret)),
        out_dtype=jnp.dtype(out_dtype),
    )


def _offset_array(group_offset):
    return jnp.asarray(0 if group_offset is None else group_offset, jnp.int32).reshape(())


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    group_offset: int | jax.Array | None = None,
    impl: str = "auto",
    interpret: bool | None = None,
    preferred_element_type: jnp.dtype | None = None,
    lowering: str | None = None,
    tiling: tuple[int, int, int] = (128, 128, 64),
) -> jax.Array:
    """Grouped matmul: rows of lhs [M,K] in group g (groups are consecutive row ranges of sizes
    `group_sizes` [G]) times rhs[g - group_offset] [K,N] -> [M,N], like `jax.lax.ragged_dot`.

    rhs [G_local,K,N] may hold experts [offset, offset + G_local) of a larger group_sizes (expert
    sharding); rows of other groups and rows past sum(group_sizes) give zeros. Accumulates in
    fp32; the result has `preferred_element_type` (default lhs.dtype). Differentiable in lhs and
    rhs. impl: "auto" | "pallas" | "reference"; lowering "gpu" (this module's Triton kernel) or
    "tpu" (megablox), default by backend; tiling (tm, tk, tn) tunes the GPU kernel.
    """
    _validate(lhs, rhs, group_sizes, group_offset)
    if _dispatch.resolve_impl(impl, "gmm") == "reference":
        return gmm_reference(
            lhs,
            rhs,
            group_sizes,
            group_offset=group_offset,
            preferred_element_type=preferred_element_type,
        )
    out_dtype = lhs.dtype if preferred_element_type is None else preferred_element_type
    plan = _plan(lowering, interpret, out_dtype, tiling, "gmm")
    return _gmm_pallas(lhs, rhs, group_sizes, _offset_array(group_offset), plan)


def tgmm(
    lhs: jax.Array,
    grad: jax.Array,
    group_sizes: jax.Array,
    *,
    group_offset: int | jax.Array | None = None,
    num_groups: int | None = None,
    impl: str = "auto",
    interpret: bool | None = None,
    preferred_element_type: jnp.dtype | None = None,
    lowering: str | None = None,
    tiling: tuple[int, int, int] = (128, 128, 64),
) -> jax.Array:
    """Transposed grouped matmul: out[g] = lhs_g^T @ grad_g -> [G_local, K, N] for lhs [M,K],
    grad [M,N]; G_local = num_groups (default len(group_sizes)) groups from `group_offset`.

    This is gmm's weight gradient. Empty groups give zero matrices. Differentiable. impl, lowering
    and tiling as for `gmm`.
    """
    _validate(lhs, grad, group_sizes, group_offset, rhs_groups=False)
    num_local = group_sizes.shape[0] if num_groups is None else int(num_groups)
    if not 1 <= num_local <= group_sizes.shape[0]:
        raise ValueError(f"num_groups={num_groups} is not in [1, {group_sizes.shape[0]}]")
    if _dispatch.resolve_impl(impl, "tgmm") == "reference":
        return tgmm_reference(
            lhs,
            grad,
            group_sizes,
            group_offset=group_offset,
            num_groups=num_local,
            preferred_element_type=preferred_element_type,
        )
    out_dtype = lhs.dtype if preferred_element_type is None else preferred_element_type
    plan = _plan(lowering, interpret, out_dtype, tiling, "tgmm")
    return _tgmm_pallas(lhs, grad, group_sizes, _offset_array(group_offset), num_local, plan)

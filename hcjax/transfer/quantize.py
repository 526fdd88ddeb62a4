"""Quantise-on-sync: the learner trains in fp32/bf16, the replicas serve weights that went over
the wire in one byte per value (fp8 e4m3 or int8) with a float32 scale per block of the last axis.

Pure functions of arrays (jittable), plus the split of a parameter tree into the tree that
travels ("wire" tree: the quantised values at the leaf's path, the scales at `path + SCALE`)
and its join back into the served tree on the replica. The replica serves exactly
dequantize(quantize(w)) in its own parameter dtype, so the sampler's log-probs are those of the
served weights, and the train-inference gap the quantisation adds is what bench.precision
measures.

Formats (FORMATS), per block of `block` consecutive values of the last axis (the last block may
be partial; a block of zeros gets scale 0 and dequantises to zeros):
  fp8_e4m3  q = float8_e4m3fn(x / s), s = max|x| / 448 (round to nearest even; relative error
            <= 2^-4 for |x / s| >= 2^-6, absolute <= 2^-10 s below, in the subnormals)
  int8      q = round(x / s) in [-127, 127], s = max|x| / 127 (absolute error <= s / 2)
  bfloat16  a plain cast (no scales): bf16 serving of an fp32 learner, for comparison
A block holding NaN or Inf gets a non-finite scale, so it dequantises to non-finite values and
the replica's finite check (RolloutServer.update_weights) still refuses the version.

Which leaves: QUANTIZED_NAMES, the matmul kernels of attention and of the dense and expert MLPs
(the last path component before `value`). The embedding (also the tied output head), the
router, norms and biases stay in the learner's dtype: they are small, and the router's logits
decide the expert choice that routing replay records.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from hcjax.transfer.reshard_plan import path_str

__all__ = ["DEFAULT_BLOCK", "FORMATS", "QUANTIZED_NAMES", "SCALE", "check_format", "dequantize",
           "dequantize_tree", "quantize", "quantize_tree", "quantized_paths", "round_trip",
           "round_trip_tree",
           "wire_bytes"]

# format -> (value dtype on the wire, largest value of the grid; None: a cast without scales)
FORMATS: dict[str, tuple[Any, float | None]] = {
    "fp8_e4m3": (jnp.float8_e4m3fn, 448.0),
    "int8": (jnp.int8, 127.0),
    "bfloat16": (jnp.bfloat16, None),
}
DEFAULT_BLOCK = 128
SCALE = "#scale"  # suffix of a scale leaf's path in the wire tree
QUANTIZED_NAMES = ("wq", "wk", "wv", "wo", "w_up", "w_gate", "w_down", "w_out", "w_up_proj")


def check_format(fmt: str | None, block: int = DEFAULT_BLOCK) -> str | None:
    """`fmt` if it names a format (or is None: no quantisation); ValueError naming it if not."""
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"quantize={fmt!r} is not one of {sorted(FORMATS)} (or None)")
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"quant_block={block!r} must be a positive int")
    return fmt


def _blocks(x: jax.Array, block: int) -> jax.Array:
    """x [..., n] -> [..., ceil(n / block), block], the last block padded with zeros."""
    n = x.shape[-1]
    nb = -(-n // block)
    pad = [(0, 0)] * (x.ndim - 1) + [(0, nb * block - n)]
    return jnp.pad(x, pad).reshape(*x.shape[:-1], nb, block)


def quantize(x: jax.Array, fmt: str, block: int = DEFAULT_BLOCK
             ) -> tuple[jax.Array, jax.Array | None]:
    """(q, scale): q of x's shape in the format's dtype, scale float32 [..., ceil(n / block)]
    (None for bfloat16). x must have at least one axis."""
    check_format(fmt, block)
    dtype, qmax = FORMATS[fmt]
    if qmax is None:
        return x.astype(dtype), None
    if x.ndim < 1:
        raise ValueError(f"quantize needs an array with a last axis, got shape {x.shape}")
    xb = _blocks(x.astype(jnp.float32), block)
    scale = jnp.max(jnp.abs(xb), axis=-1) / jnp.float32(qmax)  # NaN/Inf propagate into it
    divisor = jnp.where(scale > 0, scale, jnp.float32(1.0))
    y = xb / divisor[..., None]
    if fmt == "int8":
        y = jnp.round(y)
    y = jnp.clip(y, -qmax, qmax)
    q = y.astype(dtype).reshape(*x.shape[:-1], -1)[..., : x.shape[-1]]
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array | None, block: int = DEFAULT_BLOCK,
               dtype: Any = jnp.float32) -> jax.Array:
    """float32(q) * scale per block, cast to `dtype` (the inverse of `quantize` up to its
    rounding)."""
    if scale is None:
        return q.astype(dtype)
    n = q.shape[-1]
    nb = -(-n // block)
    if tuple(scale.shape) != (*q.shape[:-1], nb):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match values {q.shape} "
                         f"with block {block}: expected {(*q.shape[:-1], nb)}")
    y = _blocks(q.astype(jnp.float32), block) * scale.astype(jnp.float32)[..., None]
    return y.reshape(*q.shape[:-1], -1)[..., :n].astype(dtype)


def round_trip(x: jax.Array, fmt: str | None, block: int = DEFAULT_BLOCK) -> jax.Array:
    """dequantize(quantize(x)) in x's dtype: the values a replica serves (x itself if fmt is
    None)."""
    if fmt is None:
        return x
    return dequantize(*quantize(x, fmt, block), block=block, dtype=x.dtype)


def _leaf_name(path: str) -> str:
    parts = path.split("/")
    if parts and parts[-1] == "value" and len(parts) > 1:
        return parts[-2]
    return parts[-1]


def quantized_paths(tree: Any, names: Iterable[str] = QUANTIZED_NAMES) -> list[str]:
    """Paths of the floating leaves of `tree` (arrays or ShapeDtypeStructs, at least 2-D) whose
    name is in `names`."""
    names = set(names)
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [path_str(k) for k, v in flat
            if _leaf_name(path_str(k)) in names and len(v.shape) >= 2
            and jnp.issubdtype(v.dtype, jnp.floating)]


def scale_sharding(sharding: Any, ndim: int) -> Any:
    """The sharding of a leaf's scales: its own, with the last (blocked) axis not split."""
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        return NamedSharding(sharding.mesh, PartitionSpec(*spec[:-1], None))
    return sharding


def wire_layout(tree: Any, fmt: str, block: int = DEFAULT_BLOCK,
                names: Iterable[str] = QUANTIZED_NAMES) -> dict[str, jax.ShapeDtypeStruct]:
    """The wire tree's leaves (path -> ShapeDtypeStruct with sharding) for a tree of arrays or
    ShapeDtypeStructs with shardings: what `quantize_tree` makes of it."""
    check_format(fmt, block)
    chosen = set(quantized_paths(tree, names))
    dtype, qmax = FORMATS[fmt]
    out = {}
    for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]:
        path, sharding = path_str(k), getattr(v, "sharding", None)
        if path not in chosen:
            out[path] = jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
            continue
        out[path] = jax.ShapeDtypeStruct(v.shape, np.dtype(dtype), sharding=sharding)
        if qmax is not None:
            shape = (*v.shape[:-1], -(-v.shape[-1] // block))
            out[path + SCALE] = jax.ShapeDtypeStruct(
                shape, np.dtype(np.float32),
                sharding=None if sharding is None else scale_sharding(sharding, len(shape)))
    return out


@functools.lru_cache(maxsize=64)
def _quantizer(fmt: str, block: int, chosen: frozenset[str], shardings: Any):
    def run(leaves: dict[str, jax.Array]) -> dict[str, jax.Array]:
        out = {}
        for path, x in leaves.items():
            if path not in chosen:
                out[path] = x
                continue
            q, scale = quantize(x, fmt, block)
            out[path] = q
            if scale is not None:
                out[path + SCALE] = scale
        return out

    return jax.jit(run, out_shardings=None if shardings is None else dict(shardings))


def _sharding_items(pairs: Iterable[tuple[str, Any]]) -> tuple[tuple[str, Any], ...] | None:
    """(path, sharding) pairs as a hashable cache key; None when any leaf has no sharding."""
    pairs = tuple(sorted(pairs, key=lambda kv: kv[0]))
    return None if any(s is None for _, s in pairs) else pairs


def quantize_tree(tree: Any, fmt: str, block: int = DEFAULT_BLOCK,
                  names: Iterable[str] = QUANTIZED_NAMES) -> dict[str, jax.Array]:
    """The wire tree of `tree` (path -> array): the chosen leaves quantised where they are (the
    sender's devices), their scales beside them, every other leaf as it is. One jitted call."""
    layout = wire_layout(tree, fmt, block, names)
    leaves = {path_str(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
    chosen = frozenset(quantized_paths(tree, names))
    shardings = _sharding_items((p, v.sharding) for p, v in layout.items())
    return _quantizer(fmt, block, chosen, shardings)(leaves)


@functools.lru_cache(maxsize=64)
def _dequantizer(block: int, scaled: frozenset[str], dtypes: tuple[tuple[str, str], ...],
                 shardings: Any):
    want = dict(dtypes)

    def run(wire: dict[str, jax.Array]) -> dict[str, jax.Array]:
        out = {}
        for path, dtype in want.items():
            scale = wire[path + SCALE] if path in scaled else None
            out[path] = dequantize(wire[path], scale, block, np.dtype(dtype))
        return out

    return jax.jit(run, out_shardings=None if shardings is None else dict(shardings))


def dequantize_tree(wire: Mapping[str, jax.Array], template: Any,
                    block: int = DEFAULT_BLOCK) -> Any:
    """The served tree (the structure, dtypes and shardings of `template`, a tree of arrays or
    ShapeDtypeStructs) from a wire tree that arrived on the replica's devices. One jitted call."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    paths = [path_str(k) for k, _ in flat]
    missing = sorted(set(paths) - set(wire))
    if missing:
        raise ValueError(f"the wire tree lacks leaves {missing}")
    scaled = frozenset(p for p in paths if p + SCALE in wire)
    dtypes = tuple((p, np.dtype(v.dtype).name) for p, (_, v) in zip(paths, flat, strict=True))
    shardings = _sharding_items(
        (p, getattr(v, "sharding", None)) for p, (_, v) in zip(paths, flat, strict=True))
    out = _dequantizer(block, scaled, dtypes, shardings)(dict(wire))
    return jax.tree_util.tree_unflatten(treedef, [out[p] for p in paths])


def wire_bytes(layout: Mapping[str, jax.ShapeDtypeStruct]) -> int:
    """Bytes of a wire layout (values and scales)."""
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in layout.values())


def round_trip_tree(tree: Any, fmt: str | None, block: int = DEFAULT_BLOCK,
                    names: Iterable[str] = QUANTIZED_NAMES) -> Any:
    """`tree` with the leaves a push quantises replaced by the values a replica serves
    (round_trip); every other leaf as it is. For references and benchmarks."""
    if fmt is None:
        return tree
    chosen = set(quantized_paths(tree, names))
    return jax.tree_util.tree_map_with_path(
        lambda k, x: round_trip(x, fmt, block) if path_str(k) in chosen else x, tree)

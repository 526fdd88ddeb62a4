"""Refuse non-finite weights: one pass over each floating tensor (host numpy or device arrays),
an error naming every tensor that holds NaN or Inf and how many values. Used wherever weights
come in or go out: Hugging Face loads, checkpoint restores, weight pushes, the climb's publish.
Knows nothing of models; sees arrays and pytrees of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["NonFiniteWeights", "check_finite", "check_finite_array", "nonfinite_counts"]


class NonFiniteWeights(ValueError):
    """Some tensors hold NaN or Inf values; the message names them and the counts."""


def _floating(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating)


def _describe(bad: Mapping[str, tuple[int, int]], what: str) -> str:
    shown = "; ".join(f"{name}: {count} of {size}" for name, (count, size) in list(bad.items())[:8])
    more = f"; and {len(bad) - 8} more" if len(bad) > 8 else ""
    return (f"{what}: {len(bad)} tensor(s) hold non-finite values (NaN/Inf): {shown}{more}")


def check_finite_array(name: str, x: np.ndarray, what: str) -> None:
    """Raise NonFiniteWeights if host array `x` (tensor `name`) holds NaN or Inf.

    One pass: a float sum (NaN and Inf propagate into it); only a sum that is not finite is
    followed by the exact count (a sum of finite weights overflowing is then told apart)."""
    if not _floating(x.dtype) or x.size == 0:
        return
    with np.errstate(over="ignore", invalid="ignore"):
        total = np.add.reduce(x, axis=None, dtype=np.float64 if x.dtype == np.float64
                              else np.float32)
    if np.isfinite(total):
        return
    count = int(x.size - np.count_nonzero(np.isfinite(x)))
    if count:
        raise NonFiniteWeights(_describe({name: (count, int(x.size))}, what))


@jax.jit
def _device_counts(leaves: list) -> jax.Array:
    return jnp.stack([jnp.sum(~jnp.isfinite(x), dtype=jnp.int32) for x in leaves])


def _path(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path)


def nonfinite_counts(tree: Any) -> dict[str, tuple[int, int]]:
    """{leaf path: (non-finite values, size)} for each floating leaf of `tree` (numpy or JAX
    arrays) that holds any; one jitted pass over the device arrays, one over the host ones."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    named = [(_path(path), leaf) for path, leaf in flat
             if hasattr(leaf, "dtype") and _floating(leaf.dtype) and leaf.size]
    # One jitted call per set of devices (a jit cannot mix arrays placed on different ones).
    groups: dict[tuple, list[tuple[str, jax.Array]]] = {}
    for n, x in named:
        if isinstance(x, jax.Array):
            groups.setdefault(tuple(sorted(d.id for d in x.sharding.device_set)), []).append((n, x))
    bad: dict[str, tuple[int, int]] = {}
    for on_device in groups.values():
        counts = np.asarray(jax.device_get(_device_counts([x for _, x in on_device])))
        bad.update({n: (int(c), int(x.size)) for (n, x), c in zip(on_device, counts) if c})
    for name, x in named:
        if not isinstance(x, jax.Array):
            try:
                check_finite_array(name, np.asarray(x), "")
            except NonFiniteWeights:
                bad[name] = (int(x.size - np.count_nonzero(np.isfinite(x))), int(x.size))
    return bad


def check_finite(tree: Any, what: str) -> None:
    """Raise NonFiniteWeights naming every floating leaf of `tree` with NaN or Inf values;
    `what` says whose weights they are (e.g. "checkpoint runs/x step 40")."""
    bad = nonfinite_counts(tree)
    if bad:
        raise NonFiniteWeights(_describe(bad, what))

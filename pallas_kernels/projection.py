"""A projection (x contracted with a weight over its leading axes) with a backward over flattened tokens.

The reference is the einsum under automatic differentiation; the "flat" form computes the same
value with a hand-written backward of plain 2-d matmuls, which pays on XLA:CPU. Must not import
hcjax.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import _dispatch

IMPLS = ("auto", "flat", "reference")


def _validate(x, w, n_in: int) -> None:
    if not 1 <= n_in <= min(x.ndim, w.ndim):
        raise ValueError(f"n_in={n_in} is not in [1, min(x.ndim={x.ndim}, w.ndim={w.ndim})]")
    if x.shape[x.ndim - n_in:] != w.shape[:n_in]:
        raise ValueError(f"x.shape={x.shape} does not end with w's first {n_in} axes "
                         f"{w.shape[:n_in]} (w.shape={w.shape})")


def project_reference(x: jax.Array, w: jax.Array, n_in: int = 1) -> jax.Array:
    """x [..., *in] contracted with w [*in, *out] over `in` (w's first `n_in` axes): [..., *out]."""
    _validate(x, w, n_in)
    return jnp.tensordot(x, w, axes=n_in)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _project_flat(x, w, n_in):
    return _project_flat_fwd(x, w, n_in)[0]


def _project_flat_fwd(x, w, n_in):
    lead, ins, outs = x.shape[: x.ndim - n_in], w.shape[:n_in], w.shape[n_in:]
    size_in = math.prod(ins)
    y = x.reshape(-1, size_in) @ w.reshape(size_in, -1)
    return y.reshape(*lead, *outs), (x, w)


def _project_flat_bwd(n_in, res, dy):
    """dx = dy Wᵀ and dW = xᵀ dy over tokens flattened to [N, in] and [N, out]: automatic
    differentiation of a batched einsum leaves XLA:CPU transposed copies of the activation
    gradients for the weight gradient; here it is one plain xᵀ @ dy."""
    x, w = res
    size_in = math.prod(w.shape[:n_in])
    x2, w2 = x.reshape(-1, size_in), w.reshape(size_in, -1)
    dy2 = dy.reshape(x2.shape[0], w2.shape[1])
    return (dy2 @ w2.T).reshape(x.shape), (x2.T @ dy2).reshape(w.shape)


_project_flat.defvjp(_project_flat_fwd, _project_flat_bwd)


def project(x: jax.Array, w: jax.Array, n_in: int = 1, *, impl: str = "auto") -> jax.Array:
    """x [..., *in] contracted with w [*in, *out] (its first `n_in` axes): [..., *out].

    impl: "auto" (`_dispatch.AUTO["project"]`: "flat" on every platform), "flat" (the hand-written
    backward over flattened tokens) or "reference" (the einsum under autodiff).
    """
    _validate(x, w, n_in)
    if _dispatch.choose(impl, "project", IMPLS) == "reference":
        return project_reference(x, w, n_in)
    return _project_flat(x, w, n_in)

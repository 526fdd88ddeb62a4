"""The dense SwiGLU MLP, (silu(x Wg) * x Wu) Wd, with a backward over flattened tokens.

The reference is the three matmuls under automatic differentiation; the "flat" form computes the
same value with a hand-written backward over tokens flattened to [N, .], which pays on XLA:CPU.
Must not import hcjax: the caller's sharding of the hidden activation comes in as a function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from pallas_kernels import _dispatch

IMPLS = ("auto", "flat", "reference")

Constrain = Callable[[jax.Array], jax.Array]


def _unconstrained(h: jax.Array) -> jax.Array:
    return h


def _validate(x, w_gate, w_up, w_down) -> None:
    d = x.shape[-1]
    if w_gate.ndim != 2 or w_gate.shape[0] != d or w_up.shape != w_gate.shape:
        raise ValueError(f"w_gate.shape={w_gate.shape} and w_up.shape={w_up.shape} are not "
                         f"both [d={d}, f]")
    if w_down.shape != w_gate.shape[::-1]:
        raise ValueError(f"w_down.shape={w_down.shape} is not [f={w_gate.shape[1]}, d={d}]")


def swiglu_reference(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                     constrain_hidden: Constrain = _unconstrained) -> jax.Array:
    """x [..., d] -> [..., d]; `constrain_hidden` places the [..., f] hidden (a sharding
    constraint, or nothing)."""
    _validate(x, w_gate, w_up, w_down)
    return constrain_hidden(jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _swiglu_flat(x, w_gate, w_up, w_down, constrain_hidden):
    return _swiglu_flat_fwd(x, w_gate, w_up, w_down, constrain_hidden)[0]


def _swiglu_flat_fwd(x, w_gate, w_up, w_down, constrain_hidden):
    gate, up = x @ w_gate, x @ w_up
    h = constrain_hidden(jax.nn.silu(gate) * up)
    return h @ w_down, (x, gate, up, w_gate, w_up, w_down)


def _swiglu_flat_bwd(constrain_hidden, res, dy):
    """The backward by hand, over tokens flattened to [N, .]: automatic differentiation of the
    batched einsums leaves XLA:CPU a transposed copy of each [N, F] hidden gradient (fused into
    silu's derivative, several times the cost of the matmul it feeds); here each weight
    gradient contracts a plain [N, .] pair and the transposes are of x and the small weights."""
    x, gate, up, w_gate, w_up, w_down = res
    lead = x.shape[:-1]
    x, gate, up, dy = (a.reshape(-1, a.shape[-1]) for a in (x, gate, up, dy))
    sig = jax.nn.sigmoid(gate)
    act = gate * sig
    d_h = constrain_hidden(dy @ w_down.T)
    d_up = d_h * act
    d_gate = d_h * up * (sig * (1 + gate * (1 - sig)))
    x_t = x.T
    dx = d_gate @ w_gate.T + d_up @ w_up.T
    return (dx.reshape(*lead, -1), x_t @ d_gate, x_t @ d_up, (act * up).T @ dy)


_swiglu_flat.defvjp(_swiglu_flat_fwd, _swiglu_flat_bwd)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
           constrain_hidden: Constrain = _unconstrained, impl: str = "auto") -> jax.Array:
    """SwiGLU MLP of x [..., d] with w_gate, w_up [d, f] and w_down [f, d], in x's dtype.

    `constrain_hidden` is applied to the [..., f] hidden in the forward and to its gradient
    (flattened to [N, f]) in the flat backward: the caller's sharding constraint, e.g. the hidden
    split over a tensor axis; it must be the identity in value. impl: "auto"
    (`_dispatch.AUTO["swiglu"]`: "flat" on every platform), "flat" (the hand-written backward) or
    "reference" (autodiff of the matmuls).
    """
    _validate(x, w_gate, w_up, w_down)
    if _dispatch.choose(impl, "swiglu", IMPLS) == "reference":
        return swiglu_reference(x, w_gate, w_up, w_down, constrain_hidden)
    return _swiglu_flat(x, w_gate, w_up, w_down, constrain_hidden)

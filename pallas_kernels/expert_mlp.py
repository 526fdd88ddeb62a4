"""The routed experts' MLP of a dropless MoE: the dense one-hot reference, the grouped form (sorted
assignments through `jax.lax.ragged_dot` or the Pallas `gmm`), and `expert_mlp`, which chooses
among them and the XLA forms tuned for CPU (`expert_mlp_tiled`: blocked, tiled;
`expert_mlp_capacity`: capacity).

Every form computes, per token n, sum_j gates[n, j] · MLP_{experts[n, j]}(x[n]), with
MLP_e(x) = act(x Wg_e + bg_e, x Wu_e + bu_e) Wo_e + bo_e. Expert ids equal to E (experts held
elsewhere under expert parallelism, gate 0) contribute nothing. No token is dropped. Must not
import hcjax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _dispatch
from pallas_kernels.expert_mlp_capacity import expert_mlp_capacity
from pallas_kernels.expert_mlp_tiled import (
    Activation,
    Weights,
    expert_mlp_blocked,
    expert_mlp_tiled,
)
from pallas_kernels.gmm import gmm

# "dense": the reference; "ragged": grouped on `lax.ragged_dot`; "pallas": grouped on the Pallas
# gmm; "blocked", "tiled", "capacity": the XLA forms of expert_mlp_tiled / expert_mlp_capacity.
IMPLS = ("auto", "dense", "ragged", "blocked", "tiled", "capacity", "pallas")


def _validate(x_nr, w, expert_nk, gates_nk) -> None:
    if x_nr.ndim != 2:
        raise ValueError(f"x.shape={x_nr.shape} is not [tokens, width]")
    for name in ("gate", "up", "out"):
        if name not in w:
            raise ValueError(f"expert weights have no {name!r} (keys: {sorted(w)})")
    e, r, f = w["gate"].shape
    if r != x_nr.shape[1] or w["up"].shape != (e, r, f) or w["out"].shape != (e, f, r):
        raise ValueError(f"expert weights gate {w['gate'].shape}, up {w['up'].shape}, out "
                         f"{w['out'].shape} are not [E, r={x_nr.shape[1]}, f] twice and [E, f, r]")
    if expert_nk.ndim != 2 or expert_nk.shape[0] != x_nr.shape[0]:
        raise ValueError(f"experts.shape={expert_nk.shape} is not [tokens={x_nr.shape[0]}, k]")
    if gates_nk.shape != expert_nk.shape:
        raise ValueError(f"gates.shape={gates_nk.shape} differs from experts.shape="
                         f"{expert_nk.shape}")


def dense_expert_mlp(x_nr: jax.Array, w: Weights, combine_ne: jax.Array,
                     act: Activation) -> jax.Array:
    """Every expert on every token, then the outputs weighted by combine [N, E] and summed."""
    g = jnp.einsum("nr,erf->nef", x_nr, w["gate"])
    u = jnp.einsum("nr,erf->nef", x_nr, w["up"])
    if "b_gate" in w:
        g, u = g + w["b_gate"][None], u + w["b_up"][None]
    y = jnp.einsum("nef,efr->ner", act(g, u), w["out"])
    if "b_out" in w:
        y = y + w["b_out"][None]
    return jnp.einsum("ne,ner->nr", combine_ne.astype(y.dtype), y)


def expert_mlp_reference(x_nr: jax.Array, w: Weights, expert_nk: jax.Array, gates_nk: jax.Array,
                         act: Activation) -> jax.Array:
    """The reference: `dense_expert_mlp` with the one-hot combine of the chosen experts' gates
    (an id of E has no one-hot column, so it adds nothing)."""
    num_experts = w["gate"].shape[0]
    combine = jnp.sum(jax.nn.one_hot(expert_nk, num_experts) * gates_nk[..., None], 1)
    return dense_expert_mlp(x_nr, w, combine, act)


def _take(x: jax.Array, rows: jax.Array) -> jax.Array:
    return x[rows]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gather_rows(x: jax.Array, order: jax.Array, inverse: jax.Array, k: int) -> jax.Array:
    """out[j] = x[order[j] // k] for x [N, r] and `order` a permutation of [0, N·k) (`inverse`
    its inverse): every row k times, permuted (an MoE's sort of its assignments by expert, or,
    with k = 1, the unsort). The gradient is the inverse gather summed over the k copies: a
    gather, where plain indexing's is a scatter-add (and an unsort's a scatter)."""
    return _take(x, order // k)


def _gather_rows_fwd(x, order, inverse, k):
    return _take(x, order // k), (order, inverse)


def _gather_rows_bwd(k, res, g):
    order, inverse = res
    dx = _take(g, inverse)
    if k > 1:
        dx = jnp.sum(dx.reshape(-1, k, dx.shape[-1]).astype(jnp.float32), 1).astype(g.dtype)
    return dx, None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def inverse_permutation(order: jax.Array) -> jax.Array:
    """inverse[order[j]] = j."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def expert_mlp_sorted(xs: jax.Array, w: Weights, group_sizes: jax.Array, act: Activation, *,
                      gmm_impl: str = "reference", interpret: bool | None = None) -> jax.Array:
    """The experts' MLP of rows already grouped by expert: rows [0, group_sizes[0]) go to expert
    0, the next group_sizes[1] to expert 1, ...; rows after the last group give zeros. Returns the
    rows' outputs [M, r] in the same order (no gate applied)."""
    num_experts = w["gate"].shape[0]

    def matmul(lhs, rhs):
        return gmm(lhs, rhs, group_sizes, impl=gmm_impl, interpret=interpret)

    g, u = matmul(xs, w["gate"]), matmul(xs, w["up"])
    if any(name in w for name in ("b_gate", "b_out")):
        ends = jnp.cumsum(group_sizes)
        row_expert = jnp.searchsorted(ends, jnp.arange(xs.shape[0]), side="right")
        valid = (row_expert < num_experts)[:, None]
        bias_index = jnp.minimum(row_expert, num_experts - 1)
    if "b_gate" in w:
        g = g + jnp.where(valid, w["b_gate"][bias_index], 0)
        u = u + jnp.where(valid, w["b_up"][bias_index], 0)
    ys = matmul(act(g, u), w["out"])
    if "b_out" in w:
        ys = ys + jnp.where(valid, w["b_out"][bias_index], 0)
    return ys


def expert_mlp_grouped(x_nr: jax.Array, w: Weights, expert_nk: jax.Array, gates_nk: jax.Array,
                       act: Activation, *, gmm_impl: str = "reference",
                       interpret: bool | None = None) -> jax.Array:
    """Dropless: sort assignments by expert, grouped matmuls (`gmm` with `gmm_impl`: "reference"
    is `lax.ragged_dot`, "pallas" the kernel: `expert_mlp_sorted`), unsort, gate-weighted sum.
    Ids == num_experts mark rows of no local group (expert parallelism): bincount drops them,
    the sort puts them last, the matmuls leave them zero and their gate is 0."""
    n, k = expert_nk.shape
    num_experts = w["gate"].shape[0]
    flat_expert = expert_nk.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    inverse = inverse_permutation(order)
    xs = gather_rows(x_nr, order, inverse, k)
    group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
    ys = expert_mlp_sorted(xs, w, group_sizes, act, gmm_impl=gmm_impl, interpret=interpret)
    y_nkr = gather_rows(ys, inverse, order, 1).reshape(n, k, -1)  # back in assignment order
    return jnp.einsum("nk,nkr->nr", gates_nk.astype(y_nkr.dtype), y_nkr)


def expert_mlp_impl(impl: str) -> str:
    """The form `expert_mlp` runs for `impl`: "auto" is `_dispatch.AUTO["expert_mlp"]` for the
    platform built for ("pallas" on GPU/TPU, "capacity" on CPU), except that under a context mesh
    of several devices with Auto axes it is "blocked" instead of "capacity": XLA partitions the
    blocked form, while the capacity form's overflow loop is one device's.

    Resolve "auto" outside any `shard_map`: inside one the mesh's axes are Manual, so it would
    read as one device.
    """
    chosen = _dispatch.choose(impl, "expert_mlp", IMPLS)
    if impl == "auto" and chosen == "capacity" and _dispatch.on_several_devices():
        return "blocked"
    return chosen


def expert_mlp(x_nr: jax.Array, w: Weights, expert_nk: jax.Array, gates_nk: jax.Array,
               act: Activation, *, impl: str = "auto", tile: int | None = None,
               capacity: int | None = None, overflow_tile: int = 16,
               interpret: bool | None = None) -> jax.Array:
    """Gate-weighted sum of the chosen experts' MLP outputs: x [N, r], w ("gate", "up" [E, r, f],
    "out" [E, f, r], optional biases "b_gate", "b_up" [E, f], "b_out" [E, r]), experts and gates
    [N, k], act(gate, up) -> hidden; returns [N, r].

    impl (`expert_mlp_impl`): "dense" (the reference, every expert on every token), "ragged"
    (`lax.ragged_dot`), "pallas" (the gmm kernel; `interpret` as for it), "blocked" and "tiled"
    (`tile` rows a tile, default by `blocked_tile` / `default_tile`), "capacity" (`capacity` rows
    an expert in the batched part, default `default_capacity`, overflow in `overflow_tile`-row
    tiles), or "auto". Differentiable in x, w and gates in every form.
    """
    _validate(x_nr, w, expert_nk, gates_nk)
    chosen = expert_mlp_impl(impl)
    if chosen == "dense":
        return expert_mlp_reference(x_nr, w, expert_nk, gates_nk, act)
    if chosen == "ragged":
        return expert_mlp_grouped(x_nr, w, expert_nk, gates_nk, act, gmm_impl="reference")
    if chosen == "pallas":
        return expert_mlp_grouped(x_nr, w, expert_nk, gates_nk, act, gmm_impl="pallas",
                                  interpret=interpret)
    if chosen == "blocked":
        return expert_mlp_blocked(x_nr, w, expert_nk, gates_nk, act, tile=tile)
    if chosen == "tiled":
        return expert_mlp_tiled(x_nr, w, expert_nk, gates_nk, act, tile=tile)
    return expert_mlp_capacity(x_nr, w, expert_nk, gates_nk, act, capacity=capacity,
                               tile=overflow_tile)

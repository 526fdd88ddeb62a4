"""The capacity dropless expert MLP: each expert's first C rows as one batched matmul over experts,
the rows past C in a loop over overflow tiles, with a hand-written backward; the fastest form on
one CPU device (`python -m hcjax.bench.moe`).

The reference is `pallas_kernels.expert_mlp.expert_mlp_reference`; `expert_mlp` chooses among the
forms. Weights as in `pallas_kernels.expert_mlp_tiled`. Must not import hcjax.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.expert_mlp_tiled import Activation, Weights, tile_backward, tile_forward


def default_capacity(assignments: int, num_experts: int) -> int:
    """Rows per expert of the capacity dispatch's batched part: the mean m plus sqrt(m) (one
    standard deviation of an expert's load under balanced random routing), rounded up to a
    multiple of 8. Measured by `python -m hcjax.bench.moe --capacities`: at E=64, k=8 (m = 256)
    C = 272 beat 256 (more overflow tiles) and 288 (more padding); at E=8, k=2 and E=64, k=2
    the same rule was best or within noise of it."""
    mean = assignments / num_experts
    return max(8, int(math.ceil((mean + math.sqrt(mean)) / 8)) * 8)


def capacity_layout(expert_nk, num_experts: int, capacity: int, tile: int):
    """Index arrays of the capacity dispatch (integers only; no activation is moved here).

    Assignment a = token·k + slot, in [0, A); A itself is the padding assignment (gate 0, the
    zero row appended to the tokens). Ids == num_experts (experts held elsewhere) belong to no
    expert. Returns
      slot_assign [E, C]: the assignment in each expert's first C rows (A where empty);
      slot_of [A]: each assignment's row in the flattened [E·C] batch (E·C if it is not there);
      row_assign [R]: the overflow rows, each expert's rows past C padded to whole tiles (A for
        padding); R is the static worst case;
      tile_expert [R / tile], used: the overflow tiles' experts and how many hold rows."""
    n, k = expert_nk.shape
    a = n * k
    flat = expert_nk.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    sorted_expert = flat[order]
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # drops ids == E
    start = jnp.cumsum(sizes) - sizes
    c = jnp.arange(capacity, dtype=jnp.int32)
    in_batch = c < sizes[:, None]
    slot_assign = jnp.where(in_batch, order[jnp.minimum(start[:, None] + c, a - 1)], a)
    start_ext = jnp.concatenate([start, jnp.sum(sizes, keepdims=True)])
    rank = jnp.arange(a, dtype=jnp.int32) - start_ext[sorted_expert]
    batched = (sorted_expert < num_experts) & (rank < capacity)
    slot_sorted = jnp.where(batched, sorted_expert * capacity + rank, num_experts * capacity)
    slot_of = jnp.zeros(a, jnp.int32).at[order].set(slot_sorted)
    over = jnp.maximum(sizes - capacity, 0)
    over_padded = (over + tile - 1) // tile * tile
    over_end = jnp.cumsum(over_padded)
    over_start = over_end - over_padded
    # Rows past C are at most A - C in all (one expert holding everything), plus each expert's
    # last tile's padding.
    rows = -(-(max(a - capacity, 0) + num_experts * (tile - 1)) // tile) * tile
    j = jnp.arange(rows, dtype=jnp.int32)
    e_j = jnp.minimum(jnp.searchsorted(over_end, j, side="right"), num_experts - 1)
    o = j - over_start[e_j]
    row_assign = jnp.where(o < over[e_j],
                           order[jnp.minimum(start[e_j] + capacity + o, a - 1)], a)
    tile_expert = e_j[::tile]
    return slot_assign, slot_of, row_assign, tile_expert, over_end[-1] // tile


def _batched_forward(x_ecr, w, act):
    """Every expert's first C rows through its MLP as batched matmuls: (y, gu) with gu the gate
    and up pre-activations side by side (before biases). Gate and up run as one matmul of twice
    the width, faster on CPU than two (measured 1.6x for [64, 256, 128] x [64, 128, 256])."""
    f = w["gate"].shape[-1]
    gu = jnp.einsum("ecr,erf->ecf", x_ecr, jnp.concatenate([w["gate"], w["up"]], -1))
    g, u = gu[..., :f], gu[..., f:]
    if "b_gate" in w:
        g, u = g + w["b_gate"][:, None], u + w["b_up"][:, None]
    y = jnp.einsum("ecf,efr->ecr", act(g, u), w["out"])
    if "b_out" in w:
        y = y + w["b_out"][:, None]
    return y, gu


def _take(a, index):
    """a[index] along the first axis, zeros where index is past the end (the layout's padding
    ids), so no padded copy of `a` is made."""
    return a.at[index].get(mode="fill", fill_value=0)


def _capacity_forward(x_nr, w, gates_nk, layout, act, tile):
    slot_assign, slot_of, row_assign, tile_expert, used = layout
    n, k = gates_nk.shape
    gates_a = gates_nk.reshape(-1)
    x_ecr = _take(x_nr, slot_assign // k)
    y_ecr, gu = _batched_forward(x_ecr, w, act)
    out_width = y_ecr.shape[-1]
    y_assign = _take(y_ecr.reshape(-1, out_width), slot_of).reshape(n, k, out_width)
    out = jnp.einsum("nk,nkr->nr", gates_nk.astype(y_assign.dtype), y_assign)

    def body(t, out):
        rows = jax.lax.dynamic_slice_in_dim(row_assign, t * tile, tile)
        tokens = rows // k
        y, _, _ = tile_forward(_take(x_nr, tokens), w, tile_expert[t], act)
        return out.at[tokens].add(_take(gates_a, rows)[:, None].astype(y.dtype) * y, mode="drop")

    out = jax.lax.fori_loop(0, used, body, out)
    return out, (x_ecr, y_assign, gu)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _capacity_mlp(x_nr, w, gates_nk, layout, act, tile):
    return _capacity_forward(x_nr, w, gates_nk, layout, act, tile)[0]


def _capacity_mlp_fwd(x_nr, w, gates_nk, layout, act, tile):
    out, saved = _capacity_forward(x_nr, w, gates_nk, layout, act, tile)
    return out, (x_nr, w, gates_nk, layout, saved)


def _capacity_mlp_bwd(act, tile, res, d_out):
    x_nr, w, gates_nk, layout, (x_ecr, y_assign, gu) = res
    slot_assign, slot_of, row_assign, tile_expert, used = layout
    n, k = gates_nk.shape
    width = x_nr.shape[-1]
    dt = y_assign.dtype
    d_out = d_out.astype(dt)
    gates_a = gates_nk.reshape(-1)
    # The batched part: every gradient a batched matmul, every move a gather.
    d_gates = jnp.sum(y_assign * d_out[:, None, :], -1).reshape(-1)
    dy = _take(gates_a, slot_assign)[..., None].astype(dt) * _take(d_out, slot_assign // k)
    # Gate and up apart from here on: the fused [.., 2f] derivative would cost a copy, or an
    # exp per output element (measured 4.7 ms of 29 at E=64, k=8).
    f = w["gate"].shape[-1]
    g, u = gu[..., :f], gu[..., f:]
    if "b_gate" in w:
        g, u = g + w["b_gate"][:, None], u + w["b_up"][:, None]
    h, act_vjp = jax.vjp(act, g, u)
    dg, du = act_vjp(jnp.einsum("ecr,efr->ecf", dy, w["out"]))
    dw = {"out": jnp.einsum("ecf,ecr->efr", h, dy),
          "gate": jnp.einsum("ecr,ecf->erf", x_ecr, dg),
          "up": jnp.einsum("ecr,ecf->erf", x_ecr, du)}
    if "b_gate" in w:
        dw.update(b_gate=jnp.sum(dg, 1), b_up=jnp.sum(du, 1), b_out=jnp.sum(dy, 1))
    dx_ecr = (jnp.einsum("ecf,erf->ecr", dg, w["gate"])
              + jnp.einsum("ecf,erf->ecr", du, w["up"]))
    dx = jnp.sum(_take(dx_ecr.reshape(-1, width), slot_of).reshape(n, k, width), 1)

    # The overflow tiles: recompute each tile's forward, add its gradients in place.
    def body(t, carry):
        dx, d_gates, dw = carry
        rows = jax.lax.dynamic_slice_in_dim(row_assign, t * tile, tile)
        tokens = rows // k
        e, x = tile_expert[t], _take(x_nr, tokens)
        y, g_t, u_t = tile_forward(x, w, e, act)
        d = _take(d_out, tokens)
        d_gates = d_gates.at[rows].add(jnp.sum(d * y, -1), mode="drop")
        d = _take(gates_a, rows)[:, None].astype(dt) * d
        dx_t, dw = tile_backward(x, w, e, g_t, u_t, d, act, dw)
        return dx.at[tokens].add(dx_t, mode="drop"), d_gates, dw

    dx, d_gates, dw = jax.lax.fori_loop(0, used, body, (dx, d_gates, dw))
    dw = {name: dw[name].astype(w[name].dtype) for name in w}
    return (dx.astype(x_nr.dtype), dw, d_gates.reshape(n, k).astype(gates_nk.dtype), None)


_capacity_mlp.defvjp(_capacity_mlp_fwd, _capacity_mlp_bwd)


def expert_mlp_capacity(x_nr: jax.Array, w: Weights, expert_nk: jax.Array, gates_nk: jax.Array,
                        act: Activation, capacity: int | None = None,
                        tile: int = 16) -> jax.Array:
    """Dropless with batched matmuls over experts: each expert's first `capacity` rows run as one
    [E, C] batch (no weight gathers, every matmul one batched op), the rows past C in a loop over
    `tile`-row overflow tiles, so no token is ever dropped. A hand-written backward moves rows
    with gathers only. With balanced routing the loop is short; the fastest form on one CPU
    device (`python -m hcjax.bench.moe`)."""
    n, k = expert_nk.shape
    num_experts = w["gate"].shape[0]
    capacity = capacity or default_capacity(n * k, num_experts)
    layout = capacity_layout(expert_nk, num_experts, capacity, tile)
    return _capacity_mlp(x_nr, w, gates_nk, layout, act, tile)

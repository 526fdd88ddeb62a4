"""Dropless expert MLPs over tiles of rows: the blocked and tiled forms, tuned for XLA.

Both sort the (token, expert) assignments by expert and pad each expert's rows to whole tiles, so
every tile belongs to one expert. "blocked" runs all tiles as batched matmuls against per-tile
gathers of the weights (XLA partitions it over a mesh); "tiled" loops over the tiles that hold
rows with a hand-written backward that adds each tile's weight gradients into its expert's (the
faster form on one CPU device). The reference is `pallas_kernels.expert_mlp.expert_mlp_reference`;
`expert_mlp` chooses among the forms. Weights `w` are a dict: "gate", "up" [E, r, f], "out"
[E, f, r], optionally biases "b_gate", "b_up" [E, f] and "b_out" [E, r]. Must not import hcjax.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

Weights = dict[str, jax.Array]
Activation = Callable[[jax.Array, jax.Array], jax.Array]  # act(gate, up) -> hidden


def blocked_tile(assignments: int, num_experts: int) -> int:
    """Rows per tile of the blocked dispatch (which computes the static worst case of padding,
    so the tile only trades weight gathers against batch size): the mean rows per expert rounded
    up to a power of two, within [8, 128]."""
    return int(min(128, max(8, 1 << max(0, (assignments // num_experts - 1).bit_length()))))


def default_tile(assignments: int, num_experts: int) -> int:
    """Rows per tile of the tiled dispatch: a quarter of the mean rows per expert (so the padding
    of each expert's last tile, half a tile on average, stays near an eighth of the work) as a
    power of two within [16, 128]. Measured on CPU by `python -m hcjax.bench.moe --tiles`: at
    E=64 smaller tiles win (padding), at E=8 the largest (fewer, larger matmuls)."""
    quarter = max(1, assignments // num_experts // 4)
    return int(min(128, max(16, 1 << (quarter.bit_length() - 1))))


def tile_layout(x_nr, expert_nk, num_experts: int, tile: int):
    """Assignments sorted by expert, each expert's rows padded to whole tiles.

    Returns (xs [rows, r], dest [N·k] row of each sorted assignment, order [N·k] the sort,
    tile_expert [num_tiles], used_tiles: tiles holding at least one assignment, a prefix).
    rows is the static worst case, N·k + E·(tile − 1) rounded up to tiles. Ids == num_experts
    (experts held elsewhere, gate 0) run as the last expert: every index stays in bounds and
    their output is multiplied by 0."""
    n, k = expert_nk.shape
    assignments = n * k
    flat_expert = jnp.minimum(expert_nk.reshape(-1), num_experts - 1)
    order = jnp.argsort(flat_expert, stable=True)
    sorted_expert = flat_expert[order]
    sizes = jnp.bincount(flat_expert, length=num_experts)
    padded = (sizes + tile - 1) // tile * tile
    start = jnp.cumsum(sizes) - sizes
    padded_end = jnp.cumsum(padded)
    dest = (padded_end - padded)[sorted_expert] + jnp.arange(assignments) - start[sorted_expert]
    rows = -(-(assignments + num_experts * (tile - 1)) // tile) * tile
    num_tiles = rows // tile
    xs = jnp.zeros((rows, x_nr.shape[-1]), x_nr.dtype).at[dest].set(x_nr[order // k])
    tile_expert = jnp.searchsorted(padded_end, jnp.arange(num_tiles) * tile, side="right")
    tile_expert = jnp.minimum(tile_expert, num_experts - 1)  # trailing all-padding tiles
    return xs, dest, order, tile_expert, padded_end[-1] // tile


def combine_tiles(y_rows, dest, order, gates_nk):
    """Tile rows back to assignments, then the gate-weighted sum over each token's k experts."""
    n, k = gates_nk.shape
    out_width = y_rows.shape[-1]
    y_assign = jnp.zeros((n * k, out_width), y_rows.dtype).at[order].set(y_rows[dest])
    return jnp.einsum("nk,nkr->nr", gates_nk.astype(y_rows.dtype),
                      y_assign.reshape(n, k, out_width))


def expert_mlp_blocked(x_nr: jax.Array, w: Weights, expert_nk: jax.Array, gates_nk: jax.Array,
                       act: Activation, tile: int | None = None) -> jax.Array:
    """Dropless with dense batched matmuls: each expert's rows are padded to whole tiles, every tile
    belongs to one expert and multiplies that expert's weights (gathered per tile). Padding is at
    most tile-1 rows per expert, so no token is ever dropped; XLA can partition it over a mesh."""
    n, k = expert_nk.shape
    num_experts, width, _ = w["gate"].shape
    tile = tile or blocked_tile(n * k, num_experts)
    xs, dest, order, tile_expert, _ = tile_layout(x_nr, expert_nk, num_experts, tile)
    xt = xs.reshape(-1, tile, width)
    g = jnp.einsum("tbr,trf->tbf", xt, w["gate"][tile_expert])
    u = jnp.einsum("tbr,trf->tbf", xt, w["up"][tile_expert])
    if "b_gate" in w:
        g = g + w["b_gate"][tile_expert][:, None]
        u = u + w["b_up"][tile_expert][:, None]
    y = jnp.einsum("tbf,tfr->tbr", act(g, u), w["out"][tile_expert])
    if "b_out" in w:
        y = y + w["b_out"][tile_expert][:, None]
    return combine_tiles(y.reshape(xs.shape[0], -1), dest, order, gates_nk)


def tile_forward(x, w, e, act):
    """One tile [tile, r] through expert e's SwiGLU MLP: (y, g, u)."""
    g, u = x @ w["gate"][e], x @ w["up"][e]
    if "b_gate" in w:
        g, u = g + w["b_gate"][e], u + w["b_up"][e]
    y = act(g, u) @ w["out"][e]
    if "b_out" in w:
        y = y + w["b_out"][e]
    return y, g, u


def _tiles_forward(xt, w, tile_expert, used, act):
    tiles, tile, _ = xt.shape
    f, out_width = w["out"].shape[1:]

    def body(t, carry):
        y_all, g_all, u_all = carry
        y, g, u = tile_forward(xt[t], w, tile_expert[t], act)
        return y_all.at[t].set(y), g_all.at[t].set(g), u_all.at[t].set(u)

    init = (jnp.zeros((tiles, tile, out_width), xt.dtype), jnp.zeros((tiles, tile, f), xt.dtype),
            jnp.zeros((tiles, tile, f), xt.dtype))
    return jax.lax.fori_loop(0, used, body, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _tiles_mlp(xt, w, tile_expert, used, act):
    return _tiles_forward(xt, w, tile_expert, used, act)[0]


def _tiles_mlp_fwd(xt, w, tile_expert, used, act):
    y, g, u = _tiles_forward(xt, w, tile_expert, used, act)
    return y, (xt, w, tile_expert, used, g, u)


def tile_backward(x, w, e, g, u, d, act, dw):
    """One tile's backward through expert e's MLP, given its gate/up pre-activations g, u and
    output gradient d: (dx, dw with the tile's weight gradients added into expert e's)."""
    h, act_vjp = jax.vjp(act, g, u)
    dg, du = act_vjp(d @ w["out"][e].T)
    dw = dict(dw)
    dw["out"] = dw["out"].at[e].add(h.T @ d)
    dw["gate"] = dw["gate"].at[e].add(x.T @ dg)
    dw["up"] = dw["up"].at[e].add(x.T @ du)
    if "b_gate" in w:
        dw["b_gate"] = dw["b_gate"].at[e].add(jnp.sum(dg, 0))
        dw["b_up"] = dw["b_up"].at[e].add(jnp.sum(du, 0))
        dw["b_out"] = dw["b_out"].at[e].add(jnp.sum(d, 0))
    return dg @ w["gate"][e].T + du @ w["up"][e].T, dw


def _tiles_mlp_bwd(act, res, dy):
    xt, w, tile_expert, used, g_all, u_all = res

    def body(t, carry):
        dx_all, dw = carry
        dx, dw = tile_backward(xt[t], w, tile_expert[t], g_all[t], u_all[t], dy[t], act, dw)
        return dx_all.at[t].set(dx), dw

    init = (jnp.zeros_like(xt), jax.tree.map(jnp.zeros_like, w))
    dx, dw = jax.lax.fori_loop(0, used, body, init)
    return dx, dw, None, None


_tiles_mlp.defvjp(_tiles_mlp_fwd, _tiles_mlp_bwd)


def expert_mlp_tiled(x_nr: jax.Array, w: Weights, expert_nk: jax.Array, gates_nk: jax.Array,
                     act: Activation, tile: int | None = None) -> jax.Array:
    """Dropless, the blocked layout without the per-tile weight gathers: a loop over the tiles
    that hold assignments (the all-padding tail of the static worst case is skipped), each tile
    multiplying its expert's weights in place, with a hand-written backward loop that adds each
    tile's weight gradients into its expert's. The fastest form on one CPU device (2x the
    blocked one at E=64, k=8; `python -m hcjax.bench.moe`); one device's loop, so under a
    multi-device mesh "auto" keeps the blocked form, which XLA partitions."""
    n, k = expert_nk.shape
    num_experts, width, _ = w["gate"].shape
    tile = tile or default_tile(n * k, num_experts)
    xs, dest, order, tile_expert, used = tile_layout(x_nr, expert_nk, num_experts, tile)
    y = _tiles_mlp(xs.reshape(-1, tile, width), w, tile_expert, used, act)
    return combine_tiles(y.reshape(xs.shape[0], -1), dest, order, gates_nk)

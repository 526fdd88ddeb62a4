"""Mixture-of-experts layers: MAI's LatentMoE (RECIPE §2) and the open families' plain experts.

LatentMoE down-projects, routes in fp32, runs the experts in the latent space and up-projects;
plain experts (Qwen3-MoE, GPT-OSS, DeepSeek-V3) run on the model width, optionally with biases and
GPT-OSS's clamped SwiGLU, plus DeepSeek's always-on shared experts. Routers: softmax over experts
(top-k, optionally renormalised over the chosen ones; GPT-OSS's logit bias), or DeepSeek's sigmoid
scores with a choice-only correction bias, grouped top-k and a routed scaling factor.

Dispatch is dropless: the (token, expert) assignments are sorted by expert and run as grouped
matmuls over variable-size groups (`jax.lax.ragged_dot`, or our Pallas `gmm`, or "blocked": groups
padded to whole tiles and run as batched dense matmuls, or "tiled": the same tiles in a loop that
skips the padding tail, or "capacity": each expert's first C rows as one batched matmul over
experts and the rows past C in a loop over overflow tiles, the fast path on one CPU device); no
token is dropped. A dense one-hot path computes every expert for every token and is the reference
in tests. The router can be forced to given experts (routing replay); the gates then still come
from the current router logits at those experts, so the router keeps its gradient.

Expert parallelism (`ModelConfig.expert_parallel`): the routed experts run under `jax.shard_map`
over the context mesh's expert axis, each device holding E/n of them; see `_expert_parallel`. The
mesh is the one the caller entered with `jax.set_mesh(mesh)` (read at trace time through
`jax.sharding.get_abstract_mesh()`); with no mesh, or an expert axis of size 1, the global
dispatch above runs. Router, shared experts and statistics stay outside, on the global batch.

Load balance (global batch): per layer we return (token_counts[E], prob_sums[E], num_tokens) over
the valid tokens of the batch; the loss E·Σ_e f_e·P_e is formed from these sums, so statistics
summed over devices or micro-batches give exactly the global-batch loss.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from hcjax import sharding as shd
from hcjax.model.config import ModelConfig, use_pallas
from hcjax.model.layers import DenseMLP, param


def load_balance_loss(token_counts, prob_sums, num_tokens, experts_per_token: int):
    """E · Σ_e f_e · P_e with f_e the fraction of assignments to e and P_e its mean router prob."""
    num_experts = token_counts.shape[-1]
    n = jnp.maximum(num_tokens, 1.0)
    f = token_counts / (n * experts_per_token)
    p = prob_sums / n
    return num_experts * jnp.sum(f * p, axis=-1)


def load_balance_loss_from_stats(*stats_per_batch, experts_per_token: int):
    """Exact global-batch LB loss (mean over MoE layers) from the stats of several (micro-)batches.

    Each argument is a `ModelOutput.moe_stats` tuple (one (counts, prob_sums, n) per MoE layer).
    """
    if not stats_per_batch:
        raise ValueError("load_balance_loss_from_stats needs at least one stats tuple")
    num_layers = len(stats_per_batch[0])
    if num_layers == 0:
        return jnp.zeros((), jnp.float32)
    losses = []
    for layer in range(num_layers):
        counts = sum(s[layer][0] for s in stats_per_batch)
        probs = sum(s[layer][1] for s in stats_per_batch)
        n = sum(s[layer][2] for s in stats_per_batch)
        losses.append(load_balance_loss(counts, probs, n, experts_per_token))
    return jnp.mean(jnp.stack(losses))



def swiglu_act(g, u):
    return jax.nn.silu(g) * u


def clamped_swiglu_act(limit: float, alpha: float):
    """GPT-OSS's expert activation: gate clamped above, up clamped both ways, (u + 1)·g·σ(αg)."""

    def act(g, u):
        g = jnp.minimum(g, limit)
        u = jnp.clip(u, -limit, limit)
        return (u + 1) * (g * jax.nn.sigmoid(g * alpha))

    return act


def _expert_mlp_dense(x_nr, w, combine_ne, act):
    """Reference: every expert on every token, then a one-hot weighted combine."""
    g = jnp.einsum("nr,erf->nef", x_nr, w["gate"])
    u = jnp.einsum("nr,erf->nef", x_nr, w["up"])
    if "b_gate" in w:
        g, u = g + w["b_gate"][None], u + w["b_up"][None]
    y = jnp.einsum("nef,efr->ner", act(g, u), w["out"])
    if "b_out" in w:
        y = y + w["b_out"][None]
    return jnp.einsum("ne,ner->nr", combine_ne.astype(y.dtype), y)


def _expert_mlp_grouped(x_nr, w, expert_nk, gates_nk, act, matmul):
    """Dropless: sort assignments by expert, grouped matmuls, unsort, gate-weighted sum."""
    n, k = expert_nk.shape
    num_experts = w["gate"].shape[0]
    flat_expert = expert_nk.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    token_of = order // k
    sorted_expert = flat_expert[order]
    xs = x_nr[token_of]
    group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
    g, u = matmul(xs, w["gate"], group_sizes), matmul(xs, w["up"], group_sizes)
    # Ids == num_experts mark rows of no local group (expert parallelism): bincount drops them,
    # the sort puts them last, the matmuls leave them zero and their gate is 0.
    bias_index = jnp.minimum(sorted_expert, num_experts - 1)
    if "b_gate" in w:
        g, u = g + w["b_gate"][bias_index], u + w["b_up"][bias_index]
    ys = matmul(act(g, u), w["out"], group_sizes)
    if "b_out" in w:
        ys = ys + w["b_out"][bias_index]
    y_sorted_back = jnp.zeros_like(ys).at[order].set(ys)
    y_nkr = y_sorted_back.reshape(n, k, -1)
    return jnp.einsum("nk,nkr->nr", gates_nk.astype(y_nkr.dtype), y_nkr)


def _blocked_tile(assignments: int, num_experts: int) -> int:
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


def _tile_layout(x_nr, expert_nk, num_experts: int, tile: int):
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


def _combine_tiles(y_rows, dest, order, gates_nk):
    """Tile rows back to assignments, then the gate-weighted sum over each token's k experts."""
    n, k = gates_nk.shape
    out_width = y_rows.shape[-1]
    y_assign = jnp.zeros((n * k, out_width), y_rows.dtype).at[order].set(y_rows[dest])
    return jnp.einsum("nk,nkr->nr", gates_nk.astype(y_rows.dtype),
                      y_assign.reshape(n, k, out_width))


def _expert_mlp_blocked(x_nr, w, expert_nk, gates_nk, act, tile: int | None = None):
    """Dropless with dense batched matmuls: each expert's rows are padded to whole tiles, every tile
    belongs to one expert and multiplies that expert's weights (gathered per tile). Padding is at
    most tile-1 rows per expert, so no token is ever dropped; XLA can partition it over a mesh."""
    n, k = expert_nk.shape
    num_experts, width, _ = w["gate"].shape
    tile = tile or _blocked_tile(n * k, num_experts)
    xs, dest, order, tile_expert, _ = _tile_layout(x_nr, expert_nk, num_experts, tile)
    xt = xs.reshape(-1, tile, width)
    g = jnp.einsum("tbr,trf->tbf", xt, w["gate"][tile_expert])
    u = jnp.einsum("tbr,trf->tbf", xt, w["up"][tile_expert])
    if "b_gate" in w:
        g = g + w["b_gate"][tile_expert][:, None]
        u = u + w["b_up"][tile_expert][:, None]
    y = jnp.einsum("tbf,tfr->tbr", act(g, u), w["out"][tile_expert])
    if "b_out" in w:
        y = y + w["b_out"][tile_expert][:, None]
    return _combine_tiles(y.reshape(xs.shape[0], -1), dest, order, gates_nk)


def _tile_forward(x, w, e, act):
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
        y, g, u = _tile_forward(xt[t], w, tile_expert[t], act)
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


def _tile_backward(x, w, e, g, u, d, act, dw):
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
        dx, dw = _tile_backward(xt[t], w, tile_expert[t], g_all[t], u_all[t], dy[t], act, dw)
        return dx_all.at[t].set(dx), dw

    init = (jnp.zeros_like(xt), jax.tree.map(jnp.zeros_like, w))
    dx, dw = jax.lax.fori_loop(0, used, body, init)
    return dx, dw, None, None


_tiles_mlp.defvjp(_tiles_mlp_fwd, _tiles_mlp_bwd)


def _expert_mlp_tiled(x_nr, w, expert_nk, gates_nk, act, tile: int | None = None):
    """Dropless, the blocked layout without the per-tile weight gathers: a loop over the tiles
    that hold assignments (the all-padding tail of the static worst case is skipped), each tile
    multiplying its expert's weights in place, with a hand-written backward loop that adds each
    tile's weight gradients into its expert's. The fastest form on one CPU device (2x the
    blocked one at E=64, k=8; `python -m hcjax.bench.moe`); one device's loop, so under a
    multi-device mesh "auto" keeps the blocked form, which XLA partitions."""
    n, k = expert_nk.shape
    num_experts, width, _ = w["gate"].shape
    tile = tile or default_tile(n * k, num_experts)
    xs, dest, order, tile_expert, used = _tile_layout(x_nr, expert_nk, num_experts, tile)
    y = _tiles_mlp(xs.reshape(-1, tile, width), w, tile_expert, used, act)
    return _combine_tiles(y.reshape(xs.shape[0], -1), dest, order, gates_nk)


def default_capacity(assignments: int, num_experts: int) -> int:
    """Rows per expert of the capacity dispatch's batched part: the mean m plus sqrt(m) (one
    standard deviation of an expert's load under balanced random routing), rounded up to a
    multiple of 8. Measured by `python -m hcjax.bench.moe --capacities`: at E=64, k=8 (m = 256)
    C = 272 beat 256 (more overflow tiles) and 288 (more padding); at E=8, k=2 and E=64, k=2
    the same rule was best or within noise of it."""
    mean = assignments / num_experts
    return max(8, int(math.ceil((mean + math.sqrt(mean)) / 8)) * 8)


def _capacity_layout(expert_nk, num_experts: int, capacity: int, tile: int):
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
        y, _, _ = _tile_forward(_take(x_nr, tokens), w, tile_expert[t], act)
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
        y, g_t, u_t = _tile_forward(x, w, e, act)
        d = _take(d_out, tokens)
        d_gates = d_gates.at[rows].add(jnp.sum(d * y, -1), mode="drop")
        d = _take(gates_a, rows)[:, None].astype(dt) * d
        dx_t, dw = _tile_backward(x, w, e, g_t, u_t, d, act, dw)
        return dx.at[tokens].add(dx_t, mode="drop"), d_gates, dw

    dx, d_gates, dw = jax.lax.fori_loop(0, used, body, (dx, d_gates, dw))
    dw = {name: dw[name].astype(w[name].dtype) for name in w}
    return (dx.astype(x_nr.dtype), dw, d_gates.reshape(n, k).astype(gates_nk.dtype), None)


_capacity_mlp.defvjp(_capacity_mlp_fwd, _capacity_mlp_bwd)


def _expert_mlp_capacity(x_nr, w, expert_nk, gates_nk, act, capacity: int | None = None,
                         tile: int = 16):
    """Dropless with batched matmuls over experts: each expert's first `capacity` rows run as one
    [E, C] batch (no weight gathers, every matmul one batched op), the rows past C in a loop over
    `tile`-row overflow tiles, so no token is ever dropped. A hand-written backward moves rows
    with gathers only. With balanced routing the loop is short; the fastest form on one CPU
    device (`python -m hcjax.bench.moe`)."""
    n, k = expert_nk.shape
    num_experts = w["gate"].shape[0]
    capacity = capacity or default_capacity(n * k, num_experts)
    layout = _capacity_layout(expert_nk, num_experts, capacity, tile)
    return _capacity_mlp(x_nr, w, gates_nk, layout, act, tile)


def _ragged_dot(lhs, rhs, group_sizes):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def _pallas_gmm(lhs, rhs, group_sizes):
    return pallas_kernels.gmm(lhs, rhs, group_sizes, impl="pallas")


def routed_experts_fn(impl: str):
    """The dropless expert computation for `moe_impl`: f(x [N, r], w, experts [N, k], gates [N, k],
    act) -> gate-weighted sum of the chosen experts' outputs [N, r]."""
    if impl == "dense":

        def dense(x_nr, w, expert_nk, gates_nk, act):
            num_experts = w["gate"].shape[0]
            combine = jnp.sum(jax.nn.one_hot(expert_nk, num_experts) * gates_nk[..., None], 1)
            return _expert_mlp_dense(x_nr, w, combine, act)

        return dense
    if impl == "capacity" or (impl == "auto" and not use_pallas("auto")
                              and _multi_device_mesh() is None):
        return _expert_mlp_capacity
    if impl == "tiled":
        return _expert_mlp_tiled
    if impl == "blocked" or (impl == "auto" and not use_pallas("auto")):
        return _expert_mlp_blocked
    matmul = _pallas_gmm if use_pallas(impl) else _ragged_dot
    return lambda x_nr, w, expert_nk, gates_nk, act: _expert_mlp_grouped(
        x_nr, w, expert_nk, gates_nk, act, matmul
    )


# ---------------------------------------------------------------------------------------------
# Expert parallelism. Inside `shard_map` each device holds tokens [n, r] (the batch split over the
# batch axes and the expert axis) and experts [E_loc = E/P, r, f_loc] (f split over the tensor
# axis). Both forms are dropless, so their receive buffers are sized for the worst case: every
# assignment of the P peers landing on one device (P·n·k rows, as many as an all-gather).


def _expert_parallel_mesh(cfg: ModelConfig):
    """The context mesh when `cfg.expert_parallel` is on and its expert axes have size > 1."""
    if cfg.expert_parallel == "none":
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    axes = _mesh_axes(mesh, shd.LOGICAL_RULES["experts"])
    if not axes or _axes_size(mesh, axes) == 1:
        return None
    return mesh


def _multi_device_mesh():
    """The context mesh if it has more than one device and Auto axes to split over, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 or not mesh.auto_axes else mesh


def _mesh_axes(mesh, target) -> tuple[str, ...]:
    """A rule's mesh axes (str, tuple or None) that exist in `mesh`, in order."""
    targets = (target,) if isinstance(target, str) else tuple(target or ())
    return tuple(a for a in targets if a in mesh.axis_names)


def _axes_size(mesh, axes) -> int:
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    return size


def _spec(mesh, *logical):
    """PartitionSpec of logical axes by the one rule table, keeping only `mesh`'s axes."""
    out = []
    for entry in shd.logical_to_spec(logical):
        kept = _mesh_axes(mesh, entry)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return jax.sharding.PartitionSpec(*out)


def _ragged_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                     *, axes, cap: int, native_ragged: bool):
    """`jax.lax.ragged_all_to_all` with one slice per peer (same contract: `output_offsets` say
    where the sent slices land on their receivers). XLA:CPU has no ragged all-to-all, so there
    (`native_ragged=False`) the slices are padded to `cap` rows, exchanged with a dense all_to_all
    and scattered into place: same result, P times the traffic."""

    def native(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        return jax.lax.ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
            axis_name=axes,
        )

    def padded(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        rows = jnp.arange(cap, dtype=jnp.int32)
        src = jnp.minimum(input_offsets[:, None] + rows, operand.shape[0] - 1)  # [P, cap]
        slices = jnp.where((rows < send_sizes[:, None])[..., None], operand[src], 0)
        slices = jax.lax.all_to_all(slices, axes, 0, 0, tiled=True)  # [P, cap, r], from each peer
        at = jax.lax.all_to_all(output_offsets, axes, 0, 0, tiled=True)
        dest = jnp.where(rows < recv_sizes[:, None], at[:, None] + rows, output.shape[0])
        flat = slices.reshape(-1, operand.shape[-1])
        return output.at[dest.reshape(-1)].set(flat, mode="drop")

    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    return native(*args) if native_ragged else padded(*args)


def _local_ids(expert_nk, first, num_local):
    """Global expert ids -> local ids in [0, num_local), num_local for experts held elsewhere."""
    local = expert_nk - first
    return jnp.where((local >= 0) & (local < num_local), local, num_local)


def _ep_all_gather(x_nr, expert_nk, gates_nk, w, act, mlp, axes):
    """Gather every peer's tokens, run the local experts on them, reduce-scatter the outputs."""
    num_local = w["gate"].shape[0]
    x_all = jax.lax.all_gather(x_nr, axes, axis=0, tiled=True)
    expert_all = jax.lax.all_gather(expert_nk, axes, axis=0, tiled=True)
    gates_all = jax.lax.all_gather(gates_nk, axes, axis=0, tiled=True)
    local = _local_ids(expert_all, jax.lax.axis_index(axes) * num_local, num_local)
    gates_all = jnp.where(local < num_local, gates_all, 0.0)
    y_all = mlp(x_all, w, local, gates_all, act)  # this device's experts' share of every token
    return jax.lax.psum_scatter(y_all, axes, scatter_dimension=0, tiled=True)


def _ep_all_to_all(x_nr, expert_nk, gates_nk, w, act, mlp, axes, num_peers, native_ragged):
    """Send each assignment to its expert's device, run the local experts, send the rows back."""
    n, k = expert_nk.shape
    num_local = w["gate"].shape[0]
    assignments = n * k
    flat = expert_nk.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # by expert, hence by destination device
    xs = x_nr[order // k]
    counts = jnp.bincount(flat, length=num_local * num_peers).reshape(num_peers, num_local)
    send = jnp.sum(counts, 1).astype(jnp.int32)
    start = (jnp.cumsum(send) - send).astype(jnp.int32)
    # Each destination learns how many rows of each of its experts come from us, and where they
    # start in our buffer (for the way back). Row j of `meta` is then about peer j.
    meta = jnp.concatenate([counts.astype(jnp.int32), start[:, None]], 1)
    meta = jax.lax.all_to_all(meta, axes, 0, 0, tiled=True)
    recv_counts, their_start = meta[:, :num_local], meta[:, num_local]
    recv = jnp.sum(recv_counts, 1)
    me = jax.lax.axis_index(axes)
    slot = jnp.arange(num_peers, dtype=jnp.int32) * assignments
    # Peer j's rows land in slot j of our buffer (assignments rows each), sorted by expert.
    buffer = jnp.zeros((num_peers * assignments, x_nr.shape[1]), x_nr.dtype)
    xr = _ragged_exchange(xs, buffer, start, send, jnp.full_like(send, me * assignments), recv,
                          axes=axes, cap=assignments, native_ragged=native_ragged)
    rows = jnp.arange(assignments)
    ends = jnp.cumsum(recv_counts, 1)
    local = jax.vmap(lambda e: jnp.searchsorted(e, rows, side="right"))(ends).reshape(-1, 1)
    yr = mlp(xr, w, local, (local < num_local).astype(gates_nk.dtype), act)
    back = jnp.zeros((assignments, yr.shape[1]), yr.dtype)
    ys = _ragged_exchange(yr, back, slot, recv, their_start, send, axes=axes, cap=assignments,
                          native_ragged=native_ragged)
    y_assign = jnp.zeros_like(ys).at[order].set(ys).reshape(n, k, -1)
    return jnp.einsum("nk,nkr->nr", gates_nk.astype(y_assign.dtype), y_assign)


def _sized_for_device(mlp, x_nr, expert_nk, w, rounds: int):
    """`mlp` for one device inside the expert-parallel `shard_map`. The exchanges hand the
    experts worst-case buffers (P times this device's rows, most of them empty), so the capacity
    form's batched part is sized for what this device's experts receive on average, its own
    n·k assignments per round, not for the buffer."""
    if mlp is not _expert_mlp_capacity:
        return mlp
    assignments = x_nr.shape[0] // rounds * expert_nk.shape[1]
    return functools.partial(mlp, capacity=default_capacity(assignments, w["gate"].shape[0]))


def _expert_parallel(mode, mesh, x_nr, w, expert_nk, gates_nk, act, mlp, chunks: int = 1):
    """The routed experts under `shard_map` over `mesh` (see the section comment above).

    Tokens are split over the batch axes and the expert axes; expert weights over the expert axis
    and (their hidden size) the tensor axis, as the logical rules place them, and are gathered
    over the others at the boundary. Outputs partial over the tensor axis are summed there. Tokens
    are padded (gate 0) to a multiple of the token shards (times `chunks`), so any batch size
    works. With chunks > 1 each device exchanges its tokens in that many sequential rounds
    (`lax.map`), so the worst-case receive buffer holds chunks-times fewer rows.
    """
    expert_axes = _mesh_axes(mesh, shd.LOGICAL_RULES["experts"])
    batch_axes = _mesh_axes(mesh, shd.LOGICAL_RULES["batch"])
    token_axes = batch_axes + tuple(a for a in expert_axes if a not in batch_axes)
    experts = "experts"
    if mode == "local":  # every expert on every device: no exchange, weights gathered
        expert_axes, experts = (), None
    num_peers = _axes_size(mesh, expert_axes)
    num_experts = w["gate"].shape[0]
    if num_experts % num_peers:
        raise ValueError(
            f"num_experts={num_experts} is not a multiple of the expert axes {expert_axes} "
            f"of total size {num_peers}"
        )
    n = x_nr.shape[0]
    shards = _axes_size(mesh, token_axes)
    chunks = chunks if mode == "all_to_all" else 1
    pad = -n % (shards * chunks)
    if pad:
        x_nr = jnp.pad(x_nr, ((0, pad), (0, 0)))
        expert_nk = jnp.pad(expert_nk, ((0, pad), (0, 0)))
        gates_nk = jnp.pad(gates_nk, ((0, pad), (0, 0)))
    P = jax.sharding.PartitionSpec
    tokens = P(token_axes or None, None)
    w_specs = {
        "gate": _spec(mesh, experts, None, "expert_mlp"),
        "up": _spec(mesh, experts, None, "expert_mlp"),
        "out": _spec(mesh, experts, "expert_mlp", None),
        "b_gate": _spec(mesh, experts, "expert_mlp"),
        "b_up": _spec(mesh, experts, "expert_mlp"),
    }
    tensor_axes = _mesh_axes(mesh, shd.LOGICAL_RULES["expert_mlp"])
    # The mesh's platform, not the default backend: a CPU host may compile for a TPU topology.
    device = getattr(mesh, "abstract_device", None)
    native_ragged = getattr(device, "platform", jax.default_backend()) != "cpu"

    def local(x, e, g, w):
        mlp_here = _sized_for_device(mlp, x, e, w, chunks if mode == "all_to_all" else 1)
        if mode == "local":
            y = mlp_here(x, w, e, g, act)
        elif mode == "all_gather":
            y = _ep_all_gather(x, e, g, w, act, mlp_here, expert_axes)
        elif chunks == 1:
            y = _ep_all_to_all(x, e, g, w, act, mlp_here, expert_axes, num_peers, native_ragged)
        else:
            split = lambda a: a.reshape(chunks, a.shape[0] // chunks, *a.shape[1:])  # noqa: E731
            y = jax.lax.map(
                lambda c: _ep_all_to_all(*c, w, act, mlp_here, expert_axes, num_peers, native_ragged),
                (split(x), split(e), split(g)))
            y = y.reshape(-1, y.shape[-1])
        return jax.lax.psum(y, tensor_axes) if tensor_axes else y

    y = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, {name: w_specs[name] for name in w}),
        out_specs=tokens,
        check_vma=False,  # Pallas calls inside carry no varying-axes types
    )(x_nr, expert_nk.astype(jnp.int32), gates_nk, w)
    return y[:n]


def route(cfg: ModelConfig, logits_ne, correction_e, expert_nk=None):
    """Chosen experts [N, k], their gates [N, k] and the router probabilities [N, E] (fp32).

    softmax: p = softmax(logits); top-k by logit; gates = p at the chosen experts, renormalised
    over them when `router_renormalize` (= softmax over the chosen logits).
    sigmoid (DeepSeek-V3): s = σ(logits); the choice uses s + correction bias, restricted to the
    best `router_topk_groups` groups (a group's score is the sum of its two best choice scores;
    experts outside them count 0); gates = s at the chosen experts, renormalised when asked.
    Both then scale by `routed_scaling`. A given `expert_nk` (routing replay) skips the choice; the
    gates still come from the current logits, so the router keeps its gradient.
    """
    k, num_experts = cfg.experts_per_token, cfg.num_experts
    if cfg.router_type == "softmax":
        probs = jax.nn.softmax(logits_ne, axis=-1)
        if expert_nk is None:
            _, expert_nk = jax.lax.top_k(logits_ne, k)
        if cfg.router_renormalize:
            gates = jax.nn.softmax(jnp.take_along_axis(logits_ne, expert_nk, -1), axis=-1)
        else:
            gates = jnp.take_along_axis(probs, expert_nk, -1)
    else:
        scores = jax.nn.sigmoid(logits_ne)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)  # for the load-balance statistics
        if expert_nk is None:
            choice = scores if correction_e is None else scores + correction_e
            if cfg.router_groups > 1:
                n = choice.shape[0]
                grouped = choice.reshape(n, cfg.router_groups, num_experts // cfg.router_groups)
                group_score = jnp.sum(jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0], -1)
                _, best = jax.lax.top_k(group_score, cfg.router_topk_groups)
                keep = jnp.sum(jax.nn.one_hot(best, cfg.router_groups, dtype=jnp.bool_), 1)
                choice = jnp.where(keep[:, :, None], grouped, 0.0).reshape(n, num_experts)
            _, expert_nk = jax.lax.top_k(choice, k)
        gates = jnp.take_along_axis(scores, expert_nk, -1)
        if cfg.router_renormalize:
            gates = gates / (jnp.sum(gates, axis=-1, keepdims=True) + 1e-20)
    return expert_nk, gates * cfg.routed_scaling, probs


class MoE(nnx.Module):
    """Routed experts (dropless) and optional shared experts; `moe_type` latent or plain.

    Returns (y [B, T, D], chosen experts [B, T, k], load-balance stats).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, e = cfg.d_model, cfg.num_experts
        self.latent = cfg.moe_type == "latent"
        r, f = (cfg.moe_latent_dim if self.latent else d), cfg.moe_d_ff
        width_axis = "latent" if self.latent else "embed"
        self.router = param(rngs, (d, e), ("embed", "router_experts"), std=d**-0.5)
        if cfg.router_bias:
            self.router_bias = param(rngs, (e,), ("router_experts",), value=0.0)
        if cfg.router_correction_bias:
            self.correction_bias = param(rngs, (e,), ("router_experts",), value=0.0)
        if self.latent:
            self.w_down = param(rngs, (d, r), ("embed", "latent"))
        self.w_gate = param(rngs, (e, r, f), ("experts", width_axis, "expert_mlp"), std=r**-0.5)
        self.w_up = param(rngs, (e, r, f), ("experts", width_axis, "expert_mlp"), std=r**-0.5)
        self.w_out = param(rngs, (e, f, r), ("experts", "expert_mlp", width_axis), std=f**-0.5)
        if cfg.expert_bias:
            self.b_gate = param(rngs, (e, f), ("experts", "expert_mlp"), value=0.0)
            self.b_up = param(rngs, (e, f), ("experts", "expert_mlp"), value=0.0)
            self.b_out = param(rngs, (e, r), ("experts", width_axis), value=0.0)
        if self.latent:
            self.w_up_proj = param(rngs, (r, d), ("latent", "embed"))
        if cfg.num_shared_experts:
            self.shared = DenseMLP(
                d, cfg.moe_d_ff * cfg.num_shared_experts, dtype=cfg.compute_dtype, rngs=rngs
            )
        self.cfg = cfg
        self.has_router_bias, self.has_correction = cfg.router_bias, cfg.router_correction_bias
        self.has_expert_bias, self.has_shared = cfg.expert_bias, bool(cfg.num_shared_experts)
        self.k = cfg.experts_per_token
        self.num_experts = e
        self.dtype = cfg.compute_dtype
        self.impl = cfg.moe_impl

    def __call__(self, x_btd, valid_bt, routing_btk=None):
        b, t, d = x_btd.shape
        dt = self.dtype
        x = x_btd.reshape(b * t, d)
        # Router in fp32 (RECIPE §2 numerics).
        logits = x.astype(jnp.float32) @ self.router[...]
        if self.has_router_bias:
            logits = logits + self.router_bias[...]
        replay = None
        if routing_btk is not None:
            if routing_btk.shape != (b, t, self.k):
                raise ValueError(
                    f"routing replay has shape {routing_btk.shape}, expected {(b, t, self.k)}"
                )
            replay = routing_btk.reshape(b * t, self.k).astype(jnp.int32)
        correction = self.correction_bias[...] if self.has_correction else None
        expert_nk, gates, probs = route(self.cfg, logits, correction, replay)

        h = x.astype(dt) @ self.w_down[...].astype(dt) if self.latent else x.astype(dt)
        w = {"gate": self.w_gate, "up": self.w_up, "out": self.w_out}
        if self.has_expert_bias:
            w.update(b_gate=self.b_gate, b_up=self.b_up, b_out=self.b_out)
        w = {name: v[...].astype(dt) for name, v in w.items()}
        act = swiglu_act
        if self.cfg.expert_activation == "clamped_swiglu":
            act = clamped_swiglu_act(self.cfg.swiglu_limit, self.cfg.swiglu_alpha)
        mlp = routed_experts_fn(self.impl)
        mode, mesh = self.cfg.expert_parallel, _expert_parallel_mesh(self.cfg)
        if mesh is None and use_pallas(self.impl):
            # A Pallas gmm cannot be partitioned by XLA: without expert parallelism it still runs
            # on each device's tokens under shard_map, every expert's weights on every device.
            mode, mesh = "local", _multi_device_mesh()
        if mesh is None:
            y = mlp(h, w, expert_nk, gates, act)
        else:
            # b_out is added once here, not on every tensor shard inside the shard_map.
            b_out = w.pop("b_out", None)
            y = _expert_parallel(mode, mesh, h, w, expert_nk, gates, act, mlp,
                                 chunks=self.cfg.expert_parallel_chunks)
            if b_out is not None:
                y = y + jnp.einsum("nk,nkr->nr", gates.astype(dt), b_out[expert_nk])
        if self.latent:
            y = y.astype(dt) @ self.w_up_proj[...].astype(dt)
        if self.has_shared:
            y = y.astype(dt) + self.shared(x)
        out = y.reshape(b, t, d)

        valid = valid_bt.reshape(b * t).astype(jnp.float32)
        counts = jnp.sum(jax.nn.one_hot(expert_nk, self.num_experts) * valid[:, None, None], (0, 1))
        stats = (jax.lax.stop_gradient(counts), jnp.sum(probs * valid[:, None], 0), jnp.sum(valid))
        return out, expert_nk.reshape(b, t, self.k), stats


LatentMoE = MoE  # the MAI flagship's MoE is this layer with moe_type="latent"

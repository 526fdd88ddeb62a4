"""Mixture-of-experts layers: MAI's LatentMoE (RECIPE §2) and the open families' plain experts.

LatentMoE down-projects, routes in fp32, runs the experts in the latent space and up-projects;
plain experts (Qwen3-MoE, GPT-OSS, DeepSeek-V3) run on the model width, optionally with biases and
GPT-OSS's clamped SwiGLU, plus DeepSeek's always-on shared experts. Routers: softmax over experts
(top-k, optionally renormalised over the chosen ones; GPT-OSS's logit bias), or DeepSeek's sigmoid
scores with a choice-only correction bias, grouped top-k and a routed scaling factor.

Dispatch is dropless: the routed experts' MLP is `pallas_kernels.expert_mlp`, in the form
`ModelConfig.moe_impl` names (grouped matmuls on `jax.lax.ragged_dot` or the Pallas `gmm`, the
XLA forms "blocked", "tiled" and "capacity", or the dense one-hot reference; "auto" by platform);
no token is dropped. The router can be forced to given experts (routing replay); the gates then
still come from the current router logits at those experts, so the router keeps its gradient.

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

import jax
import jax.numpy as jnp
from flax import nnx

from hcjax import sharding as shd
from hcjax.model.config import ModelConfig
from hcjax.model.layers import DenseMLP, param, project
from pallas_kernels import batch_invariant as bi
from pallas_kernels.expert_mlp import (
    expert_mlp,
    expert_mlp_impl,
    expert_mlp_sorted,
    gather_rows,
    inverse_permutation,
)
from pallas_kernels.expert_mlp_capacity import default_capacity


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



def correction_bias_step(bias_e: jax.Array, load_e: jax.Array, rate: float | jax.Array
                         ) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free balancing (outside the gradient), on the last axis:
    b_e ← b_e + u · sign(mean_e'(load_e') − load_e), u = `rate`, load = tokens routed to e.

    An over-loaded expert's choice score drops by u, an under-loaded one's rises; an expert at
    the mean load keeps its bias. Only the choice reads b (`route`), never the gates.
    """
    load = jnp.asarray(load_e, jnp.float32)
    delta = jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    return (bias_e + rate * delta).astype(bias_e.dtype)


def swiglu_act(g, u):
    return jax.nn.silu(g) * u


def clamped_swiglu_act(limit: float, alpha: float):
    """GPT-OSS's expert activation: gate clamped above, up clamped both ways, (u + 1)·g·σ(αg)."""

    def act(g, u):
        g = jnp.minimum(g, limit)
        u = jnp.clip(u, -limit, limit)
        return (u + 1) * (g * jax.nn.sigmoid(g * alpha))

    return act


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
    """`jax.lax.ragged_all_to_all` (same contract: N slices, N a multiple of the peers P, slice
    i going to peer i // (N / P); `output_offsets` say where the sent slices land on their
    receivers). XLA:CPU has no ragged all-to-all, so there (`native_ragged=False`) every slice is
    padded to `cap` rows, exchanged with a dense all_to_all and scattered into place: same result,
    more traffic."""

    def native(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        return jax.lax.ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
            axis_name=axes,
        )

    def padded(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        rows = jnp.arange(cap, dtype=jnp.int32)
        src = jnp.minimum(input_offsets[:, None] + rows, operand.shape[0] - 1)  # [N, cap]
        slices = jnp.where((rows < send_sizes[:, None])[..., None], operand[src], 0)
        slices = jax.lax.all_to_all(slices, axes, 0, 0, tiled=True)  # [N, cap, r], by sender
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


def _ep_all_to_all(x_nr, expert_nk, gates_nk, w, act, mlp, axes, num_peers, native_ragged,
                   gmm_impl=None):
    """Send each assignment to its expert's device, run the local experts, send the rows back.

    One slice per (peer, expert) each way, so the rows a device receives land grouped by its
    local experts (expert-major: expert 0's rows from peer 0, 1, ..., then expert 1's): the
    grouped matmuls (`gmm_impl`, "pallas" or "reference") run on the receive buffer as it is,
    with no sort or unsort of the worst-case-sized buffer (which XLA:TPU would gather and
    scatter as 32-bit words). Other forms get each row's local expert id instead."""
    n, k = expert_nk.shape
    num_local = w["gate"].shape[0]
    assignments = n * k
    flat = expert_nk.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # by expert, hence by destination device
    inverse = inverse_permutation(order)
    xs = gather_rows(x_nr, order, inverse, k)
    # counts[p, e]: our rows for expert e of peer p, at start[p, e] of xs.
    counts = jnp.bincount(flat, length=num_local * num_peers).astype(jnp.int32)
    start = (jnp.cumsum(counts) - counts).reshape(num_peers, num_local)
    counts = counts.reshape(num_peers, num_local)
    # Row s of each: about peer s (what it sends us, where it keeps them, where they land here).
    recv = jax.lax.all_to_all(counts, axes, 0, 0, tiled=True)
    their_start = jax.lax.all_to_all(start, axes, 0, 0, tiled=True)
    per_expert = jnp.sum(recv, 0)
    land = (jnp.cumsum(per_expert) - per_expert)[None, :] + jnp.cumsum(recv, 0) - recv
    land_there = jax.lax.all_to_all(land, axes, 0, 0, tiled=True)  # where ours land on peer p
    buffer = jnp.zeros((num_peers * assignments, x_nr.shape[1]), x_nr.dtype)
    xr = _ragged_exchange(xs, buffer, start.reshape(-1), counts.reshape(-1),
                          land_there.reshape(-1), recv.reshape(-1), axes=axes, cap=assignments,
                          native_ragged=native_ragged)
    if gmm_impl is not None:
        yr = expert_mlp_sorted(xr, w, per_expert, act, gmm_impl=gmm_impl)
    else:
        rows = jnp.arange(xr.shape[0])
        local = jnp.searchsorted(jnp.cumsum(per_expert), rows, side="right")[:, None]
        yr = mlp(xr, w, local, (local < num_local).astype(gates_nk.dtype), act)
    back = jnp.zeros((assignments, yr.shape[1]), yr.dtype)
    ys = _ragged_exchange(yr, back, land.reshape(-1), recv.reshape(-1), their_start.reshape(-1),
                          counts.reshape(-1), axes=axes, cap=assignments,
                          native_ragged=native_ragged)
    y_assign = gather_rows(ys, inverse, order, 1).reshape(n, k, -1)
    return jnp.einsum("nk,nkr->nr", gates_nk.astype(y_assign.dtype), y_assign)


def _expert_mlp_for_device(impl: str, x_nr, expert_nk, w, rounds: int):
    """The routed experts' MLP (`expert_mlp` in form `impl`) for one device inside the
    expert-parallel `shard_map`. The exchanges hand the experts worst-case buffers (P times this
    device's rows, most of them empty), so the capacity form's batched part is sized for what this
    device's experts receive on average, its own n·k assignments per round, not for the buffer."""
    capacity = None
    if impl == "capacity":
        assignments = x_nr.shape[0] // rounds * expert_nk.shape[1]
        capacity = default_capacity(assignments, w["gate"].shape[0])
    return functools.partial(expert_mlp, impl=impl, capacity=capacity)


def _expert_parallel(mode, mesh, x_nr, w, expert_nk, gates_nk, act, impl: str, chunks: int = 1):
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
    # The grouped forms run on the expert-major receive buffer directly (see _ep_all_to_all).
    gmm_impl = {"pallas": "pallas", "ragged": "reference"}.get(impl)

    def local(x, e, g, w):
        mlp_here = _expert_mlp_for_device(impl, x, e, w, chunks if mode == "all_to_all" else 1)
        if mode == "local":
            y = mlp_here(x, w, e, g, act)
        elif mode == "all_gather":
            y = _ep_all_gather(x, e, g, w, act, mlp_here, expert_axes)
        elif chunks == 1:
            y = _ep_all_to_all(x, e, g, w, act, mlp_here, expert_axes, num_peers, native_ragged,
                               gmm_impl)
        else:
            split = lambda a: a.reshape(chunks, a.shape[0] // chunks, *a.shape[1:])  # noqa: E731
            y = jax.lax.map(
                lambda c: _ep_all_to_all(*c, w, act, mlp_here, expert_axes, num_peers,
                                         native_ragged, gmm_impl),
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


def _matmul(x, w, tile: int | None):
    """x @ w, or its batch-invariant form in exact mode (`tile`)."""
    return x @ w if tile is None else project(x, w, tile=tile)


def exact_expert_mlp(x_nr, w, expert_nk, gates_nk, act, tile: int):
    """The routed experts' MLP in exact mode: each (token, expert) row through its expert's
    weights on a fixed tile of that expert's rows (`batch_invariant.grouped_project`), the k
    experts' outputs summed in choice order. A token's result does not depend on which other
    tokens share the call."""
    n, k = expert_nk.shape
    num_experts = w["gate"].shape[0]
    expert_a = expert_nk.reshape(n * k)
    x_ar = jnp.repeat(x_nr, k, axis=0)
    layout = bi.grouped_layout(expert_a, num_experts, tile)
    g = bi.grouped_project(x_ar, w["gate"], layout, tile=tile)
    u = bi.grouped_project(x_ar, w["up"], layout, tile=tile)
    if "b_gate" in w:
        g, u = g + w["b_gate"][expert_a], u + w["b_up"][expert_a]
    y = bi.grouped_project(act(g, u).astype(x_nr.dtype), w["out"], layout, tile=tile)
    if "b_out" in w:
        y = y + w["b_out"][expert_a]
    y_nkr = y.reshape(n, k, -1).astype(jnp.float32)
    return bi.ordered_sum(bi.product(gates_nk.astype(jnp.float32)[..., None], y_nkr),
                          axis=1).astype(
        x_nr.dtype)


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
    softmax = bi.softmax if cfg.batch_invariant else jax.nn.softmax
    total = bi.tree_sum if cfg.batch_invariant else jnp.sum
    if cfg.router_type == "softmax":
        probs = softmax(logits_ne, axis=-1)
        if expert_nk is None:
            _, expert_nk = jax.lax.top_k(logits_ne, k)
        if cfg.router_renormalize:
            gates = softmax(jnp.take_along_axis(logits_ne, expert_nk, -1), axis=-1)
        else:
            gates = jnp.take_along_axis(probs, expert_nk, -1)
    else:
        scores = jax.nn.sigmoid(logits_ne)
        probs = scores / total(scores, axis=-1)[:, None]  # for the load-balance statistics
        if expert_nk is None:
            choice = scores if correction_e is None else scores + correction_e
            if cfg.router_groups > 1:
                n = choice.shape[0]
                grouped = choice.reshape(n, cfg.router_groups, num_experts // cfg.router_groups)
                group_score = total(jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0], -1)
                _, best = jax.lax.top_k(group_score, cfg.router_topk_groups)
                keep = jnp.sum(jax.nn.one_hot(best, cfg.router_groups, dtype=jnp.bool_), 1)
                choice = jnp.where(keep[:, :, None], grouped, 0.0).reshape(n, num_experts)
            _, expert_nk = jax.lax.top_k(choice, k)
        gates = jnp.take_along_axis(scores, expert_nk, -1)
        if cfg.router_renormalize:
            gates = gates / (total(gates, axis=-1)[:, None] + 1e-20)
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
                d, cfg.moe_d_ff * cfg.num_shared_experts, dtype=cfg.compute_dtype,
                exact_tile=cfg.exact_tile, rngs=rngs
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
        tile = self.cfg.exact_tile
        # Router in fp32 (RECIPE §2 numerics).
        logits = _matmul(x.astype(jnp.float32), self.router[...], tile)
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

        h = _matmul(x.astype(dt), self.w_down[...].astype(dt), tile) if self.latent else (
            x.astype(dt))
        w = {"gate": self.w_gate, "up": self.w_up, "out": self.w_out}
        if self.has_expert_bias:
            w.update(b_gate=self.b_gate, b_up=self.b_up, b_out=self.b_out)
        w = {name: v[...].astype(dt) for name, v in w.items()}
        act = swiglu_act
        if self.cfg.expert_activation == "clamped_swiglu":
            act = clamped_swiglu_act(self.cfg.swiglu_limit, self.cfg.swiglu_alpha)
        # "auto" resolved here, on the global program: inside a shard_map it would read as one
        # device.
        impl = expert_mlp_impl(self.impl)
        mode, mesh = self.cfg.expert_parallel, _expert_parallel_mesh(self.cfg)
        if tile is not None:
            mode, mesh = "exact", None
        if mesh is None and impl == "pallas" and tile is None:
            # A Pallas gmm cannot be partitioned by XLA: without expert parallelism it still runs
            # on each device's tokens under shard_map, every expert's weights on every device.
            mode, mesh = "local", _multi_device_mesh()
        if mode == "exact":
            y = exact_expert_mlp(h, w, expert_nk, gates, act, tile)
        elif mesh is None:
            y = expert_mlp(h, w, expert_nk, gates, act, impl=impl)
        else:
            # b_out is added once here, not on every tensor shard inside the shard_map.
            b_out = w.pop("b_out", None)
            y = _expert_parallel(mode, mesh, h, w, expert_nk, gates, act, impl,
                                 chunks=self.cfg.expert_parallel_chunks)
            if b_out is not None:
                y = y + jnp.einsum("nk,nkr->nr", gates.astype(dt), b_out[expert_nk])
        if self.latent:
            y = _matmul(y.astype(dt), self.w_up_proj[...].astype(dt), tile)
        if self.has_shared:
            y = y.astype(dt) + self.shared(x)
        out = y.reshape(b, t, d)

        valid = valid_bt.reshape(b * t).astype(jnp.float32)
        counts = jnp.sum(jax.nn.one_hot(expert_nk, self.num_experts) * valid[:, None, None], (0, 1))
        stats = (jax.lax.stop_gradient(counts), jnp.sum(probs * valid[:, None], 0), jnp.sum(valid))
        return out, expert_nk.reshape(b, t, self.k), stats


LatentMoE = MoE  # the MAI flagship's MoE is this layer with moe_type="latent"

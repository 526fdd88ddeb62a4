"""Mixture-of-experts layers: MAI's LatentMoE (RECIPE §2) and the open families' plain experts.

LatentMoE down-projects, routes in fp32, runs the experts in the latent space and up-projects;
plain experts (Qwen3-MoE, GPT-OSS, DeepSeek-V3) run on the model width, optionally with biases and
GPT-OSS's clamped SwiGLU, plus DeepSeek's always-on shared experts. Routers: softmax over experts
(top-k, optionally renormalised over the chosen ones; GPT-OSS's logit bias), or DeepSeek's sigmoid
scores with a choice-only correction bias, grouped top-k and a routed scaling factor.

Dispatch is dropless: the (token, expert) assignments are sorted by expert and run as grouped
matmuls over variable-size groups (`jax.lax.ragged_dot`, or our Pallas `gmm`, or "blocked": groups
padded to whole tiles and run as batched dense matmuls, the fast path on CPU); no capacity factor,
no token dropped. A dense one-hot path computes every expert for every token and is the reference
in tests. The router can be forced to given experts (routing replay); the gates then still come
from the current router logits at those experts, so the router keeps its gradient.

Load balance (global batch): per layer we return (token_counts[E], prob_sums[E], num_tokens) over
the valid tokens of the batch; the loss E·Σ_e f_e·P_e is formed from these sums, so statistics
summed over devices or micro-batches give exactly the global-batch loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
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
    if "b_gate" in w:
        g, u = g + w["b_gate"][sorted_expert], u + w["b_up"][sorted_expert]
    ys = matmul(act(g, u), w["out"], group_sizes)
    if "b_out" in w:
        ys = ys + w["b_out"][sorted_expert]
    y_sorted_back = jnp.zeros_like(ys).at[order].set(ys)
    y_nkr = y_sorted_back.reshape(n, k, -1)
    return jnp.einsum("nk,nkr->nr", gates_nk.astype(y_nkr.dtype), y_nkr)


def _expert_mlp_blocked(x_nr, w, expert_nk, gates_nk, act):
    """Dropless with dense batched matmuls: each expert's rows are padded to whole tiles, every tile
    belongs to one expert and multiplies that expert's weights. Padding is at most tile-1 rows per
    expert, so no token is ever dropped; it is the fast path on CPU, where ragged_dot is slow."""
    n, k = expert_nk.shape
    num_experts, width, _ = w["gate"].shape
    out_width = w["out"].shape[-1]
    assignments = n * k
    tile = int(min(128, max(8, 1 << max(0, (assignments // num_experts - 1).bit_length()))))
    flat_expert = expert_nk.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    sorted_expert = flat_expert[order]
    sizes = jnp.bincount(flat_expert, length=num_experts)
    padded = (sizes + tile - 1) // tile * tile
    start = jnp.cumsum(sizes) - sizes
    padded_end = jnp.cumsum(padded)
    dest = (padded_end - padded)[sorted_expert] + jnp.arange(assignments) - start[sorted_expert]
    rows = -(-(assignments + num_experts * (tile - 1)) // tile) * tile
    num_tiles = rows // tile
    xs = jnp.zeros((rows, width), x_nr.dtype).at[dest].set(x_nr[order // k])
    tile_expert = jnp.searchsorted(padded_end, jnp.arange(num_tiles) * tile, side="right")
    tile_expert = jnp.minimum(tile_expert, num_experts - 1)  # trailing all-padding tiles
    xt = xs.reshape(num_tiles, tile, width)
    g = jnp.einsum("tbr,trf->tbf", xt, w["gate"][tile_expert])
    u = jnp.einsum("tbr,trf->tbf", xt, w["up"][tile_expert])
    if "b_gate" in w:
        g = g + w["b_gate"][tile_expert][:, None]
        u = u + w["b_up"][tile_expert][:, None]
    y = jnp.einsum("tbf,tfr->tbr", act(g, u), w["out"][tile_expert])
    if "b_out" in w:
        y = y + w["b_out"][tile_expert][:, None]
    y = y.reshape(rows, out_width)
    y_assign = jnp.zeros((assignments, out_width), y.dtype).at[order].set(y[dest])
    return jnp.einsum("nk,nkr->nr", gates_nk.astype(y.dtype), y_assign.reshape(n, k, out_width))


def _ragged_dot(lhs, rhs, group_sizes):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def _pallas_gmm(lhs, rhs, group_sizes):
    return pallas_kernels.gmm(lhs, rhs, group_sizes, impl="pallas")


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
        if self.impl == "dense":
            combine = jnp.sum(jax.nn.one_hot(expert_nk, self.num_experts) * gates[..., None], 1)
            y = _expert_mlp_dense(h, w, combine, act)
        elif self.impl == "blocked" or (self.impl == "auto" and not use_pallas("auto")):
            y = _expert_mlp_blocked(h, w, expert_nk, gates, act)
        else:
            matmul = _pallas_gmm if use_pallas(self.impl) else _ragged_dot
            y = _expert_mlp_grouped(h, w, expert_nk, gates, act, matmul)
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

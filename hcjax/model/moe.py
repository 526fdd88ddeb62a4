"""LatentMoE (RECIPE §2): down-project, fp32 router top-k, dropless experts in latent space, up-project.

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
from hcjax.model.layers import param


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


def _expert_swiglu_dense(x_nr, w_gate, w_up, w_out, combine_ne):
    """Reference: every expert on every token, then a one-hot weighted combine."""
    h = jax.nn.silu(jnp.einsum("nr,erf->nef", x_nr, w_gate)) * jnp.einsum("nr,erf->nef", x_nr, w_up)
    y = jnp.einsum("nef,efr->ner", h, w_out)
    return jnp.einsum("ne,ner->nr", combine_ne.astype(y.dtype), y)


def _expert_swiglu_grouped(x_nr, w_gate, w_up, w_out, expert_nk, gates_nk, matmul):
    """Dropless: sort assignments by expert, grouped matmuls, unsort, gate-weighted sum."""
    n, k = expert_nk.shape
    num_experts = w_gate.shape[0]
    flat_expert = expert_nk.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    token_of = order // k
    xs = x_nr[token_of]
    group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
    h = jax.nn.silu(matmul(xs, w_gate, group_sizes)) * matmul(xs, w_up, group_sizes)
    ys = matmul(h, w_out, group_sizes)
    y_sorted_back = jnp.zeros_like(ys).at[order].set(ys)
    y_nkr = y_sorted_back.reshape(n, k, -1)
    return jnp.einsum("nk,nkr->nr", gates_nk.astype(y_nkr.dtype), y_nkr)


def _expert_swiglu_blocked(x_nr, w_gate, w_up, w_out, expert_nk, gates_nk):
    """Dropless with dense batched matmuls: each expert's rows are padded to whole tiles, every tile
    belongs to one expert and multiplies that expert's weights. Padding is at most tile-1 rows per
    expert, so no token is ever dropped; it is the fast path on CPU, where ragged_dot is slow."""
    n, k = expert_nk.shape
    num_experts, latent, _ = w_gate.shape
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
    xs = jnp.zeros((rows, latent), x_nr.dtype).at[dest].set(x_nr[order // k])
    tile_expert = jnp.searchsorted(padded_end, jnp.arange(num_tiles) * tile, side="right")
    tile_expert = jnp.minimum(tile_expert, num_experts - 1)  # trailing all-padding tiles
    xt = xs.reshape(num_tiles, tile, latent)
    h = jax.nn.silu(jnp.einsum("tbr,trf->tbf", xt, w_gate[tile_expert]))
    h = h * jnp.einsum("tbr,trf->tbf", xt, w_up[tile_expert])
    y = jnp.einsum("tbf,tfr->tbr", h, w_out[tile_expert]).reshape(rows, latent)
    y_assign = jnp.zeros((assignments, latent), y.dtype).at[order].set(y[dest])
    return jnp.einsum("nk,nkr->nr", gates_nk.astype(y.dtype), y_assign.reshape(n, k, latent))


def _ragged_dot(lhs, rhs, group_sizes):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def _pallas_gmm(lhs, rhs, group_sizes):
    return pallas_kernels.gmm(lhs, rhs, group_sizes, impl="pallas")


class LatentMoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, r, f, e = cfg.d_model, cfg.moe_latent_dim, cfg.moe_d_ff, cfg.num_experts
        self.router = param(rngs, (d, e), ("embed", "router_experts"), std=d**-0.5)
        self.w_down = param(rngs, (d, r), ("embed", "latent"))
        self.w_gate = param(rngs, (e, r, f), ("experts", "latent", "expert_mlp"), std=r**-0.5)
        self.w_up = param(rngs, (e, r, f), ("experts", "latent", "expert_mlp"), std=r**-0.5)
        self.w_out = param(rngs, (e, f, r), ("experts", "expert_mlp", "latent"), std=f**-0.5)
        self.w_up_proj = param(rngs, (r, d), ("latent", "embed"))
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
        probs = jax.nn.softmax(logits, axis=-1)
        if routing_btk is None:
            _, expert_nk = jax.lax.top_k(logits, self.k)
        else:
            if routing_btk.shape != (b, t, self.k):
                raise ValueError(
                    f"routing replay has shape {routing_btk.shape}, expected {(b, t, self.k)}"
                )
            expert_nk = routing_btk.reshape(b * t, self.k).astype(jnp.int32)
        gates = jax.nn.softmax(jnp.take_along_axis(logits, expert_nk, axis=-1), axis=-1)

        latent = x.astype(dt) @ self.w_down[...].astype(dt)
        w_gate, w_up, w_out = (w[...].astype(dt) for w in (self.w_gate, self.w_up, self.w_out))
        if self.impl == "dense":
            combine = jnp.sum(jax.nn.one_hot(expert_nk, self.num_experts) * gates[..., None], 1)
            y = _expert_swiglu_dense(latent, w_gate, w_up, w_out, combine)
        elif self.impl == "blocked" or (self.impl == "auto" and not use_pallas("auto")):
            y = _expert_swiglu_blocked(latent, w_gate, w_up, w_out, expert_nk, gates)
        else:
            matmul = _pallas_gmm if use_pallas(self.impl) else _ragged_dot
            y = _expert_swiglu_grouped(latent, w_gate, w_up, w_out, expert_nk, gates, matmul)
        out = (y.astype(dt) @ self.w_up_proj[...].astype(dt)).reshape(b, t, d)

        valid = valid_bt.reshape(b * t).astype(jnp.float32)
        counts = jnp.sum(jax.nn.one_hot(expert_nk, self.num_experts) * valid[:, None, None], (0, 1))
        stats = (jax.lax.stop_gradient(counts), jnp.sum(probs * valid[:, None], 0), jnp.sum(valid))
        return out, expert_nk.reshape(b, t, self.k), stats

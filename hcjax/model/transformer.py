"""The decoder-only transformer (Flax NNX), its KV cache, and sharded creation.

One code path for the MAI flagship of RECIPE §2 and the open families (Llama 3, Qwen3, Qwen3-MoE,
GPT-OSS, DeepSeek-V3 / Kimi K2): `ModelConfig` picks the attention (GQA or MLA), the FFN of each
layer (dense SwiGLU or MoE) and the head. Residual stream in fp32; matmuls in the compute dtype.
Each block: pre-norm attention (MAI: its output passes an RMSNorm with gain initialised to 0, so
every attention branch starts at zero), then a pre-norm FFN. MAI ties the input and output
embeddings and scales logits by d_model**-0.5; the open families use a plain (often untied) head.

At scale (`ModelConfig.scan_layers`): the leading `first_dense_layers` stay unrolled and the whole
periods after them run under one `jax.lax.scan` whose step is one period of the layer pattern (lcm
of the attention and FFN pattern lengths), its parameters stacked on a leading "layers" axis; the
layers after the last whole period (`tail_blocks`) run unrolled; `stack_layers` /
`unstack_layers` convert parameter states between the two layouts, `stack_cache` / `unstack_cache`
the KV cache. Each layer is rematerialised by `ModelConfig.remat_policy`, and activations are
constrained by logical axis names on the mesh in context (`jax.set_mesh`; none: no-op).
The public record (`ModelOutput`: routing and stats one entry per MoE layer, in layer order) is the
same in both layouts.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh

from hcjax import sharding as shd
from hcjax.model.attention import (
    attention_cache_entries,
    init_layer_cache,
    init_paged_layer_cache,
    make_attention,
)
from hcjax.model.config import FULL_REMAT, ModelConfig
from hcjax.model.layers import DenseMLP, RMSNorm, dropout, param, project
from hcjax.model.moe import MoE, correction_bias_step, load_balance_loss_from_stats


@struct.dataclass
class ModelOutput:
    logits: jax.Array | None  # [B, T, V] float32; None when called with head=False
    routing: tuple  # one [B, T, k] int32 per MoE layer
    load_balance_loss: jax.Array  # scalar
    moe_stats: tuple  # one (token_counts[E], prob_sums[E], num_tokens) per MoE layer
    cache: tuple | None = None
    # head=False: the head's input [B, T, D] (compute dtype) and weight [V, D] (parameter dtype),
    # logits = hidden @ head_weight.T in fp32, for a caller that forms them a slice at a time.
    hidden: jax.Array | None = None
    head_weight: jax.Array | None = None


_RESIDUAL_BTD = ("activation_batch", "activation_length", "activation_embed")
_LOGITS_BTV = ("activation_batch", "activation_length", "activation_vocab")
# The `checkpoint_name` tags of each layer; remat_policy="minimal" saves exactly these.
SAVED_ACTIVATIONS = ("attention_out", "ffn_out")
_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    # Weight matmuls only: attention scores/probabilities (batched dots) are recomputed.
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "minimal": jax.checkpoint_policies.save_only_these_names(*SAVED_ACTIVATIONS),
}


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        exact = cfg.batch_invariant
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, exact=exact, rngs=rngs)
        self.attn = make_attention(cfg, cfg.attention_kind(layer), rngs=rngs)
        self.has_attn_out_norm = cfg.attention_output_norm
        if cfg.attention_output_norm:
            self.attn_out_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, init_gain=0.0,
                                         exact=exact, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, exact=exact, rngs=rngs)
        self.is_moe = cfg.ffn_kind(layer) == "moe"
        if self.is_moe:
            self.ffn = MoE(cfg, rngs=rngs)
        else:
            self.ffn = DenseMLP(cfg.d_model, cfg.d_ff, dtype=cfg.compute_dtype,
                                exact_tile=cfg.exact_tile, rngs=rngs)
        self.dropout_rate = cfg.dropout_rate

    def __call__(self, x_btd, positions, segment_ids, valid, routing, cache, rngs_2):
        """x + attention, then + FFN. `rngs_2`: dropout keys of the two branches, or None.

        Returns (x [B, T, D] fp32, new cache layer or None, (chosen [B, T, k], stats) or None).
        """
        rng_attn, rng_ffn = (None, None) if rngs_2 is None else (rngs_2[0], rngs_2[1])
        x_btd = shd.constrain(x_btd, _RESIDUAL_BTD)
        h_btd, new_cache = self._attention(x_btd, positions, segment_ids, cache)
        x_btd = x_btd + dropout(h_btd, self.dropout_rate, rng_attn)
        y_btd, moe_out = self._ffn(x_btd, valid, routing)
        x_btd = x_btd + dropout(y_btd, self.dropout_rate, rng_ffn)
        return x_btd, new_cache, moe_out

    def _attention(self, x_btd, positions, segment_ids, cache):
        h_btd, new_cache = self.attn(self.attn_norm(x_btd), positions, segment_ids, cache)
        if self.has_attn_out_norm:
            h_btd = self.attn_out_norm(h_btd)
        h_btd = shd.constrain(h_btd.astype(jnp.float32), _RESIDUAL_BTD)
        return checkpoint_name(h_btd, "attention_out"), new_cache

    def _ffn(self, x_btd, valid, routing):
        h_btd = self.ffn_norm(x_btd)
        if self.is_moe:
            y_btd, chosen_btk, stats = self.ffn(h_btd, valid, routing)
            moe_out = (chosen_btk, stats)
        else:
            y_btd, moe_out = self.ffn(h_btd), None
        y_btd = shd.constrain(y_btd.astype(jnp.float32), _RESIDUAL_BTD)
        return checkpoint_name(y_btd, "ffn_out"), moe_out


def _layer_fn(graphdef, remat_policy: str, *, prevent_cse: bool = True,
              compute_dtype=jnp.bfloat16) -> Callable:
    """`(state, x, shared, per_layer) -> Block outputs` for one block, rematerialised by policy.

    shared = (positions, segment_ids, valid) for every layer; per_layer = (routing replay, cache
    layer, dropout keys), each possibly None. Pure in the block's state, so it can be remat'd and
    scanned.
    """

    def run(state, x_btd, shared, per_layer):
        positions, segment_ids, valid = shared
        routing, cache, rngs_2 = per_layer
        block = nnx.merge(graphdef, state)
        return block(x_btd, positions, segment_ids, valid, routing, cache, rngs_2)

    if remat_policy == "none":
        return run
    if remat_policy == "full_compute":
        return _saved_in(run, compute_dtype)
    return jax.checkpoint(run, policy=_REMAT_POLICIES[remat_policy], prevent_cse=prevent_cse)


def _like(states, tree):
    """`tree`'s leaves in `states`' structure (same leaf order and shapes, checked)."""
    leaves = jax.tree.leaves(tree)
    want = jax.tree.leaves(states)
    if len(leaves) != len(want) or any(a.shape != b.shape for a, b in zip(leaves, want)):
        raise ValueError(
            "the gradient accumulator does not match the scanned layers' parameters: "
            f"{[a.shape for a in leaves]} vs {[b.shape for b in want]}")
    return jax.tree.unflatten(jax.tree.structure(states), leaves)


def accumulating_scan(layers: Sequence[Callable], saved_dtype=None) -> Callable:
    """fn(states, acc, x, other, shared) -> (x, outs): `lax.scan` over periods of the layers
    `layers[r](states[r], x, other[r], shared) -> (x, out_r)` (states[r] and other[r] stacked
    [n, ...] over the periods; outs[r] stacked likewise), with a backward that writes the
    gradients into `acc` in place.

    Its VJP: the gradient with respect to `acc` is acc + (the gradient with respect to
    `states`), added one layer at a time into acc's own buffer (a dynamic-update-slice of the
    loop's carry) as the backward walks down the layers; `states` itself gets zeros (unused by
    the caller, so XLA drops them). Differentiated the plain way, a micro-batch's gradient is a
    second [n, ...] buffer the size of the parameters, added to the running sum after the
    backward. Each layer is rematerialised in full, as remat policy "full" does ("full_compute"
    with `saved_dtype`): the forward keeps only each layer's input x (in `saved_dtype` when
    given) and the backward recomputes the layer from it. `other` and `shared` get no gradient
    (routing, caches, dropout keys, positions, masks).
    """
    period = len(layers)

    def inexact(tree):
        return [a for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.inexact)]

    @jax.custom_vjp
    def run(states, acc, x, other, shared):
        del acc

        def step(x, xs):
            outs = []
            for r in range(period):
                x, out = layers[r](xs[0][r], x, xs[1][r], shared)
                outs.append(out)
            return x, tuple(outs)

        return jax.lax.scan(step, x, (states, other))

    def fwd(states, acc, x, other, shared):
        def step(x, xs):
            outs, inputs = [], []
            for r in range(period):
                inputs.append(x if saved_dtype is None else x.astype(saved_dtype))
                x, out = layers[r](xs[0][r], x, xs[1][r], shared)
                outs.append(out)
            return x, (tuple(outs), tuple(inputs))

        x_out, (outs, inputs) = jax.lax.scan(step, x, (states, other))
        return (x_out, outs), (states, acc, inputs, other, shared)

    def bwd(res, cts):
        states, acc, inputs, other, shared = res
        ct_x, ct_outs = cts
        # Integer outputs (routing choices) carry float0 cotangents: only the inexact ones flow.
        ct_float = [[c for c in jax.tree.leaves(ct_outs[r]) if c.dtype != jax.dtypes.float0]
                    for r in range(period)]
        n = inputs[0].shape[0]

        def body(j, carry):
            i = n - 1 - j
            ct_x, acc = carry
            at_i = lambda tree: jax.tree.map(  # noqa: E731
                lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)
            acc = list(acc)
            for r in reversed(range(period)):
                other_r = at_i(other[r])

                def layer(state, x, r=r, other_r=other_r):
                    x, out = layers[r](state, x, other_r, shared)
                    return x, inexact(out)

                _, vjp = jax.vjp(layer, at_i(states[r]), at_i(inputs[r]).astype(ct_x.dtype))
                d_state, ct_x = vjp((ct_x, at_i(ct_float[r])))
                acc[r] = jax.tree.map(
                    lambda a, d: jax.lax.dynamic_update_index_in_dim(
                        a, jax.lax.dynamic_index_in_dim(a, i, keepdims=False)
                        + d.astype(a.dtype), i, 0),
                    acc[r], d_state)
            return ct_x, tuple(acc)

        ct_x, acc = jax.lax.fori_loop(0, n, body, (ct_x, tuple(acc)))
        return jax.tree.map(jnp.zeros_like, states), acc, ct_x, None, None

    run.defvjp(fwd, bwd)
    return run


def _saved_in(run: Callable, dtype) -> Callable:
    """`run` rematerialised with its residual-stream input saved in `dtype`: the forward is
    `run` itself (fp32 stream), the backward recomputes the layer from the rounded input. Only
    the gradients see the rounding (relative ~2^-8 on the input of each layer's recompute)."""

    @jax.custom_vjp
    def layer(state, x_btd, shared, per_layer):
        return run(state, x_btd, shared, per_layer)

    def fwd(state, x_btd, shared, per_layer):
        saved = (state, x_btd.astype(dtype), shared, per_layer)
        return run(state, x_btd, shared, per_layer), saved

    def bwd(saved, cotangent):
        state, x_low, shared, per_layer = saved
        _, vjp = jax.vjp(run, state, x_low.astype(jnp.float32), shared, per_layer)
        return vjp(cotangent)

    layer.defvjp(fwd, bwd)
    return layer


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), std=1.0)
        if not cfg.tie_embeddings:
            self.lm_head = param(
                rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), std=cfg.d_model**-0.5
            )
        # Built layer by layer in both layouts, so a seed gives the same weights either way.
        blocks = [Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)]
        if cfg.scan_layers:
            unrolled, periodic, trailing = _scan_groups(blocks, cfg)
            self.blocks = nnx.List(unrolled)
            # scan_blocks[r]: the blocks at position r of every period, parameters [n, ...].
            self.scan_blocks = nnx.List([_stack_modules(group) for group in periodic])
            # The layers after the last whole period (64 = 10 periods of 6 + 4), unrolled.
            self.tail_blocks = nnx.List(trailing)
        else:
            self.blocks = nnx.List(blocks)
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, exact=cfg.batch_invariant,
                                  rngs=rngs)

    def __call__(
        self,
        tokens,
        *,
        positions=None,
        segment_ids=None,
        routing=None,
        cache=None,
        dropout_rng=None,
        head: bool = True,
        grad_accumulator=None,
    ) -> ModelOutput:
        """head=False: no [B, T, V] logits; the output carries the head's input and weight
        instead (`ModelOutput.hidden`, `head_weight`).

        grad_accumulator (training, scanned layers rematerialised "full" or "full_compute"): the
        running gradient sum of the scanned layers' parameters (`scan_blocks` of a params-shaped
        tree). The gradient of this call with respect to it is that sum plus this call's
        gradient of those parameters, added in place layer by layer in the backward; the
        parameters themselves then get a zero gradient from the scanned layers
        (`accumulating_scan`). For a train step's micro-batch loop (hcjax.train.step)."""
        cfg = self.config
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        positions = positions.astype(jnp.int32)
        if segment_ids is not None:
            segment_ids = segment_ids.astype(jnp.int32)
            valid = segment_ids > 0
        else:
            valid = positions >= 0
        if routing is not None and len(routing) != cfg.num_moe_layers:
            raise ValueError(
                f"routing replay has {len(routing)} layers, the model has {cfg.num_moe_layers}"
            )
        cache_entries = cache_layout_size(cfg)
        if cache is not None and len(cache) != cache_entries:
            raise ValueError(
                f"cache has {len(cache)} entries, the model expects {cache_entries} "
                f"(scan_layers={cfg.scan_layers}; see init_cache)"
            )
        if dropout_rng is not None and cfg.dropout_rate > 0:
            layer_rngs = jax.random.split(dropout_rng, (cfg.num_layers, 2))
        else:
            layer_rngs = None

        x = self.embed[...][tokens].astype(jnp.float32)  # fp32 residual stream
        shared = (positions, segment_ids, valid)
        routing_of = {} if routing is None else dict(zip(cfg.moe_layers, routing))
        cache_in = (None,) * cache_entries if cache is None else tuple(cache)
        new_cache, moe_of = [], {}  # moe_of: layer -> (chosen, stats)

        def unrolled(x, blocks, first_layer, first_entry):
            for j, block in enumerate(blocks):
                i = first_layer + j
                graphdef, state = nnx.split(block)
                rngs_2 = None if layer_rngs is None else layer_rngs[i]
                layer = _layer_fn(graphdef, cfg.remat_policy, compute_dtype=cfg.compute_dtype)
                x, layer_cache, moe_out = layer(
                    state, x, shared, (routing_of.get(i), cache_in[first_entry + j], rngs_2)
                )
                new_cache.append(layer_cache)
                if moe_out is not None:
                    moe_of[i] = moe_out
            return x

        # Every layer, or the unrolled leading ones.
        x = unrolled(x, self.blocks, 0, 0)
        if cfg.scan_layers:
            p0, period = cfg.first_dense_layers, cfg.layer_period
            x, scan_cache, scan_moe = self._scan_periods(
                x, shared, routing_of, cache_in[p0 : p0 + period], layer_rngs, grad_accumulator
            )
            new_cache.extend(scan_cache)
            moe_of.update(scan_moe)
            x = unrolled(x, self.tail_blocks, p0 + num_scan_periods(cfg) * period, p0 + period)

        hidden = head_weight = logits = None
        if head:
            logits = self._head(x)
        else:
            hidden, head_weight = self._head_input(x), self.head_weight()
        chosen = tuple(moe_of[i][0] for i in cfg.moe_layers)
        stats = tuple(moe_of[i][1] for i in cfg.moe_layers)
        lb = load_balance_loss_from_stats(stats, experts_per_token=cfg.experts_per_token)
        return ModelOutput(
            logits=logits,
            routing=chosen,
            load_balance_loss=lb,
            moe_stats=stats,
            cache=None if cache is None else tuple(new_cache),
            hidden=hidden,
            head_weight=head_weight,
        )

    def _scan_periods(self, x_btd, shared, routing_of, caches, layer_rngs, grad_accumulator=None):
        """The scanned layers: each `lax.scan` step runs one period (scan_blocks[0..period-1]).

        Per-layer inputs (routing replay, stacked cache, dropout keys) are stacked [n, ...] per
        period position r, and outputs unstacked back to their layers, so the caller sees layers.
        With a `grad_accumulator` (see __call__) the scan is `accumulating_scan`.
        """
        cfg = self.config
        period = cfg.layer_period
        layers = _scan_groups(list(range(cfg.num_layers)), cfg)[1]  # [period][n] layer indices
        graphdefs, states = zip(*(nnx.split(block) for block in self.scan_blocks))
        fns = [_layer_fn(g, cfg.remat_policy, prevent_cse=False, compute_dtype=cfg.compute_dtype)
               for g in graphdefs]

        def stacked_routing(r):
            if not routing_of or layers[r][0] not in routing_of:
                return None
            return jnp.stack([routing_of[i] for i in layers[r]])

        xs = (
            states,
            tuple(stacked_routing(r) for r in range(period)),
            tuple(caches),
            tuple(None if layer_rngs is None else layer_rngs[ids[0] :: period] for ids in layers),
        )

        def period_step(x, xs_one_period):
            states_p, routing_p, caches_p, rngs_p = xs_one_period
            outs = []
            for r in range(period):
                x, layer_cache, moe_out = fns[r](
                    states_p[r], x, shared, (routing_p[r], caches_p[r], rngs_p[r])
                )
                outs.append((layer_cache, moe_out))
            return x, tuple(outs)

        if grad_accumulator is None:
            x_btd, outs = jax.lax.scan(period_step, x_btd, xs)
        else:
            if cfg.remat_policy not in FULL_REMAT or any(c is not None
                                                                      for c in caches):
                raise ValueError(
                    "a gradient accumulator needs training (no cache) with ModelConfig."
                    f"remat_policy 'full' or 'full_compute', not {cfg.remat_policy!r}")
            def raw(graphdef):
                run = _layer_fn(graphdef, "none", compute_dtype=cfg.compute_dtype)

                def layer(state, x, per_layer, shared):
                    x, layer_cache, moe_out = run(state, x, shared, per_layer)
                    return x, (layer_cache, moe_out)

                return layer

            acc = tuple(_like(states[r], grad_accumulator[r]) for r in range(period))
            other = tuple(zip(*xs[1:]))  # per period position r: (routing, cache, dropout keys)
            saved = cfg.compute_dtype if cfg.remat_policy == "full_compute" else None
            x_btd, outs = accumulating_scan([raw(g) for g in graphdefs], saved)(
                states, acc, x_btd, other, shared)
        moe_of = {}
        for r, (_, moe_out) in enumerate(outs):
            if moe_out is None:
                continue
            chosen_nbtk, stats_n = moe_out
            for j, layer in enumerate(layers[r]):
                moe_of[layer] = (chosen_nbtk[j], tuple(s[j] for s in stats_n))
        return x_btd, [layer_cache for layer_cache, _ in outs], moe_of

    def _head_input(self, x_btd):
        """The final norm (and MAI's logit scale) of the residual stream, in the compute dtype."""
        cfg = self.config
        h = self.final_norm(x_btd)
        if cfg.scale_logits:
            # The scale applied to the [B, T, d] input of the head, not to its [B, T, V] output:
            # the same logits (to the bit when d_model is a power of 4, as in tiny_cpu.gin),
            # without a pass over the logits (64 x 152k in a decode step: 1.4 ms of 15 on CPU).
            h = h * (cfg.d_model**-0.5)
        return h.astype(cfg.compute_dtype)

    def head_weight(self):
        """The output head [V, D] (the embedding when tied), in its parameter dtype."""
        return (self.embed if self.config.tie_embeddings else self.lm_head)[...]

    def _head(self, x_btd):
        return head_logits(self._head_input(x_btd), self.head_weight(), self.config.exact_tile)


def head_logits(hidden_btd, head_vd, exact_tile: int | None = None):
    """fp32 logits [B, T, V] of the head's input (compute dtype) and weight [V, D]; in exact mode
    (`exact_tile`, ModelConfig.exact_tile) a batch-invariant projection."""
    if exact_tile is not None:
        logits = project(hidden_btd, head_vd.astype(hidden_btd.dtype).T, tile=exact_tile,
                         out_dtype=jnp.float32)
        return shd.constrain(logits, _LOGITS_BTV)
    logits = jnp.einsum("btd,vd->btv", hidden_btd, head_vd.astype(hidden_btd.dtype),
                        preferred_element_type=jnp.float32)
    return shd.constrain(logits, _LOGITS_BTV)


# Unrolled <-> scanned layouts ------------------------------------------------------------------


def _scan_groups(per_layer: Sequence, cfg: ModelConfig) -> tuple[list, list[list], list]:
    """Per-layer items -> (the unrolled leading ones, [period position r][period j] the scanned
    ones, the unrolled trailing ones after the last whole period)."""
    p0, period, n = cfg.first_dense_layers, cfg.layer_period, num_scan_periods(cfg)
    end = p0 + n * period
    return (list(per_layer[:p0]), [list(per_layer[p0 + r : end : period]) for r in range(period)],
            list(per_layer[end:]))


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _stack_values(values: Sequence):
    if isinstance(values[0], jax.ShapeDtypeStruct):  # abstract states (nnx.eval_shape)
        return jax.ShapeDtypeStruct((len(values), *values[0].shape), values[0].dtype)
    return jnp.stack(values)


def _stack_leaves(*leaves):
    """One stacked leaf; a Variable's logical axes gain a leading "layers" axis."""
    first = leaves[0]
    if not _is_variable(first):
        return _stack_values(leaves)
    meta = dict(first.get_metadata())
    if meta.get("logical_axes") is not None:
        meta["logical_axes"] = ("layers", *meta["logical_axes"])
    return type(first)(_stack_values([v.get_value() for v in leaves]), **meta)


def _stack_trees(trees: Sequence):
    return jax.tree.map(_stack_leaves, *trees, is_leaf=_is_variable)


def _unstack_tree(tree, n: int) -> list:
    """Inverse of `_stack_trees`: slice j of every leaf, for j < n."""

    def slice_leaf(j, leaf):
        if not _is_variable(leaf):
            return leaf[j]
        meta = dict(leaf.get_metadata())
        if meta.get("logical_axes") is not None:
            meta["logical_axes"] = tuple(meta["logical_axes"][1:])
        return type(leaf)(leaf.get_value()[j], **meta)

    return [
        jax.tree.map(functools.partial(slice_leaf, j), tree, is_leaf=_is_variable)
        for j in range(n)
    ]


def _stack_modules(modules: Sequence[nnx.Module]) -> nnx.Module:
    """Modules of one structure -> one module whose parameters are stacked [len(modules), ...]."""
    graphdef, _ = nnx.split(modules[0])
    return nnx.merge(graphdef, _stack_trees([nnx.state(m) for m in modules]))


def update_correction_bias(params: nnx.State, load_le: jax.Array, cfg: ModelConfig,
                           rate: float | jax.Array) -> nnx.State:
    """`params` with every MoE layer's router correction bias moved by `correction_bias_step`.

    load_le [num_moe_layers, E]: tokens routed to each expert, rows in `cfg.moe_layers` order
    (what `ModelOutput.moe_stats` counts). Works in the unrolled and the scanned layouts (a
    scanned bias [n, E] takes the rows of its n layers) and under jit; other leaves pass through.
    """
    if not cfg.router_correction_bias:
        raise ValueError("update_correction_bias: the model has no router correction bias "
                         f"(router_correction_bias={cfg.router_correction_bias})")
    row = {layer: i for i, layer in enumerate(cfg.moe_layers)}
    p0, period, n = cfg.first_dense_layers, cfg.layer_period, num_scan_periods(cfg)

    def layers_of(path) -> list[int] | None:
        keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        if "correction_bias" not in keys:
            return None
        group, index = keys[0], int(keys[1])
        if group == "blocks":
            return [index]
        if group == "scan_blocks":
            return [p0 + index + j * period for j in range(n)]
        if group == "tail_blocks":
            return [p0 + n * period + index]
        raise ValueError(f"update_correction_bias: unexpected parameter path {keys}")

    def update(path, leaf):
        layers = layers_of(path)
        if layers is None:
            return leaf
        load = jnp.stack([load_le[row[layer]] for layer in layers])
        if len(layers) == 1 and leaf.ndim == 1:
            load = load[0]
        return correction_bias_step(leaf, load, rate)

    return jax.tree_util.tree_map_with_path(update, params)


def num_scan_periods(cfg: ModelConfig) -> int:
    return (cfg.num_layers - cfg.first_dense_layers) // cfg.layer_period


def num_tail_layers(cfg: ModelConfig) -> int:
    """Layers after the last whole scanned period (unrolled)."""
    return (cfg.num_layers - cfg.first_dense_layers) % cfg.layer_period if cfg.scan_layers else 0


def cache_layout_size(cfg: ModelConfig) -> int:
    """Entries of the model's cache tuple: one per layer, or the leading unrolled layers, one per
    period position, and the trailing unrolled layers."""
    if not cfg.scan_layers:
        return cfg.num_layers
    return cfg.first_dense_layers + cfg.layer_period + num_tail_layers(cfg)


def stack_layers(state: nnx.State, cfg: ModelConfig) -> nnx.State:
    """The state of an unrolled model (`blocks/0..L-1`) in the scanned layout of `cfg`.

    blocks/0..first_dense_layers-1 stay; block p0 + r + j·period becomes slice j of
    scan_blocks/r (logical axes gain a leading "layers"). Works on concrete and abstract states.
    """
    blocks = [state["blocks"][i] for i in range(cfg.num_layers)]
    unrolled, periodic, trailing = _scan_groups(blocks, cfg)
    out = {key: value for key, value in state.items() if key != "blocks"}
    if unrolled:
        out["blocks"] = dict(enumerate(unrolled))
    out["scan_blocks"] = {r: _stack_trees(group) for r, group in enumerate(periodic)}
    if trailing:
        out["tail_blocks"] = dict(enumerate(trailing))
    return _as_state(out)


def unstack_layers(state: nnx.State, cfg: ModelConfig) -> nnx.State:
    """Inverse of `stack_layers`: a scanned model's state as `blocks/0..L-1`."""
    n = num_scan_periods(cfg)
    blocks = [state["blocks"][i] for i in range(cfg.first_dense_layers)]
    periodic = [_unstack_tree(state["scan_blocks"][r], n) for r in range(cfg.layer_period)]
    blocks += [periodic[r][j] for j in range(n) for r in range(cfg.layer_period)]
    blocks += [state["tail_blocks"][j] for j in range(num_tail_layers(cfg))]
    out = {key: value for key, value in state.items()
           if key not in ("blocks", "scan_blocks", "tail_blocks")}
    out["blocks"] = dict(enumerate(blocks))
    return _as_state(out)


def _as_state(nested: dict) -> nnx.State:
    """A nested mapping of Variables as the plain `nnx.State` that `nnx.state` would return."""
    return nnx.from_flat_state(nnx.to_flat_state(nnx.State(nested)))


def stack_cache(cache: Sequence, cfg: ModelConfig) -> tuple:
    """A per-layer cache tuple (scan_layers=False) in the scanned layout of `cfg`."""
    unrolled, periodic, trailing = _scan_groups(cache, cfg)
    return tuple(unrolled) + tuple(_stack_trees(group) for group in periodic) + tuple(trailing)


def unstack_cache(cache: Sequence, cfg: ModelConfig) -> tuple:
    """Inverse of `stack_cache`: one cache layer per model layer."""
    p0, n, period = cfg.first_dense_layers, num_scan_periods(cfg), cfg.layer_period
    periodic = [_unstack_tree(c, n) for c in cache[p0 : p0 + period]]
    return (tuple(cache[:p0]) + tuple(periodic[r][j] for j in range(n) for r in range(period))
            + tuple(cache[p0 + period :]))


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int, dtype=None) -> tuple:
    """Empty KV cache: ring buffers of `window` slots for local layers, `max_len` for global ones.

    GQA layers hold K and V per KV head; MLA layers hold the compressed latent and the RoPE key.
    One dict per layer; with `scan_layers`, the scanned layers' dicts are stacked per period
    position ([n, B, S, ...], see `stack_cache`), so a decode step does not restack the cache.
    """
    if max_len <= 0 or batch_size <= 0:
        raise ValueError(f"init_cache: batch_size={batch_size} and max_len={max_len} must be > 0")
    dtype = dtype or cfg.compute_dtype
    entries = attention_cache_entries(cfg)

    def layer(i):
        ring = cfg.attention_kind(i) == "local" and not cfg.batch_invariant
        slots = min(cfg.window, max_len) if ring else max_len
        return init_layer_cache(batch_size, slots, entries, dtype)

    return _cache_layout(cfg, layer)


def _cache_layout(cfg: ModelConfig, layer) -> tuple:
    """The cache tuple of `layer(i)` dicts: one per layer, or stacked per period position."""
    if not cfg.scan_layers:
        return tuple(layer(i) for i in range(cfg.num_layers))
    unrolled, periodic, trailing = _scan_groups(list(range(cfg.num_layers)), cfg)
    n = num_scan_periods(cfg)
    stacked = [
        jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), layer(ids[0])) for ids in periodic
    ]
    return tuple(layer(i) for i in unrolled) + tuple(stacked) + tuple(layer(i) for i in trailing)


def init_paged_cache(cfg: ModelConfig, batch_size: int, max_len: int, num_pages: int,
                     page_size: int, dtype=None) -> tuple:
    """`init_cache` with the global layers paged: each holds a pool of `num_pages` pages of
    `page_size` positions and a page table [batch_size, ceil(max_len / page_size)] (see
    attention.init_paged_layer_cache); local layers keep their ring buffers (paged too in exact
    mode, where keys stay at their positions). Scanned layers are
    stacked per period position as in `init_cache`."""
    for name, value in [("batch_size", batch_size), ("max_len", max_len),
                        ("num_pages", num_pages), ("page_size", page_size)]:
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"init_paged_cache: {name}={value!r} must be a positive integer")
    dtype = dtype or cfg.compute_dtype
    entries = attention_cache_entries(cfg)
    max_pages = -(-max_len // page_size)

    def layer(i):
        if cfg.attention_kind(i) == "local" and not cfg.batch_invariant:
            return init_layer_cache(batch_size, min(cfg.window, max_len), entries, dtype)
        return init_paged_layer_cache(batch_size, num_pages, page_size, max_pages, entries, dtype)

    return _cache_layout(cfg, layer)


def cache_bytes(cache) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))


# Sharding ------------------------------------------------------------------------------------


def param_shardings(
    abstract_state, mesh: Mesh, rules: Mapping | None = None
) -> nnx.State:
    """NamedSharding for every parameter from its logical axes; errors name the parameter."""

    def one(path, var):
        axes = var.get_metadata().get("logical_axes")
        name = "/".join(str(p) for p in path)
        return shd.named_sharding(mesh, axes, var.shape, rules, what=f"parameter {name}")

    return nnx.map_state(one, abstract_state)


class _ShapeOnlyRngs:
    """What `abstract_model` passes for `rngs`: `params()` gives one fixed key and counts nothing
    (under `eval_shape` only shapes matter; `layers.param` is the one place keys are drawn and no
    module keeps its rngs, so the graph is the same). nnx.Rngs counts each draw in a Variable, and
    under a trace every such write makes flax probe the traced count's `.sharding`, whose error
    message walks every equation traced so far: building a model was quadratic in its depth
    (DeepSeek-V3's 61 layers: 10.6 s)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def params(self) -> jax.Array:
        return jax.random.key(self.seed)


def abstract_model(cfg: ModelConfig, seed: int = 0):
    """(graphdef, abstract state) without allocating any parameter."""
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=_ShapeOnlyRngs(seed)))
    return nnx.split(model)


def with_compute_dtype(model: Transformer, dtype: str) -> Transformer:
    """`model`'s parameters (the same arrays, not copied) in a model computing in `dtype`
    (ModelConfig.dtype: activations and matmuls; parameters stay as they are, fp32 masters), e.g.
    a bf16 sampler over an fp32 learner's weights. `model` itself when it computes in `dtype`."""
    return _reconfigured(model, dtype=dtype)


def with_batch_invariant(model: Transformer, on: bool = True) -> Transformer:
    """`model`'s parameters (not copied) in a model with ModelConfig.batch_invariant=`on`
    (exact mode); `model` itself when it already is."""
    return _reconfigured(model, batch_invariant=on)


def _reconfigured(model: Transformer, **changes) -> Transformer:
    cfg = dataclasses.replace(model.config, **changes)
    if cfg == model.config:
        return model
    graphdef, _ = abstract_model(cfg)
    return nnx.merge(graphdef, nnx.state(model))


def create_sharded(
    cfg: ModelConfig, mesh: Mesh, rules: Mapping | None = None, seed: int = 0
) -> Transformer:
    """Create the model with every parameter born sharded on `mesh` (no full copy on one device)."""
    rules_key = None if rules is None else tuple(sorted(rules.items()))
    graphdef, init = _sharded_init(cfg, mesh, rules_key, seed)
    return nnx.merge(graphdef, init())


@functools.lru_cache(maxsize=16)
def _sharded_init(cfg: ModelConfig, mesh: Mesh, rules_key, seed: int):
    """One jitted initialiser per (config, mesh, rules, seed), so repeated creation compiles once."""
    rules = None if rules_key is None else dict(rules_key)
    graphdef, abstract = abstract_model(cfg, seed)
    shardings = param_shardings(abstract, mesh, rules)
    init = jax.jit(
        lambda: nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed))), out_shardings=shardings
    )
    return graphdef, init


def shard_state(state, mesh: Mesh, rules: Mapping | None = None):
    """Place an existing state on `mesh` by the logical rules (used by tests and transfers)."""
    shardings = param_shardings(state, mesh, rules)
    return jax.device_put(state, shardings)

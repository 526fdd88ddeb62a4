"""The decoder-only transformer (Flax NNX), its KV cache, and sharded creation.

One code path for the MAI flagship of RECIPE §2 and the open families (Llama 3, Qwen3, Qwen3-MoE,
GPT-OSS, DeepSeek-V3 / Kimi K2): `ModelConfig` picks the attention (GQA or MLA), the FFN of each
layer (dense SwiGLU or MoE) and the head. Residual stream in fp32; matmuls in the compute dtype.
Each block: pre-norm attention (MAI: its output passes an RMSNorm with gain initialised to 0, so
every attention branch starts at zero), then a pre-norm FFN. MAI ties the input and output
embeddings and scales logits by d_model**-0.5; the open families use a plain (often untied) head.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import Mesh

from hcjax import sharding as shd
from hcjax.model.attention import attention_cache_entries, init_layer_cache, make_attention
from hcjax.model.config import ModelConfig
from hcjax.model.layers import DenseMLP, RMSNorm, dropout, param
from hcjax.model.moe import MoE, load_balance_loss_from_stats


@struct.dataclass
class ModelOutput:
    logits: jax.Array  # [B, T, V] float32
    routing: tuple  # one [B, T, k] int32 per MoE layer
    load_balance_loss: jax.Array  # scalar
    moe_stats: tuple  # one (token_counts[E], prob_sums[E], num_tokens) per MoE layer
    cache: tuple | None = None


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.attn = make_attention(cfg, cfg.attention_kind(layer), rngs=rngs)
        self.has_attn_out_norm = cfg.attention_output_norm
        if cfg.attention_output_norm:
            self.attn_out_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, init_gain=0.0, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.is_moe = cfg.ffn_kind(layer) == "moe"
        if self.is_moe:
            self.ffn = MoE(cfg, rngs=rngs)
        else:
            self.ffn = DenseMLP(cfg.d_model, cfg.d_ff, dtype=cfg.compute_dtype, rngs=rngs)
        self.dropout_rate = cfg.dropout_rate

    def __call__(self, x, positions, segment_ids, valid, routing, cache, rngs_pair):
        h, new_cache = self.attn(self.attn_norm(x), positions, segment_ids, cache)
        if self.has_attn_out_norm:
            h = self.attn_out_norm(h)
        x = x + dropout(h.astype(jnp.float32), self.dropout_rate, rngs_pair[0])
        moe_out = None
        if self.is_moe:
            y, chosen, stats = self.ffn(self.ffn_norm(x), valid, routing)
            moe_out = (chosen, stats)
        else:
            y = self.ffn(self.ffn_norm(x))
        x = x + dropout(y.astype(jnp.float32), self.dropout_rate, rngs_pair[1])
        return x, new_cache, moe_out


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), std=1.0)
        if not cfg.tie_embeddings:
            self.lm_head = param(
                rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), std=cfg.d_model**-0.5
            )
        self.blocks = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)

    def __call__(
        self,
        tokens,
        *,
        positions=None,
        segment_ids=None,
        routing=None,
        cache=None,
        dropout_rng=None,
    ) -> ModelOutput:
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
        if cache is not None and len(cache) != cfg.num_layers:
            raise ValueError(f"cache has {len(cache)} layers, the model has {cfg.num_layers}")
        if dropout_rng is not None and cfg.dropout_rate > 0:
            layer_rngs = jax.random.split(dropout_rng, (cfg.num_layers, 2))
        else:
            layer_rngs = None

        x = self.embed[...][tokens].astype(jnp.float32)  # fp32 residual stream
        new_cache, chosen, stats = [], [], []
        moe_index = 0
        for i, block in enumerate(self.blocks):
            replay = None
            if block.is_moe and routing is not None:
                replay = routing[moe_index]
            pair = (None, None) if layer_rngs is None else (layer_rngs[i, 0], layer_rngs[i, 1])
            x, layer_cache, moe_out = block(
                x, positions, segment_ids, valid, replay, None if cache is None else cache[i], pair
            )
            new_cache.append(layer_cache)
            if moe_out is not None:
                chosen.append(moe_out[0])
                stats.append(moe_out[1])
                moe_index += 1

        h = self.final_norm(x).astype(cfg.compute_dtype)
        head = self.embed if cfg.tie_embeddings else self.lm_head
        logits = jnp.einsum(
            "btd,vd->btv", h, head[...].astype(cfg.compute_dtype),
            preferred_element_type=jnp.float32,
        )
        if cfg.scale_logits:
            logits = logits * (cfg.d_model**-0.5)
        stats = tuple(stats)
        lb = load_balance_loss_from_stats(stats, experts_per_token=cfg.experts_per_token)
        return ModelOutput(
            logits=logits,
            routing=tuple(chosen),
            load_balance_loss=lb,
            moe_stats=stats,
            cache=None if cache is None else tuple(new_cache),
        )


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int, dtype=None) -> tuple:
    """Empty KV cache: ring buffers of `window` slots for local layers, `max_len` for global ones.

    GQA layers hold K and V per KV head; MLA layers hold the compressed latent and the RoPE key.
    """
    if max_len <= 0 or batch_size <= 0:
        raise ValueError(f"init_cache: batch_size={batch_size} and max_len={max_len} must be > 0")
    dtype = dtype or cfg.compute_dtype
    entries = attention_cache_entries(cfg)
    layers = []
    for i in range(cfg.num_layers):
        slots = min(cfg.window, max_len) if cfg.attention_kind(i) == "local" else max_len
        layers.append(init_layer_cache(batch_size, slots, entries, dtype))
    return tuple(layers)


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


def abstract_model(cfg: ModelConfig, seed: int = 0):
    """(graphdef, abstract state) without allocating any parameter."""
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)))
    return nnx.split(model)


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

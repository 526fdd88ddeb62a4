"""Attention layers with a KV cache: grouped-query attention (GQA) and multi-head latent attention.

GQA serves the MAI flagship (local sliding-window layers with RoPE, global NoPE layers) and the open
families (RoPE everywhere; Qwen3's per-head q/k RMSNorm; GPT-OSS's q/k/v/o biases and learned
attention sinks). MLA is DeepSeek-V3's / Kimi K2's: queries through a LoRA, keys and values from a
compressed latent plus one shared RoPE key; its cache holds only the latent and the RoPE key, and
cached attention runs in the absorbed form (the up-projections folded into query and output).

The attention itself comes from `pallas_kernels.self_attention`: masks built from token positions
(causal, window) and segment ids (packed rows), so the same code serves the full forward and cached
generation; the full forward runs the implementation `ModelConfig.attention_impl` names (dense,
blocked, the flash kernel; "auto" by platform). A cache layer holds per-position entries
([B, S, ...]) and `pos` ([B, S], -1 = empty); local layers keep a ring buffer of `window` slots
(position p lives in slot p % window). With the engine's paged layout (`init_paged_layer_cache`),
a global layer holds pages from one pool ([num_pages, page_size, ...] per entry) and a page table
[B, max_pages]: position p of row b lives at page page_table[b, p // page_size], row
p % page_size, so memory follows the tokens held; a row's positions are contiguous from 0, so the
key positions are implied and no `pos` is kept.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from hcjax import sharding as shd
from hcjax.model.config import ModelConfig
from hcjax.model.layers import RMSNorm, param, project, rope, rope_frequencies
from pallas_kernels import batch_invariant as bi
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.paged_attention import gather_pages, paged_decode_attention
from pallas_kernels.self_attention import (
    attention_mask,
    gqa_attention,
    self_attention,
    self_attention_impl,
)

# Logical axes of per-head activations (`shd.constrain`; a no-op without a mesh in context).
_Q_BTHD = ("activation_batch", "activation_length", "activation_heads", "activation_head_dim")
_KV_BTHD = ("activation_batch", "activation_length", "activation_kv_heads", "activation_head_dim")


def on_local_shards(kernel, q, k, v, extra):
    """`kernel(q, k, v, extra)` on each device's own shard, under `shard_map` over the context mesh.

    q is [B, (T,) Hq, D], k and v [B, S, Hkv, D], extra [B, ...] or None (segment ids, lengths). The batch
    is split as the activations are, and the heads over the tensor axes when query and KV heads
    both divide (so each shard keeps whole GQA groups). A Pallas call is opaque to XLA's
    partitioner: on a global sharded array XLA would gather its operands onto every device.
    With no mesh in context (or one device) the kernel runs directly.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.auto_axes or mesh.size == 1:
        return kernel(q, k, v, extra)
    batch = shd.activation_spec(q.shape[:1], ("activation_batch",), mesh)[0]
    q_heads = shd.activation_spec(q.shape[-2:-1], ("activation_heads",), mesh)[0]
    kv_heads = shd.activation_spec(k.shape[-2:-1], ("activation_kv_heads",), mesh)[0]
    heads = q_heads if q_heads == kv_heads else None

    def spec(x, split_heads: bool):
        dims = [batch] + [None] * (x.ndim - 1)
        if split_heads:
            dims[-2] = heads
        return jax.sharding.PartitionSpec(*dims)

    q_spec, kv_spec = spec(q, True), spec(k, True)
    if extra is None:  # e.g. no segment ids: nothing to split beside q, k, v
        return jax.shard_map(lambda q, k, v: kernel(q, k, v, None), mesh=mesh,
                             in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                             check_vma=False)(q, k, v)
    return jax.shard_map(kernel, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, spec(extra, False)),
                         out_specs=q_spec, check_vma=False)(q, k, v, extra)


def init_layer_cache(batch: int, slots: int, entries: dict, dtype) -> dict:
    """Empty cache layer: one [batch, slots, *shape] array per entry, and `pos` = -1."""
    cache = {name: jnp.zeros((batch, slots, *shape), dtype) for name, shape in entries.items()}
    cache["pos"] = jnp.full((batch, slots), -1, jnp.int32)
    return cache


def write_cache(cache: dict, entries_bt: dict, pos_bt, ring: bool) -> dict:
    """Scatter a chunk's per-position entries into the cache; ring buffers keep the last `slots`."""
    slots = cache["pos"].shape[1]
    if ring:
        newest = jnp.max(pos_bt, axis=1, keepdims=True)
        keep = (pos_bt >= 0) & (pos_bt > newest - slots)
        slot = pos_bt % slots
    else:
        keep = (pos_bt >= 0) & (pos_bt < slots)
        slot = pos_bt
    slot = jnp.where(keep, slot, slots)  # out of range -> dropped by the scatter
    rows = jnp.arange(pos_bt.shape[0])[:, None]
    new = {
        name: cache[name].at[rows, slot].set(x.astype(cache[name].dtype), mode="drop")
        for name, x in entries_bt.items()
    }
    new["pos"] = cache["pos"].at[rows, slot].set(pos_bt, mode="drop")
    return new


def _cached_keys(cache: dict, entries_bt: dict, pos_bt):
    """What the cache held before this chunk plus the chunk itself (one row = one sequence)."""
    keys = {
        name: jnp.concatenate([cache[name], x.astype(cache[name].dtype)], axis=1)
        for name, x in entries_bt.items()
    }
    return keys, jnp.concatenate([cache["pos"], pos_bt], axis=1)


def decode_buckets(slots: int) -> tuple[int, ...]:
    """Key lengths one-token decode attention may read: `slots` and up to three halvings of
    it, none below 16."""
    sizes = {slots}
    for shift in range(1, 4):
        if slots >> shift >= 16 and (slots >> shift) << shift == slots:
            sizes.add(slots >> shift)
    return tuple(sorted(sizes))


def cached_attention(cache: dict, entries_bt: dict, pos_bt, ring: bool, attend,
                     write_first: bool = False):
    """(attend(keys, key positions), new cache) of a chunk against a cache layer.

    One-token decode writes the token first and reads the cache in place (appending the token
    to the cache would copy every layer's cache each step), and reads only the leading slots
    that can hold a visible key: while every row's position is below n <= slots, a key at slot
    >= n is empty or later than every query (a ring buffer that has not wrapped stores position
    p at slot p). n is the smallest of `decode_buckets(slots)` above the batch's largest
    position, chosen on device, so decode reads grow with the longest sequence, not with
    max_target_length. Longer chunks attend to the old cache plus themselves, then write; with
    `write_first` (exact mode: every key at index = position) they write, then attend to the
    whole cache.
    """
    if pos_bt.shape[1] != 1 and write_first:
        new_cache = write_cache(cache, entries_bt, pos_bt, ring=ring)
        return attend({name: new_cache[name] for name in entries_bt}, new_cache["pos"]), new_cache
    if pos_bt.shape[1] != 1:
        keys, k_pos = _cached_keys(cache, entries_bt, pos_bt)
        return attend(keys, k_pos), write_cache(cache, entries_bt, pos_bt, ring=ring)
    new_cache = write_cache(cache, entries_bt, pos_bt, ring=ring)
    sizes = decode_buckets(new_cache["pos"].shape[1])

    def read(n):
        return attend({name: new_cache[name][:, :n] for name in entries_bt},
                      new_cache["pos"][:, :n])

    if len(sizes) == 1:
        return read(sizes[0]), new_cache
    need = jnp.max(pos_bt) + 1
    index = sum((need > n).astype(jnp.int32) for n in sizes[:-1])
    out = jax.lax.switch(index, [lambda n=n: read(n) for n in sizes])
    return out, new_cache


def init_paged_layer_cache(batch: int, num_pages: int, page_size: int, max_pages: int,
                           entries: dict, dtype) -> dict:
    """Empty paged cache layer: one pool [num_pages, page_size, *shape] per entry and a page
    table [batch, max_pages] of page 0 (the engine keeps page 0 as a scratch page it never
    hands out: idle rows write there)."""
    cache = {name: jnp.zeros((num_pages, page_size, *shape), dtype)
             for name, shape in entries.items()}
    cache["page_table"] = jnp.zeros((batch, max_pages), jnp.int32)
    return cache


def is_paged(cache: dict | None) -> bool:
    return cache is not None and "page_table" in cache


def write_pages(cache: dict, entries_bt: dict, pos_bt) -> dict:
    """Scatter a chunk's per-position entries into the rows' pages (position < 0 dropped)."""
    table = cache["page_table"]
    name0 = next(iter(entries_bt))
    num_pages, page_size = cache[name0].shape[:2]
    max_pages = table.shape[1]
    index = jnp.clip(pos_bt // page_size, 0, max_pages - 1)
    page = jnp.take_along_axis(table, index, axis=1)
    keep = (pos_bt >= 0) & (pos_bt < max_pages * page_size)
    page = jnp.where(keep, page, num_pages)  # out of range -> dropped by the scatter
    row = pos_bt % page_size
    new = {name: cache[name].at[page, row].set(x.astype(cache[name].dtype), mode="drop")
           for name, x in entries_bt.items()}
    new["page_table"] = table
    return new


def paged_cached_attention(cache: dict, entries_bt: dict, pos_bt, attend):
    """`cached_attention` over a paged layer: the chunk is written into its pages first, then
    each row's leading pages are gathered ([B, n * page_size, ...], key position = index) and
    attended with the causal mask; n is the smallest of `decode_buckets(max_pages)` that covers
    the batch's largest position, so reads follow the longest sequence."""
    new_cache = write_pages(cache, entries_bt, pos_bt)
    table = new_cache["page_table"]
    page_size = new_cache[next(iter(entries_bt))].shape[1]
    b, max_pages = table.shape
    sizes = decode_buckets(max_pages)

    def read(n):
        keys = {name: gather_pages(new_cache[name], table[:, :n]) for name in entries_bt}
        k_pos = jnp.broadcast_to(jnp.arange(n * page_size, dtype=jnp.int32), (b, n * page_size))
        return attend(keys, k_pos)

    if len(sizes) == 1:
        return read(sizes[0]), new_cache
    need = jnp.max(pos_bt) // page_size + 1
    index = sum((need > n).astype(jnp.int32) for n in sizes[:-1])
    out = jax.lax.switch(index, [lambda n=n: read(n) for n in sizes])
    return out, new_cache


def paged_decode_on_local_shards(q, k, v, cache: dict, pos_bt, window, dtype):
    """(out [B, Hq, D], new cache): write one token's k, v [B, 1, Hkv, D] into a paged layer and
    attend on the paged Pallas kernel, under `shard_map` over the context mesh as
    `on_local_shards` splits it: the batch (and the page table's rows) over the activation batch
    axes, the pool's pages over the same axes, heads over tensor when they divide. The engine
    gives a slot only pages of its own shard's range (`rollout.page_table.PagePool`), so each shard
    turns page ids into its local ones; entries outside the range (scratch) read its first page.
    """
    def run(q, k, v, k_pool, v_pool, table, pos, first_page):
        local = table - first_page
        local = jnp.where((local >= 0) & (local < k_pool.shape[0]), local, 0)
        new = write_pages({"k": k_pool, "v": v_pool, "page_table": local}, {"k": k, "v": v}, pos)
        lengths = jnp.maximum(pos[:, 0] + 1, 0)
        out = paged_decode_attention(q, new["k"].astype(dtype), new["v"].astype(dtype), local,
                                     lengths, window=window, impl="pallas")
        return out, new["k"], new["v"]

    args = (q, k, v, cache["k"], cache["v"], cache["page_table"], pos_bt)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.auto_axes or mesh.size == 1:
        out, k_pool, v_pool = run(*args, 0)
    else:
        batch = shd.activation_spec(q.shape[:1], ("activation_batch",), mesh)[0]
        q_heads = shd.activation_spec(q.shape[1:2], ("activation_heads",), mesh)[0]
        kv_heads = shd.activation_spec(k.shape[2:3], ("activation_kv_heads",), mesh)[0]
        heads = q_heads if q_heads == kv_heads else None
        P = jax.sharding.PartitionSpec
        q_spec, kv_spec, rows = P(batch, heads, None), P(batch, None, heads, None), P(batch, None)

        def local(*xs):
            first = 0 if batch is None else jax.lax.axis_index(batch) * xs[3].shape[0]
            return run(*xs, first)

        out, k_pool, v_pool = jax.shard_map(
            local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, kv_spec, kv_spec, rows, rows),
            out_specs=(q_spec, kv_spec, kv_spec), check_vma=False)(*args)
    return out, {"k": k_pool, "v": v_pool, "page_table": cache["page_table"]}


class _Rope:
    """RoPE of one layer: the frequency table is a static tuple (hashable graph data)."""

    def __init__(self, cfg: ModelConfig, dim: int):
        inv_freq, self.scale = rope_frequencies(cfg, dim)
        self.inv_freq = tuple(float(f) for f in inv_freq)
        self.exact = cfg.batch_invariant

    def __call__(self, x_bthd, positions_bt):
        return rope(x_bthd, positions_bt, self.inv_freq, self.scale, exact=self.exact)


class Attention(nnx.Module):
    """One GQA layer; `kind` is "local" (sliding window) or "global" (full causal).

    Local layers always use RoPE; global layers use it when `rope_global` (the open families) and
    no positional encoding otherwise (MAI's NoPE global layers).
    """

    def __init__(self, cfg: ModelConfig, kind: str, *, rngs: nnx.Rngs):
        d, hq, hkv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq = param(rngs, (d, hq, hd), ("embed", "q_heads", "head_dim"))
        self.wk = param(rngs, (d, hkv, hd), ("embed", "kv_heads", "head_dim"))
        self.wv = param(rngs, (d, hkv, hd), ("embed", "kv_heads", "head_dim"))
        self.wo = param(rngs, (hq, hd, d), ("q_heads", "head_dim", "embed"), std=(hq * hd) ** -0.5)
        if cfg.attention_bias:
            self.bq = param(rngs, (hq, hd), ("q_heads", "head_dim"), value=0.0)
            self.bk = param(rngs, (hkv, hd), ("kv_heads", "head_dim"), value=0.0)
            self.bv = param(rngs, (hkv, hd), ("kv_heads", "head_dim"), value=0.0)
            self.bo = param(rngs, (d,), ("embed",), value=0.0)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, eps=cfg.norm_eps, exact=cfg.batch_invariant, rngs=rngs)
            self.k_norm = RMSNorm(hd, eps=cfg.norm_eps, exact=cfg.batch_invariant, rngs=rngs)
        if cfg.attention_sinks:
            self.sinks = param(rngs, (hq,), ("q_heads",), value=0.0)
        self.has_bias, self.has_qk_norm, self.has_sinks = (
            cfg.attention_bias, cfg.qk_norm, cfg.attention_sinks
        )
        self.kind = kind
        self.window = cfg.window if kind == "local" else None
        self.rope = _Rope(cfg, hd) if (kind == "local" or cfg.rope_global) else None
        self.dtype = cfg.compute_dtype
        self.attention_impl = cfg.attention_impl
        self.exact_tile = cfg.exact_tile

    @property
    def use_kernel(self) -> bool:
        """Pallas kernels or XLA, decided when traced (for the platform compiled for). The
        kernels have no sink term; with sinks the XLA path runs on every backend. Exact mode
        runs `pallas_kernels.batch_invariant.attention` everywhere."""
        if self.exact_tile is not None:
            return False
        return self_attention_impl(self.attention_impl, sinks=self.has_sinks) == "pallas"

    @staticmethod
    def cache_entries(cfg: ModelConfig) -> dict:
        return {"k": (cfg.num_kv_heads, cfg.head_dim), "v": (cfg.num_kv_heads, cfg.head_dim)}

    def _project(self, x, name):
        y = project(x, getattr(self, "w" + name)[...].astype(self.dtype), tile=self.exact_tile)
        if self.has_bias:
            y = y + getattr(self, "b" + name)[...].astype(self.dtype)
        return y

    def __call__(self, x_btd, positions_bt, segment_ids_bt, cache: dict | None = None):
        dt = self.dtype
        x = x_btd.astype(dt)
        q, k, v = self._project(x, "q"), self._project(x, "k"), self._project(x, "v")
        if self.has_qk_norm:
            q = self.q_norm(q).astype(dt)
            k = self.k_norm(k).astype(dt)
        if self.rope is not None:
            q = self.rope(q, positions_bt)
            k = self.rope(k, positions_bt)
        q, k, v = shd.constrain(q, _Q_BTHD), shd.constrain(k, _KV_BTHD), shd.constrain(v, _KV_BTHD)
        sinks = self.sinks[...] if self.has_sinks else None
        ring = self.kind == "local"

        new_cache = None
        exact = self.exact_tile is not None
        if cache is None and exact:
            mask = attention_mask(positions_bt, positions_bt, segment_ids_bt, segment_ids_bt,
                                  self.window)
            grad = functools.partial(_attend_self_grad, window=self.window,
                                     impl=self.attention_impl)
            out = bi.attention(q, k, v, mask, sinks_h=sinks, causal=True, grad_form=grad,
                               grad_args=(positions_bt, segment_ids_bt))
        elif cache is None:
            out = self._attend_self(q, k, v, positions_bt, segment_ids_bt, sinks)
        elif is_paged(cache) and self.use_kernel and q.shape[1] == 1:
            # One-token decode over the page pool on the paged Pallas kernel, per shard.
            out, new_cache = paged_decode_on_local_shards(q[:, 0], k, v, cache, positions_bt,
                                                          self.window, dt)
            out = out[:, None]
        elif self.use_kernel and q.shape[1] == 1:
            # One-token decode on the Pallas kernel: store first, then attend over the cache.
            new_cache = write_cache(cache, {"k": k, "v": v}, positions_bt, ring=ring)
            lengths = jnp.maximum(positions_bt[:, 0] + 1, 0)
            kernel = lambda q, k, v, n: decode_attention(  # noqa: E731
                q, k, v, n, window=self.window, ring=ring, impl="pallas")
            out = on_local_shards(kernel, q[:, 0], new_cache["k"].astype(dt),
                                  new_cache["v"].astype(dt), lengths)[:, None]
        else:
            def attend(keys, k_pos):
                mask = attention_mask(positions_bt, k_pos, None, None, self.window)
                form = bi.attention if exact else gqa_attention
                return form(q, keys["k"].astype(dt), keys["v"].astype(dt), mask, sinks_h=sinks)

            if is_paged(cache):
                out, new_cache = paged_cached_attention(cache, {"k": k, "v": v}, positions_bt,
                                                        attend)
            else:
                out, new_cache = cached_attention(cache, {"k": k, "v": v}, positions_bt, ring,
                                                  attend, write_first=exact)
        out = shd.constrain(out, _Q_BTHD)
        y = project(out.astype(dt), self.wo[...].astype(dt), 2, tile=self.exact_tile)
        if self.has_bias:
            y = y + self.bo[...].astype(dt)
        return y, new_cache

    def _attend_self(self, q, k, v, positions_bt, segment_ids_bt, sinks):
        return attend_self(q, k, v, positions_bt, segment_ids_bt, window=self.window,
                           sinks_h=sinks, impl=self.attention_impl)


def _attend_self_grad(q, k, v, sinks_h, positions_bt, segment_ids_bt, *, window, impl):
    """Exact mode's backward form of the training forward's attention: `attend_self`, the
    default mode's (blocked, or the flash kernel); the forward's bits are not its concern."""
    return attend_self(q, k, v, positions_bt, segment_ids_bt, window=window, impl=impl,
                       sinks_h=sinks_h)


def attend_self(q, k, v, positions_bt, segment_ids_bt, *, window: int | None,
                impl: str, sinks_h=None, scale: float | None = None):
    """The full forward's self-attention (no cache) on the implementation `impl` resolves to
    (`self_attention_impl`): the flash kernel per device shard, or the blocked / dense XLA form
    over the global arrays, which XLA partitions. q [B, T, Hq, D], k [B, T, Hkv, D],
    v [B, T, Hkv, Dv]; `scale` defaults to D**-0.5."""
    chosen = self_attention_impl(impl, sinks=sinks_h is not None)
    if chosen == "pallas":
        # The flash kernel masks by index (causal, window) and segment ids; rows whose
        # positions restart per document are handled by the segment ids.
        kernel = lambda q, k, v, seg: self_attention(  # noqa: E731
            q, k, v, None, seg, window=window, scale=scale, impl="pallas")
        return on_local_shards(kernel, q, k, v, segment_ids_bt)
    return self_attention(q, k, v, positions_bt, segment_ids_bt, window=window, sinks_h=sinks_h,
                          scale=scale, impl=chosen)


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim**-0.5, times mscale² under YaRN with mscale_all_dim (DeepSeek-V3)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim and cfg.rope_factor > 1:
        m = 0.1 * cfg.rope_mscale_all_dim * math.log(cfg.rope_factor) + 1.0
        scale *= m * m
    return scale


class MLAttention(nnx.Module):
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2).

    q = W_qb · norm(W_qa · x) (or W_q · x), split per head into a no-RoPE and a RoPE part;
    [c, k_pe] = W_kva · x with c the kv latent (normed) and k_pe one RoPE key shared by all heads;
    [k_nope, v] = W_kvb · c per head. The cache stores c and k_pe only (kv_lora_rank + rope dims a
    position, against 2·H·D for GQA); cached attention contracts queries against the latent
    directly (W_kvb's key half folded into q, its value half applied after the weighted sum).
    """

    def __init__(self, cfg: ModelConfig, kind: str, *, rngs: nnx.Rngs):
        d, h = cfg.d_model, cfg.num_heads
        nope, rd, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        r_q, r_kv = cfg.q_lora_rank, cfg.kv_lora_rank
        if r_q:
            self.wq_a = param(rngs, (d, r_q), ("embed", "q_lora"))
            self.q_norm = RMSNorm(r_q, eps=cfg.norm_eps, exact=cfg.batch_invariant, rngs=rngs)
            self.wq_b = param(rngs, (r_q, h, nope + rd), ("q_lora", "q_heads", "head_dim"))
        else:
            self.wq = param(rngs, (d, h, nope + rd), ("embed", "q_heads", "head_dim"))
        self.wkv_a = param(rngs, (d, r_kv + rd), ("embed", "kv_lora"))
        self.kv_norm = RMSNorm(r_kv, eps=cfg.norm_eps, exact=cfg.batch_invariant, rngs=rngs)
        self.wkv_b = param(rngs, (r_kv, h, nope + vd), ("kv_lora", "q_heads", "head_dim"))
        self.wo = param(rngs, (h, vd, d), ("q_heads", "head_dim", "embed"), std=(h * vd) ** -0.5)
        self.q_lora = bool(r_q)
        self.nope, self.rope_dim, self.kv_rank = nope, rd, r_kv
        self.kind = kind
        self.window = cfg.window if kind == "local" else None
        self.rope = _Rope(cfg, rd)
        self.scale = mla_softmax_scale(cfg)
        self.dtype = cfg.compute_dtype
        self.attention_impl = cfg.attention_impl
        self.exact_tile = cfg.exact_tile

    @staticmethod
    def cache_entries(cfg: ModelConfig) -> dict:
        return {"c": (cfg.kv_lora_rank,), "k_pe": (cfg.qk_rope_head_dim,)}

    def __call__(self, x_btd, positions_bt, segment_ids_bt, cache: dict | None = None):
        if self.exact_tile is not None:
            return self._exact(x_btd, positions_bt, segment_ids_bt, cache)
        dt = self.dtype
        x = x_btd.astype(dt)
        if self.q_lora:
            q_lat = self.q_norm(x @ self.wq_a[...].astype(dt)).astype(dt)
            q = jnp.einsum("btr,rhk->bthk", q_lat, self.wq_b[...].astype(dt))
        else:
            q = jnp.einsum("btd,dhk->bthk", x, self.wq[...].astype(dt))
        q = shd.constrain(q, _Q_BTHD)
        q_nope, q_pe = q[..., : self.nope], self.rope(q[..., self.nope :], positions_bt)
        kv_a = x @ self.wkv_a[...].astype(dt)
        c = self.kv_norm(kv_a[..., : self.kv_rank]).astype(dt)  # [B, T, R]
        k_pe = self.rope(kv_a[..., None, self.kv_rank :], positions_bt)[:, :, 0]  # [B, T, P]
        wkv_b = self.wkv_b[...].astype(dt)

        new_cache = None
        if cache is None:
            # Up-projected keys and values per head, then self-attention as any layer runs it
            # (flash kernel on GPU/TPU, blocked on CPU: no T x T scores in HBM), with MLA's own
            # scale and 128-wide values beside 192-wide queries and keys. The shared RoPE key is
            # copied into every head's key ([B, T, H, rope_dim], a third of the key): the kernels
            # take one key tensor.
            kv = jnp.einsum("btr,rhk->bthk", c, wkv_b)
            k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
            k_pe_h = jnp.broadcast_to(k_pe[:, :, None], (*k_nope.shape[:3], self.rope_dim))
            q_full = jnp.concatenate([q_nope, q_pe], -1)
            k_full = shd.constrain(jnp.concatenate([k_nope, k_pe_h], -1), _KV_BTHD)
            v = shd.constrain(v, _KV_BTHD)
            out = attend_self(q_full, k_full, v, positions_bt, segment_ids_bt,
                              window=self.window, impl=self.attention_impl, scale=self.scale)
        else:
            # Absorbed form over the compressed cache: one shared "key head" [c, k_pe] and one
            # shared "value head" c; W_kvb's key half moves to the query, its value half after.
            entries = {"c": c, "k_pe": k_pe}
            q_abs = jnp.einsum("bthn,rhn->bthr", q_nope, wkv_b[..., : self.nope])

            def attend(keys, k_pos):
                key = jnp.concatenate([keys["c"], keys["k_pe"]], -1).astype(dt)[:, :, None]
                mask = attention_mask(positions_bt, k_pos, None, None, self.window)
                return gqa_attention(
                    jnp.concatenate([q_abs, q_pe], -1), key, keys["c"].astype(dt)[:, :, None],
                    mask, scale=self.scale,
                )

            if is_paged(cache):  # the latent pages through the gather path (see README)
                out_lat, new_cache = paged_cached_attention(cache, entries, positions_bt, attend)
            else:
                out_lat, new_cache = cached_attention(cache, entries, positions_bt,
                                                      self.kind == "local", attend)
            out = jnp.einsum("bthr,rhv->bthv", out_lat.astype(dt), wkv_b[..., self.nope :])
        out = shd.constrain(out, _Q_BTHD)
        y = jnp.einsum("bthv,hvd->btd", out.astype(dt), self.wo[...].astype(dt))
        return y, new_cache


    def _exact(self, x_btd, positions_bt, segment_ids_bt, cache):
        """Exact mode: batch-invariant projections and attention, and no absorbed form: a
        cached latent is up-projected to its key and value as the full forward does, so a
        decode step computes each key to the bit as the learner's forward does."""
        dt, tile = self.dtype, self.exact_tile
        x = x_btd.astype(dt)
        if self.q_lora:
            q_lat = self.q_norm(project(x, self.wq_a[...].astype(dt), tile=tile)).astype(dt)
            q = project(q_lat, self.wq_b[...].astype(dt), tile=tile)
        else:
            q = project(x, self.wq[...].astype(dt), tile=tile)
        q = jnp.concatenate([q[..., : self.nope], self.rope(q[..., self.nope :], positions_bt)],
                            -1)
        kv_a = project(x, self.wkv_a[...].astype(dt), tile=tile)
        c = self.kv_norm(kv_a[..., : self.kv_rank]).astype(dt)  # [B, T, R]
        k_pe = self.rope(kv_a[..., None, self.kv_rank :], positions_bt)[:, :, 0]  # [B, T, P]
        wkv_b = self.wkv_b[...].astype(dt)

        def attend(c_bsr, k_pe_bsp, mask, causal=False):
            kv = project(c_bsr.astype(dt), wkv_b, tile=tile)
            k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
            k_pe_h = jnp.broadcast_to(k_pe_bsp.astype(dt)[:, :, None],
                                      (*k_nope.shape[:3], self.rope_dim))
            return bi.attention(q, jnp.concatenate([k_nope, k_pe_h], -1), v, mask,
                                scale=self.scale, causal=causal)

        new_cache = None
        if cache is None:
            mask = attention_mask(positions_bt, positions_bt, segment_ids_bt, segment_ids_bt,
                                  self.window)
            out = attend(c, k_pe, mask, causal=True)
        else:
            def attend_cached(keys, k_pos):
                mask = attention_mask(positions_bt, k_pos, None, None, self.window)
                return attend(keys["c"], keys["k_pe"], mask)

            entries = {"c": c, "k_pe": k_pe}
            if is_paged(cache):
                out, new_cache = paged_cached_attention(cache, entries, positions_bt,
                                                        attend_cached)
            else:
                out, new_cache = cached_attention(cache, entries, positions_bt,
                                                  self.kind == "local", attend_cached,
                                                  write_first=True)
        y = project(out.astype(dt), self.wo[...].astype(dt), 2, tile=tile)
        return y, new_cache


def make_attention(cfg: ModelConfig, kind: str, *, rngs: nnx.Rngs) -> Attention | MLAttention:
    """The attention layer `cfg.attention_type` names."""
    cls = MLAttention if cfg.attention_type == "mla" else Attention
    return cls(cfg, kind, rngs=rngs)


def attention_cache_entries(cfg: ModelConfig) -> dict:
    cls = MLAttention if cfg.attention_type == "mla" else Attention
    return cls.cache_entries(cfg)

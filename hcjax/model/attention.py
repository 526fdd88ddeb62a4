"""Grouped-query attention for local (sliding-window, RoPE) and global (NoPE) layers, with KV cache.

Scores and softmax are fp32. K/V are never repeated per query head: queries are reshaped to
[B, T, Hkv, G, D] and contracted against [B, S, Hkv, D]. Masks are built from token positions
(causal, window) and segment ids (packed rows), so the same code serves the full forward and cached
generation. A cache layer holds `k`, `v` ([B, S, Hkv, D]) and `pos` ([B, S], -1 = empty); local
layers keep a ring buffer of `window` slots (position p lives in slot p % window).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from hcjax.model.config import ModelConfig, use_pallas
from hcjax.model.layers import param, rope

_MASKED = -1e30  # finite, so a fully masked row (a padding query) gives no NaN


def attention_mask(q_pos, k_pos, q_seg, k_seg, window: int | None):
    """[B, T, S] bool: key visible to query. Positions < 0 are padding / empty cache slots."""
    visible = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] >= 0)
    if window is not None:
        visible &= q_pos[:, :, None] - k_pos[:, None, :] < window
    if q_seg is not None:
        visible &= q_seg[:, :, None] == k_seg[:, None, :]
    return visible


def gqa_attention(q_bthd, k_bshd, v_bshd, mask_bts):
    """Softmax attention with grouped K/V heads; fp32 scores and statistics."""
    b, t, hq, d = q_bthd.shape
    hkv = k_bshd.shape[2]
    q = q_bthd.reshape(b, t, hkv, hq // hkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k_bshd, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    scores = jnp.where(mask_bts[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_bshd.dtype), v_bshd)
    return out.reshape(b, t, hq, d)


def init_layer_cache(batch: int, slots: int, num_kv_heads: int, head_dim: int, dtype) -> dict:
    return {
        "k": jnp.zeros((batch, slots, num_kv_heads, head_dim), dtype),
        "v": jnp.zeros((batch, slots, num_kv_heads, head_dim), dtype),
        "pos": jnp.full((batch, slots), -1, jnp.int32),
    }


def write_cache(cache: dict, k_bthd, v_bthd, pos_bt, ring: bool) -> dict:
    """Scatter a chunk's keys/values into the cache; ring buffers keep only the last `slots`."""
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
    return {
        "k": cache["k"].at[rows, slot].set(k_bthd.astype(cache["k"].dtype), mode="drop"),
        "v": cache["v"].at[rows, slot].set(v_bthd.astype(cache["v"].dtype), mode="drop"),
        "pos": cache["pos"].at[rows, slot].set(pos_bt, mode="drop"),
    }


class Attention(nnx.Module):
    """One attention layer; `kind` is "local" (window + RoPE) or "global" (full causal, NoPE)."""

    def __init__(self, cfg: ModelConfig, kind: str, *, rngs: nnx.Rngs):
        d, hq, hkv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq = param(rngs, (d, hq, hd), ("embed", "q_heads", "head_dim"))
        self.wk = param(rngs, (d, hkv, hd), ("embed", "kv_heads", "head_dim"))
        self.wv = param(rngs, (d, hkv, hd), ("embed", "kv_heads", "head_dim"))
        self.wo = param(rngs, (hq, hd, d), ("q_heads", "head_dim", "embed"), std=(hq * hd) ** -0.5)
        self.kind = kind
        self.window = cfg.window if kind == "local" else None
        self.rope_theta = cfg.rope_theta
        self.dtype = cfg.compute_dtype
        self.use_kernel = use_pallas(cfg.attention_impl)

    def __call__(self, x_btd, positions_bt, segment_ids_bt, cache: dict | None = None):
        dt = self.dtype
        x = x_btd.astype(dt)
        q = jnp.einsum("btd,dhk->bthk", x, self.wq[...].astype(dt))
        k = jnp.einsum("btd,dhk->bthk", x, self.wk[...].astype(dt))
        v = jnp.einsum("btd,dhk->bthk", x, self.wv[...].astype(dt))
        if self.kind == "local":  # global layers use no positional encoding (NoPE)
            q = rope(q, positions_bt, self.rope_theta)
            k = rope(k, positions_bt, self.rope_theta)

        new_cache = None
        if cache is None:
            out = self._attend_self(q, k, v, positions_bt, segment_ids_bt)
        elif self.use_kernel and q.shape[1] == 1:
            # One-token decode on the Pallas kernel: store first, then attend over the cache.
            new_cache = write_cache(cache, k, v, positions_bt, ring=self.kind == "local")
            lengths = jnp.maximum(positions_bt[:, 0] + 1, 0)
            out = pallas_kernels.decode_attention(
                q[:, 0], new_cache["k"].astype(dt), new_cache["v"].astype(dt), lengths,
                window=self.window, ring=self.kind == "local", impl="pallas",
            )[:, None]
        else:
            # Attend to what the cache held before this chunk plus the chunk itself, then store
            # the chunk; one row = one sequence, so segment ids are not used here.
            keys = jnp.concatenate([cache["k"], k.astype(cache["k"].dtype)], axis=1)
            vals = jnp.concatenate([cache["v"], v.astype(cache["v"].dtype)], axis=1)
            k_pos = jnp.concatenate([cache["pos"], positions_bt], axis=1)
            mask = attention_mask(positions_bt, k_pos, None, None, self.window)
            out = gqa_attention(q, keys.astype(dt), vals.astype(dt), mask)
            new_cache = write_cache(cache, k, v, positions_bt, ring=self.kind == "local")
        y = jnp.einsum("bthk,hkd->btd", out.astype(dt), self.wo[...].astype(dt))
        return y, new_cache

    def _attend_self(self, q, k, v, positions_bt, segment_ids_bt):
        if self.use_kernel:
            # The kernel masks by index (causal, window) and segment ids; rows whose positions
            # restart per document are handled by the segment ids.
            return pallas_kernels.flash_attention(
                q, k, v, causal=True, window=self.window, segment_ids=segment_ids_bt,
                impl="pallas",
            )
        mask = attention_mask(
            positions_bt, positions_bt, segment_ids_bt, segment_ids_bt, self.window
        )
        return gqa_attention(q, k, v, mask)

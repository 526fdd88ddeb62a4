"""Prefix reuse for prefill: a bounded, block-hashed store of prompt KV entries, and the cache-layout
functions that move blocks in and out of the model's KV cache.

A prompt is cut into blocks of `block_size` tokens. A block is keyed by (its parent block, its
tokens), so a block stands for the whole prefix that ends with it, and every prompt that starts
with the same tokens (system prompt, few-shot examples, the history of a multi-turn episode) finds
the same chain of blocks: their KV entries are stored once and shared. Blocks are keyed by weight
version too; entries computed with other weights are never reused.

Layout (hcjax.model.attention): every cache leaf is [..., B, S, ...] with the slot axis right after
the batch axis, and each layer's `pos` leaf says which position a slot holds (-1 = empty). Global
layers hold position p in slot p; local (sliding-window) layers keep a ring of `window` slots, so a
finished prefill has lost the local entries of all but its last `window` positions. The engine
therefore prefills into a *wide* cache, where every layer has `max_len` slots (attention is masked
by position, so the window still applies and the result is the same), stores blocks from it, and
folds it into the ring layout of the decode state with `to_decode_layout`.

This module holds no model code and does not run the model; `PrefillCaches` jits these functions
for the engine.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Block",
    "PrefillCaches",
    "PrefixCache",
    "assemble_blocks",
    "batched_shapes",
    "block_at",
    "empty_block",
    "empty_wide_cache",
    "to_decode_layout",
    "wide_shapes",
]


@dataclasses.dataclass(eq=False)
class Block:
    """`block_size` prompt tokens' KV entries (a cache-shaped tree with S = block_size, B = 1) and
    the experts chosen for them ([num_moe_layers, block_size, k], host memory)."""

    uid: int
    key: tuple  # (parent uid or version root, tokens)
    version: int
    kv: Any
    routing: np.ndarray


class PrefixCache:
    """Thread-safe LRU store of `Block`s, at most `max_blocks` of them.

    `lookup` returns the longest chain of stored blocks that starts the prompt; `extend` adds the
    blocks that follow it. A lookup refreshes its chain from the last block to the first, so the
    least recently used block is always a chain's tail before its head: eviction drops the ends
    of old prompts first and keeps shared heads (a system prompt) for as long as they are used.
    """

    def __init__(self, block_size: int = 16, max_blocks: int = 1024) -> None:
        for name, value in [("block_size", block_size), ("max_blocks", max_blocks)]:
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._blocks: collections.OrderedDict[tuple, Block] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._next_uid = 0
        self._newest_version: int | None = None
        self.evicted = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    def _chunks(self, tokens: np.ndarray, limit: int):
        bs = self.block_size
        for i in range(min(limit, tokens.shape[0]) // bs):
            yield tuple(int(t) for t in tokens[i * bs : (i + 1) * bs])

    def lookup(self, tokens: Sequence[int] | np.ndarray, version: int, limit: int) -> list[Block]:
        """The stored blocks covering the longest prefix of `tokens` of at most `limit` tokens."""
        tokens = np.asarray(tokens).reshape(-1)
        with self._lock:
            if self._newest_version is None or version > self._newest_version:
                # Weights only move forward: entries of older versions can never be hit again.
                self._newest_version = version
                for key in [k for k, b in self._blocks.items() if b.version != version]:
                    self._drop(key)
            chain: list[Block] = []
            parent: Any = ("version", version)
            for chunk in self._chunks(tokens, limit):
                block = self._blocks.get((parent, chunk))
                if block is None:
                    break
                chain.append(block)
                parent = block.uid
            for block in reversed(chain):
                self._blocks.move_to_end(block.key)
            return chain

    def extend(
        self, tokens: Sequence[int] | np.ndarray, version: int, chain: Sequence[Block],
        new: Sequence[tuple[Any, np.ndarray]],
    ) -> list[Block]:
        """Store `new` = [(kv, routing), ...], the blocks that follow `chain` in `tokens`."""
        tokens = np.asarray(tokens).reshape(-1)
        first = len(chain)
        chunks = list(self._chunks(tokens, (first + len(new)) * self.block_size))[first:]
        if len(chunks) != len(new):
            raise ValueError(f"{len(new)} blocks given but tokens hold {len(chunks)} after the chain")
        stored = []
        with self._lock:
            parent: Any = chain[-1].uid if chain else ("version", version)
            for chunk, (kv, routing) in zip(chunks, new):
                key = (parent, chunk)
                block = self._blocks.get(key)
                if block is None:  # another prefill may have stored it meanwhile
                    block = Block(self._next_uid, key, version, kv, routing)
                    self._next_uid += 1
                    self._blocks[key] = block
                stored.append(block)
                parent = block.uid
            for block in reversed(stored):
                self._blocks.move_to_end(block.key)
            while len(self._blocks) > self.max_blocks:
                self._drop(next(iter(self._blocks)))
        return stored

    def _drop(self, key: tuple) -> None:
        del self._blocks[key]
        self.evicted += 1

    def clear(self) -> None:
        """Forget every block (weights went back to an older version: a restarted learner
        reuses version numbers, so a stored block's version no longer names its weights)."""
        with self._lock:
            for key in list(self._blocks):
                self._drop(key)
            self._newest_version = None


# Cache layout ---------------------------------------------------------------------------------
def _is_pos(path) -> bool:
    last = path[-1]
    return getattr(last, "key", None) == "pos"


def wide_shapes(decode_shapes: Any, batch_axes: Any, max_len: int) -> Any:
    """ShapeDtypeStructs of the wide prefill cache: every slot axis `max_len` long."""

    def widen(shape, axis):
        dims = list(shape.shape)
        dims[axis + 1] = max_len
        return jax.ShapeDtypeStruct(tuple(dims), shape.dtype)

    return jax.tree.map(widen, decode_shapes, batch_axes)


def batched_shapes(shapes: Any, batch_axes: Any, batch: int) -> Any:
    """`shapes` (batch 1) with every batch axis `batch` long (a batched prefill's cache)."""

    def grow(shape, axis):
        dims = list(shape.shape)
        dims[axis] = batch
        return jax.ShapeDtypeStruct(tuple(dims), shape.dtype)

    return jax.tree.map(grow, shapes, batch_axes)


def empty_wide_cache(shapes: Any) -> Any:
    """An empty cache of `shapes` (from `wide_shapes`): zero entries, every `pos` -1."""
    return jax.tree_util.tree_map_with_path(
        lambda path, s: jnp.full(s.shape, -1 if _is_pos(path) else 0, s.dtype), shapes
    )


def empty_block(shapes: Any, batch_axes: Any, block_size: int) -> Any:
    """A block that holds nothing (pads a list of blocks to a compiled length)."""
    return empty_wide_cache(wide_shapes(shapes, batch_axes, block_size))


def block_at(wide: Any, start: jax.Array, batch_axes: Any, block_size: int) -> Any:
    """Slots [start, start + block_size) of every leaf of a wide cache."""
    return jax.tree.map(
        lambda x, a: jax.lax.dynamic_slice_in_dim(x, start, block_size, axis=a + 1),
        wide, batch_axes,
    )


def assemble_blocks(blocks: Sequence[Any], shapes: Any, batch_axes: Any) -> Any:
    """A wide cache (of `shapes`) holding `blocks` in order from slot 0, empty after them."""

    def put(path, s, axis, *parts):
        joined = jnp.concatenate(parts, axis=axis + 1)
        fresh = jnp.full(s.shape, -1 if _is_pos(path) else 0, s.dtype)
        return jax.lax.dynamic_update_slice_in_dim(fresh, joined.astype(s.dtype), 0, axis=axis + 1)

    return jax.tree_util.tree_map_with_path(put, shapes, batch_axes, *blocks)


def to_decode_layout(wide: Any, length: jax.Array, decode_shapes: Any, batch_axes: Any) -> Any:
    """Fold a wide cache holding positions [0, length) into the decode layout.

    A leaf whose decode slot axis is shorter than the wide one is a ring of S slots: slot j holds
    the newest position p < length with p % S == j (empty when there is none), exactly what
    writing positions 0..length-1 into the ring one after another would leave there.
    """

    def fold(path, x, shape, axis):
        s = shape.shape[axis + 1]
        if s == x.shape[axis + 1]:
            return x
        j = jnp.arange(s, dtype=jnp.int32)
        last = length - 1
        p = last - jnp.mod(last - j, s)  # [S], newest position of slot j; < 0 if none
        taken = jnp.take(x, jnp.maximum(p, 0), axis=axis + 1)
        bshape = [1] * x.ndim
        bshape[axis + 1] = s
        held = (p >= 0).reshape(bshape)
        empty = -1 if _is_pos(path) else 0
        return jnp.where(held, taken, jnp.asarray(empty, x.dtype))

    return jax.tree_util.tree_map_with_path(fold, wide, decode_shapes, batch_axes)


class PrefillCaches:
    """The cache-layout functions above, jitted once for one engine's cache: empty wide caches
    (one prompt, or a batch of rows), a stored chain restored into one, a prompt's new blocks
    stored from one, rows split out and stacked, and the fold into the decode layout. `store`
    is the engine's PrefixCache (None: no reuse; `lookup` then finds nothing)."""

    def __init__(self, row_shapes: Any, batch_axes: Any, max_len: int,
                 store: PrefixCache | None, replicated: Any) -> None:
        self.row_shapes, self.batch_axes, self.max_len = row_shapes, batch_axes, max_len
        self.wide_shapes = wide_shapes(row_shapes, batch_axes, max_len)
        self.store = store
        bs = store.block_size if store is not None else 1
        wide = self.wide_shapes
        self.empty = jax.jit(lambda: empty_wide_cache(wide), out_shardings=replicated)
        self.empty_rows = jax.jit(
            lambda b: empty_wide_cache(batched_shapes(wide, batch_axes, b)),
            static_argnums=(0,), out_shardings=replicated)
        self._assemble = jax.jit(lambda blocks: assemble_blocks(blocks, wide, batch_axes),
                                 out_shardings=replicated)
        self._block_at = jax.jit(lambda w, start: block_at(w, start, batch_axes, bs))
        self._empty_block_jit = jax.jit(lambda: empty_block(row_shapes, batch_axes, bs),
                                        out_shardings=replicated)
        self._empty_block = None
        self.fold = jax.jit(lambda w, n: to_decode_layout(w, n, row_shapes, batch_axes))
        self.stack = jax.jit(
            lambda rows: jax.tree.map(lambda a, *xs: jnp.concatenate(xs, axis=a), batch_axes,
                                      *rows),
            out_shardings=replicated)
        self.row = jax.jit(self._row)
        self.split_rows = jax.jit(self._split_rows)

    def _row(self, w: Any, i) -> Any:
        """Row `i` of a batched cache (a batch-1 cache)."""
        return jax.tree.map(lambda x, a: jax.lax.dynamic_slice_in_dim(x, i, 1, axis=a),
                            w, self.batch_axes)

    def _split_rows(self, w: Any, logits, lengths) -> tuple:
        """Each row of a batched prefill as (its cache in the decode layout, its logits)."""
        return tuple(
            (to_decode_layout(self._row(w, i), lengths[i], self.row_shapes, self.batch_axes),
             logits[i])
            for i in range(lengths.shape[0]))

    def lookup(self, tokens: np.ndarray, version: int) -> list[Block]:
        """The stored blocks that start `tokens` ([] without reuse); the last token is always
        computed (its logits are needed)."""
        if self.store is None:
            return []
        return self.store.lookup(tokens, version, limit=int(tokens.shape[0]) - 1)

    def reused(self, chain: Sequence[Block]) -> int:
        """Prompt tokens a chain of blocks holds."""
        return len(chain) * self.store.block_size if chain else 0

    def restore(self, chain: Sequence[Block]) -> Any:
        """A wide cache holding the chain's blocks; the list is padded with empty blocks to a
        power of two so that only a few lengths compile."""
        if self._empty_block is None:
            self._empty_block = self._empty_block_jit()
        cap = self.max_len // self.store.block_size
        width = min(1 << max(0, len(chain) - 1).bit_length(), cap)
        blocks = [b.kv for b in chain] + [self._empty_block] * (width - len(chain))
        return self._assemble(blocks)

    def store_blocks(self, w: Any, tokens: np.ndarray, version: int, chain: Sequence[Block],
                     routing: np.ndarray) -> tuple[int, ...]:
        """Store the prompt's whole blocks past `chain` (nothing without reuse); returns the uids
        of the blocks, from the first, whose stored KV is exactly `w`'s (`Prefix.blocks`): the
        chain's (restored into it) and the ones stored from it, up to one another prefill
        stored first (its entries may differ in the last bits)."""
        if self.store is None:
            return ()
        bs = self.store.block_size
        new = [
            (self._block_at(w, np.int32(i * bs)), routing[:, i * bs : (i + 1) * bs])
            for i in range(len(chain), tokens.shape[0] // bs)
        ]
        exact = [block.uid for block in chain]
        if new:
            stored = self.store.extend(tokens, version, chain, new)
            for block, (kv, _) in zip(stored, new):
                if block.kv is not kv:
                    break
                exact.append(block.uid)
        return tuple(exact)

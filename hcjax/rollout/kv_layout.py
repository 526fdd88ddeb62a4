"""Where the decode state keeps its KV cache, chosen once when the engine is built: `SlotLayout`
(every global layer holds max_target_length positions per slot) or `PagedLayout` (global layers
share a pool of pages that slots take as they grow). The engine calls the same methods on either;
neither knows about requests, sampling or the model's forward.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hcjax import sharding as shd
from hcjax.model import init_paged_cache
from hcjax.rollout.page_table import PagePool

__all__ = ["KVLayout", "PagedLayout", "SlotLayout", "batch_shards", "make_kv_layout", "pool_axes"]

# one(x, batch_axis) -> the sharding of a slot-indexed leaf (Engine.decode_state_shardings)
ShardingFn = Callable[[Any, int], NamedSharding]


def _put_rows(full: Any, row: Any, axes: Any, slot) -> Any:
    """Write a batch-1 cache `row` into batch position `slot` of `full` (leaf by leaf, each at
    its own batch axis)."""
    def put(f, one, axis):
        start = [0] * f.ndim
        start[axis] = slot
        return jax.lax.dynamic_update_slice(f, one.astype(f.dtype), start)

    return jax.tree.map(put, full, row, axes)


class SlotLayout:
    """Every slot owns max_target_length positions of every global layer (local layers keep
    their ring buffers): nothing to book on the host, admission counts slots only."""

    name = "slot"

    def __init__(self, init_cache_fn: Callable[[int, int], Any], batch_axes: Any,
                 lock: threading.RLock) -> None:
        self._init_cache_fn, self._batch_axes, self._lock = init_cache_fn, batch_axes, lock

    def init_cache(self, batch: int, max_len: int) -> Any:
        return self._init_cache_fn(batch, max_len)

    def cache_shardings(self, cache: Any, one: ShardingFn) -> Any:
        return jax.tree.map(one, cache, self._batch_axes)

    def put(self, cache: Any, row: Any, slot, pages: tuple) -> Any:
        """(traced) The decode cache with a prefilled batch-1 `row` in `slot`."""
        return _put_rows(cache, row, self._batch_axes, slot)

    def admit(self, state: Any, slots: Sequence[int], length: int, budget: int,
              blocks: Sequence[int], width: int) -> tuple[Any, tuple]:
        """(state, per-slot arguments of `put`): none here."""
        return state, ()

    def reserve(self, state: Any, steps: int) -> Any:
        return state

    def release(self, slot: int) -> None:
        pass

    def deactivate(self, slot: int) -> None:
        pass

    def admissible(self, free: Sequence[int], prompt: int) -> int:
        return len(free)

    def stats(self) -> dict:
        return {}


def pool_axes(mesh: Mesh | None, slots: int) -> tuple[str, ...]:
    """Mesh axes the paged pool's pages are split over: the decode batch's activation axes, as
    the model's paged kernel (`attention.paged_decode_on_local_shards`) splits it."""
    if mesh is None:
        return ()
    entry = shd.activation_spec((slots,), ("activation_batch",), mesh)[0]
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def batch_shards(mesh: Mesh | None, slots: int) -> int:
    """Devices the decode batch (and the paged pool's pages) is split over."""
    return int(np.prod([mesh.shape[a] for a in pool_axes(mesh, slots)])) if mesh else 1


def update_tables(state, reset, scratch, slots, index, pages):
    """Page-table changes on every paged layer: rows of freed slots back to their scratch page,
    then single entries set (slot index B = padding, dropped)."""
    def layer(c):
        if not isinstance(c, dict) or "page_table" not in c:
            return c
        table = c["page_table"]  # [*lead, B, P]
        table = jnp.where(reset[:, None], scratch[:, None], table)
        table = table.at[..., slots, index].set(pages, mode="drop")
        return {**c, "page_table": table}

    return dataclasses.replace(state, cache=tuple(layer(c) for c in state.cache))


def _pause_row(state, slot):
    """(state with `slot` inactive, its logits row, its active flag): an inactive row does not
    advance, but the step overwrites its logits, which resuming puts back."""
    active = state.active[slot]
    return (dataclasses.replace(state, active=state.active.at[slot].set(False)),
            state.logits[slot], active)


def _resume_row(state, slot, logits, active):
    return dataclasses.replace(state, logits=state.logits.at[slot].set(logits),
                               active=state.active.at[slot].set(active))


def _put_paged(layer: dict, row: dict, axis: int, slot, pages_row, writes_row) -> dict:
    """Insert one prefilled row (slot layout, batch axis `axis`) into a paged layer: the row's
    positions page by page into the pool at `writes_row` (entries >= num_pages dropped: pages
    that already hold these entries, mapped from the prefix cache) and `pages_row` as the slot's
    page-table row (dropped entries -> 0)."""
    table = layer["page_table"]
    lead = table.ndim - 2
    max_pages = table.shape[-1]
    new = {}
    for name, pool in layer.items():
        if name == "page_table":
            continue
        num_pages, page_size = pool.shape[lead], pool.shape[lead + 1]
        x = jnp.squeeze(row[name], axis)  # [*lead, max_len, ...]
        pad = max_pages * page_size - x.shape[lead]
        if pad:
            x = jnp.pad(x, [(0, 0)] * lead + [(0, pad)] + [(0, 0)] * (x.ndim - lead - 1))
        x = x.reshape(*x.shape[:lead], max_pages, page_size, *x.shape[lead + 1:])
        at = (slice(None),) * lead + (writes_row,)
        new[name] = pool.at[at].set(x.astype(pool.dtype), mode="drop")
    kept = jnp.where(pages_row < num_pages, pages_row, 0)
    new["page_table"] = table.at[(slice(None),) * lead + (slot,)].set(kept)
    return new


class PagedLayout:
    """Global layers share a pool of `num_pages` pages of `page_size` positions (`PagePool`); a
    slot takes pages for its prompt on insert and one more each time it crosses a page boundary,
    and gives them back when freed; the samples of one `bulk_insert` share the prompt's full
    pages; local layers keep their ring buffers. num_pages None = enough for every slot at
    max_target_length (no saving; size it to the load). Page 0 of each batch shard is scratch
    that idle rows write to. Admission counts pages as well as slots; a page is granted only
    while every sequence can still finish, and a slot refused one pauses (its row inactive, its
    logits kept here) until pages come back. Prefill keeps the slot layout; `put` scatters its
    rows into pages. With prefix reuse (`blocks` of a Prefix), a prompt page that holds a cached
    block stays in the pool for that block: later prompts starting with it map the same page
    instead of writing their own; such a page no sequence holds is counted as free and taken
    back least recently used first.
    """

    name = "paged"

    def __init__(self, cfg: Any, batch_axes: Any, slots: int, max_len: int, page_size: int,
                 num_pages: int | None, mesh: Mesh | None, lock: threading.RLock) -> None:
        self.pool = PagePool(slots, max_len, page_size, num_pages, batch_shards(mesh, slots))
        self._cfg, self._batch_axes, self._mesh, self._lock = cfg, batch_axes, mesh, lock
        self._slots = slots
        self._tables_jit = jax.jit(update_tables, donate_argnums=(0,))
        self._pause_jit = jax.jit(_pause_row, donate_argnums=(0,))
        self._resume_jit = jax.jit(_resume_row, donate_argnums=(0,))
        self._paused_rows: dict[int, tuple] = {}  # slot -> (its logits, its active flag)

    def init_cache(self, batch: int, max_len: int) -> Any:
        return init_paged_cache(self._cfg, batch, max_len, self.pool.num_pages,
                                self.pool.page_size)

    def cache_shardings(self, cache: Any, one: ShardingFn) -> Any:
        """Page-table rows like any slot-indexed leaf; pools' pages split like the activation
        batch (a slot takes pages of its own shard), heads over the tensor axis when they
        divide; local layers as in the slot layout."""
        mesh, axes = self._mesh, pool_axes(self._mesh, self._slots)
        tensor = mesh.shape.get("tensor", 1)

        def paged(layer):
            lead = layer["page_table"].ndim - 2
            out = {"page_table": one(layer["page_table"], lead)}
            for name, x in layer.items():
                if name != "page_table":
                    spec = [None] * x.ndim
                    if axes:
                        spec[lead] = axes
                    if x.ndim == lead + 4 and tensor > 1 and x.shape[lead + 2] % tensor == 0:
                        spec[lead + 2] = "tensor"
                    out[name] = NamedSharding(mesh, PartitionSpec(*spec))
            return out

        return tuple(paged(c) if "page_table" in c else jax.tree.map(one, c, a)
                     for c, a in zip(cache, self._batch_axes))

    def put(self, cache: Any, row: Any, slot, pages: tuple) -> Any:
        """(traced) `row` into `slot`: pages = (the slot's page-table row, the pages to write)."""
        def layer(full, one, axes):
            if "page_table" in full:
                return _put_paged(full, one, axes["pos"], slot, *pages)
            return _put_rows(full, one, axes, slot)

        return tuple(map(layer, cache, row, self._batch_axes))

    def _sync_tables(self, state: Any) -> Any:
        """Apply the host's pending page-table changes (freed rows back to scratch, new pages)
        to every paged layer of the decode state."""
        with self._lock:
            update = self.pool.take_updates()
        return state if update is None else self._tables_jit(state, *update)

    def admit(self, state: Any, slots: Sequence[int], length: int, budget: int,
              blocks: Sequence[int], width: int) -> tuple[Any, tuple]:
        """(state with pending page-table changes applied, (page rows, rows of pages to write)
        [width, max_pages] for `slots`, padded with num_pages, which `put` drops)."""
        with self._lock:
            rows = self.pool.admit(slots, length, budget, blocks)
        padded = np.full((2, width, self.pool.max_pages), self.pool.num_pages, np.int32)
        padded[:, : len(slots)] = rows
        return self._sync_tables(state), (padded[0], padded[1])

    def reserve(self, state: Any, steps: int) -> Any:
        """Give every occupied slot the pages its next `steps` fed tokens need, never past its
        token budget; a slot refused one is paused (inactive, its logits kept) until pages come
        back."""
        with self._lock:
            pause, resume = self.pool.grow(steps)
        for slot in pause:  # keeps its logits and active flag; the step leaves the rest alone
            state, logits, active = self._pause_jit(state, np.int32(slot))
            self._paused_rows[slot] = (logits, active)
        state = self._sync_tables(state)  # its new page before it runs again
        for slot in resume:
            logits, active = self._paused_rows.pop(slot)
            state = self._resume_jit(state, np.int32(slot), logits, active)
        return state

    def release(self, slot: int) -> None:
        with self._lock:
            self.pool.release(slot)
            self._paused_rows.pop(slot, None)

    def deactivate(self, slot: int) -> None:
        """A paused slot that is stopped must not come back active."""
        if slot in self._paused_rows:
            logits, _ = self._paused_rows[slot]
            self._paused_rows[slot] = (logits, np.bool_(False))

    def admissible(self, free: Sequence[int], prompt: int) -> int:
        """Sequences of a `prompt`-token prompt and the longest budget the free slots and pages
        admit with every sequence in flight still able to finish (`PagePool.admissible`)."""
        pool = self.pool
        with self._lock:
            return sum(pool.admissible(shard, sum(1 for s in free if pool.shard_of(s) == shard),
                                       prompt)
                       for shard in range(pool.ways))

    def stats(self) -> dict:
        with self._lock:
            return self.pool.stats()


KVLayout = SlotLayout | PagedLayout


def make_kv_layout(kind: str, *, cfg: Any, init_cache_fn: Callable[[int, int], Any] | None,
                   batch_axes: Any, slots: int, max_len: int, page_size: int,
                   num_pages: int | None, mesh: Mesh | None, lock: threading.RLock) -> KVLayout:
    """The layout `kind` names ("slot" or "paged"); init_cache_fn is the slot layout's cache."""
    if kind == "slot":
        return SlotLayout(init_cache_fn, batch_axes, lock)
    return PagedLayout(cfg, batch_axes, slots, max_len, page_size, num_pages, mesh, lock)

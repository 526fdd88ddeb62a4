"""The generation engine: JetStream's `Engine` interface (jetstream/engine/engine_api.py of
google-jetstream 0.2.2: prefill / insert / generate, `ResultTokens`, tokenizer metadata) with the RL
extras (sampling and raw log-probs, top-p kept-set record, expert ids, weight version) computed
inside the jitted step, so one host copy per step carries everything, and prefix reuse across
requests (prefix_cache.py).

It runs on the model's KV-cache path: one cache row per decode slot, rows independent, local layers
in ring buffers; global layers either hold max_target_length positions per slot (kv_layout="slot")
or share a pool of pages that slots take as they grow (kv_layout="paged", `_PagePool`). It knows
nothing of requests, threads or losses; the server (server.py) does.
JetStream is optional: when it imports, `Engine` and `ResultTokens` are registered as virtual
subclasses of its abstract classes (`register_with_jetstream`); hcjax never needs it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import gin
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hcjax import sharding as shd
from hcjax.data.tokenizer import load_tokenizer
from hcjax.model import init_cache, init_paged_cache
from hcjax.rollout import prefix_cache as pc
from hcjax.rollout.request import SamplingOptions
from hcjax.rollout.sampling import sample, sampling_keys

__all__ = [
    "DecodeState",
    "Engine",
    "FlatParams",
    "Prefix",
    "ResultBlock",
    "ResultTokens",
    "SlotData",
    "TokenizerParameters",
    "VersionedParams",
    "register_with_jetstream",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VersionedParams:
    """The `params` argument of prefill / generate tagged with its weight version.

    Bare parameters (what `load_params` returns, what JetStream passes back) are version 0. The
    version is static metadata, so `jax.tree.map` over a VersionedParams maps the parameters only.
    """

    params: Any
    version: int = dataclasses.field(default=0, metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class FlatParams:
    """Parameters flattened once (`Engine.flatten_params`): the leaves, their tree structure and
    the weight version. `generate_block` takes them without walking the parameter tree (an
    nnx.State of hundreds of leaves is flattened in Python) on every call."""

    leaves: tuple
    treedef: Any
    version: int = 0


def _split_params(params: Any) -> tuple[Any, int]:
    if isinstance(params, VersionedParams):
        return params.params, int(params.version)
    if isinstance(params, FlatParams):
        return jax.tree.unflatten(params.treedef, params.leaves), int(params.version)
    return params, 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything the generate step needs, one row per slot ([B, ...] leaves)."""

    cache: Any  # the model's KV cache with batch = number of slots
    logits: jax.Array  # [B, V] f32: next-token logits of each row (from its last forward)
    logits_version: jax.Array  # [B] int32: weight version that computed `logits`
    positions: jax.Array  # [B] int32: absolute position of the next token to sample
    seeds: jax.Array  # [B] uint32
    sample_index: jax.Array  # [B] int32
    temperature: jax.Array  # [B] f32
    top_p: jax.Array  # [B] f32
    remaining: jax.Array  # [B] int32: tokens this slot may still generate
    generated: jax.Array  # [B] int32: tokens this slot generated since its insert
    stop_tokens: jax.Array  # [B, S] int32, -1 = unused
    active: jax.Array  # [B] bool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotData:
    """One slot's share of a ResultTokens (JetStream's SlotData): [samples, 1] tokens and
    validity, [samples] lengths."""

    tokens: Any
    valid: Any
    lengths: Any


_INDEX = dict(static=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ResultTokens:
    """One generate step's output for every slot, in JetStream's layout plus the RL extras.

    `data` [B, 3] int32 holds (token, valid, length) per slot so JetStream copies one array to the
    host; `length` counts the tokens the slot has generated since its insert, this one included.
    The extras are fields JetStream never reads. Rows with valid=0 carry no token.
    """

    data: Any  # [B, 3] int32
    tokens_idx: tuple[int, int] = dataclasses.field(metadata=_INDEX)
    valid_idx: tuple[int, int] = dataclasses.field(metadata=_INDEX)
    length_idx: tuple[int, int] = dataclasses.field(metadata=_INDEX)
    samples_per_slot: int = dataclasses.field(metadata=_INDEX)
    logprobs: Any  # [B] f32, sampling distribution (temperature, top-p, renormalised)
    raw_logprobs: Any  # [B] f32, model distribution at temperature 1
    n_kept: Any  # [B] int32, top-p support record
    threshold_logit: Any  # [B] f32
    routing: Any  # [B, num_moe_layers, k] int32: experts chosen when the token was fed
    positions: Any  # [B] int32, position of the token
    versions: Any  # [B] int32, weight version whose logits the token was drawn from
    done: Any  # [B] bool: this token ended the slot (stop token or token limit)

    @property
    def tokens(self) -> Any:
        return self.data[:, self.tokens_idx[0]]

    @property
    def valid(self) -> Any:
        return self.data[:, self.valid_idx[0]] != 0

    @property
    def lengths(self) -> Any:
        return self.data[:, self.length_idx[0]]

    def get_result_at_slot(self, slot: int) -> SlotData:
        """The `samples_per_slot` rows of `slot`."""
        lo, hi = slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot
        rows = self.data[lo:hi]
        return SlotData(
            tokens=rows[:, self.tokens_idx[0] : self.tokens_idx[1]],
            valid=rows[:, self.valid_idx[0] : self.valid_idx[1]],
            lengths=rows[:, self.length_idx[0] : self.length_idx[1]][:, 0],
        )

    def copy_to_host_async(self) -> None:
        """Start every device-to-host copy (a no-op for numpy leaves)."""
        for leaf in jax.tree.leaves(self):
            if isinstance(leaf, jax.Array):
                leaf.copy_to_host_async()

    def convert_to_numpy(self) -> ResultTokens:
        """The same result with numpy leaves (extras included)."""
        return jax.tree.map(np.asarray, self)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefix:
    """A prefilled prompt ready to be inserted into one or more slots (what `prefill` returns)."""

    cache: Any  # batch-1 cache in the decode layout, holding the prompt
    logits: Any  # [V] f32 logits after the last prompt token
    routing: Any  # [num_moe_layers, length, k] int32 experts of the prompt tokens
    length: int = dataclasses.field(metadata=dict(static=True))  # = position of the first token
    version: int = dataclasses.field(metadata=dict(static=True))
    sampling: SamplingOptions = dataclasses.field(metadata=dict(static=True))
    tokens: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    # Prefix-cache block uids whose stored KV this cache holds exactly at positions 0.. (block i
    # at [i * block_size, (i + 1) * block_size)): the paged layout maps cached pages for them.
    blocks: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ResultBlock:
    """`steps` decode steps of every slot (`Engine.generate_block`): [K, B] leaves, row i the
    ResultTokens of step i (K = the block's compiled size; rows from `steps` on are invalid)."""

    tokens: Any  # [K, B] int32
    valid: Any  # [K, B] bool: the row's slot drew a token at this step
    lengths: Any  # [K, B] int32: tokens the slot generated since its insert, this one included
    logprobs: Any  # [K, B] f32
    raw_logprobs: Any  # [K, B] f32
    n_kept: Any  # [K, B] int32
    threshold_logit: Any  # [K, B] f32
    routing: Any  # [K, B, num_moe_layers, k] int32
    positions: Any  # [K, B] int32
    versions: Any  # [K, B] int32
    done: Any  # [K, B] bool
    steps: Any  # [] int32: steps run

    def step(self, i: int) -> dict:
        """Row i as a dict of the ResultTokens fields (tests compare it with `generate`)."""
        return {f.name: getattr(self, f.name)[i] for f in dataclasses.fields(self)
                if f.name != "steps"}


@dataclasses.dataclass(frozen=True)
class TokenizerParameters:
    """What `get_tokenizer` returns: the fields of JetStream's TokenizerParameters proto. `path` is
    "byte" (hcjax's ByteTokenizer) or a Hugging Face model folder."""

    path: str = "byte"
    extra_ids: int = 0


class JetStreamTokenizer:
    """JetStream's tokenizer interface (tokenizer_api.Tokenizer) over an hcjax tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, s: str, **kwargs) -> tuple[np.ndarray, int]:
        """(padded ids, true length): BOS first unless is_bos=False, padded with pad_id to a power
        of two no longer than max_prefill_length (a longer prompt is an error, not truncated)."""
        ids = list(self.tokenizer.encode(s))
        if kwargs.get("is_bos", True):
            ids = [self.bos_id] + ids
        limit = kwargs.get("max_prefill_length")
        if limit is not None and len(ids) > limit:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds max_prefill_length={limit}")
        width = _next_pow2(max(len(ids), 1))
        if limit is not None:
            width = min(width, limit)
        padded = np.full((width,), self.pad_id, np.int32)
        padded[: len(ids)] = ids
        return (jnp.asarray(padded) if kwargs.get("jax_padding") else padded), len(ids)

    def decode(self, token_ids: Sequence[int], **kwargs) -> str:
        return self.tokenizer.decode([int(t) for t in token_ids])

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_id)

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_id)

    @property
    def bos_id(self) -> int:
        return int(self.tokenizer.bos_id)  # HFTokenizer raises a clear error when it has none

    @property
    def stop_tokens(self) -> set[int]:
        return {*getattr(self.tokenizer, "eos_ids", (self.eos_id,)), self.pad_id}


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _batch_axes(init_cache_fn: Callable[[int, int], Any], max_len: int) -> Any:
    """The batch axis of every cache leaf, found by comparing batch-1 and batch-2 shapes."""
    one = jax.eval_shape(lambda: init_cache_fn(1, max_len))
    two = jax.eval_shape(lambda: init_cache_fn(2, max_len))

    def axis(a, b):
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        if len(diff) != 1:
            raise ValueError(f"cache leaf of shape {a.shape} has no single batch axis")
        return diff[0]

    return jax.tree.map(axis, one, two)


def _pool_axes(mesh: Mesh | None, slots: int) -> tuple[str, ...]:
    """Mesh axes the paged pool's pages are split over: the decode batch's activation axes, as
    the model's paged kernel (`attention.paged_decode_on_local_shards`) splits it."""
    if mesh is None:
        return ()
    entry = shd.activation_spec((slots,), ("activation_batch",), mesh)[0]
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


class _PagePool:
    """Host-side bookkeeping of the paged layout: free lists, each slot's pages, and the page
    table changes not yet applied on device. With the decode batch split over `ways` devices,
    the pool's page axis is split the same way and a slot only takes pages of its own shard
    (each shard's first page is its scratch page). The engine's lock guards every call."""

    def __init__(self, slots: int, max_len: int, page_size: int, num_pages: int | None,
                 ways: int) -> None:
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size={page_size!r} must be a positive integer")
        self.page_size, self.ways, self.slots = page_size, ways, slots
        self.max_pages = -(-max_len // page_size)
        if num_pages is None:
            num_pages = slots * self.max_pages + ways
        if not isinstance(num_pages, int) or num_pages < 2 * ways or num_pages % ways:
            raise ValueError(f"num_pages={num_pages!r} must be a multiple of {ways} (the decode "
                             f"batch shards) with at least 2 pages each")
        self.num_pages = num_pages
        self.per_shard = num_pages // ways
        self.usable = num_pages - ways
        self._free = [list(range((w + 1) * self.per_shard - 1, w * self.per_shard, -1))
                      for w in range(ways)]  # popped from the end: lowest ids first
        self.owned: dict[int, list[int]] = {}
        self.refs: dict[int, int] = {}  # page -> slots holding it (a prompt's pages are shared)
        self.next_pos: dict[int, int] = {}  # next position each occupied slot feeds
        self.limit: dict[int, int] = {}  # one past the last position it may feed
        self._reset: dict[int, int] = {}  # slot -> scratch page its row goes back to
        self._new: list[tuple[int, int, int]] = []  # (slot, page index, page)
        self.paused: set[int] = set()  # slots waiting for a page
        self.waits = 0  # times a slot was paused for want of a page
        # Pages that hold a prefix-cache block (`Prefix.blocks`), per shard: block uid -> page.
        # Sequences whose prompts start with the block map the page instead of taking their own.
        # A cached page no sequence holds is idle: counted as free, and taken back (least
        # recently used first) when the free list runs out.
        self.cached: list[dict[int, int]] = [{} for _ in range(ways)]
        self._cached_uid: dict[int, int] = {}  # page -> the block uid it holds
        self._idle: list[collections.OrderedDict[int, int]] = [
            collections.OrderedDict() for _ in range(ways)]  # uid -> page, LRU first
        self.shared = 0  # prompt pages mapped from the cache instead of written
        self.reclaimed = 0  # idle cached pages taken back for other use

    def shard_of(self, slot: int) -> int:
        return slot // (self.slots // self.ways)

    def scratch(self, slot: int) -> int:
        return self.shard_of(slot) * self.per_shard

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def free_counts(self) -> list[int]:
        """Pages each shard can hand out: its free list and its idle cached pages."""
        return [self._avail(w) for w in range(self.ways)]

    def _avail(self, shard: int) -> int:
        return len(self._free[shard]) + len(self._idle[shard])

    def _take(self, shard: int) -> int:
        """A page of `shard` for new contents: from the free list, else the least recently used
        idle cached page (its block is forgotten here; the prefix cache may still hold it)."""
        if self._free[shard]:
            return self._free[shard].pop()
        uid, page = self._idle[shard].popitem(last=False)
        del self.cached[shard][uid], self._cached_uid[page]
        self.reclaimed += 1
        return page

    def _hits(self, shard: int, blocks: Sequence[int], full: int) -> list[int | None]:
        """For each of a prompt's `full` whole pages, the cached page holding its block or None."""
        cached = self.cached[shard]
        return [cached.get(blocks[i]) if i < len(blocks) else None for i in range(full)]

    def admit(self, slots: Sequence[int], length: int, budget: int,
              blocks: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """Pages for a `length`-token prompt in each of `slots`: ([len(slots), max_pages] page
        rows, the same rows with the pages the insert must write; unused entries = num_pages,
        which the insert's scatter drops). The slots of one shard share the prompt's full pages
        (read-only: every write is at a position past the prompt) and each gets its own copy of
        a partly filled last page. `blocks`: prefix-cache block uids whose KV the prompt's first
        pages hold exactly (`Prefix.blocks`); a page already caching one is mapped, not written,
        and a new page for one is registered for later prompts. Raises when a shard has too few
        pages free, or when admitting could leave no sequence able to finish."""
        full, part = divmod(length, self.page_size)
        part = int(part > 0)
        limit = min(length + budget, self.max_pages * self.page_size)
        for slot in slots:
            if slot in self.owned:
                raise ValueError(f"slot={slot} still holds pages (free_resource it first)")
        by_shard: dict[int, list[int]] = {}
        for slot in slots:
            by_shard.setdefault(self.shard_of(slot), []).append(slot)
        for shard, group in by_shard.items():
            hits = [p for p in self._hits(shard, blocks, full) if p is not None]
            idle = sum(1 for p in hits if p not in self.refs)  # mapped back into use
            live = len(hits) - idle  # held by running sequences already
            avail = self._avail(shard) - idle
            want = full - len(hits) + part * len(group)
            if want > avail:
                raise RuntimeError(
                    f"paged KV: {want} pages needed for {len(group)} x a {length}-token prompt, "
                    f"{avail} free in shard {shard} "
                    f"(num_pages={self.num_pages}); admit fewer sequences or raise num_pages")
            # pages only this slot would free
            held = full - live + part if len(group) == 1 else part
            new = [(self.pages_for(limit) - full - part, held)] * len(group)
            if not self._safe(avail - want, self._holdings(shard) + new):
                raise RuntimeError(
                    f"paged KV: admitting {len(group)} more {length}-token prompts (budget "
                    f"{budget}) could leave shard {shard} without pages for any sequence to "
                    f"finish (num_pages={self.num_pages}); admit fewer sequences or raise "
                    "num_pages")
        rows = np.full((len(slots), self.max_pages), self.num_pages, np.int32)
        writes = rows.copy()
        index = {slot: i for i, slot in enumerate(slots)}
        for shard, group in by_shard.items():
            hits = self._hits(shard, blocks, full)
            for i, page in enumerate(hits):  # out of the idle set before any page is taken
                if page is not None:
                    self._idle[shard].pop(blocks[i], None)
                    self.shared += 1
            shared, written = [], []
            for i, page in enumerate(hits):
                if page is not None:
                    shared.append(page)
                    continue
                page = self._take(shard)
                if i < len(blocks):
                    self.cached[shard][blocks[i]] = page
                    self._cached_uid[page] = blocks[i]
                shared.append(page)
                written.append(i)
            for slot in group:
                pages = shared + [self._take(shard) for _ in range(part)]
                for page in pages:
                    self.refs[page] = self.refs.get(page, 0) + 1
                self.owned[slot] = pages
                self.next_pos[slot] = length
                self.limit[slot] = limit
                self._reset.pop(slot, None)  # the insert rewrites the row
                self._new = [u for u in self._new if u[0] != slot]
                rows[index[slot], : len(pages)] = pages
                keep = written + list(range(full, len(pages)))
                writes[index[slot], keep] = rows[index[slot], keep]
        return rows, writes

    def _need(self, slot: int) -> int:
        """Pages `slot` may still take before its token budget runs out (its worst case)."""
        return self.pages_for(self.limit[slot]) - len(self.owned[slot])

    def _holdings(self, shard: int) -> list[tuple[int, int]]:
        """(worst-case need, pages it alone holds) of each sequence of the shard: a shared page
        only comes back with its last holder, so it counts for none (the test stays safe)."""
        return [(self._need(s), sum(1 for page in p if self.refs[page] == 1))
                for s, p in self.owned.items() if self.shard_of(s) == shard]

    @staticmethod
    def _safe(free: int, holdings: list[tuple[int, int]]) -> bool:
        """Whether every sequence can still finish in some order (the banker's test, one
        resource): taken by smallest worst-case need, each fits in what is free plus the pages
        of those finished before it."""
        for need, held in sorted(holdings):
            if need > free:
                return False
            free += held
        return True

    def admissible(self, shard: int, free_slots: int, prompt: int) -> int:
        """How many more sequences of a `prompt`-token prompt and the longest budget the shard
        can admit and stay safe (binary search; safety only gets harder with more)."""
        held = self.pages_for(prompt)
        new = (self.max_pages - held, held)
        free, base = self._avail(shard), self._holdings(shard)
        lo, hi = 0, min(free_slots, free // max(1, held))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._safe(free - mid * held, base + [new] * mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def grow(self, steps: int) -> tuple[list[int], list[int]]:
        """Pages for the next `steps` positions of every occupied slot (up to its limit), in
        admission order. A page is granted only while every sequence can still finish (the
        banker's test, `_safe`), so some sequence always can; a slot refused one waits (paused)
        until pages come back. Returns (slots to pause, paused slots to resume)."""
        pause, resume = [], []
        most = {}  # per shard, an upper bound of the needs (they only shrink while granting)
        for slot in self.owned:
            shard = self.shard_of(slot)
            most[shard] = max(most.get(shard, 0), self._need(slot))
        for slot, pages in self.owned.items():
            last = min(self.next_pos[slot] + steps, self.limit[slot]) - 1
            shard = self.shard_of(slot)
            free = self._avail(shard)
            k = max(0, -(-(last + 1) // self.page_size) - len(pages))
            granted = k <= free and (
                k == 0 or free - k >= most[shard]
                or self._safe(free - k, [(n - k, h + k) if s == slot else (n, h) for s, (n, h)
                                         in zip(self._shard_slots(shard),
                                                self._holdings(shard))]))
            if not granted:
                if slot not in self.paused:
                    self.paused.add(slot)
                    pause.append(slot)
                    self.waits += 1
                continue
            for _ in range(k):
                pages.append(self._take(shard))
                self.refs[pages[-1]] = 1
                self._new.append((slot, len(pages) - 1, pages[-1]))
            if slot in self.paused:
                self.paused.discard(slot)
                resume.append(slot)
            self.next_pos[slot] = min(self.next_pos[slot] + steps, self.limit[slot])
        return pause, resume

    def _shard_slots(self, shard: int) -> list[int]:
        return [s for s in self.owned if self.shard_of(s) == shard]

    def release(self, slot: int) -> None:
        pages = self.owned.pop(slot, None)
        if pages is None:
            return
        shard = self.shard_of(slot)
        for page in reversed(pages):
            self.refs[page] -= 1
            if not self.refs[page]:
                del self.refs[page]
                uid = self._cached_uid.get(page)
                if uid is None:
                    self._free[shard].append(page)
                else:  # keeps its block for the next prompt that starts with it
                    self._idle[shard][uid] = page
        del self.next_pos[slot], self.limit[slot]
        self._new = [u for u in self._new if u[0] != slot]
        self._reset[slot] = self.scratch(slot)
        self.paused.discard(slot)

    def take_updates(self):
        """(reset [B] bool, scratch [B], slots [M], page index [M], pages [M]) for
        `_update_tables`, M padded to a multiple of the slots (few shapes compile); None when
        nothing changed."""
        if not self._reset and not self._new:
            return None
        reset = np.zeros((self.slots,), bool)
        scratch = np.zeros((self.slots,), np.int32)
        for slot, page in self._reset.items():
            reset[slot], scratch[slot] = True, page
        m = max(1, -(-len(self._new) // self.slots)) * self.slots
        upd = np.full((3, m), self.slots, np.int32)  # slot = B: dropped
        for i, (slot, index, page) in enumerate(self._new):
            upd[:, i] = (slot, index, page)
        self._reset, self._new = {}, []
        return reset, scratch, upd[0], upd[1], upd[2]


def _update_tables(state, reset, scratch, slots, index, pages):
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


@gin.configurable
class Engine:
    """JetStream engine over an NNX model with the hcjax forward contract.

    `model(tokens, positions=..., cache=...)` must return an object with `.logits` [B, T, V],
    `.routing` (tuple of [B, T, k], one per MoE layer) and `.cache`. Prompts are padded to a
    power-of-two bucket with position -1 on the padding, which the model's cache never stores.

    default_sampling: what a prefill without `sampling` uses (JetStream passes none); its token
      limit is clipped to the room left in max_target_length.
    tokenizer: "byte" or a Hugging Face model folder, for get_tokenizer / build_tokenizer.
    prefix_cache_blocks: blocks of prompt KV kept for reuse across requests (0 = no reuse);
      prefix_block_size tokens each (prefix_cache.py).
    kv_layout: "slot" (every global layer keeps max_target_length positions per slot) or
      "paged" (global layers share a pool of `num_pages` pages of `page_size` positions; a slot
      takes pages for its prompt on insert and one more each time it crosses a page boundary,
      and gives them back on `free_resource`; the samples of one `bulk_insert` share the
      prompt's full pages; local layers keep their ring buffers). num_pages
      None = enough for every slot at max_target_length (no saving; size it to the load). Page 0
      of each batch shard is scratch that idle rows write to. Admission (`num_free_slots`) counts
      pages as well as slots; a page is granted only while every sequence can still finish, and
      a slot refused one pauses until pages come back. Prefill keeps the slot layout (batch 1,
      or one row a prompt in `bulk_prefill`). With prefix reuse (prefix_block_size must equal
      page_size), a prompt page that holds a cached block is kept in the pool for that block:
      later prompts starting with the block map the same page instead of taking and writing
      their own, so sequences with a common head (a system prompt, an episode's history) hold
      it once; such a page no sequence holds stays cached, counted as free and taken back least
      recently used first. The prefix cache's own copy of each block stays outside the pool
      (prefill runs without the decode state, so it cannot read pages).
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        mesh: Mesh | None = None,
        max_concurrent_decodes: int = 8,
        max_prefill_length: int | None = None,
        max_target_length: int | None = None,
        max_stop_tokens: int = 8,
        init_cache_fn: Callable[[int, int], Any] | None = None,
        default_sampling: SamplingOptions | None = None,
        tokenizer: str = "byte",
        prefix_cache_blocks: int = 0,
        prefix_block_size: int = 16,
        kv_layout: str = "slot",
        page_size: int = 16,
        num_pages: int | None = None,
    ) -> None:
        cfg = getattr(model, "config", None)
        if kv_layout not in ("slot", "paged"):
            raise ValueError(f"kv_layout={kv_layout!r} is not 'slot' or 'paged'")
        if kv_layout == "paged" and (cfg is None or init_cache_fn is not None):
            raise ValueError("kv_layout='paged' needs a model with .config and no init_cache_fn")
        if init_cache_fn is None:
            init_cache_fn = lambda b, n: init_cache(cfg, b, n)
        if max_target_length is None:
            max_target_length = cfg.max_seq_len
        if max_prefill_length is None:  # leave as much room for the response as for the prompt
            max_prefill_length = max(1, max_target_length // 2)
        for name, value in [
            ("max_concurrent_decodes", max_concurrent_decodes),
            ("max_prefill_length", max_prefill_length),
            ("max_target_length", max_target_length),
            ("max_stop_tokens", max_stop_tokens),
            ("prefix_block_size", prefix_block_size),
        ]:
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not isinstance(prefix_cache_blocks, int) or prefix_cache_blocks < 0:
            raise ValueError(f"prefix_cache_blocks={prefix_cache_blocks!r} must be an integer >= 0")
        if max_prefill_length >= max_target_length:
            raise ValueError(
                f"max_prefill_length={max_prefill_length} must be < "
                f"max_target_length={max_target_length}"
            )
        self._graphdef, self._params = nnx.split(model)
        self._vocab = None if cfg is None else int(cfg.vocab_size)
        self._model_type, self._model_config = type(model), cfg
        self._mesh = mesh
        self._num_slots = max_concurrent_decodes
        self._max_prefill = max_prefill_length
        self._max_len = max_target_length
        self._max_stop = max_stop_tokens
        self._default_sampling = default_sampling or SamplingOptions()
        self._tokenizer_path = tokenizer
        self._init_cache_fn = init_cache_fn
        self._batch_axes = _batch_axes(init_cache_fn, max_target_length)
        self._row_shapes = jax.eval_shape(lambda: init_cache_fn(1, max_target_length))
        self._wide_shapes = pc.wide_shapes(self._row_shapes, self._batch_axes, max_target_length)
        self.prefix_cache = (
            pc.PrefixCache(prefix_block_size, prefix_cache_blocks) if prefix_cache_blocks else None
        )
        self._routing_shape: tuple[int, int] | None = None
        self._stats = {"prompt_tokens": 0, "computed_tokens": 0, "reused_tokens": 0, "prefills": 0}
        self._free = list(range(max_concurrent_decodes))
        self._free_lock = threading.Lock()
        if kv_layout == "paged" and prefix_cache_blocks and prefix_block_size != page_size:
            raise ValueError(
                f"prefix_block_size={prefix_block_size} must equal page_size={page_size} with "
                "kv_layout='paged' and prefix reuse (a cached block is shared as one page)")
        self._pages = None if kv_layout == "slot" else _PagePool(
            max_concurrent_decodes, max_target_length, page_size, num_pages,
            int(np.prod([mesh.shape[a] for a in _pool_axes(mesh, max_concurrent_decodes)])))
        if self._pages is not None:
            pool = self._pages
            self._decode_cache_fn = lambda b, n: init_paged_cache(
                cfg, b, n, pool.num_pages, pool.page_size)
        else:
            self._decode_cache_fn = init_cache_fn
        replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        self._prefill_jit = jax.jit(self._prefill_impl, donate_argnums=(1,))
        self._init_prefill_jit = jax.jit(
            lambda: pc.empty_wide_cache(self._wide_shapes), out_shardings=replicated
        )
        self._assemble_jit = jax.jit(
            lambda blocks: pc.assemble_blocks(blocks, self._wide_shapes, self._batch_axes),
            out_shardings=replicated,
        )
        self._block_at_jit = jax.jit(
            lambda wide, start: pc.block_at(wide, start, self._batch_axes, prefix_block_size)
        )
        self._empty_block_jit = jax.jit(
            lambda: pc.empty_block(self._row_shapes, self._batch_axes, prefix_block_size),
            out_shardings=replicated,
        )
        self._empty_block = None
        self._fold_jit = jax.jit(
            lambda wide, n: pc.to_decode_layout(wide, n, self._row_shapes, self._batch_axes)
        )
        self._prefill_rows_jit = jax.jit(self._prefill_rows_impl, donate_argnums=(1,))
        self._init_rows_jit = jax.jit(
            lambda b: pc.empty_wide_cache(pc.batched_shapes(self._wide_shapes, self._batch_axes, b)),
            static_argnums=(0,), out_shardings=replicated,
        )
        self._stack_jit = jax.jit(
            lambda rows: jax.tree.map(lambda a, *xs: jnp.concatenate(xs, axis=a),
                                      self._batch_axes, *rows),
            out_shardings=replicated,
        )
        self._row_jit = jax.jit(self._row_impl)
        self._split_rows_jit = jax.jit(self._split_rows_impl)
        self._insert_jit = jax.jit(self._insert_impl, donate_argnums=(0,))
        self._bulk_insert_jit = jax.jit(self._bulk_insert_impl, donate_argnums=(0,))
        self._generate_jit = jax.jit(self._generate_impl, donate_argnums=(1,))
        self._block_jit = jax.jit(self._block_impl, static_argnums=(0, 4), donate_argnums=(2,))
        self._deactivate_jit = jax.jit(self._deactivate_impl, donate_argnums=(0,))
        self._tables_jit = jax.jit(_update_tables, donate_argnums=(0,))
        self._pause_jit = jax.jit(_pause_row, donate_argnums=(0,))
        self._resume_jit = jax.jit(_resume_row, donate_argnums=(0,))
        self._paused_rows: dict[int, tuple] = {}
        self._init_decode_jit = {}  # by vocab size: jit with the state's shardings

    # JetStream Engine API: properties ---------------------------------------------------------
    @property
    def max_concurrent_decodes(self) -> int:
        return self._num_slots

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill

    @property
    def max_target_length(self) -> int:
        return self._max_len

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def mesh(self) -> Mesh | None:
        return self._mesh

    @property
    def colocated_cpus(self) -> None:
        return None

    @property
    def max_stop_tokens(self) -> int:
        return self._max_stop

    @property
    def vocab_size(self) -> int | None:
        return self._vocab

    def serves(self, model: nnx.Module) -> bool:
        """Whether `model`'s state can be served as this engine's parameters: a model of the
        same class and config, whose parameters have the same shapes and dtypes (two models built
        from one config have unequal graphdefs, whose static parts are distinct equal objects)."""
        def layout(state: Any) -> Any:
            return jax.tree.map(lambda x: (x.shape, x.dtype), state)

        return (type(model) is self._model_type
                and getattr(model, "config", None) == self._model_config
                and layout(nnx.state(model)) == layout(self._params))

    def load_params(self, *args, **kwargs) -> Any:
        """The model's parameters (an nnx.State), version 0; wrap them as
        `VersionedParams(params, version)` to tag another version."""
        return self._params

    def get_prefix_destination_sharding(self) -> Any:
        return None if self._mesh is None else NamedSharding(self._mesh, PartitionSpec())

    def get_tokenizer(self) -> TokenizerParameters:
        return TokenizerParameters(path=self._tokenizer_path)

    def build_tokenizer(self, metadata: Any) -> JetStreamTokenizer:
        """A JetStream tokenizer over hcjax.data's tokenizer at `metadata.path`."""
        path = getattr(metadata, "path", None)
        if not path:
            raise ValueError(f"tokenizer metadata {metadata!r} has no path")
        return JetStreamTokenizer(load_tokenizer(path))

    @property
    def routing_shape(self) -> tuple[int, int]:
        """(MoE layers, experts per token) of the routing records, from the prefill's shapes."""
        if self._routing_shape is None:
            chunk = jax.ShapeDtypeStruct((8,), jnp.int32)
            scalar = jax.ShapeDtypeStruct((), jnp.int32)
            _, _, routing = jax.eval_shape(
                self._prefill_impl, self._params, self._wide_shapes, chunk, scalar, scalar
            )
            self._routing_shape = (int(routing.shape[0]), int(routing.shape[2]))
        return self._routing_shape

    def prefill_stats(self) -> dict:
        """Prompt tokens prefilled so far: total, computed by the model, reused from the cache."""
        with self._free_lock:
            return dict(self._stats)

    # Slot bookkeeping ------------------------------------------------------------------------
    def allocate_slots(self, n: int) -> list[int]:
        """Take up to `n` free slots (fewer if fewer are free)."""
        with self._free_lock:
            taken, self._free = self._free[:n], self._free[n:]
        return taken

    def free_resource(self, slot: int) -> None:
        """Return a slot whose sample has finished (or been deactivated) to the free pool, and
        its pages to the page pool (paged layout)."""
        if not 0 <= slot < self._num_slots:
            raise ValueError(f"slot={slot} is not in [0, {self._num_slots})")
        with self._free_lock:
            if slot in self._free:
                raise ValueError(f"slot={slot} is already free")
            self._free.append(slot)
            if self._pages is not None:
                self._pages.release(slot)
                self._paused_rows.pop(slot, None)

    @property
    def num_free_slots(self) -> int:
        """Free slots; with the paged layout, no more than the free pages admit: each new
        sequence counted at a max_prefill_length prompt and a budget to max_target_length, and
        admitted only while every sequence in flight can still finish (`_PagePool.admissible`).
        Sequences take pages as they grow, so this is not a reservation of their budget."""
        with self._free_lock:
            if self._pages is None:
                return len(self._free)
            pool = self._pages
            return sum(pool.admissible(shard, sum(1 for s in self._free if pool.shard_of(s) == shard),
                                       self._max_prefill)
                       for shard in range(pool.ways))

    @property
    def kv_layout(self) -> str:
        return "slot" if self._pages is None else "paged"

    def page_stats(self) -> dict:
        """Pages of the paged layout: total, free (idle cached pages included), in use, `waits`
        (times a sequence was paused for want of a page), pages holding prefix-cache blocks
        (`cached`, `idle_cached` of them held by no sequence), prompt pages mapped from the cache
        (`shared`) and idle cached pages taken back (`reclaimed`); empty for the slot layout."""
        if self._pages is None:
            return {}
        pool = self._pages
        with self._free_lock:
            free = sum(pool.free_counts())
            return {"num_pages": pool.num_pages, "page_size": pool.page_size,
                    "free": free, "in_use": pool.usable - free, "waits": pool.waits,
                    "cached": len(pool._cached_uid), "idle_cached": sum(map(len, pool._idle)),
                    "shared": pool.shared, "reclaimed": pool.reclaimed}

    def _sync_tables(self, state: DecodeState) -> DecodeState:
        """Apply the host's pending page-table changes (freed rows back to scratch, new pages)
        to every paged layer of the decode state."""
        with self._free_lock:
            update = self._pages.take_updates()
        if update is None:
            return state
        return self._tables_jit(state, *update)

    def reserve_pages(self, decode_state: DecodeState, steps: int = 1) -> DecodeState:
        """Give every occupied slot the pages its next `steps` fed tokens need (paged layout;
        `generate` calls it with steps=1). A slot never takes pages past its token budget."""
        if self._pages is None:
            return decode_state
        with self._free_lock:
            pause, resume = self._pages.grow(steps)
        for slot in pause:  # keeps its logits and active flag; the step leaves the rest alone
            decode_state, logits, active = self._pause_jit(decode_state, np.int32(slot))
            self._paused_rows[slot] = (logits, active)
        decode_state = self._sync_tables(decode_state)  # its new page before it runs again
        for slot in resume:
            logits, active = self._paused_rows.pop(slot)
            decode_state = self._resume_jit(decode_state, np.int32(slot), logits, active)
        return decode_state

    # Decode state ----------------------------------------------------------------------------
    def _init_decode_impl(self, vocab: int):
        b = self._num_slots
        return DecodeState(
            cache=self._decode_cache_fn(b, self._max_len),
            logits=jnp.zeros((b, vocab), jnp.float32),
            logits_version=jnp.zeros((b,), jnp.int32),
            positions=jnp.zeros((b,), jnp.int32),
            seeds=jnp.zeros((b,), jnp.uint32),
            sample_index=jnp.zeros((b,), jnp.int32),
            temperature=jnp.ones((b,), jnp.float32),
            top_p=jnp.ones((b,), jnp.float32),
            remaining=jnp.zeros((b,), jnp.int32),
            generated=jnp.zeros((b,), jnp.int32),
            stop_tokens=jnp.full((b, self._max_stop), -1, jnp.int32),
            active=jnp.zeros((b,), bool),
        )

    def init_decode_state(self, vocab_size: int | None = None) -> DecodeState:
        """A decode state with every slot empty."""
        vocab = vocab_size or self._vocab
        if vocab is None:
            raise ValueError("init_decode_state needs vocab_size for a model without .config")
        vocab = int(vocab)
        if vocab not in self._init_decode_jit:
            self._init_decode_jit[vocab] = jax.jit(
                functools.partial(self._init_decode_impl, vocab),
                out_shardings=self.decode_state_shardings(vocab))
        return self._init_decode_jit[vocab]()

    def decode_state_shardings(self, vocab_size: int | None = None):
        """Shardings of the decode state on the engine's mesh (None without one): every
        slot-indexed leaf split over the decode batch axes (data, fsdp, expert, as many as divide
        the slots) on its batch dimension (a stacked scanned cache has its layers first), and a
        KV cache's heads ([.., B, S, heads, head_dim]) over the tensor axis when they divide, as
        the projections that write them are. Nothing that grows with the number of sequences or
        the KV length is replicated."""
        mesh = self._mesh
        if mesh is None:
            return None
        state = jax.eval_shape(lambda: self._init_decode_impl(int(vocab_size or self._vocab)))
        axes, size = [], 1
        for a in ("data", "fsdp", "expert"):
            n = mesh.shape.get(a, 1)
            if n > 1 and self._num_slots % (size * n) == 0:
                axes.append(a)
                size *= n
        tensor = mesh.shape.get("tensor", 1)

        def one(x, b):
            spec = [None] * x.ndim
            if axes:
                spec[b] = tuple(axes)
            if x.ndim == b + 4 and tensor > 1 and x.shape[b + 2] % tensor == 0:
                spec[b + 2] = "tensor"
            return NamedSharding(mesh, PartitionSpec(*spec))

        pool_axes = _pool_axes(mesh, self._num_slots)

        def paged(layer):  # pages split like the activation batch, heads over tensor (_PagePool)
            lead = layer["page_table"].ndim - 2
            out = {"page_table": one(layer["page_table"], lead)}
            for name, x in layer.items():
                if name != "page_table":
                    spec = [None] * x.ndim
                    if pool_axes:
                        spec[lead] = pool_axes
                    if x.ndim == lead + 4 and tensor > 1 and x.shape[lead + 2] % tensor == 0:
                        spec[lead + 2] = "tensor"
                    out[name] = NamedSharding(mesh, PartitionSpec(*spec))
            return out

        if self._pages is None:
            cache = jax.tree.map(one, state.cache, self._batch_axes)
        else:
            cache = tuple(paged(c) if "page_table" in c else jax.tree.map(one, c, a)
                          for c, a in zip(state.cache, self._batch_axes))
        rest = {f.name: jax.tree.map(lambda x: one(x, 0), getattr(state, f.name))
                for f in dataclasses.fields(state) if f.name != "cache"}
        return dataclasses.replace(state, cache=cache, **rest)

    # Prefill ---------------------------------------------------------------------------------
    def _prefill_impl(self, params, cache, tokens_t, start, length):
        """One prompt chunk: `length` real tokens at positions start.., then padding."""
        model = nnx.merge(self._graphdef, params)
        idx = jnp.arange(tokens_t.shape[0], dtype=jnp.int32)
        positions = jnp.where(idx < length, start + idx, -1)  # -1: padding, never cached
        out = model(tokens_t[None], positions=positions[None], cache=cache)
        logits = out.logits[0, length - 1].astype(jnp.float32)
        routing = _stack_routing(out.routing, 1, tokens_t.shape[0])[0]  # [T, L, k]
        return out.cache, logits, jnp.transpose(routing, (1, 0, 2))

    def _prefill_rows_impl(self, params, cache, tokens_bt, start_b, length_b):
        """`_prefill_impl` for a batch of rows, each its own prompt: row i holds length_b[i]
        real tokens at positions start_b[i].., then padding. Returns (cache, logits [B, V],
        routing [B, L, T, k])."""
        model = nnx.merge(self._graphdef, params)
        b, t = tokens_bt.shape
        idx = jnp.arange(t, dtype=jnp.int32)[None]
        positions = jnp.where(idx < length_b[:, None], start_b[:, None] + idx, -1)
        out = model(tokens_bt, positions=positions, cache=cache)
        logits = jnp.take_along_axis(out.logits, (length_b - 1)[:, None, None], axis=1)[:, 0]
        routing = _stack_routing(out.routing, b, t)  # [B, T, L, k]
        return out.cache, logits.astype(jnp.float32), jnp.transpose(routing, (0, 2, 1, 3))

    def prefill(
        self,
        *,
        params: Any,
        existing_prefix: Prefix | None = None,
        padded_tokens: Sequence[int] | np.ndarray | jax.Array,
        true_length: int,
        sampling: SamplingOptions | None = None,
    ) -> Prefix:
        """Run the prompt through the model into a fresh batch-1 cache (JetStream's prefill).

        `params` is what load_params returns or a `VersionedParams`. `existing_prefix`: the
        tokens are appended to that prefix's prompt (its blocks are reused when prefix reuse is
        on, else recomputed). With prefix reuse, the longest stored block prefix is copied in and
        only the rest is computed. Chunks of at most max_prefill_length tokens, each padded to a
        power-of-two bucket so few shapes compile. The first token is drawn at generate time from
        `prefix.logits` with each sample's own key, so the n samples of a `bulk_insert` differ.
        `sampling` (an hcjax extra JetStream never passes) defaults to `default_sampling`.
        """
        weights, version = _split_params(params)
        tokens, sampling = self._prompt(padded_tokens, true_length, existing_prefix, sampling)
        total = int(tokens.shape[0])
        chain = self._lookup(tokens, version)
        done = len(chain) * (self.prefix_cache.block_size if chain else 0)
        cache = self._restore(chain) if chain else self._init_prefill_jit()
        routings = [block.routing for block in chain]
        for start in range(done, total, self._max_prefill):
            n = min(self._max_prefill, total - start)
            chunk = np.zeros((self.prefill_bucket(n),), np.int32)
            chunk[:n] = tokens[start : start + n]
            cache, logits, routing = self._prefill_jit(
                weights, cache, chunk, np.int32(start), np.int32(n)
            )
            routings.append(np.asarray(routing)[:, :n])
        routing = np.concatenate(routings, axis=1)
        blocks = ()
        if self.prefix_cache is not None:
            blocks = self._store_blocks(cache, tokens, version, chain, routing)
        self._count_prefill(total, done)
        return Prefix(
            cache=self._fold_jit(cache, np.int32(total)),
            logits=logits,
            routing=routing,
            length=total,
            version=version,
            sampling=sampling,
            tokens=tuple(int(t) for t in tokens),
            blocks=blocks,
        )

    def prefill_bucket(self, n: int) -> int:
        """The compiled length of a prefill chunk of `n` tokens: a power of two, at least 8, at
        most max_prefill_length."""
        return min(_next_pow2(max(n, 8)), self._max_prefill)

    def _prompt(self, padded_tokens, true_length, existing_prefix, sampling):
        """(the prompt's tokens, its sampling options) of a prefill, or a clear error."""
        tokens = np.asarray(padded_tokens, np.int32).reshape(-1)
        if not isinstance(true_length, int | np.integer) or not 0 < true_length <= tokens.shape[0]:
            raise ValueError(
                f"true_length={true_length!r} must be in [1, len(padded_tokens)={tokens.shape[0]}]"
            )
        tokens = tokens[:true_length]
        if existing_prefix is not None:
            if not isinstance(existing_prefix, Prefix):
                raise TypeError(f"existing_prefix must be a Prefix, got {type(existing_prefix)}")
            tokens = np.concatenate([np.asarray(existing_prefix.tokens, np.int32), tokens])
            sampling = sampling or existing_prefix.sampling
        total = int(tokens.shape[0])
        if total >= self._max_len:
            raise ValueError(
                f"prompt length {total} leaves no room in max_target_length={self._max_len}"
            )
        if self._vocab is not None and (int(tokens.max()) >= self._vocab or int(tokens.min()) < 0):
            bad = int(tokens.max()) if int(tokens.max()) >= self._vocab else int(tokens.min())
            raise ValueError(f"token id {bad} is not in [0, vocab_size={self._vocab})")
        if sampling is None:
            room = self._max_len - total
            sampling = dataclasses.replace(
                self._default_sampling, max_tokens=min(self._default_sampling.max_tokens, room)
            )
        return tokens, sampling

    def _lookup(self, tokens: np.ndarray, version: int) -> list:
        """The prefix cache's stored blocks that start `tokens` ([] without reuse); the last
        token is always computed (its logits are needed)."""
        if self.prefix_cache is None:
            return []
        return self.prefix_cache.lookup(tokens, version, limit=int(tokens.shape[0]) - 1)

    def _count_prefill(self, total: int, done: int) -> None:
        with self._free_lock:
            self._stats["prompt_tokens"] += total
            self._stats["computed_tokens"] += total - done
            self._stats["reused_tokens"] += done
            self._stats["prefills"] += 1

    def bulk_prefill(
        self,
        *,
        params: Any,
        prompts: Sequence[Sequence[int] | np.ndarray],
        samplings: Sequence[SamplingOptions | None] | None = None,
    ) -> list[Prefix]:
        """Prefill several prompts in one device call (an hcjax extra): the Prefix of each is
        `prefill`'s for it alone (same cache entries, logits, routing; prefix reuse as there).

        The prompts' computed parts (past any prefix-cache hit) run as the rows of one batch,
        padded to the longest one's bucket (`prefill`'s powers of two up to max_prefill_length)
        and to a power-of-two number of rows, so at most log2(rows) x buckets programs compile.
        A prompt whose computed part is longer than max_prefill_length is prefilled in chunks
        alone (`prefill`). Raises ValueError naming the first bad prompt before running any.
        """
        if samplings is None:
            samplings = [None] * len(prompts)
        if len(samplings) != len(prompts):
            raise ValueError(f"{len(samplings)} sampling options for {len(prompts)} prompts")
        weights, version = _split_params(params)
        checked = []
        for i, (prompt, sp) in enumerate(zip(prompts, samplings)):
            prompt = np.asarray(prompt, np.int32).reshape(-1)
            try:
                checked.append(self._prompt(prompt, int(prompt.shape[0]), None, sp))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        out: list[Prefix | None] = [None] * len(checked)
        rows = []  # (index, tokens, sampling, chain, done)
        for i, (tokens, sp) in enumerate(checked):
            chain = self._lookup(tokens, version)
            done = len(chain) * (self.prefix_cache.block_size if chain else 0)
            if tokens.shape[0] - done > self._max_prefill:
                out[i] = self.prefill(params=params, padded_tokens=tokens,
                                      true_length=int(tokens.shape[0]), sampling=sp)
            else:
                rows.append((i, tokens, sp, chain, done))
        if len(rows) == 1:
            i, tokens, sp, _, _ = rows[0]
            out[i] = self.prefill(params=params, padded_tokens=tokens,
                                  true_length=int(tokens.shape[0]), sampling=sp)
        elif rows:
            for i, prefix in zip([r[0] for r in rows], self._prefill_rows(weights, version, rows)):
                out[i] = prefix
        return out

    def _row_impl(self, wide, i):
        """Row `i` of a batched cache (a batch-1 cache)."""
        return jax.tree.map(lambda x, a: jax.lax.dynamic_slice_in_dim(x, i, 1, axis=a),
                            wide, self._batch_axes)

    def _split_rows_impl(self, wide, logits, lengths):
        """Each row of a batched prefill as (its cache in the decode layout, its logits)."""
        return tuple(
            (pc.to_decode_layout(self._row_impl(wide, i), lengths[i], self._row_shapes,
                                 self._batch_axes), logits[i])
            for i in range(lengths.shape[0]))

    def _prefill_rows(self, weights, version, rows) -> list[Prefix]:
        """One batched chunk for rows of (index, tokens, sampling, prefix-cache chain, tokens
        reused), each computing at most max_prefill_length tokens."""
        b = _next_pow2(len(rows))
        width = self.prefill_bucket(max(int(t.shape[0]) - done for _, t, _, _, done in rows))
        chunk = np.zeros((b, width), np.int32)
        starts = np.zeros((b,), np.int32)
        lengths = np.ones((b,), np.int32)  # padding rows: one token at position 0
        caches = []
        for r, (_, tokens, _, chain, done) in enumerate(rows):
            n = int(tokens.shape[0]) - done
            chunk[r, :n] = tokens[done:]
            starts[r], lengths[r] = done, n
            caches.append(self._restore(chain) if chain else None)
        if any(c is not None for c in caches):
            empty = self._init_prefill_jit()
            caches = [empty if c is None else c for c in caches]
            caches += [empty] * (b - len(rows))
            cache = self._stack_jit(caches)
        else:
            cache = self._init_rows_jit(b)
        cache, logits, routing = self._prefill_rows_jit(weights, cache, chunk, starts, lengths)
        totals = np.ones((b,), np.int32)
        totals[: len(rows)] = [int(t.shape[0]) for _, t, _, _, _ in rows]
        split = self._split_rows_jit(cache, logits, totals)
        routing = np.asarray(routing)  # [b, L, width, k]
        out = []
        for r, (_, tokens, sp, chain, done) in enumerate(rows):
            total = int(tokens.shape[0])
            routed = np.concatenate([block.routing for block in chain]
                                    + [routing[r][:, : total - done]], axis=1)
            blocks = ()
            if self.prefix_cache is not None:
                blocks = self._store_blocks(self._row_jit(cache, np.int32(r)), tokens, version,
                                            chain, routed)
            self._count_prefill(total, done)
            out.append(Prefix(
                cache=split[r][0],
                logits=split[r][1],
                routing=routed,
                length=total,
                version=version,
                sampling=sp,
                tokens=tuple(int(t) for t in tokens),
                blocks=blocks,
            ))
        return out

    def _restore(self, chain: list) -> Any:
        """A wide cache holding the chain's blocks; the list is padded with empty blocks to a
        power of two so that only a few lengths compile."""
        if self._empty_block is None:
            self._empty_block = self._empty_block_jit()
        cap = self._max_len // self.prefix_cache.block_size
        width = min(_next_pow2(len(chain)), cap)
        blocks = [b.kv for b in chain] + [self._empty_block] * (width - len(chain))
        return self._assemble_jit(blocks)

    def _store_blocks(self, wide, tokens, version, chain, routing) -> tuple[int, ...]:
        """Store the prompt's whole blocks past `chain`; returns the uids of the blocks, from the
        first, whose stored KV is exactly `wide`'s (`Prefix.blocks`): the chain's (restored into
        it) and the ones stored from it, up to one another prefill stored first (its entries
        may differ in the last bits)."""
        bs = self.prefix_cache.block_size
        new = [
            (self._block_at_jit(wide, np.int32(i * bs)), routing[:, i * bs : (i + 1) * bs])
            for i in range(len(chain), tokens.shape[0] // bs)
        ]
        exact = [block.uid for block in chain]
        if new:
            stored = self.prefix_cache.extend(tokens, version, chain, new)
            for block, (kv, _) in zip(stored, new):
                if block.kv is not kv:
                    break
                exact.append(block.uid)
        return tuple(exact)

    # Insert ----------------------------------------------------------------------------------
    def _insert_impl(self, state, cache, logits, version, length, slot, sample_index, seed,
                     temperature, top_p, remaining, stop_tokens, pages=None, writes=None):
        def put(full, one, axis):
            start = [0] * full.ndim
            start[axis] = slot
            return jax.lax.dynamic_update_slice(full, one.astype(full.dtype), start)

        def put_layer(full, one, axes):
            if "page_table" in full:
                return _put_paged(full, one, axes["pos"], slot, pages, writes)
            return jax.tree.map(put, full, one, axes)

        def row(arr, value):
            return arr.at[slot].set(value)

        return DecodeState(
            cache=(jax.tree.map(put, state.cache, cache, self._batch_axes) if pages is None
                   else tuple(map(put_layer, state.cache, cache, self._batch_axes))),
            logits=row(state.logits, logits),
            logits_version=row(state.logits_version, version),
            positions=row(state.positions, length),
            seeds=row(state.seeds, seed),
            sample_index=row(state.sample_index, sample_index),
            temperature=row(state.temperature, temperature),
            top_p=row(state.top_p, top_p),
            remaining=row(state.remaining, remaining),
            generated=row(state.generated, 0),
            stop_tokens=row(state.stop_tokens, stop_tokens),
            active=row(state.active, True),
        )

    def _bulk_insert_impl(self, state, cache, logits, version, length, slots, sample_indices,
                          count, seed, temperature, top_p, remaining, stop_tokens, pages=None,
                          writes=None):
        """`_insert_impl` for slots[:count] (one loop inside one call, in place)."""
        def body(i, state):
            return self._insert_impl(state, cache, logits, version, length, slots[i],
                                     sample_indices[i], seed, temperature, top_p, remaining,
                                     stop_tokens, None if pages is None else pages[i],
                                     None if writes is None else writes[i])

        return jax.lax.fori_loop(0, count, body, state)

    def _check_insert(self, prefix: Prefix, slots: Sequence[int], max_tokens: int | None):
        """(token budget, stop-token row, seed) of inserting `prefix` into `slots`, or a clear
        error. A prefix whose options leave the seed to the server (None) draws with seed 0 here:
        the server always resolves it first, and JetStream passes no options at all."""
        if not isinstance(prefix, Prefix):
            raise TypeError(f"insert expects the Prefix that prefill returned, got {type(prefix)}")
        for slot in slots:
            if not 0 <= slot < self._num_slots:
                raise ValueError(f"slot={slot} is not in [0, {self._num_slots})")
        sp = prefix.sampling
        budget = sp.max_tokens if max_tokens is None else max_tokens
        if budget <= 0:
            raise ValueError(f"max_tokens={budget} must be positive")
        if prefix.length + budget > self._max_len:
            raise ValueError(
                f"prompt length {prefix.length} + max_tokens {budget} exceeds "
                f"max_target_length={self._max_len}"
            )
        if len(sp.stop_tokens) > self._max_stop:
            raise ValueError(
                f"{len(sp.stop_tokens)} stop tokens exceed max_stop_tokens={self._max_stop}"
            )
        stop = np.full((self._max_stop,), -1, np.int32)
        stop[: len(sp.stop_tokens)] = sp.stop_tokens
        return budget, stop, np.uint32(0 if sp.seed is None else sp.seed)

    def insert(
        self,
        prefix: Prefix,
        decode_state: DecodeState,
        slot: int,
        *,
        sample_index: int = 0,
        max_tokens: int | None = None,
    ) -> DecodeState:
        """Put a prefilled prompt into `slot` as sample `sample_index` (its key depends on it).

        `max_tokens` (an hcjax extra) overrides the sampling params' limit (partial-rollout
        budgets).
        """
        budget, stop, seed = self._check_insert(prefix, [slot], max_tokens)
        sp = prefix.sampling
        decode_state, pages = self._admit_pages(decode_state, prefix, [slot], budget)
        return self._insert_jit(
            decode_state, prefix.cache, prefix.logits, np.int32(prefix.version),
            np.int32(prefix.length), np.int32(slot), np.int32(sample_index),
            seed, np.float32(sp.temperature), np.float32(sp.top_p),
            np.int32(budget), stop, *(() if pages is None else (pages[0][0], pages[1][0])),
        )

    def _admit_pages(self, state, prefix, slots, budget):
        """(state with pending page-table changes applied, (page rows, rows of pages to write)
        for `slots`) in the paged layout; (state, None) in the slot layout."""
        if self._pages is None:
            return state, None
        blocks = prefix.blocks if self.prefix_cache is not None else ()
        with self._free_lock:
            rows = self._pages.admit(slots, prefix.length, budget, blocks)
        return self._sync_tables(state), rows

    def bulk_insert(
        self,
        prefix: Prefix,
        decode_state: DecodeState,
        slots: Sequence[int],
        *,
        sample_indices: Sequence[int] | None = None,
        max_tokens: int | None = None,
    ) -> DecodeState:
        """Insert one prefill into several slots: the n samples of a GRPO group share it. One
        device call whatever the number of slots (the same state as `insert` slot by slot)."""
        slots = [int(s) for s in slots]
        if sample_indices is None:
            sample_indices = range(len(slots))
        sample_indices = [int(i) for i in sample_indices]
        if len(sample_indices) != len(slots):
            raise ValueError(f"{len(sample_indices)} sample indices for {len(slots)} slots")
        if not slots:
            return decode_state
        if len(slots) > self._num_slots:
            raise ValueError(f"{len(slots)} slots exceed max_concurrent_decodes={self._num_slots}")
        budget, stop, seed = self._check_insert(prefix, slots, max_tokens)
        sp = prefix.sampling
        padded = np.zeros((2, self._num_slots), np.int32)  # one shape: compiled once
        padded[0, : len(slots)] = slots
        padded[1, : len(slots)] = sample_indices
        decode_state, rows = self._admit_pages(decode_state, prefix, slots, budget)
        pages = ()
        if rows is not None:
            pages = np.full((2, self._num_slots, rows[0].shape[1]), self._pages.num_pages,
                            np.int32)
            pages[:, : len(slots)] = rows
        return self._bulk_insert_jit(
            decode_state, prefix.cache, prefix.logits, np.int32(prefix.version),
            np.int32(prefix.length), padded[0], padded[1], np.int32(len(slots)),
            seed, np.float32(sp.temperature), np.float32(sp.top_p),
            np.int32(budget), stop, *pages,
        )

    def _deactivate_impl(self, state, slot):
        return dataclasses.replace(state, active=state.active.at[slot].set(False))

    def deactivate(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Stop a slot before it finishes by itself (cancelled request)."""
        if slot in self._paused_rows:  # waiting for a page: it must not come back active
            logits, _ = self._paused_rows[slot]
            self._paused_rows[slot] = (logits, np.bool_(False))
        return self._deactivate_jit(decode_state, np.int32(slot))

    # Generate --------------------------------------------------------------------------------
    def _generate_impl(self, params, state, version):
        keys = sampling_keys(state.seeds, state.sample_index, state.positions)
        # Idle rows draw greedily: their token is discarded, and a stale flat row must not send
        # the whole batch to the sampler's wider top-p levels.
        temperature = jnp.where(state.active, state.temperature, 0.0)
        drawn = sample(state.logits, keys, temperature, state.top_p)
        valid = state.active
        # Feed the drawn token at once: its expert ids and the next logits come from this same
        # forward. Idle rows feed a token too (fixed shapes); their cache row is rewritten on
        # insert, and their position is clamped to stay inside the cache.
        feed_pos = jnp.minimum(state.positions, self._max_len - 1)
        model = nnx.merge(self._graphdef, params)
        out = model(drawn.tokens[:, None], positions=feed_pos[:, None], cache=state.cache)
        b = drawn.tokens.shape[0]
        routing = _stack_routing(out.routing, b, 1)[:, 0]  # [B, L, k]
        hit_stop = jnp.any(drawn.tokens[:, None] == state.stop_tokens, axis=-1)
        step = valid.astype(jnp.int32)
        remaining = state.remaining - step
        generated = state.generated + step
        done = valid & (hit_stop | (remaining <= 0))
        data = jnp.stack([drawn.tokens.astype(jnp.int32), step, generated], axis=1)
        result = ResultTokens(
            data=data,
            tokens_idx=(0, 1),
            valid_idx=(1, 2),
            length_idx=(2, 3),
            samples_per_slot=1,
            logprobs=drawn.logprobs,
            raw_logprobs=drawn.raw_logprobs,
            n_kept=drawn.n_kept,
            threshold_logit=drawn.threshold_logit,
            routing=routing,
            positions=state.positions,
            versions=state.logits_version,
            done=done,
        )
        new_state = dataclasses.replace(
            state,
            cache=out.cache,
            # Every row's new logits, idle ones too: an idle row draws greedily and its token is
            # discarded, and `insert` rewrites its logits before it is active again, so keeping
            # its old logits bought nothing and cost a pass over [B, V] every step (64 slots,
            # one process: the greedy step 7.3 -> 5.6 ms at 32k ids, 22.3 -> 14.7 ms at 152k).
            logits=out.logits[:, 0].astype(jnp.float32),
            logits_version=jnp.where(valid, version, state.logits_version),
            positions=state.positions + step,
            remaining=remaining,
            generated=generated,
            active=valid & ~done,
        )
        return new_state, result

    def generate(self, params: Any, decode_state: DecodeState) -> tuple[DecodeState, ResultTokens]:
        """One decode step for every slot: sample from each row's logits, feed the token. Tokens
        are tagged with the version of `params` (a VersionedParams; bare params are version 0)."""
        weights, version = _split_params(params)
        decode_state = self.reserve_pages(decode_state)
        return self._generate_jit(weights, decode_state, np.int32(version))

    def _block_impl(self, treedef, leaves, state, version, max_steps, steps):
        params = jax.tree.unflatten(treedef, leaves)
        def zeros(x):
            return jnp.zeros((max_steps, *x.shape), x.dtype)

        def record(r: ResultTokens) -> dict:
            return dict(tokens=r.data[:, 0], valid=r.data[:, 1] != 0, lengths=r.data[:, 2],
                        logprobs=r.logprobs, raw_logprobs=r.raw_logprobs, n_kept=r.n_kept,
                        threshold_logit=r.threshold_logit, routing=r.routing,
                        positions=r.positions, versions=r.versions, done=r.done)

        def body(i, carry):
            st, buf = carry
            st, r = self._generate_impl(params, st, version)
            buf = jax.tree.map(lambda a, x: jax.lax.dynamic_update_index_in_dim(a, x, i, 0),
                               buf, record(r))
            return st, buf

        shapes = jax.eval_shape(lambda: record(self._generate_impl(params, state, version)[1]))
        buf = jax.tree.map(zeros, shapes)
        state, buf = jax.lax.fori_loop(0, steps, body, (state, buf))
        return state, ResultBlock(**buf, steps=steps)

    def flatten_params(self, params: Any, version: int | None = None) -> FlatParams:
        """`params` (bare, VersionedParams or FlatParams) flattened once for `generate_block`;
        `version` overrides theirs."""
        if isinstance(params, FlatParams):
            return params if version is None else dataclasses.replace(params, version=version)
        weights, v = _split_params(params)
        leaves, treedef = jax.tree.flatten(weights)
        return FlatParams(tuple(leaves), treedef, v if version is None else int(version))

    def generate_block(self, params: Any, decode_state: DecodeState, steps: int, *,
                       max_steps: int | None = None) -> tuple[DecodeState, ResultBlock]:
        """`steps` decode steps in one device call (an hcjax extra; JetStream calls `generate`):
        each step is `generate`'s, stop tokens, token limits and done flags evaluated per slot
        on the device, so a slot that ends mid-block stays idle to its end, and the block's
        records come back as [max_steps, slots] arrays, row i equal to the i-th of `steps` calls
        of `generate`. One program per `max_steps` (default `steps`): any `steps` in
        [1, max_steps] runs it, the rows from `steps` on are invalid. `params`: a FlatParams
        (`flatten_params`, flattened once per weight version), a VersionedParams or bare."""
        max_steps = steps if max_steps is None else max_steps
        if not isinstance(max_steps, int | np.integer) or max_steps <= 0:
            raise ValueError(f"max_steps={max_steps!r} must be a positive integer")
        if not isinstance(steps, int | np.integer) or not 1 <= steps <= max_steps:
            raise ValueError(f"steps={steps!r} must be in [1, max_steps={max_steps}]")
        flat = self.flatten_params(params)
        # Paged layout: every occupied slot gets the pages its next `steps` tokens write before
        # the block runs (a slot refused one waits paused, as under `generate`).
        decode_state = self.reserve_pages(decode_state, int(steps))
        return self._block_jit(flat.treedef, list(flat.leaves), decode_state,
                               np.int32(flat.version), int(max_steps), np.int32(steps))


def _stack_routing(routing: tuple, b: int, t: int) -> jax.Array:
    """[B, T, L, k] from the model's per-MoE-layer tuple (L may be 0)."""
    if not routing:
        return jnp.zeros((b, t, 0, 0), jnp.int32)
    return jnp.stack([r.astype(jnp.int32) for r in routing], axis=2)


def register_with_jetstream() -> bool:
    """Register Engine and ResultTokens as virtual subclasses of JetStream's abstract Engine and
    ResultTokens (its orchestrator tells results from requests with isinstance). Returns False
    when jetstream (or an import of it, e.g. seqio) is missing; hcjax works without it."""
    try:
        # optional: jetstream (requirements-jetstream.txt); hcjax runs without it
        from jetstream.engine import engine_api
    except ImportError:
        return False
    engine_api.Engine.register(Engine)
    engine_api.ResultTokens.register(ResultTokens)
    return True


register_with_jetstream()

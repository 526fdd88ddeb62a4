"""The page table of the paged KV layout, kept on the host: free lists, each slot's pages,
prompt pages shared between slots and with the prefix cache, the banker's test that keeps some
sequence always able to finish, and the page-table changes not yet applied on device. Plain
Python and numpy: it never touches a device array (kv_layout.py applies its changes).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

__all__ = ["PagePool"]


class PagePool:
    """Host-side bookkeeping of the paged layout: free lists, each slot's pages, and the page
    table changes not yet applied on device. With the decode batch split over `ways` devices,
    the pool's page axis is split the same way and a slot only takes pages of its own shard
    (each shard's first page is its scratch page). The caller's lock (the engine's, through
    kv_layout.PagedLayout) guards every call."""

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
        `kv_layout.update_tables`, M padded to a multiple of the slots (few shapes compile);
        None when nothing changed."""
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

    def stats(self) -> dict:
        """Pages: total, free (idle cached pages included), in use, `waits` (times a sequence was
        paused for want of a page), pages holding prefix-cache blocks (`cached`, `idle_cached`
        of them held by no sequence), prompt pages mapped from the cache (`shared`), idle cached
        pages taken back (`reclaimed`), and the decode batch shards the pool is split over."""
        free = sum(self.free_counts())
        return {"num_pages": self.num_pages, "page_size": self.page_size,
                "free": free, "in_use": self.usable - free, "waits": self.waits,
                "cached": len(self._cached_uid), "idle_cached": sum(map(len, self._idle)),
                "shared": self.shared, "reclaimed": self.reclaimed, "batch_shards": self.ways}

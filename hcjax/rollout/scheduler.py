"""Admission and fair scheduling for the rollout server: what a request costs, how much of the
server one client host may hold, and which waiting work goes next.

Work is counted in tokens a request may hold in the server's slots: per sample, prompt plus the
new tokens it may still generate (capped by its token budget). A host's share bounds its admitted
work and requests, in flight and queued; the capacity bounds everyone's. Among waiting work,
lanes (one per client host and priority) are served by start-time fair queueing over samples,
weighted 2**priority, so a light client's request goes ahead of a heavy client's backlog. This
module knows nothing of engines or transport.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import Any

__all__ = ["Admission", "FairQueue", "QueueFull", "request_cost"]


class QueueFull(RuntimeError):
    """The request would take a host past its share, or the server past its capacity, right now:
    retry later or elsewhere. The message names the limit and by how much."""


def request_cost(prompt_len: int, n: int, max_tokens: int, token_budget: int | None = None,
                 done_tokens: tuple[int, ...] = ()) -> int:
    """Tokens the request may hold in the server's slots: per sample, prompt + the tokens it has
    (a continued sample's earlier response) + the new tokens it may still generate (max_tokens
    less those, capped by token_budget)."""
    done = list(done_tokens) or [0] * n
    total = 0
    for d in done:
        new = max(0, max_tokens - d)
        if token_budget is not None:
            new = min(new, token_budget)
        total += prompt_len + d + new
    return total


@dataclasses.dataclass
class _Holding:
    work: int = 0
    requests: int = 0


class Admission:
    """Counts what each client host holds (work and requests, from admission until the request
    ends) against its share and the server's capacity.

    work_capacity / request_capacity: the most the server holds, in flight and queued, over all
    hosts. host_share: the fraction of each that one host may hold. A request larger than one
    host's share could never be admitted: `check_size` refuses it with a ValueError."""

    def __init__(self, work_capacity: int, request_capacity: int, host_share: float) -> None:
        if work_capacity <= 0 or request_capacity <= 0:
            raise ValueError(f"work_capacity={work_capacity} and request_capacity="
                             f"{request_capacity} must be positive")
        if not 0.0 < host_share <= 1.0:
            raise ValueError(f"queue_share={host_share!r} must be in (0, 1]")
        self.work_capacity, self.request_capacity = int(work_capacity), int(request_capacity)
        self.host_share = float(host_share)
        self.host_work = max(1, int(host_share * work_capacity))
        self.host_requests = max(1, int(host_share * request_capacity))
        self._held: dict[str, _Holding] = {}
        self._total = _Holding()
        self._cond = threading.Condition()
        self.refused = 0

    def check_size(self, cost: int) -> None:
        """ValueError if a request of `cost` could never be admitted."""
        if cost > self.host_work:
            raise ValueError(
                f"the request holds up to {cost} tokens (samples x (prompt + max_tokens)), more "
                f"than one host's share of this server ({self.host_work} tokens = queue_share "
                f"{self.host_share} x capacity {self.work_capacity}): send fewer samples or "
                "fewer tokens per request")

    def _why_not(self, client: str, cost: int) -> str | None:
        held = self._held.get(client, _Holding())
        if held.requests + 1 > self.host_requests:
            return (f"client {client} holds {held.requests} requests, its share is "
                    f"{self.host_requests} (queue_share {self.host_share} x {self.request_capacity}"
                    "); retry later")
        if held.work + cost > self.host_work:
            return (f"client {client} holds {held.work} tokens of work and this request needs "
                    f"{cost}: {held.work + cost - self.host_work} over its share of "
                    f"{self.host_work} (queue_share {self.host_share} x {self.work_capacity}); "
                    "retry later")
        if self._total.requests + 1 > self.request_capacity:
            return (f"the server holds {self._total.requests} requests, its capacity is "
                    f"{self.request_capacity}; retry later")
        if self._total.work + cost > self.work_capacity:
            return (f"the server holds {self._total.work} tokens of work and this request needs "
                    f"{cost}: {self._total.work + cost - self.work_capacity} over its capacity "
                    f"of {self.work_capacity}; retry later")
        return None

    def admit(self, client: str, cost: int, *, block: bool = False,
              timeout: float | None = None) -> None:
        """Count the request in, or raise QueueFull (at once, or after waiting up to
        `timeout` s for room when `block`)."""
        self.check_size(cost)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (why := self._why_not(client, cost)) is not None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if not block or (remaining is not None and remaining <= 0):
                    self.refused += 1
                    raise QueueFull(why)
                self._cond.wait(remaining)
            held = self._held.setdefault(client, _Holding())
            held.work += cost
            held.requests += 1
            self._total.work += cost
            self._total.requests += 1

    def release(self, client: str, cost: int) -> None:
        with self._cond:
            held = self._held[client]
            held.work -= cost
            held.requests -= 1
            self._total.work -= cost
            self._total.requests -= 1
            if held.requests == 0:
                del self._held[client]
            self._cond.notify_all()

    def snapshot(self) -> dict[str, Any]:
        """What every host holds now, beside the limits (for metrics and the load bench)."""
        with self._cond:
            return {
                "work_capacity": self.work_capacity, "request_capacity": self.request_capacity,
                "host_share_work": self.host_work, "host_share_requests": self.host_requests,
                "work": self._total.work, "requests": self._total.requests,
                "refused": self.refused,
                "hosts": {c: {"work": h.work, "requests": h.requests}
                          for c, h in self._held.items()},
            }


@dataclasses.dataclass
class _Lane:
    items: deque
    weight: float
    vtime: float = 0.0
    since: int = 0  # when the lane last became backlogged: ties go to the older


class FairQueue:
    """Per-lane FIFOs served by start-time fair queueing: `choose` returns the backlogged lane
    with the least virtual time, `charge(lane, cost)` advances it by cost / weight. A lane that
    becomes backlogged starts at the current virtual time, so idling earns no credit and a new
    lane waits at most one round. Not thread-safe: the caller holds its own lock."""

    def __init__(self) -> None:
        self._lanes: dict[Hashable, _Lane] = {}
        self._now = 0.0
        self._arrivals = itertools.count()

    def push(self, lane: Hashable, item: Any, weight: float = 1.0) -> None:
        entry = self._lanes.get(lane)
        if entry is None:
            entry = self._lanes[lane] = _Lane(deque(), weight)
        if not entry.items:
            entry.vtime = max(entry.vtime, self._now)
            entry.since = next(self._arrivals)
        entry.weight = weight
        entry.items.append(item)

    def choose(self, eligible: Callable[[Hashable], bool] | None = None) -> Hashable | None:
        """The lane to serve next among backlogged (and `eligible`) lanes, or None."""
        best, key = None, None
        for lane, entry in self._lanes.items():
            if entry.items and (eligible is None or eligible(lane)):
                k = (entry.vtime, entry.since)
                if key is None or k < key:
                    best, key = lane, k
        return best

    def head(self, lane: Hashable) -> Any:
        return self._lanes[lane].items[0]

    def charge(self, lane: Hashable, cost: float) -> None:
        entry = self._lanes[lane]
        self._now = max(self._now, entry.vtime)
        entry.vtime += cost / entry.weight
        for idle in [k for k, e in self._lanes.items() if not e.items and e.vtime <= self._now]:
            del self._lanes[idle]  # it would restart at the clock anyway

    def pop(self, lane: Hashable) -> Any:
        """Remove and return the lane's head item (an emptied lane keeps its virtual time)."""
        entry = self._lanes[lane]
        item = entry.items.popleft()
        if not entry.items and entry.vtime <= self._now:
            del self._lanes[lane]  # nothing to remember: it would restart at the clock anyway
        return item

    def first(self, lane: Hashable, match: Callable[[Any], bool]) -> Any:
        """The lane's first item (head first) for which `match` is true, or None."""
        entry = self._lanes.get(lane)
        return next((item for item in entry.items if match(item)), None) if entry else None

    def remove(self, lane: Hashable, item: Any) -> bool:
        entry = self._lanes.get(lane)
        if entry is None:
            return False
        try:
            entry.items.remove(item)
        except ValueError:
            return False
        return True

    def __len__(self) -> int:
        return sum(len(e.items) for e in self._lanes.values())

    def count(self, lane: Hashable) -> int:
        entry = self._lanes.get(lane)
        return 0 if entry is None else len(entry.items)

    def items(self) -> Iterator[tuple[Hashable, Any]]:
        for lane, entry in self._lanes.items():
            for item in entry.items:
                yield lane, item

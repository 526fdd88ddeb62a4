"""Admission and fair scheduling for the rollout server: what a request costs, how much of the
server one client host may hold, and which waiting work goes next.

Work is counted in tokens a request may hold in the server's slots: per sample, prompt plus the
new tokens it may still generate (capped by its token budget). A host's share bounds its admitted
work and requests, in flight and queued; a request refused for it waits in its host's line, the
oldest with its room kept, so later smaller ones cannot overtake it for ever; the capacity bounds
everyone's. Every refusal says when to retry. Among admitted work,
lanes (one per client host and priority) are served by start-time fair queueing over samples,
weighted 2**priority, so a light client's request goes ahead of a heavy client's backlog. This
module knows nothing of engines or transport.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator
from typing import Any

__all__ = ["Admission", "FairQueue", "QueueFull", "request_cost"]


class QueueFull(RuntimeError):
    """The request would take a host past its share, or the server past its capacity, right now:
    retry later or elsewhere. The message names the limit and by how much; `retry_after` is the
    server's estimate, in seconds, of when to ask again; `in_line` whether the request holds a
    place in its host's line (asked again with its ticket, it keeps it)."""

    def __init__(self, message: str, retry_after: float, in_line: bool = False) -> None:
        super().__init__(message)
        self.retry_after, self.in_line = retry_after, in_line


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


# The retry-after hint: the estimated wait, halved for the first in line (early, its retry costs
# a refusal; late, it leaves the room kept for it idle), at least RETRY_AFTER_MIN doubled
# for each refusal in a row with nothing given back in between (the server stalls, in a compile
# or a pause: an estimate from recent releases says nothing then, and a client that honoured it
# would spend its tries in moments), at most RETRY_AFTER_MAX (past it, kept room would idle).
RETRY_AFTER_MIN, RETRY_AFTER_MAX = 0.05, 2.0
_RETRY_AFTER_UNKNOWN = 0.25  # nothing of the host (or the server) has ended yet to estimate from
_DRAIN_TAU = 2.0  # s: the memory of the release rate the estimate divides by


@dataclasses.dataclass
class _Holding:
    work: int = 0
    requests: int = 0


@dataclasses.dataclass
class _Waiter:
    """A request refused for its host's share, in its host's line until it is admitted."""

    cost: int
    mark: int  # the server's releases at its last refusal
    due: float = 0.0  # its last refusal's hint + reserve_seconds: not back by then, it leaves
    blocked: int = 0  # threads blocked in `admit` on it (it stays in line while they wait)
    stalls: int = 0  # refusals in a row with nothing released in between


@dataclasses.dataclass(frozen=True)
class _Refusal:
    reason: str
    own_share: bool  # the host's own share refused it (else the server's capacity)
    work: int = 0  # the capacity's missing room (a host's is worked out from its line)
    requests: int = 0


@dataclasses.dataclass
class _Drain:
    """Work and requests released, exponentially decayed over _DRAIN_TAU s: their rate."""

    work: float = 0.0
    requests: float = 0.0
    at: float = 0.0

    def add(self, now: float, work: int) -> None:
        decay = math.exp(-(now - self.at) / _DRAIN_TAU)
        self.work, self.requests, self.at = self.work * decay + work, self.requests * decay + 1, now

    def rates(self, now: float) -> tuple[float, float]:
        decay = math.exp(-(now - self.at) / _DRAIN_TAU) / _DRAIN_TAU
        return self.work * decay, self.requests * decay


class Admission:
    """Counts what each client host holds (work and requests, from admission until the request
    ends) against its share and the server's capacity, and keeps each host's waiting requests in
    line.

    work_capacity / request_capacity: the most the server holds, in flight and queued, over all
    hosts. host_share: the fraction of each that one host may hold. A request larger than one
    host's share could never be admitted: `check_size` refuses it with a ValueError.

    Waiting is honoured within a host: a request refused for its host's share joins the host's
    line (identified by its `ticket`: a retry brings the same one), and the oldest in line has
    its work and one request kept free of the host's share: a later request of the host is
    admitted only if it leaves that room, so no stream of smaller requests overtakes a larger
    one for ever. A waiter not back within `reserve_seconds` of the time its refusal's hint said
    leaves the line (its client gave up, or sends a new message each try); a line holds at most
    the server's request capacity (a bound on what one host can make it remember, but room for
    everything a busy host sends beyond its share, so a place is not a lottery). Other hosts are not affected, and the server's capacity keeps
    no reservation (a light host is never held for a heavy one). Every refusal carries a
    retry-after hint: the room missing over the rate at which the host (or, for the capacity,
    the server) has been giving work back. A caller that holds refused requests (the gRPC
    service) asks again when `add_listener`'s callback says their host gave work back."""

    def __init__(self, work_capacity: int, request_capacity: int, host_share: float, *,
                 reserve_seconds: float = 3.0) -> None:
        if work_capacity <= 0 or request_capacity <= 0:
            raise ValueError(f"work_capacity={work_capacity} and request_capacity="
                             f"{request_capacity} must be positive")
        if not 0.0 < host_share <= 1.0:
            raise ValueError(f"queue_share={host_share!r} must be in (0, 1]")
        if reserve_seconds <= 0:
            raise ValueError(f"reserve_seconds={reserve_seconds!r} must be positive")
        self.work_capacity, self.request_capacity = int(work_capacity), int(request_capacity)
        self.host_share = float(host_share)
        self.host_work = max(1, int(host_share * work_capacity))
        self.host_requests = max(1, int(host_share * request_capacity))
        self.reserve_seconds = float(reserve_seconds)
        self._held: dict[str, _Holding] = {}
        self._total = _Holding()
        self._lines: dict[str, OrderedDict[Hashable, _Waiter]] = {}
        self._drain: dict[str, _Drain] = {}
        self._drain_total = _Drain()
        self._releases = 0  # requests given back so far: a waiter's stall is none in between
        self._listeners: list[Callable[[str], None]] = []
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

    def _head(self, client: str, now: float) -> tuple[Hashable, _Waiter] | None:
        """The oldest waiter of the host's line, after those that lapsed have left it."""
        line = self._lines.get(client)
        if not line:
            return None
        for ticket in [t for t, w in line.items() if not w.blocked and now > w.due]:
            del line[ticket]
        if not line:
            del self._lines[client]
            return None
        return next(iter(line.items()))

    def _why_not(self, client: str, cost: int, ticket: Hashable | None, now: float
                 ) -> _Refusal | None:
        """None if the request fits now, else why not."""
        held = self._held.get(client, _Holding())
        head = self._head(client, now)
        kept = head[1] if head is not None and head[0] != ticket else None
        kept_work, kept_requests = (kept.cost, 1) if kept is not None else (0, 0)
        kept_note = (f" ({kept_work} tokens and 1 request more are kept for its oldest waiting "
                     "request)" if kept is not None else "")
        over = held.requests + 1 + kept_requests - self.host_requests
        if over > 0:
            return _Refusal(f"client {client} holds {held.requests} requests{kept_note}, its "
                            f"share is {self.host_requests} (queue_share {self.host_share} x "
                            f"{self.request_capacity})", True)
        over = held.work + cost + kept_work - self.host_work
        if over > 0:
            return _Refusal(f"client {client} holds {held.work} tokens of work{kept_note} and "
                            f"this request needs {cost}: {over} over its share of "
                            f"{self.host_work} (queue_share {self.host_share} x "
                            f"{self.work_capacity})", True)
        over = self._total.requests + 1 - self.request_capacity
        if over > 0:
            return _Refusal(f"the server holds {self._total.requests} requests, its capacity is "
                            f"{self.request_capacity}", False, requests=over)
        over = self._total.work + cost - self.work_capacity
        if over > 0:
            return _Refusal(f"the server holds {self._total.work} tokens of work and this "
                            f"request needs {cost}: {over} over its capacity of "
                            f"{self.work_capacity}", False, work=over)
        return None

    def _retry_after(self, client: str, cost: int, ticket: Hashable | None, refusal: _Refusal,
                     waiter: _Waiter | None, now: float) -> float:
        """The hint (see RETRY_AFTER_MIN): for the host's share, the wait until the host has
        given back enough for this request and the waiters ahead of it in line (all of them,
        for a newcomer) at the rate it has been giving work back; for the capacity, the
        server's missing room at the server's rate (no line: as the first in it)."""
        if refusal.own_share:
            held = self._held.get(client, _Holding())
            ahead_work = ahead = 0
            for waiting, other in self._lines.get(client, {}).items():
                if waiting == ticket:
                    break
                ahead_work += other.cost
                ahead += 1
            estimate = self._estimate(self._drain.get(client), now,
                                      held.work + ahead_work + cost - self.host_work,
                                      held.requests + ahead + 1 - self.host_requests)
            first = ahead == 0
        else:
            estimate = self._estimate(self._drain_total, now, refusal.work, refusal.requests)
            first = True
        wait = (_RETRY_AFTER_UNKNOWN if estimate is None
                else estimate / 2 if first else estimate)
        floor = RETRY_AFTER_MIN * 2.0 ** min(10, waiter.stalls if waiter is not None else 0)
        return min(RETRY_AFTER_MAX, max(floor, wait))

    @staticmethod
    def _estimate(drain: _Drain | None, now: float, work: int, requests: int) -> float | None:
        """Seconds until `work` tokens and `requests` requests should have been given back at
        the rate `drain` has seen; None before anything was."""
        if drain is None:
            return None
        work_rate, request_rate = drain.rates(now)
        return max(max(0, work) / max(work_rate, 1e-9),
                   max(0, requests) / max(request_rate, 1e-9))

    def admit(self, client: str, cost: int, *, block: bool = False,
              timeout: float | None = None, ticket: Hashable | None = None) -> None:
        """Count the request in, or raise QueueFull (at once, or after waiting up to
        `timeout` s for room when `block`).

        ticket: what identifies this request when it is asked again (e.g. a digest of its
        message): refused for its host's share, it takes its place in the host's line, and a
        retry with the same ticket keeps that place. A blocking call waits in line without one.
        """
        self.check_size(cost)
        deadline = None if timeout is None else time.monotonic() + timeout
        own_ticket = ticket is None and block  # nobody else can ask again with it
        if own_ticket:
            ticket = object()
        admitted = False
        with self._cond:
            try:
                while (refusal := self._why_not(client, cost, ticket, now := time.monotonic())
                       ) is not None:
                    waiter = (None if ticket is None
                              else self._line_up(client, ticket, cost, refusal.own_share))
                    retry_after = self._retry_after(client, cost, ticket, refusal, waiter, now)
                    if waiter is not None:
                        waiter.due = now + retry_after + self.reserve_seconds
                    remaining = None if deadline is None else deadline - now
                    if not block or (remaining is not None and remaining <= 0):
                        self.refused += 1
                        raise QueueFull(f"{refusal.reason}; retry after {retry_after:.2f} s",
                                        retry_after, in_line=waiter is not None)
                    if waiter is not None:
                        waiter.blocked += 1
                    try:
                        self._cond.wait(remaining)
                    finally:
                        if waiter is not None:
                            waiter.blocked -= 1
                held = self._held.setdefault(client, _Holding())
                held.work += cost
                held.requests += 1
                self._total.work += cost
                self._total.requests += 1
                admitted = True
            finally:
                if ticket is not None and (admitted or own_ticket):
                    self._leave_line(client, ticket)

    def _line_up(self, client: str, ticket: Hashable, cost: int, own_share: bool
                 ) -> _Waiter | None:
        """The refused request's place in its host's line: the one it has, or the last one if
        its host's share refused it and the line has room (else None)."""
        line = self._lines.get(client)
        waiter = line.get(ticket) if line else None
        if waiter is not None:
            waiter.stalls = waiter.stalls + 1 if waiter.mark == self._releases else 0
            waiter.mark = self._releases
        elif own_share and (line is None or len(line) < self.request_capacity):
            waiter = self._lines.setdefault(client, OrderedDict())[ticket] = _Waiter(
                cost, self._releases)
        return waiter

    def withdraw(self, client: str, ticket: Hashable) -> None:
        """The request of `ticket` will not be asked again (its client went away): it gives up
        its place in its host's line."""
        with self._cond:
            self._leave_line(client, ticket)

    def add_listener(self, listener: Callable[[str], None]) -> None:
        """Call `listener(client)` after each release of the client's work (from the releasing
        thread, outside the lock): e.g. to ask again for requests waiting in its line."""
        with self._cond:
            self._listeners.append(listener)

    def _leave_line(self, client: str, ticket: Hashable) -> None:
        line = self._lines.get(client)
        if line is not None and line.pop(ticket, None) is not None:
            if not line:
                del self._lines[client]
            self._cond.notify_all()  # a new head: the blocked waiters look again

    def release(self, client: str, cost: int) -> None:
        now = time.monotonic()
        with self._cond:
            held = self._held[client]
            held.work -= cost
            held.requests -= 1
            self._total.work -= cost
            self._total.requests -= 1
            if held.requests == 0:
                del self._held[client]
            self._releases += 1
            self._drain.setdefault(client, _Drain()).add(now, cost)
            self._drain_total.add(now, cost)
            if len(self._drain) > 1024:  # forget hosts that gave nothing back for a while
                for host in [h for h, d in self._drain.items()
                             if h not in self._held and d.rates(now)[1] < 1e-3]:
                    del self._drain[host]
            self._cond.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            listener(client)

    def snapshot(self) -> dict[str, Any]:
        """What every host holds now, beside the limits, and each host's line (for metrics and
        the load bench)."""
        with self._cond:
            return {
                "work_capacity": self.work_capacity, "request_capacity": self.request_capacity,
                "host_share_work": self.host_work, "host_share_requests": self.host_requests,
                "work": self._total.work, "requests": self._total.requests,
                "refused": self.refused,
                "hosts": {c: {"work": h.work, "requests": h.requests}
                          for c, h in self._held.items()},
                "waiting": {c: {"requests": len(line), "head_work": next(iter(line.values())).cost}
                            for c, line in self._lines.items() if line},
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

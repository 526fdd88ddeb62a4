"""Router across rollout replicas (RECIPE §4): least-loaded dispatch with per-replica flow control,
a circuit breaker per replica, and retry elsewhere of a request whose replica failed half-way.

An unhealthy replica gets no new requests; a background prober re-admits it once its Health call
answers SERVING and `on_readmit(address)` (if given: e.g. "it has the current weights") agrees.
A step-progress watchdog opens the breaker of a replica that has requests in flight but streamed
no token for `stall_seconds` (a hung or SIGSTOPped process still accepts connections) and
cancels its calls, so they retry elsewhere. A retried request keeps its seed, so it samples the
same tokens on the new replica (given the same weight version). Invalid requests are never
retried. A replica that refuses for lack of room (RESOURCE_EXHAUSTED) is not failing: the
request is asked again when the refusal's retry-after hint says.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc

from hcjax.rollout.request import GenerateRequest, SampledRollout, TokenEvent
from hcjax.rollout.service import RolloutClient, retry_after

__all__ = ["NoReplicaAvailable", "Router"]

CLOSED, OPEN = "closed", "open"  # circuit-breaker states: closed = healthy, takes traffic

# Errors that say "this request is wrong", not "this replica is unwell": never retried.
_FATAL = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
# A replica that refuses for lack of room (RESOURCE_EXHAUSTED) is asked again when its
# retry-after hint says (at most _MAX_HINT s: a bad hint cannot park a request), or, from a
# replica that gives none, after this long, doubling up to the maximum.
_PRESSURE_BACKOFF, _MAX_PRESSURE_BACKOFF = 0.05, 1.0
_MAX_HINT = 10.0


def _too_large(err: grpc.RpcError) -> bool:
    """gRPC's own RESOURCE_EXHAUSTED for a message over the size limit: retrying cannot help."""
    return (err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "larger than max" in (err.details() or ""))


class NoReplicaAvailable(RuntimeError):
    """No healthy replica had capacity in time, or every attempt failed."""


@dataclasses.dataclass
class _Replica:
    address: str
    client: RolloutClient
    state: str = CLOSED
    inflight: int = 0
    consecutive_failures: int = 0
    failures: int = 0
    completed: int = 0
    readmissions: int = 0
    stalls: int = 0
    open_until: float = 0.0
    backoff: float = 0.0
    last_progress: float = 0.0  # when a token last streamed (or work arrived at an idle replica)
    why: str = ""  # why the breaker last opened


class Router:
    """Dispatches GenerateRequests to replicas; thread-safe; `generate` blocks until done."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        max_inflight_per_replica: int = 64,
        failure_threshold: int = 1,
        probe_interval: float = 0.5,
        max_probe_backoff: float = 10.0,
        max_attempts: int = 3,
        stall_seconds: float | None = 120.0,
        on_readmit: Callable[[str], bool] | None = None,
        max_backpressure_seconds: float = 600.0,
    ) -> None:
        """stall_seconds: in-flight requests with no token for this long open the replica's
        breaker (None: no watchdog). on_readmit(address): called (from the prober thread) when
        an open replica answers SERVING; it rejoins only if this returns True (else it is probed
        again later). max_backpressure_seconds: how long a request without a timeout keeps asking
        replicas that refuse it for lack of room (RESOURCE_EXHAUSTED) before it fails."""
        if max_inflight_per_replica <= 0:
            raise ValueError(f"max_inflight_per_replica={max_inflight_per_replica} must be > 0")
        if failure_threshold <= 0:
            raise ValueError(f"failure_threshold={failure_threshold} must be > 0")
        if max_attempts <= 0:
            raise ValueError(f"max_attempts={max_attempts} must be > 0")
        if stall_seconds is not None and stall_seconds <= 0:
            raise ValueError(f"stall_seconds={stall_seconds} must be > 0 (or None: no watchdog)")
        self._stall = stall_seconds
        self._on_readmit = on_readmit
        self._max_inflight = max_inflight_per_replica
        self._threshold = failure_threshold
        self._probe_interval = probe_interval
        self._max_backoff = max_probe_backoff
        self._max_attempts = max_attempts
        self._max_backpressure = max_backpressure_seconds
        self._backpressure = 0  # refusals for lack of room, waited out
        self._cond = threading.Condition()
        self._replicas: dict[str, _Replica] = {}
        self._requests = 0
        self._retries = 0
        self._failed_requests = 0
        self._closed = threading.Event()
        for a in addresses:
            self.add_replica(a)
        self._prober = threading.Thread(target=self._probe_loop, name="router-prober", daemon=True)
        self._prober.start()

    # Membership ------------------------------------------------------------------------------
    def add_replica(self, address: str) -> None:
        """Add (or rediscover) a replica; it takes traffic at once."""
        with self._cond:
            if address not in self._replicas:
                self._replicas[address] = _Replica(address, RolloutClient(address))
            self._cond.notify_all()

    def mark_down(self, address: str, why: str = "marked down") -> None:
        """Stop sending `address` requests until the prober readmits it (unknown: ignored)."""
        with self._cond:
            rep = self._replicas.get(address)
            if rep is not None and rep.state == CLOSED:
                self._open(rep, why)
        if rep is not None and hasattr(rep.client, "cancel_inflight"):
            rep.client.cancel_inflight()

    def mark_down_unresponsive(self, timeout: float,
                               among: Sequence[str] | None = None) -> list[str]:
        """Ask the replicas `among` (default: all) for Health at once; mark down each that does
        not answer SERVING within `timeout` s, provided another one does (with none answering
        there is nobody to route to instead). Returns the addresses it marked down."""
        with self._cond:
            clients = {a: r.client for a, r in self._replicas.items()
                       if among is None or a in among}
        if len(clients) < 2:
            return []

        def answers(client) -> bool:
            try:
                return client.health(timeout=timeout).get("status") == "SERVING"
            except Exception:  # noqa: BLE001 - no answer in time, or an error: unresponsive
                return False

        with futures.ThreadPoolExecutor(len(clients)) as pool:
            ok = dict(zip(clients, pool.map(answers, clients.values()), strict=True))
        if not any(ok.values()):
            return []
        down = [a for a, answered in ok.items() if not answered]
        for address in down:
            self.mark_down(address, f"no Health answer within {timeout} s")
        return down

    def is_up(self, address: str) -> bool:
        with self._cond:
            rep = self._replicas.get(address)
            return rep is not None and rep.state == CLOSED

    def remove_replica(self, address: str) -> None:
        with self._cond:
            rep = self._replicas.pop(address, None)
        if rep is not None:
            rep.client.close()

    # Dispatch --------------------------------------------------------------------------------
    def generate(
        self,
        request: GenerateRequest,
        *,
        timeout: float | None = None,
        on_event: Callable[[TokenEvent, str], None] | None = None,
    ) -> list[SampledRollout]:
        """Run `request` on the least-loaded healthy replica, retrying elsewhere on failure.

        on_event(event, replica_address) sees the token stream; after a retry the new replica's
        stream starts again from the first token.
        """
        if request.seed is None:  # fix the seed so a retry reproduces the same samples
            request = dataclasses.replace(request, seed=random.randrange(2**32))
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._requests += 1
        tried: set[str] = set()
        last_error: Exception | None = None
        attempt, pressure = 0, _PRESSURE_BACKOFF
        pressure_until = time.monotonic() + self._max_backpressure
        while attempt < self._max_attempts:
            try:
                rep = self._acquire(tried, deadline)
            except NoReplicaAvailable:
                with self._cond:
                    self._failed_requests += 1
                raise
            if attempt:
                with self._cond:
                    self._retries += 1
            callback = self._progress_callback(rep, on_event)
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                records = rep.client.generate(request, timeout=remaining, on_event=callback)
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                if code in _FATAL or _too_large(e):
                    self._release(rep, ok=True)
                    raise ValueError(e.details()) from None
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    # Back-pressure (the replica holds this host's share), not ill health: wait
                    # as the replica says and ask again (the same message: a replica that refused
                    # it keeps its place in this host's line), without opening the breaker or
                    # spending an attempt.
                    self._release(rep, ok=True, count=False)
                    last_error = e
                    now = time.monotonic()
                    if now >= (pressure_until if deadline is None else deadline):
                        break
                    with self._cond:
                        self._backpressure += 1
                    hint = retry_after(e)
                    wait = pressure if hint is None else min(hint, _MAX_HINT)
                    time.sleep(wait if deadline is None else min(wait, deadline - now))
                    if hint is None:
                        pressure = min(2 * pressure, _MAX_PRESSURE_BACKOFF)
                    continue
                self._release(rep, ok=False)
                last_error = e
            except ConnectionError as e:
                self._release(rep, ok=False)
                last_error = e
            else:
                self._release(rep, ok=True)
                return records
            tried.add(rep.address)
            attempt += 1
        with self._cond:
            self._failed_requests += 1
        raise NoReplicaAvailable(
            f"request failed after {attempt} attempts; last error: {last_error!r}"
        )

    def _acquire(self, tried: set[str], deadline: float | None) -> _Replica:
        with self._cond:
            while True:
                healthy = [r for r in self._replicas.values() if r.state == CLOSED]
                # Prefer replicas this request has not failed on; fall back to any healthy one.
                fresh = [r for r in healthy if r.address not in tried] or healthy
                ready = [r for r in fresh if r.inflight < self._max_inflight]
                if ready:
                    rep = min(ready, key=lambda r: (r.inflight, random.random()))
                    if rep.inflight == 0:  # work arrives at an idle replica: the clock starts
                        rep.last_progress = time.monotonic()
                    rep.inflight += 1
                    return rep
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    raise NoReplicaAvailable(
                        f"no healthy replica with capacity (states: {self._states()})"
                    )
                self._cond.wait(timeout=0.1 if wait is None else min(wait, 0.1))

    def _release(self, rep: _Replica, ok: bool, count: bool = True) -> None:
        with self._cond:
            rep.inflight -= 1
            if ok:
                rep.consecutive_failures = 0
                rep.completed += count
            else:
                rep.failures += 1
                rep.consecutive_failures += 1
                if rep.state == CLOSED and rep.consecutive_failures >= self._threshold:
                    self._open(rep)
            self._cond.notify_all()

    def _progress_callback(self, rep: _Replica, on_event):
        def progress(event) -> None:
            rep.last_progress = time.monotonic()  # a float store: no lock needed
            if on_event is not None:
                on_event(event, rep.address)

        return progress

    def _open(self, rep: _Replica, why: str = "failed") -> None:
        rep.why = why
        rep.state = OPEN
        rep.backoff = self._probe_interval
        rep.open_until = time.monotonic() + rep.backoff

    # Circuit breaker probes ------------------------------------------------------------------
    def _watchdog(self) -> None:
        """Open the breaker of every replica whose in-flight requests made no progress for
        stall_seconds, and cancel its calls (they fail here and are retried elsewhere)."""
        if self._stall is None:
            return
        now = time.monotonic()
        with self._cond:
            stalled = [r for r in self._replicas.values() if r.state == CLOSED and r.inflight
                       and now - r.last_progress > self._stall]
            for rep in stalled:
                rep.stalls += 1
                self._open(rep, f"stalled: {rep.inflight} requests in flight and no token for "
                                f"{now - rep.last_progress:.1f} s")
            self._cond.notify_all()
        for rep in stalled:
            if hasattr(rep.client, "cancel_inflight"):
                rep.client.cancel_inflight()

    def _healthy(self, rep: _Replica) -> bool:
        try:
            reply = rep.client.health(timeout=max(1.0, self._probe_interval))
        except Exception:  # any failure to answer a probe keeps the breaker open
            return False
        if reply.get("status", "SERVING" if reply.get("ok") else "NOT_SERVING") != "SERVING":
            return False
        if self._on_readmit is None:
            return True
        try:
            return bool(self._on_readmit(rep.address))
        except Exception:  # noqa: BLE001 - e.g. the weights push failed: probe again later
            return False

    def _probe_loop(self) -> None:
        while not self._closed.wait(self._probe_interval / 2):
            self._watchdog()
            now = time.monotonic()
            with self._cond:
                due = [r for r in self._replicas.values() if r.state == OPEN and r.open_until <= now]
            for rep in due:
                healthy = self._healthy(rep)
                with self._cond:
                    if healthy and rep.state == OPEN:
                        rep.state = CLOSED
                        rep.consecutive_failures = 0
                        rep.readmissions += 1
                        self._cond.notify_all()
                    elif not healthy:
                        rep.backoff = min(self._max_backoff, rep.backoff * 2)
                        rep.open_until = time.monotonic() + rep.backoff

    # Introspection ---------------------------------------------------------------------------
    def _states(self) -> dict[str, str]:
        return {a: r.state for a, r in self._replicas.items()}

    def metrics(self) -> dict:
        with self._cond:
            return {
                "requests": self._requests,
                "retries": self._retries,
                "backpressure_waits": self._backpressure,
                "failed_requests": self._failed_requests,
                "replicas": {
                    a: {
                        "state": r.state,
                        "inflight": r.inflight,
                        "completed": r.completed,
                        "failures": r.failures,
                        "readmissions": r.readmissions,
                        "stalls": r.stalls,
                        "why": r.why,
                    }
                    for a, r in self._replicas.items()
                },
            }

    def close(self) -> None:
        self._closed.set()
        self._prober.join(5.0)
        with self._cond:
            reps = list(self._replicas.values())
        for r in reps:
            r.client.close()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""Router across rollout replicas (RECIPE §4): least-loaded dispatch with per-replica flow control,
a circuit breaker per replica, and retry elsewhere of a request whose replica failed half-way.

An unhealthy replica gets no new requests; a background prober re-admits it once its Health call
succeeds. A retried request keeps its seed, so it samples the same tokens on the new replica
(given the same weight version). Invalid requests are never retried.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from hcjax.rollout.request import GenerateRequest, SampledRollout, TokenEvent
from hcjax.rollout.service import RolloutClient

__all__ = ["NoReplicaAvailable", "Router"]

CLOSED, OPEN = "closed", "open"  # circuit-breaker states: closed = healthy, takes traffic

# Errors that say "this request is wrong", not "this replica is unwell": never retried.
_FATAL = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}


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
    open_until: float = 0.0
    backoff: float = 0.0


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
    ) -> None:
        if max_inflight_per_replica <= 0:
            raise ValueError(f"max_inflight_per_replica={max_inflight_per_replica} must be > 0")
        if failure_threshold <= 0:
            raise ValueError(f"failure_threshold={failure_threshold} must be > 0")
        if max_attempts <= 0:
            raise ValueError(f"max_attempts={max_attempts} must be > 0")
        self._max_inflight = max_inflight_per_replica
        self._threshold = failure_threshold
        self._probe_interval = probe_interval
        self._max_backoff = max_probe_backoff
        self._max_attempts = max_attempts
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
        for attempt in range(self._max_attempts):
            try:
                rep = self._acquire(tried, deadline)
            except NoReplicaAvailable:
                with self._cond:
                    self._failed_requests += 1
                raise
            if attempt:
                with self._cond:
                    self._retries += 1
            callback = None if on_event is None else (lambda e, a=rep.address: on_event(e, a))
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                records = rep.client.generate(request, timeout=remaining, on_event=callback)
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                if code in _FATAL:
                    self._release(rep, ok=True)
                    raise ValueError(e.details()) from None
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    # Back-pressure, not ill health: try elsewhere without opening the breaker.
                    self._release(rep, ok=True, count=False)
                    last_error = e
                    time.sleep(0.05)
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
        with self._cond:
            self._failed_requests += 1
        raise NoReplicaAvailable(
            f"request failed on {self._max_attempts} attempts; last error: {last_error!r}"
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

    def _open(self, rep: _Replica) -> None:
        rep.state = OPEN
        rep.backoff = self._probe_interval
        rep.open_until = time.monotonic() + rep.backoff

    # Circuit breaker probes ------------------------------------------------------------------
    def _probe_loop(self) -> None:
        while not self._closed.wait(self._probe_interval / 2):
            now = time.monotonic()
            with self._cond:
                due = [r for r in self._replicas.values() if r.state == OPEN and r.open_until <= now]
            for rep in due:
                try:
                    healthy = bool(rep.client.health(timeout=max(1.0, self._probe_interval)).get("ok"))
                except Exception:  # any failure to answer a probe keeps the breaker open
                    healthy = False
                with self._cond:
                    if healthy:
                        rep.state = CLOSED
                        rep.consecutive_failures = 0
                        rep.readmissions += 1
                        self._cond.notify_all()
                    else:
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
                "failed_requests": self._failed_requests,
                "replicas": {
                    a: {
                        "state": r.state,
                        "inflight": r.inflight,
                        "completed": r.completed,
                        "failures": r.failures,
                        "readmissions": r.readmissions,
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

"""Router logic with in-memory replicas (no model, no network): per-replica flow control,
least-loaded choice, circuit breaker open/probe/re-admit, no retry of invalid requests."""

import threading
import time

import grpc
import pytest

from hcjax.rollout import GenerateRequest
from hcjax.rollout.router import NoReplicaAvailable, Router
from hcjax.rollout.service import RETRY_AFTER_KEY, retry_after


class FakeReplica:
    def __init__(self, delay=0.0, fail=False):
        self.delay, self.fail, self.healthy = delay, fail, True
        self.inflight = self.peak = self.calls = 0
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.release.set()

    def generate(self, request, timeout=None, on_event=None):
        with self.lock:
            self.inflight += 1
            self.calls += 1
            self.peak = max(self.peak, self.inflight)
        try:
            self.release.wait()
            time.sleep(self.delay)
            if self.fail:
                raise ConnectionError("replica died")
            return [f"record-{request.seed}"]
        finally:
            with self.lock:
                self.inflight -= 1

    def health(self, timeout=None):
        if not self.healthy:
            raise ConnectionError("down")
        return {"ok": True}

    def close(self):
        pass


def _router(fakes, **kw):
    router = Router([f"fake:{i}" for i in range(len(fakes))], **kw)
    for i, fake in enumerate(fakes):
        router._replicas[f"fake:{i}"].client = fake
    return router


def _run_many(router, n, threads=8):
    out, errors = [], []

    def worker(w):
        try:
            for i in range(w, n, threads):
                out.append(router.generate(GenerateRequest(prompt=[1], seed=i), timeout=30))
        except Exception as e:
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return out, errors


def test_flow_control_caps_inflight_per_replica():
    fakes = [FakeReplica(delay=0.01), FakeReplica(delay=0.01)]
    with _router(fakes, max_inflight_per_replica=2) as router:
        out, errors = _run_many(router, 40)
    assert not errors and len(out) == 40
    assert all(f.peak <= 2 for f in fakes)
    assert sum(f.calls for f in fakes) == 40


def test_least_loaded_replica_gets_new_requests():
    busy, idle = FakeReplica(), FakeReplica()
    busy.release.clear()
    with _router([busy, idle], max_inflight_per_replica=8) as router:
        blocker = threading.Thread(
            target=lambda: router.generate(GenerateRequest(prompt=[1], seed=0))
        )
        # Load fake:0 first by making it the only choice, then add the idle one back.
        router._replicas["fake:1"].state = "open"
        router._replicas["fake:1"].open_until = float("inf")
        blocker.start()
        while busy.inflight == 0:
            time.sleep(0.01)
        router._replicas["fake:1"].state = "closed"
        for i in range(5):
            router.generate(GenerateRequest(prompt=[1], seed=i + 1), timeout=10)
        assert idle.calls == 5 and busy.calls == 1
        busy.release.set()
        blocker.join(10)


def test_breaker_opens_retries_elsewhere_and_readmits_after_probe():
    flaky, good = FakeReplica(fail=True), FakeReplica()
    with _router([flaky, good], probe_interval=0.05) as router:
        flaky.healthy = False
        out, errors = _run_many(router, 20, threads=4)
        assert not errors and len(out) == 20
        m = router.metrics()
        assert m["replicas"]["fake:0"]["state"] == "open"
        assert m["retries"] == flaky.calls >= 1
        assert good.calls == 20
        calls_while_open = flaky.calls
        time.sleep(0.3)
        assert flaky.calls == calls_while_open  # an open replica gets no traffic
        flaky.fail, flaky.healthy = False, True
        deadline = time.monotonic() + 10
        while router.metrics()["replicas"]["fake:0"]["state"] != "closed":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert router.metrics()["replicas"]["fake:0"]["readmissions"] == 1


def test_every_replica_failing_raises_after_max_attempts():
    fakes = [FakeReplica(fail=True), FakeReplica(fail=True)]
    with _router(fakes, max_attempts=2, probe_interval=60) as router:
        with pytest.raises(NoReplicaAvailable):
            router.generate(GenerateRequest(prompt=[1], seed=0), timeout=2)
        assert router.metrics()["failed_requests"] == 1


def test_invalid_request_is_not_retried():
    class Invalid(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.INVALID_ARGUMENT

        def details(self):
            return "n=0 must be a positive integer"

    calls = []

    def invalid(*args, **kwargs):
        calls.append(1)
        raise Invalid()

    fakes = [FakeReplica(), FakeReplica()]
    for f in fakes:
        f.generate = invalid
    with _router(fakes) as router:
        with pytest.raises(ValueError, match="n=0"):
            router.generate(GenerateRequest(prompt=[1], seed=0), timeout=5)
        m = router.metrics()
    assert len(calls) == 1 and m["retries"] == 0
    assert all(r["state"] == "closed" for r in m["replicas"].values())


def test_router_rejects_bad_settings():
    with pytest.raises(ValueError, match="max_inflight_per_replica=0"):
        Router([], max_inflight_per_replica=0)


class _Refusal(grpc.RpcError):
    def __init__(self, details, metadata=()):
        self._details, self._metadata = details, metadata

    def code(self):
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._metadata


class BusyReplica(FakeReplica):
    """Refuses for lack of room (its client host's share is full) `refusals` times, then serves;
    each refusal carries the retry-after hint `hint_ms` in its trailing metadata if given."""

    def __init__(self, refusals, hint_ms=None):
        super().__init__()
        self.refusals, self.hint_ms = refusals, hint_ms
        self.requests = []

    def generate(self, request, timeout=None, on_event=None):
        with self.lock:
            self.calls += 1
            self.requests.append(request)
            if self.refusals:
                self.refusals -= 1
                metadata = () if self.hint_ms is None else ((RETRY_AFTER_KEY, str(self.hint_ms)),)
                raise _Refusal("client ipv4:127.0.0.1 holds 96 tokens of work ... retry later",
                               metadata)
        return [f"record-{request.seed}"]


def test_retry_after_reads_the_trailing_metadata_then_the_message():
    assert retry_after(_Refusal("... retry after 9.00 s", ((RETRY_AFTER_KEY, "350"),))) == 0.35
    assert retry_after(_Refusal("client a holds 5 requests ...; retry after 1.25 s")) == 1.25
    assert retry_after(_Refusal("... retry later", (("other", "1"),))) is None
    assert retry_after(_Refusal("Received message larger than max (5 vs. 1)")) is None


def test_the_router_asks_again_when_the_refusal_says_with_the_same_request():
    """Two refusals that say 'retry after 0.4 s': the router waits that long each time (its own
    backoff would be 0.05 + 0.1 s) and asks again with the same request, seed included, so the
    replica recognises it and it keeps its place in the host's line there."""
    busy = BusyReplica(refusals=2, hint_ms=400)
    with _router([busy]) as router:
        t0 = time.monotonic()
        assert router.generate(GenerateRequest(prompt=[1]), timeout=30)
        waited = time.monotonic() - t0
    assert waited >= 0.8 and busy.calls == 3
    assert busy.requests[0] == busy.requests[1] == busy.requests[2]
    assert busy.requests[0].seed is not None


def test_a_replica_refusing_for_lack_of_room_is_waited_out_not_failed():
    """RESOURCE_EXHAUSTED is back-pressure: more refusals than max_attempts still succeed, the
    breaker stays closed; a message over the size limit is the request's fault and fails at
    once; a refusal that outlasts the timeout fails the request naming the last refusal."""
    busy = BusyReplica(refusals=5)
    with _router([busy], max_attempts=2) as router:
        assert router.generate(GenerateRequest(prompt=[1], seed=3), timeout=30) == ["record-3"]
        metrics = router.metrics()
    assert busy.calls == 6 and metrics["backpressure_waits"] == 5
    assert metrics["replicas"]["fake:0"]["state"] == "closed"
    too_large = BusyReplica(refusals=10**6)
    too_large.generate = lambda *a, **k: (_ for _ in ()).throw(
        _Refusal("Received message larger than max (5 vs. 1)"))
    with _router([too_large]) as router:
        with pytest.raises(ValueError, match="larger than max"):
            router.generate(GenerateRequest(prompt=[1]), timeout=30)
    with _router([BusyReplica(refusals=10**6)]) as router:
        t0 = time.monotonic()
        with pytest.raises(NoReplicaAvailable, match="retry later"):
            router.generate(GenerateRequest(prompt=[1]), timeout=0.5)
        assert time.monotonic() - t0 < 5

"""Admission by work and fair queueing (hcjax.rollout.scheduler), alone with hand-computed
values, then inside a RolloutServer: a light client is served ahead of a heavy client's backlog,
and no client holds more than its share."""

import threading
import time

import pytest

from hcjax.rollout import Engine, GenerateRequest, RolloutServer
from hcjax.rollout.scheduler import (
    RETRY_AFTER_MAX,
    RETRY_AFTER_MIN,
    Admission,
    FairQueue,
    QueueFull,
    request_cost,
)
from tests.rollout_fixtures import tiny_model

# The engines here test serving, not the sampler: its sort-only setting (bit-identical draws,
# a third of the compile; tests/conftest.py).
pytestmark = pytest.mark.usefixtures("sort_only_sampler")


@pytest.fixture(scope="module")
def tiny_engine():
    return Engine(tiny_model(0), max_concurrent_decodes=4, max_prefill_length=16,
                  max_target_length=64)


def test_request_cost_counts_what_each_sample_may_hold():
    assert request_cost(10, 4, 32) == 4 * (10 + 32)
    assert request_cost(10, 4, 32, token_budget=8) == 4 * (10 + 8)
    # continued samples hold their earlier tokens and may add what is left of max_tokens
    assert request_cost(10, 2, 32, done_tokens=(30, 5)) == (10 + 30 + 2) + (10 + 5 + 27)
    assert request_cost(10, 2, 32, token_budget=4, done_tokens=(30, 5)) == (10 + 32) + (10 + 9)


def test_admission_refuses_past_the_share_and_the_capacity_naming_the_limit():
    adm = Admission(work_capacity=1000, request_capacity=10, host_share=0.5)
    assert (adm.host_work, adm.host_requests) == (500, 5)
    adm.admit("a", 400)
    with pytest.raises(QueueFull, match=r"client a holds 400 tokens .* needs 200: 100 over its "
                                        r"share of 500"):
        adm.admit("a", 200)
    adm.admit("b", 450)
    with pytest.raises(QueueFull, match=r"the server holds 850 tokens .* needs 200: 50 over its "
                                        r"capacity of 1000"):
        adm.admit("c", 200)
    with pytest.raises(ValueError, match="more than one host's share of this server"):
        adm.admit("c", 501)
    for _ in range(5):
        adm.admit("d", 1)
    with pytest.raises(QueueFull, match=r"client d holds 5 requests, its share is 5"):
        adm.admit("d", 1)
    snap = adm.snapshot()
    assert snap["hosts"]["a"] == {"work": 400, "requests": 1} and snap["refused"] == 3
    adm.release("a", 400)
    adm.admit("a", 100)  # room again
    assert "a" in adm.snapshot()["hosts"] and adm.snapshot()["work"] == 100 + 450 + 5


def test_a_blocking_admission_waits_for_room():
    adm = Admission(work_capacity=100, request_capacity=4, host_share=1.0)
    adm.admit("a", 80)
    threading.Timer(0.2, adm.release, ("a", 80)).start()
    t0 = time.monotonic()
    adm.admit("a", 50, block=True, timeout=10)
    assert 0.1 < time.monotonic() - t0 < 5
    with pytest.raises(QueueFull):
        adm.admit("a", 60, block=True, timeout=0.1)


def _run_host(adm: Admission, *, tickets: bool, steps: int) -> int | None:
    """One host of the issue's shape on a 500-token share: each step its oldest request ends,
    small requests (50 tokens; a refused one is asked again first) take whatever room they are
    given, and a 300-token request asks again every third step. Returns the step the large one
    got in, or None."""
    held: list[int] = []
    small = 0  # the next small request to ask for (asked again until admitted)
    for step in range(steps):
        if held:
            adm.release("h", held.pop(0))
        while True:
            try:
                adm.admit("h", 50, ticket=("small", small) if tickets else None)
            except QueueFull:
                break
            held.append(50)
            small += 1
        if step % 3 == 0:
            try:
                adm.admit("h", 300, ticket="large" if tickets else None)
            except QueueFull:
                continue
            return step
    return None


def test_a_waiting_request_is_not_overtaken_for_ever_by_later_smaller_ones():
    """Without a line (no tickets: as before) the small requests keep the share above 200
    tokens and the large one never fits; in line, its room is kept and it gets in as soon as
    the work held before it ends (450 tokens, one 50-token request a step)."""
    assert _run_host(Admission(1000, 100, 0.5), tickets=False, steps=300) is None
    step = _run_host(Admission(1000, 100, 0.5), tickets=True, steps=300)
    assert step is not None and step <= 12, step


def test_the_oldest_waiting_request_keeps_its_room_and_the_others_theirs_in_turn():
    adm = Admission(work_capacity=1000, request_capacity=100, host_share=0.5)
    adm.admit("a", 450)
    with pytest.raises(QueueFull, match=r"client a holds 450 tokens of work and this request "
                                        r"needs 300: 250 over its share of 500"):
        adm.admit("a", 300, ticket="L")
    # 40 more would fit the share, but not beside the 300 kept for L
    with pytest.raises(QueueFull, match=r"holds 450 tokens of work \(300 tokens and 1 request "
                                        r"more are kept for its oldest waiting request\) and "
                                        r"this request needs 40: 290 over"):
        adm.admit("a", 40, ticket="S")
    assert adm.snapshot()["waiting"] == {"a": {"requests": 2, "head_work": 300}}
    adm.admit("b", 450)  # another host is not held for a's line
    adm.release("a", 450)
    adm.admit("a", 40, ticket="S")  # behind L, but it leaves L's room: 40 + 300 <= 500
    with pytest.raises(QueueFull, match="kept for its oldest"):
        adm.admit("a", 200)  # a newcomer without a ticket may not take L's room either
    adm.admit("a", 300, ticket="L")  # the retry of the head: its room was kept
    assert adm.snapshot()["hosts"]["a"] == {"work": 340, "requests": 2}
    assert "a" not in adm.snapshot()["waiting"]
    # refused for the server's capacity, not the host's share: no place in line
    adm2 = Admission(work_capacity=100, request_capacity=10, host_share=0.6)
    adm2.admit("x", 60)
    adm2.admit("y", 30)
    with pytest.raises(QueueFull, match="over its capacity of 100"):
        adm2.admit("y", 20, ticket="T")
    assert adm2.snapshot()["waiting"] == {}


def test_a_line_is_bounded_and_a_waiter_that_does_not_come_back_leaves_it():
    adm = Admission(work_capacity=100, request_capacity=4, host_share=0.5, reserve_seconds=0.2)
    # (no release yet: each refusal's hint is the default 0.25 s; a waiter is due back by 0.45 s)
    assert (adm.host_work, adm.host_requests) == (50, 2)
    adm.admit("a", 45)
    for i in range(5):
        with pytest.raises(QueueFull) as err:
            adm.admit("a", 10, ticket=i)
        assert err.value.in_line == (i < 4)
    assert adm.snapshot()["waiting"]["a"]["requests"] == 4  # the server's request capacity
    adm.release("a", 45)
    adm.admit("a", 5)  # 5 + the 10 kept for the first + 10 <= 50
    assert adm.snapshot()["waiting"]["a"] == {"requests": 4, "head_work": 10}
    time.sleep(0.6)  # no waiter came back by its hint + reserve_seconds: they all left
    assert adm.snapshot()["waiting"]["a"]["requests"] == 4  # (a snapshot does not expire them)
    adm.admit("a", 35)  # 5 + 35 <= 50: no room kept any more
    assert adm.snapshot()["waiting"] == {}
    with pytest.raises(ValueError, match="reserve_seconds=0"):
        Admission(100, 4, 0.5, reserve_seconds=0)


def test_a_refusal_says_when_to_retry_from_the_rate_work_ends():
    """The hint: the room missing (for the waiters ahead in line too) over the rate the host,
    or for the capacity the server, gave work back, halved for the first in line (and for the
    capacity); doubling while nothing ends."""
    adm = Admission(work_capacity=1000, request_capacity=100, host_share=0.5)
    adm.admit("a", 400)
    with pytest.raises(QueueFull, match=r"; retry after 0\.25 s$") as err:
        adm.admit("a", 200)  # nothing of a's has ended yet: the default
    assert err.value.retry_after == 0.25
    adm.admit("a", 100)
    adm.release("a", 100)  # 100 tokens just ended: ~50 tokens/s over the 2 s memory
    with pytest.raises(QueueFull) as err:
        adm.admit("a", 150, ticket="L")  # 50 over: about a second, halved
    assert 0.45 < err.value.retry_after < 0.75
    assert str(err.value).endswith(f"; retry after {err.value.retry_after:.2f} s")
    with pytest.raises(QueueFull) as err:
        adm.admit("a", 20, ticket="S")  # behind L: 400 + 150 + 20 - 500 = 70 over, ~1.4 s
    assert 1.3 < err.value.retry_after < 1.9
    adm.admit("b", 450)
    with pytest.raises(QueueFull, match="over its capacity") as err:
        adm.admit("c", 200)  # the server's capacity (50 over), at the server's rate
    assert 0.45 < err.value.retry_after < 0.75
    adm.release("b", 450)
    adm.admit("d", 400)
    adm.release("d", 400)  # now ~200 tokens/s of d's ended
    adm.admit("d", 499)
    with pytest.raises(QueueFull) as err:
        adm.admit("d", 2)  # 1 token over, 5 ms at that rate: the least a refusal is told
    assert err.value.retry_after == RETRY_AFTER_MIN == 0.05
    # A waiter refused again and again while nothing ends (the server stalls) is told to wait
    # twice as long each time, whatever the estimate says; once something ends, the estimate.
    adm = Admission(work_capacity=1000, request_capacity=100, host_share=0.5)
    adm.admit("e", 450)

    def hint() -> float:
        with pytest.raises(QueueFull) as err:
            adm.admit("e", 100, ticket="T")
        return err.value.retry_after

    assert [hint() for _ in range(7)] == [0.25, 0.25, 0.25, 0.4, 0.8, 1.6, RETRY_AFTER_MAX]
    adm.admit("f", 10)
    adm.release("f", 10)
    assert hint() == 0.25


def test_a_blocked_admission_waits_in_line_and_keeps_its_room():
    adm = Admission(work_capacity=1000, request_capacity=100, host_share=0.5)
    adm.admit("a", 450)
    waiter = threading.Thread(target=adm.admit, args=("a", 300), kwargs={"block": True,
                                                                        "timeout": 30})
    waiter.start()
    deadline = time.monotonic() + 30
    while "a" not in adm.snapshot()["waiting"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(QueueFull, match="kept for its oldest waiting request"):
        adm.admit("a", 40)  # would fit the share, not beside the blocked one's room
    adm.release("a", 450)
    waiter.join(30)
    assert adm.snapshot()["hosts"]["a"] == {"work": 300, "requests": 1}
    assert adm.snapshot()["waiting"] == {}  # its place went with it


def test_fair_queue_serves_a_light_lane_ahead_of_a_heavy_backlog():
    q = FairQueue()
    for i in range(10):
        q.push("heavy", f"h{i}")
    served = []
    for _ in range(3):  # the heavy lane runs alone for a while
        lane = q.choose()
        q.charge(lane, 4)
        served.append(q.pop(lane))
    q.push("light", "l0")
    lane = q.choose()
    assert lane == "light"  # it starts at the current virtual time, ahead of the backlog
    q.charge(lane, 1)
    assert q.pop(lane) == "l0" and served == ["h0", "h1", "h2"]


def test_fair_queue_shares_by_weight_and_idle_lanes_earn_no_credit():
    q = FairQueue()
    for i in range(60):
        q.push("p1", i, weight=2.0)
        q.push("p0", i, weight=1.0)
    picks = []
    for _ in range(30):
        lane = q.choose()
        q.charge(lane, 1)
        q.pop(lane)
        picks.append(lane)
    assert picks.count("p1") == 20 and picks.count("p0") == 10
    # a lane that was idle while another was served gets no burst when it comes back
    q = FairQueue()
    for i in range(20):
        q.push("busy", i)
    for _ in range(10):
        lane = q.choose()
        q.charge(lane, 1)
        q.pop(lane)
    for i in range(10):
        q.push("back", i)
    picks = []
    for _ in range(6):
        lane = q.choose()
        q.charge(lane, 1)
        q.pop(lane)
        picks.append(lane)
    assert picks.count("back") == 3 and picks[0] == "back"


def test_a_light_client_is_served_ahead_of_a_heavy_clients_backlog(tiny_engine):
    """Four slots; one client queues 8 requests of 4 samples x 12 tokens, then another asks for
    one sample of 3 tokens. In one FIFO the light request would end last; with fair queues it
    ends before most of the heavy backlog."""
    with RolloutServer(tiny_engine, max_queue=64).start() as srv:
        done: list[str] = []
        lock = threading.Lock()

        def watch(handle, name):
            handle.result(timeout=300)
            with lock:
                done.append(name)

        threads = []
        for i in range(8):
            h = srv.submit(GenerateRequest(prompt=[1, 2, 3], n=4, max_tokens=12, seed=i,
                                           temperature=0.0), client="heavy")
            threads.append(threading.Thread(target=watch, args=(h, f"heavy{i}")))
        light = srv.submit(GenerateRequest(prompt=[4, 5], n=1, max_tokens=3, temperature=0.0),
                           client="light")
        threads.append(threading.Thread(target=watch, args=(light, "light")))
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(done) == 9
        assert done.index("light") <= 3, done
        assert srv.metrics()["admission"]["work"] == 0  # everything given back


def test_one_client_never_holds_more_than_its_share(tiny_engine):
    srv = RolloutServer(tiny_engine, max_queue=8, queue_share=0.5)  # not started: nothing drains
    adm = srv.admission
    # 4 slots + max(8, 4) queue = 12 samples at max_target_length tokens; half to each host
    assert adm.request_capacity == 12 and adm.work_capacity == 12 * 64
    assert adm.host_work == 6 * 64 >= 4 * 64  # one host can still fill every slot
    request = GenerateRequest(prompt=[1, 2, 3, 4], n=2, max_tokens=44)  # 2 x 48 = 96 tokens
    for _ in range(4):
        srv.submit(request, block=False, client="flood")
    with pytest.raises(QueueFull, match="client flood holds 384 tokens .* over its share of 384"):
        srv.submit(request, block=False, client="flood")
    srv.submit(request, block=False, client="light")  # another host still gets in
    held = srv.metrics()["admission"]["hosts"]
    assert held == {"flood": {"work": 384, "requests": 4}, "light": {"work": 96, "requests": 1}}
    with pytest.raises(ValueError, match="more than one host's share"):
        srv.submit(GenerateRequest(prompt=[1], n=8, max_tokens=60), block=False, client="x")
    srv.stop()
    assert srv.metrics()["admission"]["work"] == 0  # stopping fails and releases everything


def test_a_cancelled_waiting_request_leaves_the_queue_and_gives_its_work_back(tiny_engine):
    srv = RolloutServer(tiny_engine, max_queue=8)  # not started: the request stays queued
    handle = srv.submit(GenerateRequest(prompt=[1, 2], n=2, max_tokens=8), client="a")
    assert srv.metrics()["queue_depth"] == 1
    handle.cancel()
    assert srv.metrics()["queue_depth"] == 0 and srv.metrics()["admission"]["work"] == 0
    assert handle.done
    srv.stop()

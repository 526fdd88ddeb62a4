"""Readiness, health and recovery of the rollout services: the Health RPC (SERVING / NOT_SERVING
with the served version, authenticated), `wait_ready`'s backoff on a service that starts late,
the router's step-progress watchdog routing around a replica that hangs, and a replica that
comes back being readmitted only once it holds the learner's current weights."""

import socket
import threading
import time

import grpc
import pytest

from hcjax import config as hcfg
from hcjax.rollout import GenerateRequest
from hcjax.rollout.router import Router
from hcjax.rollout.scheduler import Admission
from hcjax.rollout.service import (
    NOT_SERVING,
    SERVING,
    RolloutClient,
    RolloutServicer,
    rpc_server,
    wait_ready,
)
from hcjax.rpc.auth import Security

# The engines here test serving, not the sampler: its sort-only setting (bit-identical draws,
# a third of the compile; tests/conftest.py).
pytestmark = pytest.mark.usefixtures("sort_only_sampler")

TOKEN = "health-test-token-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Engine:
    max_concurrent_decodes = 4
    vocab_size = 64
    routing_shape = (1, 1)


class _Handle:
    """A request on a hung engine: never a token, never finished."""

    done = False

    def __init__(self):
        self.cancelled = threading.Event()

    def set_notifier(self, notify):
        pass

    def drain(self):
        return [], False

    def cancel(self):
        self.cancelled.set()


class HungServer:
    """Stands in for a RolloutServer whose device stopped making progress: its threads are
    alive, it accepts requests, and no token ever comes out."""

    engine = _Engine()
    max_queue = 8
    version = 7

    def __init__(self):
        # The service's admission, as a RolloutServer of 8 slots of 64 tokens has one.
        self.admission = Admission(work_capacity=16 * 64, request_capacity=16, host_share=0.5)

    def health(self):
        return {"ok": True, "error": None}

    def submit(self, request, block=True, timeout=None, client="local", priority=None,
               ticket=None):
        return _Handle()


def start_service(server, port=0, *, security=None, stall_seconds=120.0):
    srv = rpc_server(security or Security())
    servicer = RolloutServicer(server, stall_seconds=stall_seconds)
    srv.add_generic_rpc_handlers((servicer.handler(),))
    port = srv.add_insecure_port(f"127.0.0.1:{port}")
    srv.start()
    return srv, servicer, f"127.0.0.1:{port}"


def test_health_answers_serving_with_the_served_version():
    srv, _, address = start_service(HungServer())
    try:
        with RolloutClient(address, Security()) as client:
            reply = client.health()
    finally:
        srv.stop(0)
    assert reply["status"] == SERVING and reply["ok"] and reply["version"] == 7
    assert reply["inflight"] == 0 and reply["error"] is None


def test_health_is_authenticated_like_every_rpc():
    srv, _, address = start_service(HungServer(), security=Security(token=TOKEN))
    try:
        with RolloutClient(address, Security()) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.health()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(PermissionError, match="HCJAX_TOKEN"):
            wait_ready([address], timeout=5, security=Security())
        assert wait_ready([address], timeout=5, security=Security(token=TOKEN)) == [address]
    finally:
        srv.stop(0)


def test_wait_ready_backs_off_until_a_late_service_binds():
    port = free_port()
    address = f"127.0.0.1:{port}"
    started = {}

    def late():
        time.sleep(1.0)
        started["srv"] = start_service(HungServer(), port)[0]

    threading.Thread(target=late, daemon=True).start()
    t0 = time.monotonic()
    try:
        assert wait_ready([address], timeout=20, initial_backoff=0.1,
                          security=Security()) == [address]
        assert time.monotonic() - t0 >= 0.9
    finally:
        time.sleep(0.1)
        if "srv" in started:
            started["srv"].stop(0)


def test_wait_ready_times_out_naming_what_is_not_ready():
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(TimeoutError, match=address.replace(".", r"\.")):
        wait_ready([address], timeout=0.6, initial_backoff=0.1, security=Security())


def test_wait_ready_cli_exit_codes():
    from hcjax.cluster import wait_ready as cli

    srv, _, address = start_service(HungServer())
    try:
        assert cli.main([address, "--timeout", "5"]) == 0
    finally:
        srv.stop(0)
    assert cli.main([f"127.0.0.1:{free_port()}", "--timeout", "0.3"]) == 1


class GoodReplica:
    """An in-memory replica that answers every request at once, or, given `hold_until`, once
    that condition holds (at most 10 s), so a test can make sure other replicas get work."""

    def __init__(self, hold_until=None):
        self.calls = 0
        self.hold_until = hold_until

    def generate(self, request, timeout=None, on_event=None):
        self.calls += 1
        deadline = time.monotonic() + 10
        while self.hold_until is not None and not self.hold_until() and time.monotonic() < deadline:
            time.sleep(0.01)
        return [f"record-{request.seed}"]

    def health(self, timeout=None):
        return {"status": SERVING, "ok": True}

    def close(self):
        pass


def test_watchdog_routes_around_a_replica_that_hangs():
    srv, servicer, hung = start_service(HungServer(), stall_seconds=0.5)
    # The router picks at random between idle replicas; the good one holds its answers until the
    # hung one has been given a request, so the hung one is always tried (without the hold, all
    # four requests went to the good replica about one run in sixteen).
    good = GoodReplica(hold_until=lambda: router._replicas[hung].inflight > 0
                       or router._replicas[hung].stalls > 0)
    router = Router([hung, "fake:good"], max_inflight_per_replica=1, stall_seconds=0.5,
                    probe_interval=0.2)
    router._replicas[hung].client = RolloutClient(hung, Security())
    router._replicas["fake:good"].client = good
    try:
        out, errors = [], []

        def one(seed):
            try:
                out.append(router.generate(GenerateRequest(prompt=[1], seed=seed), timeout=20))
            except Exception as err:  # noqa: BLE001 - asserted below
                errors.append(err)

        threads = [threading.Thread(target=one, args=(s,)) for s in range(4)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors and sorted(out) == [[f"record-{s}"] for s in range(4)]
        assert time.monotonic() - t0 < 10
        stats = router.metrics()["replicas"][hung]
        assert stats["stalls"] >= 1 and "stalled" in stats["why"]
        assert router.metrics()["retries"] >= 1
        # The server side agrees: while a request hangs there, Health says NOT_SERVING, so the
        # prober does not readmit it.
        stuck = RolloutClient(hung, Security())
        t = threading.Thread(target=lambda: _drain(stuck), daemon=True)
        t.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            reply = servicer.health_status()
            if reply["status"] == NOT_SERVING:
                break
            time.sleep(0.1)
        assert reply["status"] == NOT_SERVING and "stalled" in reply["error"]
        stuck.cancel_inflight()
        t.join(5)
        stuck.close()
    finally:
        router.close()
        srv.stop(0)


def _drain(client):
    try:
        list(client.stream(GenerateRequest(prompt=[1], seed=0), timeout=30))
    except grpc.RpcError:
        pass


def test_versions_only_move_forward_unless_a_new_session_rolls_back():
    from hcjax.rollout import Engine, RolloutServer
    from tests.rollout_fixtures import tiny_model

    engine = Engine(tiny_model(0), max_concurrent_decodes=2, max_prefill_length=8,
                    max_target_length=16)
    server = RolloutServer(engine)  # not started: a new version waits for the next step
    params = engine.load_params()
    server.update_weights(params, 7)
    # Older than the waiting version 7 (the served one is still 0): refused.
    with pytest.raises(ValueError, match="version=6 is older than the served 7"):
        server.update_weights(params, 6)
    # A learner restarted from a checkpoint (a new weights session) goes back.
    server.update_weights(params, 5, rollback=True)
    assert server.version == 5


class FrozenServer(HungServer):
    """A SIGSTOPped process as a client sees it: connections open, no answer to anything."""

    def health(self):
        time.sleep(3.0)
        return {"ok": True, "error": None}


def test_a_replica_that_does_not_answer_health_is_marked_down_before_a_push():
    srv, _, frozen = start_service(FrozenServer())
    good = GoodReplica()
    router = Router([frozen, "fake:good"], probe_interval=0.2)
    router._replicas[frozen].client = RolloutClient(frozen, Security())
    router._replicas["fake:good"].client = good
    try:
        t0 = time.monotonic()
        # Alone, it is not marked down: there would be nobody to route to instead.
        assert router.mark_down_unresponsive(0.5, among=[frozen]) == []
        assert router.mark_down_unresponsive(0.5) == [frozen]
        assert time.monotonic() - t0 < 2.5  # the probes run at once, each bounded by 0.5 s
        assert not router.is_up(frozen) and router.is_up("fake:good")
        assert "no Health answer within 0.5 s" in router.metrics()["replicas"][frozen]["why"]
    finally:
        router.close()
        srv.stop(0)


def test_breaker_readmits_only_when_on_readmit_agrees():
    good = GoodReplica()
    answers = []
    router = Router(["fake:a"], probe_interval=0.1,
                    on_readmit=lambda a: answers.append(a) or len(answers) >= 3)
    router._replicas["fake:a"].client = good
    try:
        router.mark_down("fake:a", "test")
        assert not router.is_up("fake:a")
        deadline = time.monotonic() + 10
        while not router.is_up("fake:a") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert router.is_up("fake:a") and answers == ["fake:a"] * 3
        assert router.metrics()["replicas"]["fake:a"]["readmissions"] == 1
    finally:
        router.close()


# Readmission with real inference processes and weight sync -------------------------------------

MODEL = [
    "ModelConfig.vocab_size = 64", "ModelConfig.d_model = 32", "ModelConfig.num_layers = 2",
    "ModelConfig.num_heads = 2", "ModelConfig.num_kv_heads = 1", "ModelConfig.head_dim = 16",
    "ModelConfig.attention_pattern = ('local', 'global')", "ModelConfig.window = 8",
    "ModelConfig.d_ff = 64", "ModelConfig.num_experts = 4", "ModelConfig.moe_latent_dim = 16",
    "ModelConfig.moe_d_ff = 32", "ModelConfig.max_seq_len = 64", "ModelConfig.dtype = 'float32'",
    "MeshConfig.fsdp = 1", "MeshConfig.device_offset = 4", "MeshConfig.num_devices = 1",
]


def _until(predicate, seconds=60.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.mark.slow
def test_a_replica_that_comes_back_is_readmitted_with_the_current_weights(monkeypatch):
    from hcjax.rl.inference import RemoteInference
    from hcjax.rollout.standalone import ServeOptions
    from hcjax.transfer.weights_service import param_digests, weights_status
    from tests.test_serve import InProcess, learner_versions

    for var in ("HCJAX_TOKEN", "HCJAX_TOKEN_FILE", "HCJAX_TLS_DIR"):
        monkeypatch.delenv(var, raising=False)
    hcfg.bind([], MODEL)
    v1, v2, v3 = learner_versions(1, 2, 3)
    current = {"params": v1}
    late_port = free_port()
    late = f"127.0.0.1:{late_port}"
    with InProcess(ServeOptions(warmup=False)) as early:
        # The late replica is not up: the climb starts without it, and the router holds it down.
        inference = RemoteInference([early, late], lambda: current["params"], ready_timeout=60,
                                    stall_seconds=None)
        try:
            inference.router._probe_interval = 0.2
            assert not inference.router.is_up(late) and late in inference.publisher.dead
            inference.start(1)
            with InProcess(ServeOptions(port=late_port, warmup=False)):
                # It answers SERVING, is handshaken, and waits for the next version while the
                # early replica serves: never readmitted with stale weights.
                assert _until(lambda: late in inference.publisher.live)
                assert not inference.router.is_up(late)
                current["params"] = v2
                inference.publish(2)
                assert _until(lambda: inference.router.is_up(late))
                assert weights_status(late, digests=True)["digests"] == param_digests(v2)
                # Alone (the other one down), a returning replica gets the current version at once.
                inference.router.mark_down(late, "test")
                current["params"] = v3
                inference.router.remove_replica(early)
                with pytest.raises(RuntimeError, match="reached no replica"):
                    inference.publish(3)
                assert _until(lambda: inference.router.is_up(late))
                status = weights_status(late, digests=True)
                assert status["version"] == 3 and status["digests"] == param_digests(v3)
                assert inference.router.metrics()["replicas"][late]["readmissions"] == 2
                records = inference.generate(GenerateRequest(prompt=[1, 2], max_tokens=3,
                                                             temperature=0.0, seed=0), timeout=60)
                assert records[0].versions.tolist() == [3, 3, 3]
        finally:
            inference.close()


@pytest.mark.slow
def test_readmission_survives_pushes_faster_than_the_prober(monkeypatch):
    """A returning replica stays in weight sync between its handshake and the router taking it
    back: with a push every few tens of milliseconds (the tiny climb's pace) and the prober's
    backoff at a second, each push used to drop it again (the router still held it down), so it
    was never readmitted."""
    from hcjax.rl.inference import RemoteInference
    from hcjax.rollout.standalone import ServeOptions
    from hcjax.transfer.weights_service import param_digests, weights_status
    from tests.test_serve import InProcess, learner_versions

    for var in ("HCJAX_TOKEN", "HCJAX_TOKEN_FILE", "HCJAX_TLS_DIR"):
        monkeypatch.delenv(var, raising=False)
    hcfg.bind([], MODEL)
    (v1,) = learner_versions(1)
    late_port = free_port()
    late = f"127.0.0.1:{late_port}"
    with InProcess(ServeOptions(warmup=False)) as early:
        inference = RemoteInference([early, late], lambda: v1, ready_timeout=60,
                                    stall_seconds=None)
        stop, versions = threading.Event(), [0]

        def pushes():
            while not stop.is_set():
                versions[0] += 1
                inference.publish(versions[0])
                time.sleep(0.03)

        pusher = threading.Thread(target=pushes, daemon=True)
        try:
            inference.router._probe_interval = 0.2
            inference.router._max_backoff = 1.0
            inference.start(0)
            pusher.start()
            with InProcess(ServeOptions(port=late_port, warmup=False)):
                assert _until(lambda: inference.router.is_up(late), 30), \
                    inference.router.metrics()["replicas"][late]
                stop.set()
                pusher.join(30)
                status = weights_status(late, digests=True)
                assert status["version"] == versions[0]
                assert status["digests"] == param_digests(v1)
        finally:
            stop.set()
            inference.close()


@pytest.mark.slow
def test_a_restarted_learner_may_publish_an_older_version(monkeypatch):
    """A learner restarted from a checkpoint numbers its versions from that checkpoint, below
    what the replicas served before it died: a new weights session (handshake) takes its first
    version back; within a session versions still only move forward."""
    from hcjax.rollout.standalone import ServeOptions
    from hcjax.transfer.weights_service import WeightPublisher, param_digests, weights_status
    from tests.test_serve import InProcess, learner_versions

    for var in ("HCJAX_TOKEN", "HCJAX_TOKEN_FILE", "HCJAX_TLS_DIR"):
        monkeypatch.delenv(var, raising=False)
    hcfg.bind([], MODEL)
    v1, v2 = learner_versions(1, 2)
    with InProcess(ServeOptions(warmup=False)) as address:
        before = WeightPublisher(lambda: v1, [address], timeout=60)
        before(7)
        before.close()
        after = WeightPublisher(lambda: v2, [address], timeout=60)  # the restarted learner
        after(5)
        status = weights_status(address, digests=True)
        assert status["version"] == 5 and status["digests"] == param_digests(v2)
        with RolloutClient(address, Security()) as client:
            records = client.generate(GenerateRequest(prompt=[1, 2], max_tokens=2,
                                                      temperature=0.0, seed=0), timeout=60)
        assert records[0].versions.tolist() == [5, 5]
        with pytest.raises(RuntimeError, match="reached no replica"):
            after(4)
        after.close()


@pytest.mark.slow
def test_a_restarted_learner_never_reuses_a_transfer_index_the_replica_handed_out(monkeypatch):
    """Transfer ids are (version, process index, chunk), and a learner killed inside a push
    leaves a pull of that push's ack ids pending on the replica's transfer server, which takes
    the next offer of the same id (checked with jax 0.10.2: a later puller then waits forever).
    A restarted learner re-sends the same versions, so the replica refuses an index it handed
    out before and the publisher takes the next one: here the restarted learner's random start
    is forced onto the dead one's index, and it still re-sends version 7 through a fresh one."""
    import secrets

    from hcjax.rollout.standalone import ServeOptions
    from hcjax.transfer.weights_service import WeightPublisher, param_digests, weights_status
    from tests.test_serve import InProcess, learner_versions

    for var in ("HCJAX_TOKEN", "HCJAX_TOKEN_FILE", "HCJAX_TLS_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(secrets, "randbelow", lambda n: n - 1)  # the last index, then wrap
    hcfg.bind([], MODEL)
    v1, v2 = learner_versions(1, 2)
    with InProcess(ServeOptions(warmup=False)) as address:
        before = WeightPublisher(lambda: v1, [address], timeout=60)
        assert [r.process for r in before.replicas] == [1023]
        before(7)
        before.close()
        after = WeightPublisher(lambda: v2, [address], timeout=60)  # the same random start
        assert [r.process for r in after.replicas] == [1]  # 1023 refused, the next one taken
        after(7)
        status = weights_status(address, digests=True)
        assert status["version"] == 7 and status["digests"] == param_digests(v2)
        after.close()


_DEAD_LEARNER = """
import sys
import jax
from hcjax.transfer.remote import _ACK, JaxTransferBackend
device = jax.local_devices()[0]
spec = jax.ShapeDtypeStruct(_ACK.shape, _ACK.dtype,
                            sharding=jax.sharding.SingleDeviceSharding(device))
backend = JaxTransferBackend()
print("pulling", flush=True)
backend.pull(sys.argv[1], int(sys.argv[2]), [spec])[0].block_until_ready()
print("got it", flush=True)
"""


@pytest.mark.slow
def test_a_killed_learners_pending_ack_pull_does_not_hang_its_successor(monkeypatch):
    """The hazard itself: a learner process waiting for the ack of version 7's first chunk on
    the replica's transfer server is killed; its successor, forced onto the same random start,
    re-sends version 7. With the dead index reused, the replica's ack would go to the dead
    pull and the push would wait out its timeout; the replica refuses the index and the push
    lands in seconds."""
    import secrets
    import subprocess
    import sys

    from hcjax.rollout.standalone import ServeOptions
    from hcjax.transfer.remote import transfer_uuid
    from hcjax.transfer.weights_service import WeightPublisher, weights_status
    from tests.test_serve import REPO, InProcess, _env, learner_versions

    for var in ("HCJAX_TOKEN", "HCJAX_TOKEN_FILE", "HCJAX_TLS_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(secrets, "randbelow", lambda n: n - 1)
    hcfg.bind([], MODEL)
    v1, v2 = learner_versions(1, 2)
    with InProcess(ServeOptions(warmup=False)) as address:
        before = WeightPublisher(lambda: v1, [address], timeout=60)
        before(6)
        (process, replica_transfer), = before.replicas[0].sender.peers.items()
        before.close()
        dead = subprocess.Popen(
            [sys.executable, "-c", _DEAD_LEARNER, replica_transfer,
             str(transfer_uuid(7, 0, process, 0, True))],
            cwd=REPO, env=_env(1), stdout=subprocess.PIPE, text=True)
        try:
            assert dead.stdout.readline().strip() == "pulling"
            time.sleep(3.0)  # its pull request reaches the replica's transfer server
        finally:
            dead.kill()
            dead.wait(30)
        after = WeightPublisher(lambda: v2, [address], timeout=30)
        assert after.replicas[0].process != process
        start = time.monotonic()
        after(7)
        assert time.monotonic() - start < 20 and after.dead == {}
        assert weights_status(address)["version"] == 7
        after.close()


def _serve_process(tmp_path, name):
    """`python -m hcjax.serve` (the test_serve model, 2 devices) in its own process, so it can be
    SIGSTOPped; returns (process, address) once it serves."""
    import json
    import subprocess
    import sys

    from tests.test_serve import MODEL as SERVE_MODEL
    from tests.test_serve import REPO, _env

    cmd = [sys.executable, "-m", "hcjax.serve", "--max_prefill_length", "16",
           "--max_target_length", "32", "--max_concurrent_decodes", "4"]
    for p in SERVE_MODEL:
        cmd += ["--gin_param", p]
    log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=_env(2), cwd=REPO,
                            text=True)
    line = proc.stdout.readline()
    assert line, (tmp_path / f"{name}.log").read_text()[-3000:]
    return proc, f"127.0.0.1:{json.loads(line)['port']}"


@pytest.mark.slow
def test_a_replica_stopped_in_the_middle_of_a_push_is_dropped_in_seconds(monkeypatch, tmp_path):
    """A replica SIGSTOPped after the pre-push Health probe (so inside the push: the chaos
    bench's replica_sigstop can land there) used to hold the push, and the learner with it, for
    the publisher's whole timeout (120 s). The probe inside the push drops it within seconds,
    the other replica installs the version, and the stopped replica's Pull is cancelled. Once
    resumed it is readmitted, though the version it was pulling is gone (the learner's next step
    donates those arrays), and installs the next version."""
    import os
    import signal

    import jax

    from hcjax.rl.inference import RemoteInference
    from hcjax.transfer.weights_service import param_digests, weights_status
    from tests.test_serve import MODEL as SERVE_MODEL
    from tests.test_serve import learner_versions

    for var in ("HCJAX_TOKEN", "HCJAX_TOKEN_FILE", "HCJAX_TLS_DIR"):
        monkeypatch.delenv(var, raising=False)
    (pa, a), (pb, b) = _serve_process(tmp_path, "a"), _serve_process(tmp_path, "b")
    hcfg.bind([], SERVE_MODEL)
    v1, v2, v3 = learner_versions(1, 2, 3)
    current = {"params": v1}
    inference = RemoteInference([a, b], lambda: current["params"], ready_timeout=120,
                                stall_seconds=None)
    try:
        inference.router._probe_interval = 0.2
        inference.router._max_backoff = 1.0
        inference.start(1)
        os.kill(pb.pid, signal.SIGSTOP)
        current["params"] = v2
        t0 = time.monotonic()
        inference.publisher(2)  # the push itself: the pre-push probe has passed
        took = time.monotonic() - t0
        assert took < 30, took  # a probe every 5 s, each bounded by the 2 s Health timeout
        assert inference.publisher.timeout == 120.0
        assert inference.publisher.live == [a]
        assert "stopped answering during the push" in inference.publisher.dead[b]
        assert not inference.router.is_up(b) and inference.router.is_up(a)
        assert weights_status(a, digests=True)["digests"] == param_digests(v2)
        for x in jax.tree.leaves(v2):  # the learner steps on, donating version 2's arrays
            x.delete()
        current["params"] = v3
        os.kill(pb.pid, signal.SIGCONT)
        # It answers again: handshaken anew, it waits in weight sync for the next version.
        assert _until(lambda: b in inference.publisher.live, 60), inference.publisher.dead
        inference.publish(3)
        assert _until(lambda: inference.router.is_up(b), 60)
        status = weights_status(b, digests=True)
        assert status["version"] == 3 and status["digests"] == param_digests(v3)
    finally:
        inference.close()
        for proc in (pa, pb):
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
    assert pa.wait(60) == 0 and pb.wait(60) == 0  # SIGTERM: both stopped cleanly


class _Cancelled:
    """A Pull's server-side context whose client gives up after `after` s."""

    def __init__(self, after):
        self.end = time.monotonic() + after

    def is_active(self):
        return time.monotonic() < self.end

    def abort(self, code, details):
        raise RuntimeError(f"aborted {code.name}: {details}")


class _NeverArrives:
    """A PlanReceiver whose chunks are never offered (the learner dropped this replica and gave
    the version up)."""

    def receive(self, version):
        threading.Event().wait()


def test_a_pull_the_learner_gave_up_releases_the_replica():
    """The learner cancels the Pull of a replica it dropped from a push (or the Pull's deadline
    passes). The replica stops waiting for chunks that will never come: the Pull ends, the lock a
    Handshake needs is free, and the receiver is retired (the next version needs a Handshake)."""
    import json

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from hcjax.transfer.weights_service import WeightsServicer

    mesh = jax.make_mesh((1,), ("fsdp",), devices=jax.devices()[:1])
    template = {"w": jax.device_put(jnp.zeros((2, 2)), NamedSharding(mesh, PartitionSpec()))}
    servicer = WeightsServicer(server=None, params_template=template)
    servicer.receiver = _NeverArrives()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="INTERNAL: .*version 4: the learner gave the pull up"):
        servicer.pull(json.dumps({"version": 4}).encode(), _Cancelled(0.3))
    assert time.monotonic() - t0 < 5
    assert servicer.receiver is None and servicer._lock.acquire(blocking=False)
    servicer._lock.release()
    with pytest.raises(RuntimeError, match="FAILED_PRECONDITION: pull of version 5 before any"):
        servicer.pull(json.dumps({"version": 5}).encode(), _Cancelled(10))


def test_the_replica_refuses_a_used_transfer_index_until_every_index_is_used():
    """`WeightsServicer.handshake` alone: an index it handed out is refused (ALREADY_EXISTS); once
    all 1023 are used the record starts again instead of refusing every handshake."""
    import json

    import jax
    import numpy as np

    from hcjax.transfer.weights_service import WeightsServicer, describe_layout

    class Context:
        def peer(self):
            return "ipv4:127.0.0.1:5000"

        def abort(self, code, details):
            raise RuntimeError(code, details)

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    params = {"w": jax.device_put(np.zeros((4, 4), np.float32),
                                  jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))}
    servicer = WeightsServicer(server=None, params_template=params)

    def handshake(process):
        request = {"layout": describe_layout(params), "process_index": process,
                   "transfer_address": "127.0.0.1:5001", "max_bytes_per_pull": 1 << 20}
        return json.loads(servicer.handshake(json.dumps(request).encode(), Context()))

    assert handshake(5)["expected_bytes"] == 64
    with pytest.raises(RuntimeError) as refused:
        handshake(5)
    assert refused.value.args[0] == grpc.StatusCode.ALREADY_EXISTS
    assert "process index 5" in refused.value.args[1]
    for process in range(1, 1024):
        if process != 5:
            handshake(process)
    assert handshake(5)["expected_bytes"] == 64  # all used: the record started again
    with pytest.raises(RuntimeError):
        handshake(5)

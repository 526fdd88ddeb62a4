"""Delta sync: encodings round trip bit for bit; the checked push path applies deltas, checks a
CRC-32 per entry, refuses a base it does not hold, and installs nothing of a corrupted version."""

import threading

import numpy as np
import pytest


def _pair(old_scale=1e-2, frac=0.01, seed=0, dtype="bfloat16"):
    import ml_dtypes

    rng = np.random.default_rng(seed)
    base = (rng.standard_normal((64, 96)) * old_scale).astype(getattr(ml_dtypes, dtype)
                                                              if dtype == "bfloat16" else dtype)
    new = base.copy()
    flat = new.reshape(-1)
    idx = rng.choice(flat.size, int(frac * flat.size), replace=False)
    flat[idx] = (rng.standard_normal(len(idx)) * old_scale).astype(base.dtype)
    return base, new


@pytest.mark.parametrize("encoding", ["raw", "sparse", "sparse_z", "xor_z", "bitmap"])
@pytest.mark.parametrize("frac", [0.0, 0.01, 0.7])
def test_every_encoding_round_trips_bit_for_bit(encoding, frac):
    from hcjax.transfer import delta

    for dtype in ("bfloat16", "float32", "int8"):
        base, new = _pair(frac=frac, dtype=dtype)
        if dtype == "float32":  # NaN payloads and signed zeros survive (bit patterns)
            new.reshape(-1)[:2] = [np.float32("nan"), -0.0]
        payload, changed = delta.encode(base, new, encoding)
        out = delta.decode(base, payload)
        assert out.dtype == new.dtype and out.shape == new.shape
        np.testing.assert_array_equal(out.view(np.uint8), new.view(np.uint8))
        unsigned = np.dtype(f"u{new.dtype.itemsize}")
        assert changed == int(np.count_nonzero(base.view(unsigned) != new.view(unsigned)))
        assert len(payload) <= new.nbytes + 1  # never larger than raw (plus the code byte)
        assert delta.checksum(out) == delta.checksum(new)


def test_sparse_delta_is_small_and_a_raw_payload_needs_no_base():
    from hcjax.transfer import delta

    base, new = _pair(frac=0.01)
    payload, changed = delta.encode(base, new, "sparse")
    assert changed == int(np.count_nonzero(base.view(np.uint16) != new.view(np.uint16)))
    assert len(payload) == 1 + 8 + 6 * changed  # code, count, uint32 index + bf16 per change
    raw, _ = delta.encode(None, new)
    np.testing.assert_array_equal(delta.decode(None, raw, new.shape, new.dtype).view(np.uint16),
                                  new.view(np.uint16))
    with pytest.raises(ValueError, match="needs a base version"):
        delta.decode(None, payload, new.shape, new.dtype)
    with pytest.raises(ValueError, match="encoding='gzip'"):
        delta.encode(base, new, "gzip")


def _one_process_pair(max_bytes=256):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from hcjax.transfer import Cast, JaxTransferBackend, PlanReceiver, PlanSender, make_plan

    devices = np.array(jax.devices())
    learner = Mesh(devices[:4].reshape(2, 2), ("fsdp", "tensor"))
    inference = Mesh(devices[4:], ("tensor",))
    dst = {"w": NamedSharding(inference, P("tensor", None)), "n": NamedSharding(inference, P())}

    def source(w, n):
        return {"w": jax.device_put(w, NamedSharding(learner, P("fsdp", "tensor"))),
                "n": jax.device_put(n, NamedSharding(learner, P()))}

    plan = make_plan(source(np.zeros((8, 16), np.float32), np.zeros(8, np.float32)), dst,
                     {"w": Cast(jnp.bfloat16)}).with_processes(0, 1)
    a, b = JaxTransferBackend(), JaxTransferBackend()
    sender = PlanSender(plan, 0, a, {1: b.address}, max_bytes_per_pull=max_bytes)
    receiver = PlanReceiver(plan, 1, b, {0: a.address}, max_bytes_per_pull=max_bytes)
    return source, sender, receiver


def _push(sender, receiver, src, version, base):
    from hcjax.transfer.remote import CHECKED_DELTA, CHECKED_FULL

    errors = []

    def send():
        try:
            sender.send_checked(src, version, base)
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        out = receiver.receive(version, CHECKED_FULL if base is None else CHECKED_DELTA, base)
    finally:
        thread.join(timeout=30)
    assert not errors, errors
    return out


def test_checked_pushes_full_then_delta_exact_and_smaller():
    import ml_dtypes

    source, sender, receiver = _one_process_pair()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 16)).astype(np.float32)
    n = np.ones(8, np.float32)
    out = _push(sender, receiver, source(w, n), 1, None)
    receiver.commit_base(1)
    full_bytes = sender.last_push["wire_bytes"]
    assert sender.last_push["changed_fraction"] == 1.0
    w2 = w.copy()
    w2[3, 5] += 1.0  # one weight changes
    out = _push(sender, receiver, source(w2, n), 2, 1)
    receiver.commit_base(2)
    np.testing.assert_array_equal(np.asarray(out.leaves["w"]).view(np.uint16),
                                  w2.astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(out.leaves["n"]), n)
    assert sender.last_push["changed_elements"] == 1
    assert sender.last_push["wire_bytes"] < full_bytes / 2
    with pytest.raises(ValueError, match="this sender's base is 2"):
        sender.send_checked(source(w2, n), 3, 1)
    # a receiver that holds another base refuses the delta (and still lets the sender end)
    from hcjax.transfer.remote import BaseMismatch

    receiver.commit_base(7)  # nothing pending for version 7: the base is dropped
    assert receiver.base_version is None
    with pytest.raises(BaseMismatch, match="holds base version None"):
        _push(sender, receiver, source(w2, n), 3, 2)
    assert sender.last_push["version"] == 3


def test_a_corrupted_delta_fails_its_checksum_and_keeps_the_base():
    from hcjax.transfer.remote import ChecksumMismatch

    source, sender, receiver = _one_process_pair()
    w = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    n = np.ones(8, np.float32)
    _push(sender, receiver, source(w, n), 1, None)
    receiver.commit_base(1)

    def flip(chunk, payload):  # the last byte of every payload: a value of the delta
        return payload[:-1] + bytes([payload[-1] ^ 0x40])

    sender.tamper = flip
    with pytest.raises(ChecksumMismatch, match="CRC-32|did not decode"):
        _push(sender, receiver, source(w + 1e-1, n), 2, 1)
    assert sender.last_push["version"] == 2  # the receiver pulled and acked every chunk
    receiver.drop_pending()
    assert receiver.base_version == 1


def test_the_publisher_sends_deltas_and_falls_back_to_full_pushes(monkeypatch, tmp_path):
    """Through the gRPC weights service in one process: full, then deltas; a corrupted delta and
    a replica that lost its base each get the same version whole, and no replica ever serves a
    version whose checksums failed; a full push on request and after `full_every` deltas. The
    receiver's chaos test hook corrupts exactly one delta; Status tells each pull's kind."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from hcjax.rpc.auth import Security
    from hcjax.rpc.server import RpcServer
    from hcjax.transfer.weights_service import (
        WeightPublisher,
        WeightsServicer,
        param_digests,
        weights_status,
    )

    mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec()))  # noqa: E731
    installed = []

    class Server:
        version = 0

        def update_weights(self, tree, version, rollback=False):
            installed.append((version, param_digests(tree)))

    grpc_server = RpcServer(Security())
    rng = np.random.default_rng(0)
    host = {"w": rng.standard_normal((64, 64)).astype(np.float32),
            "b": rng.standard_normal(64).astype(np.float32)}
    servicer = WeightsServicer(Server(), {k: put(np.zeros_like(v)) for k, v in host.items()})
    grpc_server.add_generic_rpc_handlers((servicer.handler(grpc_server.blocking_pool),))
    address = f"127.0.0.1:{grpc_server.add_insecure_port('127.0.0.1:0')}"
    grpc_server.start()
    state = {"tree": {k: put(v) for k, v in host.items()}}
    try:
        publisher = WeightPublisher(lambda: state["tree"], [address], timeout=60, sync="delta",
                                    full_every=3, max_bytes_per_pull=4096)

        def push(version, change=True):
            if change:
                host["w"][version % 64, version % 7] += 1.0
                state["tree"] = {k: put(v) for k, v in host.items()}
            publisher(version)
            assert installed[-1] == (version, param_digests(state["tree"]))
            assert weights_status(address)["version"] == version
            return publisher.history[-1]

        first = push(1)
        assert (first["fulls"], first["deltas"]) == (1, 0)
        second = push(2)
        assert (second["deltas"], second["changed_fraction"]) == (1, 1 / (64 * 64 + 64)), second
        assert second["wire_bytes"] * 50 < first["wire_bytes"]
        # a corrupted delta: refused (DATA_LOSS), then the same version whole
        publisher.replicas[0].sender.tamper = (  # deltas only, not raw (full) payloads
            lambda c, p: p if p[0] == 0 else p[:-1] + bytes([p[-1] ^ 1]))
        before = len(installed)
        third = push(3)
        publisher.replicas[0].sender.tamper = None
        assert list(third["fallbacks"].values())[0].startswith("DATA_LOSS")
        assert (third["fulls"], len(installed)) == (1, before + 1)  # nothing half-applied
        # the replica lost its base: refused (FAILED_PRECONDITION), then whole
        servicer.receiver.commit_base(-1)
        fourth = push(4)
        assert list(fourth["fallbacks"].values())[0].startswith("FAILED_PRECONDITION")
        assert [push(v)["deltas"] for v in (5, 6, 7, 8)] == [1, 1, 1, 0]  # full_every=3
        publisher.request_full()
        assert push(9, change=False)["fulls"] == 1
        assert push(10, change=False)["changed_fraction"] == 0.0
        # hcjax.bench.chaos's hook: the next delta received after the trigger file appears
        # arrives with a byte flipped (refused, then whole), once
        from hcjax.transfer.remote import TEST_CORRUPT_NEXT_DELTA_ENV

        trigger = tmp_path / "corrupt-next-delta"
        monkeypatch.setenv(TEST_CORRUPT_NEXT_DELTA_ENV, str(trigger))
        assert push(11)["fallbacks"] == {}  # no trigger file: untouched
        trigger.touch()
        before = len(installed)
        twelfth = push(12)
        assert list(twelfth["fallbacks"].values())[0].startswith("DATA_LOSS")
        assert (twelfth["fulls"], len(installed), trigger.exists()) == (1, before + 1, False)
        assert push(13)["deltas"] == 1 and publisher.history[-1]["fallbacks"] == {}
        status = weights_status(address)
        assert [(f["version"], f["mode"], f["base"], f["why"].split(":")[0])
                for f in status["failed"]] == [(3, "delta", 2, "ChecksumMismatch"),
                                               (4, "delta", 3, "BaseMismatch"),
                                               (12, "delta", 11, "ChecksumMismatch")]
        assert [(s["version"], s["mode"]) for s in status["served"]] == [
            (1, "full"), (2, "delta"), (3, "full"), (4, "full"), (5, "delta"), (6, "delta"),
            (7, "delta"), (8, "full"), (9, "full"), (10, "delta"), (11, "delta"), (12, "full"),
            (13, "delta")]
        assert status["pulling"] is None
        publisher.close()
    finally:
        grpc_server.stop(None)


def test_the_publisher_checks_its_sync_settings():
    with pytest.raises(ValueError, match="sync='fast'"):
        from hcjax.transfer.weights_service import WeightPublisher

        WeightPublisher(lambda: {}, ["127.0.0.1:1"], sync="fast")


@pytest.mark.slow  # ~20 s: a second process, two model compiles
def test_bench_sync_reports_delta_and_full_pushes_between_two_processes():
    """`python -m hcjax.bench.sync` on a small model, one step at lr 1e-6: every push after the
    first is a delta, checked, smaller than the full push; the replica ends on the learner's
    bytes; every encoding is measured."""
    from hcjax.bench import sync

    result = sync.main(["--d_model", "32", "--layers", "1", "--vocab", "256", "--steps", "1",
                        "--lrs", "1e-6", "--batch", "2", "--seq", "16"])
    row = result["settings"]["1e-06"]
    assert row["every_push_delta"] and row["final_digests_match"]
    assert row["checksum_fallbacks"] == 0 and row["checked_pushes"] == 3
    assert 0 < row["changed_fraction_per_push"][0] < 0.5
    assert row["delta_wire_bytes_median"] < row["full_wire_bytes"]
    assert row["full_wire_bytes"] > result["served_bytes"]  # whole, plus headers and codes
    assert set(result["encodings"]) >= {"learning_rate", "sparse", "sparse_z", "xor_z"}
    assert result["plain_full_push_s_median"] > 0


@pytest.mark.slow  # ~35 s: starts hcjax.serve and compiles its engine
def test_a_serving_replica_installs_deltas_and_generates_with_them(monkeypatch):
    """Delta sync into `hcjax.serve` (on a thread): the first version whole, then a version that
    differs in one element per tensor arrives as a delta, is the learner's tree bit for bit and
    is what the next generation runs on."""
    import jax

    from hcjax import config as hcfg
    from hcjax.rollout import GenerateRequest
    from hcjax.rollout.service import RolloutClient
    from hcjax.rollout.standalone import ServeOptions
    from hcjax.rpc.auth import Security
    from hcjax.transfer.weights_service import WeightPublisher, param_digests, weights_status
    from tests.test_health import MODEL
    from tests.test_serve import InProcess, learner_versions

    for var in ("HCJAX_TOKEN", "HCJAX_TOKEN_FILE", "HCJAX_TLS_DIR"):
        monkeypatch.delenv(var, raising=False)
    hcfg.bind([], MODEL)
    (v1,) = learner_versions(1)
    v2 = jax.tree.map(lambda x: x.at[(0,) * x.ndim].add(0.5), v1)
    current = {"tree": v1}
    with InProcess(ServeOptions(warmup=False)) as address:
        publisher = WeightPublisher(lambda: current["tree"], [address], timeout=60,
                                    sync="delta")
        publisher(1)
        current["tree"] = v2
        publisher(2)
        first, second = publisher.history
        assert (first["fulls"], second["deltas"]) == (1, 1)
        assert second["wire_bytes"] * 10 < first["wire_bytes"]
        status = weights_status(address, digests=True)
        assert status["version"] == 2 and status["digests"] == param_digests(v2)
        with RolloutClient(address, Security()) as client:
            records = client.generate(GenerateRequest(prompt=[1, 2], max_tokens=2,
                                                      temperature=0.0, seed=0), timeout=60)
        assert records[0].versions.tolist() == [2, 2]
        publisher.close()


def test_the_climb_goes_on_when_a_push_reaches_no_replica():
    """A push no replica installed (Unreached) is counted and kept, not fatal: the publisher
    holds it as the current version and a readmitted replica receives it. Other errors still
    stop the climb."""
    import types

    import jax.numpy as jnp

    from hcjax.rl.climber import Climb
    from hcjax.transfer.weights_service import Unreached

    calls = []

    class Inference:
        def __init__(self, error):
            self.error = error

        def publish(self, version):
            calls.append(version)
            raise self.error

    climb = types.SimpleNamespace(_params=lambda: {"w": jnp.ones(2)}, output_dir="/tmp",
                                  unreached_pushes=0,
                                  inference=Inference(Unreached("weights version 3 reached "
                                                                "no replica")))
    Climb._publish(climb, 3)
    assert calls == [3] and climb.unreached_pushes == 1
    climb.inference = Inference(ValueError("layout"))
    with pytest.raises(ValueError, match="layout"):
        Climb._publish(climb, 4)

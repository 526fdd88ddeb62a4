"""Cross-process transfer over jax.experimental.transfer: one learner process serves two inference
processes (one replica each) on 127.0.0.1; each pulls exactly its entries, in bounded chunks.

This file is also the peer program: `python tests/test_transfer_remote.py learner|replica NAME`.
"""

import json
import os
import subprocess
import sys

import pytest

from hcjax.config import cpu_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"a_embed": (16, 8), "b_qkv": (8, 24), "c_mlp": (8, 16), "d_norm": (8,)}
LEARNER_SPECS = {
    "a_embed": ("fsdp", "tensor"),
    "b_qkv": ("fsdp", "tensor"),
    "c_mlp": (None, "tensor"),
    "d_norm": (),
}
REPLICA_DEVICES = {"A": (4, 5), "B": (6, 7)}
PROCESS = {"learner": 0, "A": 1, "B": 2}
CHUNK_BYTES = 128  # small, so each version travels in many chunks under flow control
FAILING_VERSION = 3  # the learner loses a buffer half-way through this version


def build():
    """The same plans in every process: learner mesh on devices 0-3, one plan per replica (on 4-5
    and 6-7), their entries labelled with the processes of the devices."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from hcjax.transfer import Cast, assign_processes, make_plan

    devices = np.array(jax.devices())
    learner = Mesh(devices[:4].reshape(2, 2), ("fsdp", "tensor"))
    source = {
        k: jax.ShapeDtypeStruct(
            s, np.float32, sharding=NamedSharding(learner, P(*LEARNER_SPECS[k]))
        )
        for k, s in SHAPES.items()
    }
    rules = {"*": Cast(jnp.bfloat16)}
    process_of = {d: 0 for d in range(4)}
    process_of.update({d: PROCESS[r] for r, ids in REPLICA_DEVICES.items() for d in ids})
    plans, entries = {}, {}
    for r, ids in REPLICA_DEVICES.items():
        mesh = Mesh(devices[list(ids)], ("tensor",))
        dst = {
            "a_embed": NamedSharding(mesh, P(None, "tensor")),
            "b_qkv": NamedSharding(mesh, P("tensor", None)),
            "c_mlp": NamedSharding(mesh, P("tensor", None)),
            "d_norm": NamedSharding(mesh, P()),
        }
        plans[r] = make_plan(source, dst, rules)
        entries[r] = assign_processes(plans[r].entries, process_of, process_of)
    return plans, learner, entries


def host_params(version):
    import numpy as np

    rng = np.random.default_rng(version)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def send(line):
    print(json.dumps(line), flush=True)


def run_learner():
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from hcjax.transfer import JaxTransferBackend, PlanSender

    plans, learner, entries = build()
    backend = JaxTransferBackend("127.0.0.1:0")
    send({"address": backend.address})
    peers = {int(k): v for k, v in json.loads(sys.stdin.readline())["peers"].items()}
    sender = PlanSender(  # the plans differ only in their destination devices
        plans["A"], 0, backend, peers, entries=entries["A"] + entries["B"],
        max_bytes_per_pull=CHUNK_BYTES
    )
    sent = {}
    for version in (1, 2, FAILING_VERSION):
        params = {
            k: jax.device_put(v, NamedSharding(learner, P(*LEARNER_SPECS[k])))
            for k, v in host_params(version).items()
        }
        if version == FAILING_VERSION:
            params["c_mlp"].delete()  # half-way: a_embed and b_qkv travel first
        try:
            sent[version] = sender.send(params, version)
        except Exception as err:
            send(
                {
                    "sent": sent,
                    "chunks": {k: len(v) for k, v in sender.chunks.items()},
                    "failed": str(err),
                }
            )
            os._exit(0)  # closes the connections, as a crashed learner would
    send({"sent": sent})


def run_replica(name):
    import numpy as np

    from hcjax.transfer import JaxTransferBackend, PlanReceiver, TransferFailed, VersionedWeights

    plans, _, entries = build()
    plan = plans[name]
    backend = JaxTransferBackend("127.0.0.1:0")
    send({"address": backend.address})
    peers = {int(k): v for k, v in json.loads(sys.stdin.readline())["peers"].items()}
    shardings = {p: s.sharding for p, s in plan.dst_leaves.items()}
    receiver = PlanReceiver(
        plan,
        PROCESS[name],
        backend,
        peers,
        entries=entries[name],
        dst_shardings=shardings,
        max_bytes_per_pull=CHUNK_BYTES,
    )
    weights = VersionedWeights()
    report = {"expected_bytes": sum(e.nbytes for e in entries[name]), "equal": {}, "received": {}}
    for version in (1, 2, FAILING_VERSION):
        pulled_before = receiver.chunks_pulled
        try:
            leaves = weights.update(lambda v=version: receiver.receive(v).leaves, version)
        except TransferFailed as err:
            report["failed"] = str(err)
            report["chunks_pulled_before_failure"] = receiver.chunks_pulled - pulled_before
            continue
        ref = plan.reference(host_params(version))
        report["received"][version] = receiver.bytes_received
        report["equal"][version] = all(
            np.array_equal(np.asarray(leaves[k]), ref[k])
            and leaves[k].sharding.is_equivalent_to(shardings[k], ref[k].ndim)
            for k in ref
        )
    # The version still served after the failure, checked against its own reference.
    version, served = weights.current()
    ref = plan.reference(host_params(version))
    report["serving"] = version
    report["serving_equal"] = all(np.array_equal(np.asarray(served[k]), ref[k]) for k in ref)
    send(report)


def _spawn(*args):
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=cpu_xla_flags(8),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
    )
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.mark.slow
def test_two_inference_processes_pull_their_entries_from_the_learner():
    procs = {"learner": _spawn("learner"), "A": _spawn("replica", "A"), "B": _spawn("replica", "B")}
    try:
        addresses = {}
        for name, proc in procs.items():
            line = proc.stdout.readline()
            assert line, f"{name} exited early: {proc.stderr.read()}"
            addresses[name] = json.loads(line)["address"]
        peers = {"learner": {1: addresses["A"], 2: addresses["B"]}}
        peers.update({name: {0: addresses["learner"]} for name in ("A", "B")})
        for name, proc in procs.items():
            proc.stdin.write(json.dumps({"peers": peers[name]}) + "\n")
            proc.stdin.flush()
        outputs = {}
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, f"{name} failed:\n{err[-3000:]}"
            outputs[name] = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()

    learner = outputs["learner"]
    assert "c_mlp" in learner["failed"] and "deleted" in learner["failed"]
    assert min(learner["chunks"].values()) > 2  # more chunks than the window of 2 in flight
    for name in ("A", "B"):
        replica = outputs[name]
        expected = replica["expected_bytes"]
        # Each replica gets every destination element once, in bf16 (cast on the learner side).
        elements = 16 * 8 + 8 * 24 + 8 * 16 + 8 * 2  # d_norm is replicated on both devices
        assert expected == elements * 2
        assert replica["equal"] == {"1": True, "2": True}
        assert replica["received"] == {"1": expected, "2": 2 * expected}
        # Version 3 broke half-way: the replica still serves version 2, intact.
        assert f"version {FAILING_VERSION} failed" in replica["failed"]
        assert replica["chunks_pulled_before_failure"] > 0  # it broke half-way, not at the start
        assert replica["serving"] == 2 and replica["serving_equal"] is True
    sent = learner["sent"]
    total = outputs["A"]["expected_bytes"] + outputs["B"]["expected_bytes"]
    assert sent == {"1": total, "2": total}


if __name__ == "__main__":
    if sys.argv[1] == "learner":
        run_learner()
    else:
        run_replica(sys.argv[2])


# ---------------------------------------------------------------------------------------------
# Pieces of the protocol, in this process.


def test_transfer_ids_are_distinct_and_checked():
    from hcjax.transfer.remote import transfer_uuid

    ids = {
        transfer_uuid(v, s, d, c, a)
        for v in (0, 1, 7)
        for s in (0, 1, 1023)
        for d in (0, 2)
        for c in (0, 1, 65535)
        for a in (False, True)
    }
    assert len(ids) == 3 * 3 * 2 * 3 * 2 and max(ids) < 2**63
    with pytest.raises(ValueError, match="chunk=65536 is out of range"):
        transfer_uuid(0, 0, 0, 65536, False)
    with pytest.raises(ValueError, match=r"process indices \(1024, 0\)"):
        transfer_uuid(0, 1024, 0, 0, False)


def test_chunks_keep_order_and_bound():
    import dataclasses

    from hcjax.transfer import TransferEntry
    from hcjax.transfer.remote import chunk_entries

    base = TransferEntry("a", "a", 0, 0, 4, 1, (), (), "copy", "float32", 0)
    entries = [dataclasses.replace(base, nbytes=n) for n in (40, 30, 50, 200, 10, 10)]
    chunks = chunk_entries(entries, 100)
    assert [[e.nbytes for e in c] for c in chunks] == [[40, 30], [50], [200], [10, 10]]
    with pytest.raises(ValueError, match="max_bytes_per_pull=0"):
        chunk_entries(entries, 0)


def test_sender_and_receiver_in_one_process():
    """Two transfer servers in one runtime: the protocol and assembly, without process start-up."""
    import threading

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from hcjax.transfer import Cast, JaxTransferBackend, PlanReceiver, PlanSender, make_plan

    devices = np.array(jax.devices())
    learner = Mesh(devices[:4].reshape(2, 2), ("fsdp", "tensor"))
    inference = Mesh(devices[4:], ("tensor",))
    host = {"w": np.arange(8 * 16, dtype=np.float32).reshape(8, 16), "n": np.ones(8, np.float32)}
    source = {
        "w": jax.device_put(host["w"], NamedSharding(learner, P("fsdp", "tensor"))),
        "n": jax.device_put(host["n"], NamedSharding(learner, P())),
    }
    dst = {"w": NamedSharding(inference, P("tensor", None)), "n": NamedSharding(inference, P())}
    plan = make_plan(source, dst, {"w": Cast(jnp.bfloat16)}).with_processes(0, 1)
    learner_side, inference_side = JaxTransferBackend(), JaxTransferBackend()
    sender = PlanSender(plan, 0, learner_side, {1: inference_side.address}, max_bytes_per_pull=64)
    receiver = PlanReceiver(
        plan, 1, inference_side, {0: learner_side.address}, max_bytes_per_pull=64
    )
    thread = threading.Thread(target=sender.send, args=(source, 5))
    thread.start()
    out = receiver.receive(5)
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert sender.bytes_sent == receiver.bytes_received == plan.bytes_moved
    np.testing.assert_array_equal(np.asarray(out.leaves["w"]), host["w"].astype(jnp.bfloat16))
    assert out.leaves["w"].sharding.is_equivalent_to(dst["w"], 2)
    np.testing.assert_array_equal(np.asarray(out.leaves["n"]), host["n"])

"""The multi-process climb's weight sync (hcjax.transfer.weights_service): the gRPC control
channel and the plan transfer in one process (handshake checks, dropped replicas, all-failed
errors), then the real placement on 127.0.0.1 — two `python -m hcjax.serve` processes and a
learner process."""

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hcjax.config import cpu_xla_flags
from hcjax.rpc.auth import Security
from hcjax.rpc.server import RpcServer
from hcjax.transfer.weights_service import (
    WeightPublisher,
    WeightsServicer,
    build_plan,
    check_same_parameters,
    describe_layout,
    param_digests,
    weights_status,
)

REPO = Path(__file__).resolve().parent.parent


# In one process: learner params on devices 0-1, replicas on 4-7 and 6-7 -------------------------


def mesh(ids):
    devices = {d.id: d for d in jax.devices()}
    return Mesh(np.array([devices[i] for i in ids]), ("fsdp",))


def params(on, w_spec, w_shape=(8, 16), seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(w_shape).astype(dtype)
    norm = rng.standard_normal(8).astype(np.float32)
    return {"blocks": {"w": jax.device_put(w, NamedSharding(on, P(*w_spec))),
                       "norm": jax.device_put(norm, NamedSharding(on, P()))}}


class FakeServer:
    """A RolloutServer's update_weights; `fail_at` versions raise (the replica 'fails')."""

    def __init__(self, fail_at=()):
        self.fail_at, self.versions = set(fail_at), []

    def update_weights(self, tree, version):
        if version in self.fail_at:
            raise RuntimeError(f"replica broke while installing version {version}")
        self.versions.append(version)


def serve(template, server):
    servicer = WeightsServicer(server, template)
    grpc_server = RpcServer(Security())
    grpc_server.add_generic_rpc_handlers((servicer.handler(grpc_server.blocking_pool),))
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    return grpc_server, f"127.0.0.1:{port}"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_publisher_moves_every_version_and_drops_failed_replicas():
    learner_mesh = mesh([0, 1])
    current = {"params": params(learner_mesh, ("fsdp", None))}
    # Replica A holds w column-sharded over 4 devices, replica B over 2: a reshard each.
    server_a, server_b = FakeServer(fail_at={3}), FakeServer(fail_at={2})
    grpc_a, a = serve(params(mesh([4, 5, 6, 7]), (None, "fsdp"), seed=9), server_a)
    grpc_b, b = serve(params(mesh([6, 7]), (None, "fsdp"), seed=9), server_b)
    nobody = f"127.0.0.1:{free_port()}"
    dropped = []
    try:
        publisher = WeightPublisher(lambda: current["params"], [a, b, nobody],
                                    on_dead=dropped.append, timeout=60, max_bytes_per_pull=64)
        # The unreachable replica is reported and skipped at the handshake.
        assert publisher.live == [a, b] and dropped == [nobody]
        assert "handshake failed: UNAVAILABLE:" in publisher.dead[nobody]
        assert len(publisher.plans) == 2  # one plan per distinct replica layout, made once
        for version in (0, 1):
            current["params"] = params(learner_mesh, ("fsdp", None), seed=version)
            publisher(version)
            for address in (a, b):
                status = weights_status(address, digests=True)
                assert status["version"] == version
                assert status["digests"] == param_digests(current["params"])
        # Every element of w once (8*16 fp32) plus norm once per replica device.
        status_a, status_b = weights_status(a), weights_status(b)
        assert status_a["expected_bytes"] == 8 * 16 * 4 + 4 * 8 * 4
        assert status_b["expected_bytes"] == 8 * 16 * 4 + 2 * 8 * 4
        for status in (status_a, status_b):
            assert status["served"] == [{"version": v, "bytes": status["expected_bytes"],
                                         "mode": "plain"} for v in (0, 1)]
        # B fails installing version 2: dropped (the router would stop sending to it); A goes on.
        current["params"] = params(learner_mesh, ("fsdp", None), seed=2)
        publisher(2)
        assert publisher.live == [a] and dropped == [nobody, b]
        assert publisher.dead[b].startswith("version 2: INTERNAL: weights version 2 failed")
        assert "replica broke while installing version 2" in publisher.dead[b]
        assert weights_status(a)["version"] == 2 and weights_status(b)["version"] == 1
        assert server_a.versions == [0, 1, 2] and server_b.versions == [0, 1]
        assert [h["version"] for h in publisher.history] == [0, 1, 2]
        # The last replica fails too: the version reached nobody.
        with pytest.raises(RuntimeError, match="weights version 3 reached no replica"):
            publisher(3)
        assert weights_status(a, digests=True)["digests"] == param_digests(current["params"])
        with pytest.raises(RuntimeError, match="weights version 4 reached no replica"):
            publisher(4)
        publisher.close()
    finally:
        grpc_a.stop(None)
        grpc_b.stop(None)


def test_handshake_rejects_parameters_that_differ():
    learner_mesh = mesh([0, 1])
    grpc_server, address = serve(params(mesh([4, 5]), (None, "fsdp"), w_shape=(8, 32)),
                                 FakeServer())
    try:
        with pytest.raises(ValueError, match=rf"inference process {address}: .*blocks/w: "
                           r"learner float32\[8, 16\] vs inference float32\[8, 32\]"):
            WeightPublisher(lambda: params(learner_mesh, ("fsdp", None)), [address], timeout=30)
    finally:
        grpc_server.stop(None)


def test_layout_checks_name_the_bad_values():
    learner = describe_layout(params(mesh([0, 1]), ("fsdp", None)))
    inference = describe_layout(params(mesh([4, 5]), (None, "fsdp"), dtype=np.float16))
    inference["leaves"]["blocks/extra"] = inference["leaves"].pop("blocks/norm")
    with pytest.raises(ValueError) as err:
        check_same_parameters(learner, inference)
    message = str(err.value)
    assert "only on the learner: ['blocks/norm']" in message
    assert "only on the inference process: ['blocks/extra']" in message
    assert "blocks/w: learner float32[8, 16] vs inference float16[8, 16]" in message
    # A mesh on devices this process lacks: the error says how many devices are needed.
    far = describe_layout(params(mesh([4, 5]), (None, "fsdp")))
    far["mesh"]["device_ids"] = [4, 99]
    with pytest.raises(ValueError, match=r"inference mesh uses device ids \[4, 99\].*missing "
                       r"\[99\].*at least 100 devices"):
        build_plan(learner, far)
    # Leaves that are not NamedShardings on one mesh are refused by name.
    with pytest.raises(ValueError, match="parameter 'x' has sharding"):
        describe_layout({"x": jax.device_put(np.zeros(2), jax.devices()[0])})


# The real placement: python -m hcjax.serve (x2) + the learner process -----------------------------


def tiny_params():
    from tests.test_climb import TINY

    return [*TINY, "ClimbConfig.eval_problems = 4", "ClimbConfig.eval_every = 100"]


def climb_env(devices):
    env = dict(os.environ)
    env["XLA_FLAGS"] = cpu_xla_flags(devices)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def gin_args(bindings):
    return [arg for b in bindings for arg in ("--gin_param", b)]


def start_inference(devices):
    proc = subprocess.Popen(
        [sys.executable, "-m", "hcjax.serve", "--port", "0", "--gin_file", "climb_tiny.gin",
         "--max_prefill_length", "32", "--max_target_length", "52",
         "--max_concurrent_decodes", "16", "--version", "-1", "--max_queue", "4096",
         "--max_request_mb", "1024", *gin_args(tiny_params())],
        cwd=REPO, env=climb_env(devices), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    return proc


def wait_serving(proc, timeout=180):
    lines, found = [], {}

    def read():
        for line in proc.stdout:
            lines.append(line)
            if '"event": "serving"' in line:
                found["port"] = json.loads(line)["port"]
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if "port" not in found:
        proc.kill()
        pytest.fail(f"inference process never served: {''.join(lines)}{proc.stderr.read()[-3000:]}")
    return f"127.0.0.1:{found['port']}"


def final_learner_params(out_dir, step):
    """The learner's params at the end of the climb, from its final checkpoint (read as any run's
    by hcjax.model_io), with the leaf paths of the served tree, an nnx.State's
    ('blocks/0/attn/wk/value')."""
    from flax import nnx

    from hcjax.model import ModelConfig, create_sharded
    from hcjax.model_io import read_checkpoint
    from hcjax.sharding import MeshConfig, make_mesh
    from tests.test_climb import TINY_MODEL

    one = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, expert=1, num_devices=1))
    _, target, _ = nnx.split(create_sharded(ModelConfig(**TINY_MODEL), one), nnx.Param, ...)
    loaded = read_checkpoint(str(out_dir), target=nnx.to_pure_dict(target))
    assert loaded.step == step
    return jax.tree.map(lambda x: {"value": x}, loaded.params)


@pytest.mark.slow
def test_multi_process_climb_moves_weights_by_plan(tiny_base, tmp_path):
    from flax import nnx

    from hcjax.model import ModelConfig, create_sharded
    from hcjax.sharding import MeshConfig, make_mesh
    from tests.test_climb import TINY_MODEL

    # Each inference process shards the model over 2 devices; the learner holds it on 1 and
    # starts from the run's tiny base.
    replicas = [start_inference(2), start_inference(2)]
    try:
        addresses = [wait_serving(p) for p in replicas]
        out = tmp_path / "climb"
        learner = subprocess.run(
            [sys.executable, "-m", "hcjax.climb", "--output_dir", str(out), "--quiet",
             "--mode", "on_policy", "--base_checkpoint", str(tiny_base),
             *gin_args([*tiny_params(), "ClimbConfig.num_steps = 3"]),
             *[arg for a in addresses for arg in ("--inference_address", a)]],
            cwd=REPO, env=climb_env(2), capture_output=True, text=True, timeout=400)
        assert learner.returncode == 0, learner.stderr[-4000:]
        assert "dropped from weight sync" not in learner.stderr
        statuses = [weights_status(a, digests=True) for a in addresses]
    finally:
        for proc in replicas:
            if proc.poll() is None:
                proc.terminate()
        for proc in replicas:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    summary = json.loads((out / "summary.json").read_text())
    assert summary["placement"] == "multi_process" and summary["steps"] == 3
    # On-policy: version 0 at the start, one per step, and the final push for the final eval.
    final_version = summary["evals"][-1]["version"]
    assert final_version == 4
    # The plan each replica pulls by, rebuilt here from the two layouts: every element of each
    # inference device's shard once (replicated leaves once per device).
    one = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, expert=1, num_devices=1))
    two = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1, expert=1, num_devices=2))
    model_cfg = ModelConfig(**TINY_MODEL)
    plan = build_plan(describe_layout(nnx.state(create_sharded(model_cfg, one), nnx.Param)),
                      describe_layout(nnx.state(create_sharded(model_cfg, two), nnx.Param)))
    learner_params = final_learner_params(out, summary["steps"])
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(learner_params))
    assert plan.bytes_moved == plan.ideal_bytes > param_bytes  # some leaves replicated twice
    for status in statuses:
        assert status["expected_bytes"] == plan.bytes_moved
        assert status["served"] == [{"version": v, "bytes": plan.bytes_moved, "mode": "plain"}
                                    for v in range(final_version + 1)]
        assert status["version"] == final_version
        # What the replica serves after the final push is the learner's final params, exactly.
        assert status["digests"] == param_digests(learner_params)


@pytest.mark.slow
def test_learner_over_two_processes_climbs_with_a_remote_replica(tiny_base, tmp_path):
    """Two learner processes (jax.distributed on 127.0.0.1, one CPU device each, one fsdp mesh
    over both) climb with one inference process: process 0 drives, process 1 follows; the
    replica ends up serving exactly the params both learner processes checkpointed.

    The tiny base mostly runs out of its 12 tokens; truncated rollouts train here
    (mask_truncated = False) so that every step runs the lockstep train on both processes rather
    than being skipped for want of usable rollouts."""
    replica = start_inference(1)
    out = tmp_path / "climb"
    coordinator = f"127.0.0.1:{free_port()}"
    try:
        address = wait_serving(replica)
        learners = [subprocess.Popen(
            [sys.executable, "-m", "hcjax.climb", "--output_dir", str(out), "--quiet",
             "--mode", "on_policy", "--base_checkpoint", str(tiny_base),
             "--coordinator_address", coordinator, "--num_processes", "2",
             "--process_id", str(i), "--inference_address", address,
             *gin_args([*tiny_params(), "ClimbConfig.num_steps = 3",
                        "Placement.learner_mesh = {'num_devices': 2}", "LearnerConfig.mask_truncated = False"])],
            cwd=REPO, env=climb_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True) for i in range(2)]
        results = [p.communicate(timeout=400) for p in learners]
        for p, (_, err) in zip(learners, results, strict=True):
            assert p.returncode == 0, err[-4000:]
        status = weights_status(address, digests=True)
    finally:
        for proc in [replica, *locals().get("learners", [])]:
            if proc.poll() is None:
                proc.kill()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["learner_processes"] == 2 and summary["steps"] == 3
    # The steps the leader trained (a skipped step records no loss): all three, each also run by
    # the follower.
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = sorted(r["step"] for r in records if "loss" in r)
    assert trained == [1, 2, 3], trained
    follower = [json.loads(x) for x in results[1][0].splitlines() if "follower_done" in x]
    assert follower and follower[0]["learner_steps"] == 3 and follower[0]["process_index"] == 1
    assert status["version"] == summary["evals"][-1]["version"]
    assert status["digests"] == param_digests(final_learner_params(out, summary["steps"]))

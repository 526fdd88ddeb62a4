"""gRPC service, client and router: round trip of every per-token field, error statuses, health
and metrics, concurrent load, circuit breaker with re-admission, and a replica process killed
mid-request whose request completes on another replica."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from hcjax.config import cpu_xla_flags
from hcjax.rollout import Engine, GenerateRequest, RolloutServer
from hcjax.rollout.router import Router
from hcjax.rollout.service import RolloutClient
from hcjax.rollout.wire import decode, encode
from tests.rollout_fixtures import serve_grpc, tiny_model

# The engines here test serving, not the sampler: its sort-only setting (bit-identical draws,
# a third of the compile; tests/conftest.py).
pytestmark = pytest.mark.usefixtures("sort_only_sampler")

PROMPT = [1, 5, 9, 3, 7, 2, 11]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def backend():
    engine = Engine(tiny_model(0), max_concurrent_decodes=4, max_prefill_length=16,
                    max_target_length=64)
    server = RolloutServer(engine, max_queue=8).start()
    grpc_server, port = serve_grpc(server)
    yield server, f"127.0.0.1:{port}"
    grpc_server.stop(None)
    server.stop()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wire_round_trip_and_rejects_garbage():
    arrays = {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "b": np.array([0.5], np.float32)}
    meta, back = decode(encode({"x": 1}, arrays))
    assert meta == {"x": 1}
    for k in arrays:
        np.testing.assert_array_equal(back[k], arrays[k])
    with pytest.raises(ValueError, match="not an hcjax rollout message"):
        decode(b"nope")
    with pytest.raises(ValueError, match="dtype"):
        encode({}, {"s": np.array(["x"])})


def test_grpc_stream_carries_every_field(backend):
    server, address = backend
    req = GenerateRequest(prompt=PROMPT, n=2, max_tokens=9, temperature=0.9, top_p=0.9, seed=5)
    local = server.generate(req, timeout=120)
    with RolloutClient(address) as client:
        events = []
        remote = client.generate(req, timeout=120, on_event=events.append)
    assert len(events) == sum(r.response_len for r in remote)
    for a, b in zip(local, remote):
        for name in ("prompt_ids", "response_ids", "logprobs", "raw_logprobs", "n_kept",
                     "threshold_logit", "versions", "routing", "loss_mask"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert (a.seed, a.sample_index, a.finish_reason, a.partial) == (
            b.seed, b.sample_index, b.finish_reason, b.partial)
    streamed = [e.token for e in events if e.sample_index == 1]
    assert streamed == remote[1].response_ids.tolist()
    assert events[0].routing.shape == (2, 2)


def test_partial_rollout_continues_over_grpc(backend):
    _, address = backend
    req = GenerateRequest(prompt=PROMPT, max_tokens=12, seed=2, token_budget=5)
    with RolloutClient(address) as client:
        part = client.generate(req, timeout=120)
        assert part[0].partial
        done = client.generate(GenerateRequest.continuation(part), timeout=120)
        full = client.generate(GenerateRequest(prompt=PROMPT, max_tokens=12, seed=2), timeout=120)
    assert done[0].response_ids.tolist() == full[0].response_ids.tolist()


@pytest.mark.parametrize(
    "options,message",
    [
        ({"prompt": []}, "prompt is empty"),
        ({"prompt": [1] * 40, "max_tokens": 30}, "max_target_length=64"),
        ({"prompt": [1], "max_tokens": 0}, "max_tokens=0"),
        ({"prompt": [1], "n": 0}, "n=0"),
        ({"prompt": [1], "beam_width": 4}, "unknown request options"),
    ],
)
def test_bad_requests_get_invalid_argument_and_server_keeps_serving(backend, options, message):
    _, address = backend
    channel = grpc.insecure_channel(address)
    call = channel.unary_stream("/hcjax.Rollout/Generate")
    with pytest.raises(grpc.RpcError) as err:
        list(call(encode({"options": options, "continue_from": []}), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    channel.close()
    with RolloutClient(address) as client:
        assert client.generate(GenerateRequest(prompt=[1, 2], max_tokens=2), timeout=60)


def test_health_and_metrics(backend):
    _, address = backend
    with RolloutClient(address) as client:
        assert client.health()["ok"]
        m = client.metrics()
    assert set(m) >= {"queue_depth", "slot_occupancy", "tokens_per_second", "version"}
    assert m["slots_total"] == 4


def test_router_load_breaker_and_readmission(backend):
    server, live = backend
    dead_port = _free_port()
    dead = f"127.0.0.1:{dead_port}"
    with Router([live, dead], probe_interval=0.2, max_inflight_per_replica=8) as router:
        results, errors = [], []

        def client(worker):
            try:
                for i in range(worker, 200, 16):
                    req = GenerateRequest(prompt=PROMPT, max_tokens=1 + i % 4, seed=i)
                    results.append(router.generate(req, timeout=300))
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=client, args=(w,)) for w in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert not errors and len(results) == 200
        m = router.metrics()
        assert m["replicas"][dead]["state"] == "open"
        assert m["replicas"][dead]["failures"] >= 1
        assert m["retries"] == m["replicas"][dead]["failures"]
        assert m["replicas"][live]["completed"] == 200
        # The dead replica comes back on the same address: the prober re-admits it.
        revived, _ = serve_grpc(server, dead)
        try:
            deadline = time.monotonic() + 30
            while router.metrics()["replicas"][dead]["state"] != "closed":
                assert time.monotonic() < deadline, router.metrics()
                time.sleep(0.1)
            assert router.metrics()["replicas"][dead]["readmissions"] == 1
            with pytest.raises(ValueError, match="n=0"):
                router.generate(_bad_n_request(), timeout=30)
        finally:
            revived.stop(None)


def _bad_n_request():
    # Bypasses client-side validation to check that the router does not retry a bad request.
    req = GenerateRequest(prompt=PROMPT)
    object.__setattr__(req, "n", 0)
    return req


def _start_replica(tmp_path, name):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=cpu_xla_flags(1),
               PYTHONPATH=str(REPO))
    params = [
        "ModelConfig.vocab_size = 64", "ModelConfig.d_model = 32", "ModelConfig.num_layers = 4",
        "ModelConfig.num_heads = 4", "ModelConfig.num_kv_heads = 2", "ModelConfig.head_dim = 8",
        "ModelConfig.attention_pattern = ('local', 'global')", "ModelConfig.window = 8",
        "ModelConfig.d_ff = 64", "ModelConfig.num_experts = 4", "ModelConfig.experts_per_token = 2",
        "ModelConfig.moe_latent_dim = 16", "ModelConfig.moe_d_ff = 32",
        "ModelConfig.max_seq_len = 64", "Engine.max_concurrent_decodes = 4",
        "Engine.max_prefill_length = 16", "RolloutServer.min_step_seconds = 0.1",
    ]
    cmd = [sys.executable, "-m", "hcjax.serve", "--init_noise", "0.3"]
    for p in params:
        cmd += ["--gin_param", p]
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, cwd=REPO, text=True)


@pytest.mark.slow
def test_killed_replica_process_mid_request_completes_elsewhere(tmp_path, backend):
    # The replica to kill is a separate `python -m hcjax.serve` process with the same weights as
    # the in-process backend (same config, seed and noise), which the router discovers mid-run.
    _, survivor = backend
    proc = _start_replica(tmp_path, "victim")
    try:
        line = proc.stdout.readline()
        assert line, (tmp_path / "victim.log").read_text()[-3000:]
        victim = f"127.0.0.1:{json.loads(line)['port']}"
        seen = {victim: [], survivor: []}

        def kill_on_third_token(event, address):
            seen[address].append(event)
            if address == victim and len(seen[victim]) == 3:
                router.add_replica(survivor)
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)

        req = GenerateRequest(prompt=PROMPT, n=2, max_tokens=24, seed=9)
        with Router([victim], probe_interval=0.2) as router:
            records = router.generate(req, timeout=240, on_event=kill_on_third_token)
            m = router.metrics()
        assert proc.returncode == -signal.SIGKILL
        assert [r.response_len for r in records] == [24, 24]
        assert m["retries"] == 1 and m["failed_requests"] == 0
        assert m["replicas"][victim]["state"] == "open"
        assert m["replicas"][survivor]["completed"] == 1
        # Same seed and weights: the retry resampled exactly what the victim had streamed.
        for e in seen[victim]:
            assert records[e.sample_index].response_ids[e.position - len(PROMPT)] == e.token
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)

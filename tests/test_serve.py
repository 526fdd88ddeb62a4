"""The inference process `python -m hcjax.serve` (`hcjax.rollout.standalone.serve`): its mesh comes from the gin
MeshConfig and a binding the devices cannot form fails before anything is built; it serves the
Weights service beside Rollout, so a learner's WeightPublisher moves new versions into it and
greedy generation follows them."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import jax
import pytest
from flax import nnx

from hcjax import config as hcfg
from hcjax.config import cpu_xla_flags
from hcjax.rollout.standalone import ServeOptions, serve

REPO = Path(__file__).resolve().parent.parent

# A tiny model that compiles in seconds on CPU.
MODEL = [
    "ModelConfig.vocab_size = 64", "ModelConfig.d_model = 32", "ModelConfig.num_layers = 2",
    "ModelConfig.num_heads = 2", "ModelConfig.num_kv_heads = 1", "ModelConfig.head_dim = 16",
    "ModelConfig.attention_pattern = ('local', 'global')", "ModelConfig.window = 8",
    "ModelConfig.d_ff = 64", "ModelConfig.num_experts = 4", "ModelConfig.moe_latent_dim = 16",
    "ModelConfig.moe_d_ff = 32", "ModelConfig.max_seq_len = 64", "ModelConfig.dtype = 'float32'",
]


def learner_versions(*seeds):
    """The learner's parameter trees on device 0, one per seed: the seed-0 initialisation of the
    bound ModelConfig with N(0, 0.3^2) noise of that seed (arrays laid out like the learner's)."""
    from hcjax.model import ModelConfig, add_weight_noise, create_sharded
    from hcjax.sharding import MeshConfig, make_mesh

    one = make_mesh(MeshConfig(fsdp=1, num_devices=1))
    state = nnx.state(create_sharded(ModelConfig(), one, seed=0))
    return [jax.tree.map(lambda x, ref: jax.device_put(x, ref.sharding),
                         add_weight_noise(state, seed, 0.3), state) for seed in seeds]


class InProcess:
    """`serve` on a thread of this process; `address` once it is ready."""

    def __init__(self, options):
        self.stop, self.ready, self.info, self.error = threading.Event(), threading.Event(), {}, None
        self.thread = threading.Thread(target=self._run, args=(options,), daemon=True)

    def _run(self, options):
        try:
            serve(options, ready=self._announce, stop=self.stop)
        except BaseException as err:  # noqa: BLE001 - reported by __enter__
            self.error = err
            self.ready.set()

    def _announce(self, info):
        self.info.update(info)
        self.ready.set()

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(300), "serve never became ready"
        if self.error is not None:
            raise self.error
        return f"127.0.0.1:{self.info['port']}"

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(60)


def test_a_mesh_binding_the_devices_cannot_form_fails_before_building(monkeypatch):
    import hcjax.model

    hcfg.bind([], [*MODEL, "MeshConfig.tensor = 16"])
    monkeypatch.setattr(hcjax.model, "create_sharded",
                        lambda *a, **k: pytest.fail("built the model despite a bad mesh"))
    with pytest.raises(ValueError) as err:
        serve(ServeOptions(warmup=False))
    message = str(err.value)
    assert "gin MeshConfig(data=1, fsdp=-1, tensor=16, expert=1, device_offset=0, " in message
    assert "on this process's 8 cpu device(s)" in message
    assert "do not divide the 8 available devices" in message
    assert "MeshConfig.tensor = 1" in message


def test_weights_service_installs_the_learners_version_on_the_gin_mesh():
    from hcjax.transfer.weights_service import WeightPublisher, param_digests, weights_status

    hcfg.bind([], [*MODEL, "MeshConfig.fsdp = 2", "MeshConfig.device_offset = 4"])
    [pushed] = learner_versions(1)
    with InProcess(ServeOptions(warmup=False)) as address:
        publisher = WeightPublisher(lambda: pushed, [address], timeout=120)
        try:
            # The replica described the gin MeshConfig's mesh: devices 4-5, fsdp 2.
            [layout] = [json.loads(k) for k in publisher.plans]
            assert layout["mesh"]["device_ids"] == [4, 5]
            publisher(1)
        finally:
            publisher.close()
        status = weights_status(address, digests=True)
    assert status["version"] == 1
    assert status["digests"] == param_digests(pushed)


def _env(devices):
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
                XLA_FLAGS=cpu_xla_flags(devices))


@pytest.mark.slow
def test_python_m_hcjax_serve_generates_with_the_pushed_versions(tmp_path):
    from hcjax.rollout import GenerateRequest
    from hcjax.rollout.service import RolloutClient
    from hcjax.transfer.weights_service import WeightPublisher, param_digests, weights_status

    cmd = [sys.executable, "-m", "hcjax.serve", "--max_prefill_length", "16",
           "--max_target_length", "32", "--max_concurrent_decodes", "4"]
    for p in MODEL:
        cmd += ["--gin_param", p]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=_env(2), cwd=REPO,
                            text=True)
    hcfg.bind([], MODEL)
    a, b = learner_versions(1, 2)
    try:
        line = proc.stdout.readline()
        assert line, (tmp_path / "serve.log").read_text()[-3000:]
        serving = json.loads(line)
        assert serving["event"] == "serving" and serving["max_target_length"] == 32
        assert serving["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1, "expert": 1}
        address = f"127.0.0.1:{serving['port']}"
        current = {"params": a}
        publisher = WeightPublisher(lambda: current["params"], [address], timeout=120)
        request = GenerateRequest(prompt=[3, 1, 4, 1, 5], max_tokens=10, temperature=0.0, seed=0)
        greedy = {}
        with RolloutClient(address) as client:
            for version, params in [(1, a), (2, b), (3, a)]:
                current["params"] = params
                publisher(version)
                assert weights_status(address, digests=True)["digests"] == param_digests(params)
                [record] = client.generate(request, timeout=120)
                assert set(record.versions.tolist()) == {version}
                greedy[version] = record.response_ids.tolist()
        publisher.close()
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    # Greedy decoding follows the weights: A again gives A's tokens exactly, B others.
    assert greedy[3] == greedy[1] and greedy[2] != greedy[1]
    assert proc.returncode == 0  # SIGTERM: the server stopped cleanly

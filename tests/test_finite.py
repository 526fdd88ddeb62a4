"""NaN/Inf weights are refused wherever weights come in or go out (hcjax.finite): a Hugging Face
load, a checkpoint restore, a push to a replica (which keeps serving its version) and the climb's
publish; each error names the tensor and how many values are bad."""

import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcjax.checkpoint import CheckpointConfig, Checkpointer
from hcjax.finite import NonFiniteWeights, check_finite, check_finite_array, nonfinite_counts
from hcjax.model import hf
from hcjax.model.safetensors_io import SafetensorsCheckpoint
from tests.hf_fixtures import fixture

# The engines here test serving, not the sampler: its sort-only setting (bit-identical draws,
# a third of the compile; tests/conftest.py).
pytestmark = pytest.mark.usefixtures("sort_only_sampler")


def poison(folder, name, count=3, value=np.nan):
    """Overwrite the first `count` values of fp32 tensor `name` in place."""
    entry = SafetensorsCheckpoint.open(folder)._entry(name)
    assert entry.info.dtype == "F32"
    with open(entry.info.file, "r+b") as f:
        f.seek(entry.begin)
        f.write(np.full(count, value, np.float32).tobytes())


def test_counts_name_every_bad_tensor_on_host_and_device():
    tree = {"a": {"w": jnp.array([1.0, np.nan, np.inf, 2.0])},
            "b": np.array([[1.0, -np.inf]], np.float32), "ids": jnp.arange(3),
            "ok": jnp.ones((2, 2))}
    assert nonfinite_counts(tree) == {"a/w": (2, 4), "b": (1, 2)}
    with pytest.raises(NonFiniteWeights, match=r"restored x: 2 tensor\(s\) hold non-finite "
                                               r"values \(NaN/Inf\): a/w: 2 of 4; b: 1 of 2"):
        check_finite(tree, "restored x")
    check_finite({"ok": jnp.ones(3), "ids": np.arange(4)}, "fine")
    # leaves on different devices are checked too (one call per device set)
    elsewhere = jax.device_put(jnp.array([np.nan, 1.0]), jax.devices()[1])
    assert nonfinite_counts({"a": jnp.ones(2), "b": elsewhere}) == {"b": (1, 2)}
    # finite weights whose float sum overflows are not mistaken for bad ones
    check_finite_array("big", np.full(16, 3e38, np.float32), "fine")
    with pytest.raises(NonFiniteWeights, match="big: 1 of 16"):
        check_finite_array("big", np.r_[np.full(15, 3e38), np.nan].astype(np.float32), "x")


def test_a_hugging_face_folder_with_nans_is_refused_naming_the_tensor(tmp_path):
    folder = tmp_path / "qwen3"
    shutil.copytree(fixture("qwen3"), folder)
    name = "model.layers.0.mlp.down_proj.weight"
    poison(folder, name, count=5)
    with pytest.raises(NonFiniteWeights, match=rf"{name}: 5 of \d+"):
        hf.load(str(folder))


def test_a_checkpoint_with_nans_is_refused_without_falling_back(tmp_path):
    ck = Checkpointer(str(tmp_path), CheckpointConfig(save_every=1, async_save=False), {})
    good = {"params": {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}}
    ck.save(1, good)
    ck.save(2, {"params": {"w": jnp.ones((4, 4)).at[0, :2].set(jnp.inf), "b": jnp.zeros(4)}})
    ck.wait()
    with pytest.raises(NonFiniteWeights, match=r"step 2: 1 tensor\(s\) .*params/w: 2 of 16"):
        ck.restore(None, good)
    with pytest.raises(NonFiniteWeights, match=r"step 2 \('params'\): .*w: 2 of 16"):
        ck.restore_subtree(2, "params", good["params"])
    state, _ = ck.restore(1, good)  # the good step still reads
    assert float(state["params"]["w"].sum()) == 16.0
    ck.close()


def test_a_replica_refuses_a_push_of_nans_and_keeps_serving_its_version():
    from hcjax.rollout import Engine, GenerateRequest, RolloutServer
    from tests.rollout_fixtures import tiny_model

    engine = Engine(tiny_model(0), max_concurrent_decodes=2, max_prefill_length=8,
                    max_target_length=16)
    params = engine.load_params()
    with RolloutServer(engine, params, version=3) as server:
        bad = jax.tree.map(lambda x: x, params)
        leaf_path, leaf = jax.tree_util.tree_flatten_with_path(bad)[0][0]
        poisoned = jax.tree_util.tree_map_with_path(
            lambda p, x: x.at[(0,) * x.ndim].set(jnp.nan) if p == leaf_path else x, bad)
        with pytest.raises(NonFiniteWeights, match=r"weights version 4: 1 tensor\(s\)"):
            server.update_weights(poisoned, 4)
        assert server.version == 3
        [record] = server.generate(GenerateRequest(prompt=[1, 2], max_tokens=3, seed=0),
                                   timeout=120)
        assert set(record.versions.tolist()) == {3} and np.isfinite(record.logprobs).all()


def test_the_weights_service_refuses_nans_and_the_publisher_stops_the_learner():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from hcjax.rpc.auth import Security
    from hcjax.rpc.server import RpcServer
    from hcjax.transfer.weights_service import WeightPublisher, WeightsServicer, weights_status

    mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec()))  # noqa: E731
    served = []

    class Server:
        version = 0

        def update_weights(self, tree, version, rollback=False):
            check_finite(tree, f"weights version {version}")
            served.append(version)

    grpc_server = RpcServer(Security())
    template = {"w": put(np.zeros((4, 4), np.float32))}
    grpc_server.add_generic_rpc_handlers(
        (WeightsServicer(Server(), template).handler(grpc_server.blocking_pool),))
    address = f"127.0.0.1:{grpc_server.add_insecure_port('127.0.0.1:0')}"
    grpc_server.start()
    current = {"w": put(np.ones((4, 4), np.float32))}
    try:
        publisher = WeightPublisher(lambda: current, [address], timeout=60)
        publisher(1)
        current = {"w": put(np.ones((4, 4), np.float32)).at[1, 1].set(jnp.nan)}
        with pytest.raises(NonFiniteWeights, match=r"weights version 2 was refused: .*w: 1 of 16"):
            publisher(2)
        assert publisher.live == [address] and served == [1]
        assert weights_status(address)["version"] == 1
        publisher.close()
    finally:
        grpc_server.stop(None)


def test_the_climb_stops_before_publishing_a_non_finite_update(tmp_path):
    from hcjax.rl.climber import Climb

    published = []
    params = {"layers": {"w": jnp.ones(3).at[2].set(jnp.nan)}}
    climb = types.SimpleNamespace(_params=lambda: params, output_dir=str(tmp_path),
                                  inference=types.SimpleNamespace(publish=published.append))
    with pytest.raises(NonFiniteWeights, match=r"learner's parameters for weights version 7 "
                                               r".*layers/w: 1 of 3"):
        Climb._publish(climb, 7)
    assert published == []
    params = {"layers": {"w": jnp.ones(3)}}
    Climb._publish(climb, 8)
    assert published == [8]


def test_bench_finite_reports_both_costs():
    from hcjax.bench.finite import main

    out = main(["--host_mb", "1", "--models", "tiny", "--repeats", "1"])
    assert out["host"]["check_s"] > 0 and out["device"][0]["check_over_copy"] > 0

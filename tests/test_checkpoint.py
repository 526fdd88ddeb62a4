"""Orbax checkpoints: round trip with data state, keep-N, interval, config mismatch errors, and an
unfinished save never replacing the last good checkpoint."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcjax.checkpoint import CheckpointConfig, Checkpointer


def _state(x):
    return {"params": {"w": jnp.full((4, 3), x, jnp.float32), "b": jnp.arange(3.0) + x},
            "step": jnp.asarray(int(x), jnp.int32)}


def test_round_trip_keep_and_interval(tmp_path):
    ck = Checkpointer(str(tmp_path), CheckpointConfig(save_every=2, keep=2), {"model": "a"})
    for step in range(1, 8):
        ck.save(step, _state(step), {"cursor": step * 10}, force=step == 7)
    ck.wait()
    assert ck.all_steps() == [6, 7]  # saved 2, 4, 6 on the interval, 7 forced; keep 2
    state, data = ck.restore(None, _state(0))
    np.testing.assert_array_equal(state["params"]["w"], np.full((4, 3), 7.0))
    assert int(state["step"]) == 7 and data == {"cursor": 70}
    state6, data6 = ck.restore(6, _state(0))
    assert float(state6["params"]["b"][0]) == 6.0 and data6 == {"cursor": 60}
    ck.close()


def test_restore_keeps_target_sharding(tmp_path):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    target = {"w": jax.device_put(jnp.zeros(8), sh)}
    ck = Checkpointer(str(tmp_path), CheckpointConfig(async_save=False), {})
    ck.save(1, {"w": jax.device_put(jnp.arange(8.0), sh)}, force=True)
    state, _ = ck.restore(1, target)
    assert state["w"].sharding == sh
    np.testing.assert_array_equal(state["w"], np.arange(8.0))
    ck.close()


def test_incompatible_config_is_named(tmp_path):
    ck = Checkpointer(str(tmp_path), CheckpointConfig(), {"model_config": {"d_model": 64}})
    ck.save(1, _state(1), force=True)
    ck.close()
    other = Checkpointer(str(tmp_path), CheckpointConfig(), {"model_config": {"d_model": 128}})
    with pytest.raises(ValueError, match="incompatible.*d_model.*64.*128"):
        other.restore(None, _state(0))
    other.close()


def test_missing_steps(tmp_path):
    ck = Checkpointer(str(tmp_path), CheckpointConfig(), {})
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ck.restore(None, _state(0))
    ck.save(1, _state(1), force=True)
    ck.wait()
    with pytest.raises(FileNotFoundError, match="step=5"):
        ck.restore(5, _state(0))
    ck.close()


def test_unfinished_save_does_not_replace_last_good(tmp_path):
    ck = Checkpointer(str(tmp_path), CheckpointConfig(), {})
    ck.save(1, _state(1), force=True)
    ck.close()
    # What a run killed mid-save leaves behind: a temporary folder for the next step.
    os.makedirs(tmp_path / "2.orbax-checkpoint-tmp-1234" / "state")
    ck = Checkpointer(str(tmp_path), CheckpointConfig(), {})
    assert ck.latest_step() == 1
    state, _ = ck.restore(None, _state(0))
    assert int(state["step"]) == 1
    ck.close()


def test_bad_config():
    with pytest.raises(ValueError, match="save_every=0"):
        CheckpointConfig(save_every=0)
    with pytest.raises(ValueError, match="keep=0"):
        CheckpointConfig(keep=0)


def test_restore_subtree_reads_straight_into_another_sharding(tmp_path):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = np.array(jax.devices())
    eight = NamedSharding(Mesh(devices.reshape(8), ("x",)), PartitionSpec("x", None))
    four = NamedSharding(Mesh(devices[4:].reshape(2, 2), ("a", "b")), PartitionSpec("b", "a"))
    vec = NamedSharding(Mesh(devices.reshape(8), ("x",)), PartitionSpec("x"))
    params = {"w": jax.device_put(jnp.arange(64.0).reshape(16, 4), eight),
              "blocks": {0: {"b": jax.device_put(jnp.ones(8), vec)}}}
    state = {"params": params, "opt": {"mu": jnp.zeros((1000,))}, "step": jnp.int32(3)}
    ck = Checkpointer(str(tmp_path), CheckpointConfig(async_save=False), {})
    ck.save(1, state, force=True)
    target = {"w": jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=four),
              "blocks": {0: {"b": jax.ShapeDtypeStruct((8,), jnp.bfloat16, sharding=vec)}}}
    got = ck.restore_subtree(1, "params", target)
    assert got["w"].sharding == four and got["blocks"][0]["b"].dtype == jnp.bfloat16
    assert {s.data.shape for s in got["w"].addressable_shards} == {(8, 2)}
    np.testing.assert_array_equal(got["w"], np.arange(64.0).reshape(16, 4))
    bad = {"w": jax.ShapeDtypeStruct((4, 16), jnp.float32)}
    with pytest.raises(ValueError, match="different structure"):
        ck.restore_subtree(1, "params", bad)
    bad = dict(target, w=jax.ShapeDtypeStruct((4, 16), jnp.float32))
    with pytest.raises(ValueError, match=r"params'/w has shape \(16, 4\)"):
        ck.restore_subtree(1, "params", bad)
    ck.close()

"""Quantise-on-sync through the climb's in-process replicas (hcjax.rl.inference.LocalInference):
the replica serves exactly dequantize(quantize(w)) of the learner's weights, the engine's
log-probs are those of a forward of those weights (not of the learner's), the wire carries one
byte per quantised value plus scales, and NaN weights are still refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hcjax.finite import NonFiniteWeights
from hcjax.model import add_weight_noise, create_sharded
from hcjax.rl.inference import LocalInference
from hcjax.rollout import GenerateRequest
from hcjax.sharding import MeshConfig, make_mesh
from hcjax.transfer import quantize as qz
from hcjax.transfer.reshard_plan import path_str
from hcjax.transfer.weights_service import WeightSyncConfig
from tests.rollout_fixtures import TINY_TEST_CONFIG

BLOCK = 16


def _flat(tree):
    return {path_str(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.slow  # an engine, its plan and two forwards compiled: 25 s on the shared 2-core CPU
@pytest.mark.parametrize("fmt", ["fp8_e4m3"])
def test_replica_serves_and_samples_the_quantised_weights(fmt):
    # One device each (the 2-device sharding of values and scales is test_transfer_quantize's).
    learner = create_sharded(TINY_TEST_CONFIG, make_mesh(MeshConfig(fsdp=1, num_devices=1)),
                             seed=0)
    nnx.update(learner, add_weight_noise(nnx.state(learner), 1))
    state = nnx.state(learner)
    mesh = make_mesh(MeshConfig(fsdp=1, device_offset=1, num_devices=1))
    inference = LocalInference(learner, [mesh], lambda: state, max_concurrent_decodes=1,
                               max_prefill_length=8, max_target_length=24, quantize=fmt,
                               quant_block=BLOCK)
    try:
        inference.start(1)
        _, served = inference.replicas[0]["served"].current()
        want, got = _flat(state), _flat(served)
        chosen = set(qz.quantized_paths(state))
        assert chosen and any("experts" in p or "w_up" in p for p in chosen)
        for path, x in want.items():
            ref = qz.round_trip(x, fmt, BLOCK) if path in chosen else x
            assert got[path].dtype == x.dtype and got[path].sharding.mesh == mesh, path
            np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(ref), err_msg=path)
        assert any(not np.array_equal(np.asarray(got[p]), np.asarray(want[p])) for p in chosen)
        # The wire: one byte per quantised value, 4 B of scale per BLOCK values, the rest fp32.
        quantised = sum(want[p].size for p in chosen)
        full = sum(x.size * 4 for x in want.values())
        assert inference.wire_bytes == full - 3 * quantised + 4 * sum(
            want[p].size // want[p].shape[-1] * -(-want[p].shape[-1] // BLOCK) for p in chosen)

        # The sampler's log-probs are a forward of the served (round-tripped) weights.
        rec = inference.generate(GenerateRequest(prompt=[3, 1, 4, 1, 5], max_tokens=10,
                                                 temperature=1.0, top_p=1.0, seed=3),
                                 timeout=120)[0]
        graphdef = nnx.graphdef(learner)
        seq = np.concatenate([rec.prompt_ids, rec.response_ids])[None]

        def logp(tree):
            logits = np.asarray(nnx.merge(graphdef, tree)(jnp.asarray(seq)).logits[0], np.float64)
            logits = logits[rec.prompt_len - 1: -1]
            logits -= logits.max(-1, keepdims=True)
            lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            return lp[np.arange(rec.response_len), rec.response_ids]

        served_on_learner = jax.tree.map(
            lambda x, s: jax.device_put(x, s.sharding), served, state)
        np.testing.assert_allclose(rec.logprobs, logp(served_on_learner), atol=1e-4)
        # and not of the learner's own weights: the gap quantisation adds is visible here
        assert np.max(np.abs(rec.logprobs - logp(state))) > 1e-3

        # NaN in a quantised kernel: the replica refuses the version and keeps serving 1.
        bad = jax.tree.map(lambda x: x, state)
        leaf = bad["blocks"][0]["attn"]["wq"]
        leaf.value = leaf.value.at[0, 0, 0].set(jnp.nan)
        inference._params = lambda: bad
        with pytest.raises(NonFiniteWeights):
            inference.publish(2)
        assert inference.replicas[0]["server"].version == 1
        # ... and its kept copy too is still version 1's weights, untouched by the refusal
        kept_version, kept = inference.replicas[0]["served"].current()
        assert kept_version == 1 and kept is served
        inference._params = lambda: state
        inference.publish(2)  # the next finite push installs as usual
        assert inference.replicas[0]["served"].version == 2
        assert inference.replicas[0]["server"].version == 2
    finally:
        inference.close()


def test_bad_quantize_option_names_the_value():
    with pytest.raises(ValueError, match="'fp6'"):
        WeightSyncConfig(quantize="fp6")
    with pytest.raises(ValueError, match="quant_block=-1"):
        WeightSyncConfig(quantize="int8", quant_block=-1)


@pytest.mark.parametrize("sync", ["full", "delta"])
def test_remote_push_serves_the_quantised_weights(sync):
    """WeightPublisher(quantize="int8") to a WeightsServicer over gRPC: the wire carries int8
    values and scales, the replica serves their dequantised values in float32, a delta of
    quantised values applies, and NaN weights are still refused."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from hcjax.finite import check_finite
    from hcjax.rpc.auth import Security
    from hcjax.rpc.server import RpcServer
    from hcjax.transfer.weights_service import WeightPublisher, WeightsServicer

    mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    put = lambda x: jax.device_put(jnp.asarray(x), NamedSharding(mesh, PartitionSpec()))  # noqa: E731
    served = {}

    class Server:
        version = 0

        def update_weights(self, tree, version, rollback=False):
            check_finite(tree, f"weights version {version}")
            served[version] = tree

    rng = np.random.default_rng(5)
    tree = lambda: {"layer": {"wq": put(rng.normal(size=(4, 40)).astype(np.float32)),  # noqa: E731
                              "norm": put(rng.normal(size=(4,)).astype(np.float32))}}
    grpc_server = RpcServer(Security())
    grpc_server.add_generic_rpc_handlers(
        (WeightsServicer(Server(), tree()).handler(grpc_server.blocking_pool),))
    address = f"127.0.0.1:{grpc_server.add_insecure_port('127.0.0.1:0')}"
    grpc_server.start()
    current = tree()
    try:
        publisher = WeightPublisher(lambda: current, [address], timeout=60, sync=sync,
                                    quantize="int8", quant_block=BLOCK)
        for version in (1, 2):
            if version == 2:
                current = {"layer": {"wq": current["layer"]["wq"].at[0, :5].add(1.0),
                                     "norm": current["layer"]["norm"]}}
            publisher(version)
            got = served[version]["layer"]
            assert got["wq"].dtype == jnp.float32
            np.testing.assert_array_equal(
                np.asarray(got["wq"]),
                np.asarray(qz.round_trip(current["layer"]["wq"], "int8", BLOCK)))
            np.testing.assert_array_equal(np.asarray(got["norm"]),
                                          np.asarray(current["layer"]["norm"]))
        # int8 values (1 B) and a float32 scale per 16 values (3 blocks a row), fp32 norm
        assert publisher.history[0]["bytes"] == 4 * 40 + 4 * 3 * 4 + 4 * 4
        if sync == "delta":
            assert publisher.history[1]["deltas"] == 1
            assert publisher.history[1]["wire_bytes"] < publisher.history[0]["bytes"]
        current = {"layer": {"wq": current["layer"]["wq"].at[1, 1].set(jnp.nan),
                             "norm": current["layer"]["norm"]}}
        with pytest.raises(NonFiniteWeights):
            publisher(3)
        assert 3 not in served
        publisher.close()
    finally:
        grpc_server.stop(None)

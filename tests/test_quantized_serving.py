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
from hcjax.model import create_sharded
from hcjax.rl.inference import LocalInference
from hcjax.rollout import GenerateRequest
from hcjax.rollout.testing import TINY_TEST_CONFIG, perturbed
from hcjax.sharding import MeshConfig, make_mesh
from hcjax.transfer import quantize as qz
from hcjax.transfer.reshard_plan import path_str
from hcjax.transfer.weights_service import WeightSyncConfig

BLOCK = 16


def _flat(tree):
    return {path_str(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("fmt", ["fp8_e4m3"])
def test_replica_serves_and_samples_the_quantised_weights(fmt):
    # One device each (the 2-device sharding of values and scales is test_transfer_quantize's).
    learner = create_sharded(TINY_TEST_CONFIG, make_mesh(MeshConfig(fsdp=1, num_devices=1)),
                             seed=0)
    nnx.update(learner, perturbed(nnx.state(learner), 1))
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
    finally:
        inference.close()


def test_bad_quantize_option_names_the_value():
    with pytest.raises(ValueError, match="'fp6'"):
        WeightSyncConfig(quantize="fp6")
    with pytest.raises(ValueError, match="quant_block=-1"):
        WeightSyncConfig(quantize="int8", quant_block=-1)

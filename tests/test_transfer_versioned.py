"""Atomic weight versions (hcjax.transfer.versioned): a swap only moves forward, and a failure
injected half-way through a transfer keeps the previous version serving."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hcjax.transfer import Cast, LocalTransfer, TransferFailed, VersionedWeights, make_plan

DEVICES = np.array(jax.devices())
BF16 = jnp.bfloat16


def test_swap_only_moves_forward():
    weights = VersionedWeights({"w": 1}, version=3)
    with pytest.raises(ValueError, match="version=3 is not newer than the served 3"):
        weights.swap({"w": 2}, 3)
    weights.swap({"w": 2}, 4)
    assert weights.current() == (4, {"w": 2})


def test_failure_half_way_keeps_the_previous_version_serving():
    learner = Mesh(DEVICES[:4].reshape(2, 2), ("fsdp", "tensor"))
    inference = Mesh(DEVICES[4:], ("tensor",))
    names = [f"layer{i}" for i in range(4)]
    shape = (8, 16)

    def params(seed):
        rng = np.random.default_rng(seed)
        host = {n: rng.standard_normal(shape).astype(np.float32) for n in names}
        return host, {
            n: jax.device_put(v, NamedSharding(learner, P("fsdp", "tensor")))
            for n, v in host.items()
        }

    dst = {n: NamedSharding(inference, P(None, "tensor")) for n in names}
    host1, params1 = params(1)
    transfer = LocalTransfer(make_plan(params1, dst, {"*": Cast(BF16)}), max_bytes_in_flight=1024)
    weights = VersionedWeights()
    weights.update(lambda: transfer(params1), version=1)
    served = weights.current()[1]

    # Version 2: the third leaf's buffer is gone (donated by the learner's next step) while the
    # transfer runs, after the first leaves were copied.
    host2, params2 = params(2)
    params2["layer2"].delete()
    with pytest.raises(TransferFailed, match="version 2 failed.*layer2.*still serving version 1"):
        weights.update(lambda: transfer(params2), version=2)
    assert weights.version == 1 and weights.current()[1] is served
    assert isinstance(weights.last_error, TransferFailed) and weights.last_error.serving == 1
    for n in names:  # the served buffers are intact and still usable
        np.testing.assert_array_equal(np.asarray(served[n]), host1[n].astype(BF16))
        assert float(jnp.sum(served[n].astype(jnp.float32))) == pytest.approx(
            float(host1[n].astype(BF16).astype(np.float32).sum()), rel=1e-6
        )

    # The next good version goes through the same executor and replaces it in one step.
    host3, params3 = params(3)
    weights.update(lambda: transfer(params3), version=3)
    version, tree = weights.current()
    assert version == 3 and weights.last_error is None
    for n in names:
        np.testing.assert_array_equal(np.asarray(tree[n]), host3[n].astype(BF16))

"""The transfer benchmark's model trees: sizes as stated, and a plan that moves exactly the ideal
bytes (every inference shard once, in bf16), counted here independently of the plan."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from hcjax.bench.transfer import SIZES, build_trees, param_shapes
from hcjax.transfer import Cast, make_plan


def count(tree):
    return sum(
        int(np.prod(s))
        for s, _ in jax.tree.leaves(
            tree, is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[1], str)
        )
    )


def test_sizes_are_as_stated():
    assert 1.0e6 < count(param_shapes(SIZES["tiny"])) < 1.5e6
    assert 1.9e8 < count(param_shapes(SIZES["mid"])) < 2.2e8


def test_tiny_plan_moves_the_ideal_bytes():
    devices = np.array(jax.devices())
    learner = Mesh(devices[:4].reshape(2, 2), ("fsdp", "tensor"))
    inference = Mesh(devices[4:], ("tensor",))
    source, destination = build_trees(SIZES["tiny"], learner, inference)
    plan = make_plan(source, destination, {"*": Cast(jnp.bfloat16)})
    expected = 0
    for src, dst in zip(jax.tree.leaves(source), jax.tree.leaves(destination), strict=True):
        copies = 4 if dst.is_fully_replicated else 1  # replicated leaves go to every device
        expected += int(np.prod(src.shape)) * 2 * copies
    assert plan.bytes_moved == plan.ideal_bytes == expected
    assert all(e.wire_dtype == "bfloat16" for e in plan.entries)

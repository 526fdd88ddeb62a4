"""Replica expansion (groups feeding disjoint replicas, replicas joining and leaving) and atomic
weight versions with a failure injected half-way through a transfer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hcjax.transfer import (
    Cast,
    PlanError,
    TransferFailed,
    VersionedWeights,
    assign_replicas,
    data_parallel_groups,
    expand_plan,
    make_plan,
)

DEVICES = np.array(jax.devices())
BF16 = jnp.bfloat16
# Learner: data=2 x fsdp=2 on devices 0-3; inference replicas: tensor=2 on pairs of 4-7.
LEARNER = Mesh(DEVICES[:4].reshape(2, 2), ("data", "fsdp"))
SPECS = {"embed": P("fsdp", None), "w": P(None, "fsdp"), "norm": P()}
DST_SPECS = {"embed": P(None, "tensor"), "w": P("tensor", None), "norm": P()}
SHAPES = {"embed": (8, 6), "w": (4, 8), "norm": (6,)}


def host_params(seed):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def learner_params(host):
    """Full learner arrays: sharded over fsdp, replicated over the data axis."""
    return {k: jax.device_put(v, NamedSharding(LEARNER, SPECS[k])) for k, v in host.items()}


def replica_mesh(ids):
    return Mesh(DEVICES[list(ids)], ("tensor",))


@pytest.fixture(scope="module")
def plan():
    groups = data_parallel_groups(LEARNER)
    template = replica_mesh([4, 5])
    source = {
        k: jax.ShapeDtypeStruct(s, np.float32, sharding=NamedSharding(groups[0], SPECS[k]))
        for k, s in SHAPES.items()
    }
    dst = {k: NamedSharding(template, DST_SPECS[k]) for k in SHAPES}
    return make_plan(source, dst, {"*": Cast(BF16)})


def check_replica(tree, host, mesh):
    for k, v in host.items():
        out = tree[k]
        assert out.sharding.is_equivalent_to(NamedSharding(mesh, DST_SPECS[k]), out.ndim)
        ref = jax.device_put(v.astype(BF16), NamedSharding(mesh, DST_SPECS[k]))
        for got, want in zip(out.addressable_shards, ref.addressable_shards, strict=True):
            assert got.device == want.device and got.index == want.index
            np.testing.assert_array_equal(np.asarray(got.data), np.asarray(want.data))


def test_assignment_is_balanced_contiguous_and_disjoint():
    fleet = assign_replicas([f"s{i:02d}" for i in range(36)], 4)
    for g in range(4):  # e.g. a 36-server fleet as 4 groups of 9
        assert [r for r, a in fleet.items() if a == g] == [
            f"s{i:02d}" for i in range(9 * g, 9 * g + 9)
        ]
    assert assign_replicas(["a", "b"], 4) == {"a": 0, "b": 2}  # fewer replicas than groups
    with pytest.raises(ValueError, match="num_groups=0"):
        assign_replicas(["a"], 0)


def test_groups_feed_disjoint_replicas_and_joins_leaves_only_change_expansion(plan):
    groups = data_parallel_groups(LEARNER)
    assert [sorted(d.id for d in g.devices.flat) for g in groups] == [[0, 1], [2, 3]]
    host = host_params(0)
    params = learner_params(host)
    entries_before = plan.entries

    one = expand_plan(plan, groups, {"r0": replica_mesh([4, 5])})
    out = one.execute(params)
    check_replica(out["r0"], host, replica_mesh([4, 5]))

    both = one.with_replicas({"r0": replica_mesh([4, 5]), "r1": replica_mesh([6, 7])})
    assert both.plan is plan and plan.entries is entries_before  # no re-planning
    assert both.assignment == {"r0": 0, "r1": 1}
    for replica, group in both.assignment.items():
        group_devices = {d.id for d in groups[group].devices.flat}
        replica_devices = {d.id for d in both.replicas[replica].devices.flat}
        entries = both.entries_for(replica)
        assert {e.src_device for e in entries} <= group_devices
        assert {e.dst_device for e in entries} == replica_devices
    assert both.bytes_moved == 2 * plan.bytes_moved
    out = both.execute(params)
    check_replica(out["r0"], host, replica_mesh([4, 5]))
    check_replica(out["r1"], host, replica_mesh([6, 7]))
    assert "group 1 feeds ['r1']" in str(both)

    # r0 leaves, r2 joins on r0's old devices: only the expansion changes.
    later = both.with_replicas({"r1": replica_mesh([6, 7]), "r2": replica_mesh([5, 4])})
    assert later.assignment == {"r1": 0, "r2": 1}
    host2 = host_params(1)
    out = later.execute(learner_params(host2))
    check_replica(out["r1"], host2, replica_mesh([6, 7]))
    check_replica(out["r2"], host2, replica_mesh([5, 4]))


def test_one_device_replicas_two_per_group():
    groups = data_parallel_groups(LEARNER)
    source = {
        k: jax.ShapeDtypeStruct(s, np.float32, sharding=NamedSharding(groups[0], SPECS[k]))
        for k, s in SHAPES.items()
    }
    single = Mesh(DEVICES[[4]], ("tensor",))
    small = make_plan(source, {k: NamedSharding(single, DST_SPECS[k]) for k in SHAPES})
    replicas = {f"r{i}": Mesh(DEVICES[[4 + i]], ("tensor",)) for i in range(4)}
    expanded = expand_plan(small, groups, replicas)
    assert expanded.assignment == {"r0": 0, "r1": 0, "r2": 1, "r3": 1}
    host = host_params(2)
    out = expanded.execute(learner_params(host))
    for r, m in replicas.items():
        for k, v in host.items():
            assert out[r][k].devices() == set(m.devices.flat)
            np.testing.assert_array_equal(np.asarray(out[r][k]), v)


def test_expansion_errors_name_the_problem(plan):
    groups = data_parallel_groups(LEARNER)
    with pytest.raises(ValueError, match="shares device 5"):
        expand_plan(plan, groups, {"a": replica_mesh([4, 5]), "b": replica_mesh([5, 6])})
    with pytest.raises(ValueError, match="replica 'a' mesh"):
        expand_plan(plan, groups, {"a": replica_mesh([4, 5, 6, 7])})
    with pytest.raises(ValueError, match="axis='pipeline' is not an axis"):
        data_parallel_groups(LEARNER, "pipeline")
    # Learner params sharded over `data` are not replicas: the remapped entries would be wrong.
    expanded = expand_plan(plan, groups, {"a": replica_mesh([4, 5])})
    bad = {k: jax.device_put(v, NamedSharding(LEARNER, P())) for k, v in host_params(0).items()}
    bad["embed"] = jax.device_put(
        host_params(0)["embed"], NamedSharding(LEARNER, P(("data", "fsdp")))
    )
    with pytest.raises(PlanError, match="embed: group 0 device 0 holds"):
        expanded.execute(bad)


# ---------------------------------------------------------------------------------------------
# Atomic versions.


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
    plan = make_plan(params1, dst, {"*": Cast(BF16)})
    weights = VersionedWeights()
    weights.update(lambda: plan.execute(params1, max_bytes_in_flight=1024), version=1)
    served = weights.current()[1]

    # Version 2: the third leaf's buffer is gone (donated by the learner's next step) while the
    # transfer runs, after the first leaves were copied.
    host2, params2 = params(2)
    params2["layer2"].delete()
    with pytest.raises(TransferFailed, match="version 2 failed.*layer2.*still serving version 1"):
        weights.update(lambda: plan.execute(params2, max_bytes_in_flight=1024), version=2)
    assert weights.version == 1 and weights.current()[1] is served
    assert isinstance(weights.last_error, TransferFailed) and weights.last_error.serving == 1
    for n in names:  # the served buffers are intact and still usable
        np.testing.assert_array_equal(np.asarray(served[n]), host1[n].astype(BF16))
        assert float(jnp.sum(served[n].astype(jnp.float32))) == pytest.approx(
            float(host1[n].astype(BF16).astype(np.float32).sum()), rel=1e-6
        )

    # The next good version goes through and replaces it in one step.
    host3, params3 = params(3)
    weights.update(lambda: plan.execute(params3), version=3)
    version, tree = weights.current()
    assert version == 3 and weights.last_error is None
    for n in names:
        np.testing.assert_array_equal(np.asarray(tree[n]), host3[n].astype(BF16))

"""Transfer plans on 8 fake CPU devices: random reshards against jax.device_put, casts on the
narrow side, byte counts against the ideal, and validation errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hcjax.transfer import Cast, LocalTransfer, PlanError, TransferError, make_plan

DEVICES = np.array(jax.devices())
BF16 = jnp.bfloat16


def mesh(ids, shape, names):
    return Mesh(DEVICES[list(ids)].reshape(shape), names)


LEARNER = mesh(range(4), (2, 2), ("fsdp", "tensor"))
INFERENCE = mesh(range(4, 8), (4,), ("tensor",))


def put(x, m, spec):
    return jax.device_put(x, NamedSharding(m, spec))


def assert_same_as_device_put(out, expected_host, sharding):
    """Exactly what jax.device_put of the transformed array gives, shard by shard."""
    ref = jax.device_put(expected_host, sharding)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert out.sharding.is_equivalent_to(sharding, out.ndim)
    ref_shards = {s.device: s for s in ref.addressable_shards}
    assert len(out.addressable_shards) == len(ref_shards)
    for shard in out.addressable_shards:
        expected = ref_shards[shard.device]
        assert shard.index == expected.index
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(expected.data))


# ---------------------------------------------------------------------------------------------
# Property test: random meshes, specs, dtypes and casts.

MESH_SHAPES = {1: [(1,)], 2: [(2,), (1, 2), (2, 1)], 4: [(4,), (2, 2), (1, 4)]}


@st.composite
def reshard_case(draw):
    perm_devices = draw(st.permutations(range(8)))
    same = draw(st.booleans())
    n_src = draw(st.sampled_from([1, 2, 4]))
    n_dst = n_src if same else draw(st.sampled_from([1, 2, 4]))
    src_ids = perm_devices[:n_src]
    dst_ids = draw(st.permutations(src_ids)) if same else perm_devices[4 : 4 + n_dst]
    src_shape = draw(st.sampled_from(MESH_SHAPES[n_src]))
    dst_shape = draw(st.sampled_from(MESH_SHAPES[n_dst]))
    src_mesh = mesh(src_ids, src_shape, ("a", "b")[: len(src_shape)])
    dst_mesh = mesh(dst_ids, dst_shape, ("x", "y")[: len(dst_shape)])
    ndim = draw(st.integers(1, 3))

    def spec(m):
        axes = list(m.axis_names) + [None] * ndim
        chosen = draw(st.permutations(axes))[:ndim]
        return P(*chosen)

    src_spec = spec(src_mesh)
    dst_spec = spec(dst_mesh)
    # Each dim must divide by its source mesh axis and by its destination mesh axis.
    shape = []
    for i in range(ndim):
        a, b = src_spec[i], dst_spec[i]
        div_a = src_mesh.shape[a] if a else 1
        div_b = dst_mesh.shape[b] if b else 1
        shape.append(math.lcm(div_a, div_b) * draw(st.integers(1, 3)))
    src_dtype = draw(st.sampled_from([np.float32, np.int32, BF16]))
    cast = draw(st.sampled_from([None, np.float32, BF16, np.int8]))
    return src_mesh, src_spec, dst_mesh, dst_spec, tuple(shape), src_dtype, cast, same


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=reshard_case(), seed=st.integers(0, 2**16))
def test_random_reshard_equals_device_put(case, seed):
    src_mesh, src_spec, dst_mesh, dst_spec, shape, src_dtype, cast, same = case
    rng = np.random.default_rng(seed)
    # Within int8 range: out-of-range float->int casts differ between numpy and XLA.
    host = np.clip(rng.standard_normal(shape) * 40, -120, 120).astype(src_dtype)
    source = {"w": put(host, src_mesh, src_spec)}
    dst_sharding = NamedSharding(dst_mesh, dst_spec)
    plan = make_plan(source, {"w": dst_sharding}, {"w": Cast(cast)} if cast else None)

    expected = host.astype(cast) if cast else host
    transfer = LocalTransfer(plan)
    out = transfer(source)["w"]
    assert_same_as_device_put(out, expected, dst_sharding)

    # Ideal bytes: every destination shard once, in the narrower of the two dtypes.
    wire = min(np.dtype(src_dtype).itemsize, np.dtype(cast or src_dtype).itemsize)
    shard_elements = math.prod(dst_sharding.shard_shape(expected.shape))
    ideal = len(dst_sharding.device_set) * shard_elements * wire
    assert plan.bytes_moved == plan.ideal_bytes == ideal
    assert plan.bytes_across_devices <= plan.bytes_moved
    if (
        same
        and src_spec == dst_spec
        and src_mesh.devices.shape == dst_mesh.devices.shape
    ):
        if (src_mesh.devices == dst_mesh.devices).all():
            assert plan.bytes_across_devices == 0  # every shard is already where it is needed

    # Executed twice, the executor gives fresh, equal buffers (compiled once, run many times).
    again = transfer(source)["w"]
    np.testing.assert_array_equal(np.asarray(again), np.asarray(out))


# ---------------------------------------------------------------------------------------------
# Casts, against numpy.


def arange(shape, dtype=np.float32):
    return np.arange(math.prod(shape), dtype=dtype).reshape(shape)


def test_cast_runs_on_the_narrow_side():
    x = arange((8, 12))
    source = {
        "down": put(x, LEARNER, P("fsdp", "tensor")),
        "up": put(x.astype(BF16), LEARNER, P("fsdp")),
    }
    dst = {
        "down": NamedSharding(INFERENCE, P(None, "tensor")),
        "up": NamedSharding(INFERENCE, P("tensor")),
    }
    plan = make_plan(source, dst, {"down": Cast(BF16), "up": Cast(np.float32)})
    by_leaf = {e.dst_leaf: e for e in plan.entries}
    assert (
        by_leaf["down"].wire_dtype == "bfloat16"
        and by_leaf["down"].transform == "cast(bfloat16)@src"
    )
    assert by_leaf["up"].wire_dtype == "bfloat16" and by_leaf["up"].transform == "cast(float32)@dst"
    out = LocalTransfer(plan)(source)
    assert_same_as_device_put(out["down"], x.astype(BF16), dst["down"])
    assert_same_as_device_put(out["up"], x.astype(BF16).astype(np.float32), dst["up"])
    assert plan.bytes_moved == 2 * x.size * 2  # both travel as bf16


# ---------------------------------------------------------------------------------------------
# Replicated sources, locality and byte accounting.


def test_replicated_source_is_read_once_per_destination_element():
    x = arange((8, 8))
    source = {"w": put(x, LEARNER, P())}  # 4 replicas
    dst = {"w": NamedSharding(INFERENCE, P("tensor"))}
    plan = make_plan(source, dst)
    assert plan.bytes_moved == x.nbytes  # not 4x
    assert sorted(e.src_device for e in plan.entries) == [0, 1, 2, 3]  # spread over replicas
    assert_same_as_device_put(LocalTransfer(plan)(source)["w"], x, dst["w"])


def test_same_devices_prefers_the_local_replica():
    x = arange((8, 8))
    source = {"w": put(x, LEARNER, P())}
    same = mesh(range(4), (4,), ("tensor",))
    dst = {"w": NamedSharding(same, P("tensor"))}
    plan = make_plan(source, dst)
    assert plan.bytes_across_devices == 0 and plan.bytes_moved == x.nbytes
    assert_same_as_device_put(LocalTransfer(plan)(source)["w"], x, dst["w"])


def test_replicated_destination_gets_every_copy():
    x = arange((4, 8))
    source = {"w": put(x, LEARNER, P("fsdp", "tensor"))}
    dst = {"w": NamedSharding(INFERENCE, P())}
    plan = make_plan(source, dst)
    assert plan.bytes_moved == 4 * x.nbytes  # one full copy per inference device
    assert_same_as_device_put(LocalTransfer(plan)(source)["w"], x, dst["w"])


def test_plan_from_shape_dtype_structs_and_bounded_in_flight():
    xs = {f"w{i}": arange((8, 16)) * (i + 1) for i in range(6)}
    specs = {
        k: jax.ShapeDtypeStruct(
            v.shape, v.dtype, sharding=NamedSharding(LEARNER, P("fsdp", "tensor"))
        )
        for k, v in xs.items()
    }
    dst = {k: NamedSharding(INFERENCE, P(None, "tensor")) for k in xs}
    plan = make_plan(specs, dst)
    source = {k: put(v, LEARNER, P("fsdp", "tensor")) for k, v in xs.items()}
    shard_bytes = 8 * 4 * 4  # one destination shard
    result = LocalTransfer(plan, max_bytes_in_flight=2 * shard_bytes).run(source)
    assert result.peak_bytes_in_flight <= 2 * shard_bytes
    assert result.bytes_moved == plan.bytes_moved == sum(v.nbytes for v in xs.values())
    out = plan.unflatten(result.leaves)
    for k, v in xs.items():
        assert_same_as_device_put(out[k], v, dst[k])


# ---------------------------------------------------------------------------------------------
# Printing and validation errors.


def test_print_and_entries_are_plain_data():
    source = {"a": put(arange((8, 4)), LEARNER, P("fsdp"))}
    plan = make_plan(source, {"a": NamedSharding(INFERENCE, P("tensor"))}, {"a": Cast(BF16)})
    text = str(plan)
    assert text.startswith("TransferPlan: 1 source -> 1 destination leaves, 4 entries")
    assert "a: float32[8, 4] -> bfloat16[8, 4] [cast(bfloat16)@src]" in text
    entry = plan.entries[0]
    assert (entry.src_leaf, entry.dst_leaf, entry.transform) == ("a", "a", "cast(bfloat16)@src")
    assert entry.src_process == entry.dst_process == 0
    # Source shards hold 4 rows, destination shards 2: device 0's first half goes to device 4.
    assert entry.src_index == entry.dst_index == (slice(0, 2), slice(0, 4))
    assert (entry.src_device, entry.dst_device, entry.nbytes) == (0, 4, 2 * 4 * 2)
    expected = "a[0:2, 0:4] dev0(p0) -> a[0:2, 0:4] dev4(p0) [cast(bfloat16)@src] 16 B bfloat16"
    assert str(entry) == expected


def test_missing_extra_and_mismatched_leaves_are_all_listed():
    source = {
        "a": put(arange((8, 4)), LEARNER, P()),
        "b": put(arange((4,)), LEARNER, P()),
        "c": put(arange((4,)), LEARNER, P()),
    }
    sharding = NamedSharding(INFERENCE, P())
    dst = {
        "a": jax.ShapeDtypeStruct((4, 8), np.float32, sharding=sharding),
        "c": sharding,
        "zzz": sharding,
    }
    with pytest.raises(PlanError) as info:
        make_plan(source, dst)
    message = str(info.value)
    assert "missing destination leaves" in message and "['b']" in message
    assert "extra destination leaves" in message and "['zzz']" in message
    assert "'a': expected float32[4, 8], the transformed source gives float32[8, 4]" in message
    assert len(info.value.problems) == 3


def test_bad_transform_arguments_name_the_value():
    source = {"a": put(arange((8, 4)), LEARNER, P())}
    dst = {"a": NamedSharding(INFERENCE, P())}
    with pytest.raises(PlanError, match="pattern 'nope/\\*' matched no source leaf"):
        make_plan(source, dst, {"nope/*": Cast(BF16)})
    with pytest.raises(PlanError, match="sharding does not fit shape"):
        make_plan(
            {"a": put(arange((6, 4)), LEARNER, P())}, {"a": NamedSharding(INFERENCE, P("tensor"))}
        )


def test_validate_catches_missing_and_duplicate_entries():
    import dataclasses

    source = {"a": put(arange((8, 4)), LEARNER, P("fsdp"))}
    plan = make_plan(source, {"a": NamedSharding(INFERENCE, P("tensor"))})
    plan.validate()
    dropped = dataclasses.replace(plan, entries=plan.entries[1:])
    with pytest.raises(PlanError, match="entries cover 0 of 8 elements"):
        dropped.validate()
    doubled = dataclasses.replace(plan, entries=plan.entries + plan.entries[:1])
    with pytest.raises(PlanError, match="overlap"):
        doubled.validate()
    moved = dataclasses.replace(
        plan, entries=(dataclasses.replace(plan.entries[0], src_device=3),) + plan.entries[1:]
    )
    with pytest.raises(PlanError, match="outside shard"):
        moved.validate()


def test_executor_rejects_a_source_of_another_structure():
    source = {"a": put(arange((8, 4)), LEARNER, P("fsdp"))}
    plan = make_plan(source, {"a": NamedSharding(INFERENCE, P("tensor"))})
    with pytest.raises(PlanError, match=r"lacks leaves \['a'\]"):
        LocalTransfer(plan)({"b": source["a"]})
    with pytest.raises(
        PlanError, match="is float32\\[4, 8\\], the plan was made for float32\\[8, 4\\]"
    ):
        LocalTransfer(plan)({"a": put(arange((4, 8)), LEARNER, P())})


def test_failure_names_the_entry():
    source = {
        "a": put(arange((8, 4)), LEARNER, P("fsdp")),
        "b": put(arange((8, 4)), LEARNER, P("fsdp")),
    }
    plan = make_plan(source, {k: NamedSharding(INFERENCE, P("tensor")) for k in source})
    source["b"].delete()
    with pytest.raises(
        TransferError, match=r"transfer failed at entry b\[0:2, 0:4\] dev0.*deleted"
    ):
        LocalTransfer(plan)(source)


def test_chain_errors_are_listed():
    xs = {
        "l": [put(arange((4,)), LEARNER, P()) for _ in range(2)],
        "m": put(arange((4,)), LEARNER, P()),
    }
    sharding = NamedSharding(INFERENCE, P())
    dst = {"l": [sharding, sharding], "m": sharding}
    with pytest.raises(PlanError, match="transform 'bf16' for pattern 'm' is not one of") as info:
        make_plan(xs, dst, {"m": "bf16", "l/*": [Cast(BF16), "f32"]})
    bad = [p for p in info.value.problems if "is not one of ['Cast']" in p]
    assert [p.split(":")[0] for p in bad] == ["l/0", "l/1", "m"]  # every leaf's bad chain
    plan = make_plan(xs, dst, {"l/*": [Cast(BF16), Cast(np.float32)]})  # a chain of casts
    assert {e.transform for e in plan.entries if e.dst_leaf.startswith("l/")} == {
        "cast(bfloat16)@src | cast(float32)@dst"}


def test_process_of_prefers_a_replica_in_the_destination_process():
    # Two "hosts": devices 0-1 and 4-5 on process 0, devices 2-3 and 6-7 on process 1.
    process = {d: (d // 2) % 2 for d in range(8)}
    source = {"w": put(arange((8, 8)), mesh(range(4), (2, 2), ("data", "fsdp")), P(None, "fsdp"))}
    dst = {"w": NamedSharding(INFERENCE, P("tensor", None))}
    plan = make_plan(source, dst, process_of=lambda d: process[d.id])
    for e in plan.entries:
        assert (e.src_process, e.dst_process) == (process[e.src_device], process[e.dst_device])
    assert plan.bytes_across_processes == 0  # every column block has a replica on each host
    relabelled = plan.with_processes(source=0, destination=1)
    assert relabelled.bytes_across_processes == relabelled.bytes_moved == plan.bytes_moved
    assert_same_as_device_put(LocalTransfer(plan)(source)["w"], arange((8, 8)), dst["w"])

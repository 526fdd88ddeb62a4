"""The in-process executor's batched path: small pieces packed into a few device copies give the
same bits as moving every piece alone and as the plan's host reference, for mixed sizes, dtypes,
shardings and casts; bytes in flight stay under the bound; schedules are reused."""

import copy
import dataclasses
import math
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hcjax.transfer import Cast, LocalTransfer, TransferError, make_plan
from hcjax.transfer.local import PIECES_PER_BUFFER

DEVICES = np.array(jax.devices())
LEARNER = Mesh(DEVICES[:4].reshape(2, 2), ("fsdp", "tensor"))
INFERENCE = Mesh(DEVICES[4:8], ("tensor",))
BF16 = jnp.bfloat16


def put(x, spec, mesh=LEARNER):
    return jax.device_put(x, NamedSharding(mesh, spec))


def host(shape, dtype, seed):
    values = np.random.default_rng(seed).standard_normal(shape) * 40
    return np.clip(values, -120, 120).astype(dtype)


def mixed_case():
    """Leaves of several sizes, dtypes and layouts, with narrowing and widening casts (a tiny
    replicated scalar up to a leaf of several hundred KiB)."""
    xs = {
        "embed": host((256, 64), np.float32, 0),
        "q": host((64, 96), np.float32, 1),
        "o": host((32, 64), np.float32, 2),
        "norm": host((64,), np.float32, 3),
        "scale": host((), np.float32, 4),
        "ids": host((16, 8), np.int32, 5),
        "small": host((8, 4), np.int8, 6),
        "big": host((512, 256), BF16, 7),
        "qkv": host((64, 48), np.float32, 8),
        **{f"layer{i}": host((8, 16), np.float32, 9 + i) for i in range(3)},
    }
    specs = {
        "embed": P("tensor", "fsdp"),
        "q": P("fsdp", "tensor"),
        "o": P("tensor", "fsdp"),
        "norm": P(),
        "scale": P(),
        "ids": P("fsdp"),
        "small": P(None, "tensor"),
        "big": P("fsdp", "tensor"),
        "qkv": P("fsdp", None),
        **{f"layer{i}": P("fsdp", "tensor") for i in range(3)},
    }
    source = jax.tree.map(put, xs, specs)
    dst = {
        "embed": NamedSharding(INFERENCE, P("tensor", None)),
        "q": NamedSharding(INFERENCE, P(None, "tensor")),
        "o": NamedSharding(INFERENCE, P(None, "tensor")),
        "norm": NamedSharding(INFERENCE, P()),
        "scale": NamedSharding(INFERENCE, P()),
        "ids": NamedSharding(INFERENCE, P(None, "tensor")),
        "small": NamedSharding(INFERENCE, P("tensor")),
        "big": NamedSharding(INFERENCE, P(None, "tensor")),
        "qkv": NamedSharding(INFERENCE, P("tensor", None)),
        **{f"layer{i}": NamedSharding(INFERENCE, P(None, "tensor")) for i in range(3)},
    }
    rules = {
        "o": Cast(BF16),
        "qkv": [Cast(BF16), Cast(np.float32)],  # narrowed on the sender, widened back
        "layer*": Cast(BF16),
        "ids": Cast(np.int8),
        "small": Cast(np.float32),  # widened on the receiver
        "big": Cast(np.float32),
        "embed": Cast(BF16),
        "q": Cast(BF16),
    }
    return source, dst, make_plan(source, dst, rules)


def assert_bit_identical(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    for x, y in zip(a.addressable_shards, b.addressable_shards, strict=True):
        assert x.device == y.device and x.index == y.index
        np.testing.assert_array_equal(
            np.asarray(x.data).reshape(-1).view(np.uint8),
            np.asarray(y.data).reshape(-1).view(np.uint8),
        )


def packed_buffers(entries):
    groups = Counter((e.src_device, e.dst_device, e.wire_dtype) for e in entries)
    return sum(math.ceil(n / PIECES_PER_BUFFER) for n in groups.values())


def test_batched_equals_piece_by_piece_and_the_host_reference():
    source, dst, plan = mixed_case()
    batched = LocalTransfer(plan).run(source)
    alone = LocalTransfer(plan, pack_below=0).run(source)  # every piece alone
    reference = plan.reference(source)
    assert batched.bytes_moved == alone.bytes_moved == plan.bytes_moved == plan.ideal_bytes
    for path, out in batched.leaves.items():
        assert_bit_identical(out, alone.leaves[path])
        expected = jax.device_put(reference[path], dst[path])
        assert_bit_identical(out, expected)
    # The pieces travel in a few buffers per (source, destination device, wire dtype) when
    # everything is packed, against one per entry when nothing is.
    assert batched.copies == packed_buffers(plan.entries) < len(plan.entries) == alone.copies


def test_large_pieces_travel_alone_and_small_ones_are_packed():
    source, dst, plan = mixed_case()
    big = [e for e in plan.entries if e.nbytes >= 32 << 10]
    assert big and len(big) < len(plan.entries)
    mixed = LocalTransfer(plan, pack_below=32 << 10).run(source)
    packed = LocalTransfer(plan).run(source)
    small = [e for e in plan.entries if e.nbytes < 32 << 10]
    assert mixed.copies == len(big) + packed_buffers(small)
    for path, out in mixed.leaves.items():
        assert_bit_identical(out, packed.leaves[path])


@pytest.mark.parametrize("pack_below", [0, 1 << 20])
def test_bytes_in_flight_stay_under_the_bound(pack_below):
    xs = {f"w{i}": host((16, 8 * (i + 1)), np.float32, i) for i in range(8)}
    source = {k: put(v, P("fsdp", "tensor")) for k, v in xs.items()}
    dst = {k: NamedSharding(INFERENCE, P(None, "tensor")) for k in xs}
    plan = make_plan(source, dst)
    shard_bytes = {k: v.nbytes // 4 for k, v in xs.items()}
    bound = 3 * max(shard_bytes.values())
    transfer = LocalTransfer(plan, max_bytes_in_flight=bound, pack_below=pack_below)
    result = transfer.run(source)
    assert result.bytes_moved == plan.bytes_moved
    assert max(shard_bytes.values()) <= result.peak_bytes_in_flight <= bound
    schedule, = transfer.schedules.values()
    assert len(schedule.chunks) > 2  # the tree did not fit one chunk
    assert all(c.nbytes <= bound // 2 for c in schedule.chunks)
    for k, v in xs.items():
        assert_bit_identical(result.leaves[k], jax.device_put(v, dst[k]))


def test_a_shard_larger_than_the_bound_moves_alone():
    xs = {"small": host((8, 8), np.float32, 0), "huge": host((64, 64), np.float32, 1)}
    source = {k: put(v, P("fsdp", "tensor")) for k, v in xs.items()}
    dst = {k: NamedSharding(INFERENCE, P(None, "tensor")) for k in xs}
    plan = make_plan(source, dst)
    huge_shard = xs["huge"].nbytes // 4
    result = LocalTransfer(plan, max_bytes_in_flight=huge_shard // 2).run(source)
    assert result.peak_bytes_in_flight == huge_shard  # alone: nothing else was in flight
    for k, v in xs.items():
        assert_bit_identical(result.leaves[k], jax.device_put(v, dst[k]))


def test_schedule_is_made_once_and_every_execution_gives_fresh_buffers():
    source, _, plan = mixed_case()
    before = copy.deepcopy(plan)
    transfer = LocalTransfer(plan)
    first = transfer(source)
    assert len(transfer.schedules) == 1
    second = transfer(source)
    assert len(transfer.schedules) == 1  # reused, not rebuilt
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        assert_bit_identical(a, b)
        for x, y in zip(a.addressable_shards, b.addressable_shards, strict=True):
            assert x.data.unsafe_buffer_pointer() != y.data.unsafe_buffer_pointer()
    # Another bound is another executor with its own schedule; the plan stays data, unchanged
    # by executing it (no compiled state is kept on it).
    other = LocalTransfer(plan, max_bytes_in_flight=4096)
    other(source)
    assert len(other.schedules) == 1 and len(transfer.schedules) == 1
    assert plan == before
    assert {f.name for f in dataclasses.fields(plan)} == {
        "entries", "routes", "src_leaves", "dst_leaves", "dst_paths", "dst_treedef"}


@pytest.mark.parametrize("pack_below", [0, 1 << 20])
def test_failure_names_the_entry_on_both_paths(pack_below):
    source = {
        "a": put(host((8, 4), np.float32, 0), P("fsdp")),
        "b": put(host((8, 4), np.float32, 1), P("fsdp")),
    }
    plan = make_plan(source, {k: NamedSharding(INFERENCE, P("tensor")) for k in source})
    source["b"].delete()
    with pytest.raises(TransferError, match=r"transfer failed at entry b\[0:2, 0:4\] dev0.*delet"):
        LocalTransfer(plan, pack_below=pack_below).run(source)


def test_copies_grow_with_buffers_not_with_entries():
    def copies(n):
        xs = {f"w{i}": host((8, 8), np.float32, i) for i in range(n)}
        source = {k: put(v, P("fsdp", "tensor")) for k, v in xs.items()}
        dst = {k: NamedSharding(INFERENCE, P(None, "tensor")) for k in xs}
        plan = make_plan(source, dst, {"*": Cast(BF16)})
        result = LocalTransfer(plan).run(source)
        for k, v in xs.items():
            assert_bit_identical(result.leaves[k], jax.device_put(v.astype(BF16), dst[k]))
        return result.copies, len(plan.entries)

    # Each source device feeds two destination devices, one piece of every leaf each.
    assert copies(2) == (8, 16)
    assert copies(24) == (8 * math.ceil(24 / PIECES_PER_BUFFER), 192)

"""hcjax.planner.hlo reads compiled HLO text: collectives and matmul FLOPs per device per step,
loop bodies counted their trip count of times (hand-written HLO, a CPU compile, and a TPU
compile where libtpu is installed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hcjax.planner import hlo
from hcjax.planner.tpu import tpu_devices


def test_collectives_parser_counts_loop_trips():
    text = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %g = f32[32]{0} all-gather(%x), dimensions={0}
  ROOT %t = (s32[], f32[8]) tuple(%x, %x)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %r = f32[8]{0} all-reduce(%a), to_apply=%add
  %w = (s32[], f32[8]) while(%a), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %s = f32[4]{0} reduce-scatter(%a), dimensions={0}
}
"""
    out = hlo.collectives(text)
    assert out["all-gather"] == {"count": 3, "bytes": 3 * 32 * 4}
    assert out["all-reduce"] == {"count": 1, "bytes": 32}
    assert out["reduce-scatter"] == {"count": 1, "bytes": 32}  # the operand, the larger side


def test_loops_that_step_by_two_count_half_their_bound():
    """TPU's windowed einsums (collective matmuls over the FSDP axis) loop `i = 0, 2, .. < 4`,
    taking a block from each neighbour per step: 2 trips, not 4 (the bound alone said 4, which
    doubled those matmuls' FLOPs and collective-permutes in the plan). The step and the start
    are read through the copies TPU inserts; a loop counting by 1 from 1 runs bound - 1 times."""
    text = """HloModule m

%cond (p: (u32[], f32[8])) -> pred[] {
  %p = (u32[], f32[8]) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %n = u32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (u32[], f32[8])) -> (u32[], f32[8]) {
  %p = (u32[], f32[8]) parameter(0)
  %two = u32[] constant(2)
  %i = u32[] get-tuple-element(%p), index=0
  %c = u32[] copy(%i)
  %next = u32[] add(%c, %two)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %g = f32[8]{0} collective-permute(%x), source_target_pairs={{0,1},{1,0}}
  ROOT %t = (u32[], f32[8]) tuple(%next, %g)
}

%cond1 (p: (u32[], f32[8])) -> pred[] {
  %p = (u32[], f32[8]) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %n = u32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body1 (p: (u32[], f32[8])) -> (u32[], f32[8]) {
  %p = (u32[], f32[8]) parameter(0)
  %one = u32[] constant(1)
  %i = u32[] get-tuple-element(%p), index=0
  %next = u32[] add(%i, %one)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %g = f32[32]{0} all-gather(%x), dimensions={0}
  ROOT %t = (u32[], f32[8]) tuple(%next, %x)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %zero = u32[] constant(0)
  %z = u32[] copy(%zero)
  %s = (u32[], f32[8]) tuple(%z, %a)
  %w = (u32[], f32[8]) while(%s), condition=%cond, body=%body
  %start = u32[] constant(1)
  %s1 = (u32[], f32[8]) tuple(%start, %a)
  %w1 = (u32[], f32[8]) while(%s1), condition=%cond1, body=%body1
  ROOT %r = f32[8]{0} get-tuple-element(%w), index=1
}
"""
    out = hlo.collectives(text)
    assert out["collective-permute"] == {"count": 2, "bytes": 2 * 32}
    assert out["all-gather"] == {"count": 4, "bytes": 4 * 128}


def test_hlo_costs_count_loop_bodies_their_trip_count():
    """XLA's cost analysis visits a scan body once; the plan's own count multiplies it out."""

    def f(x, w):
        return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]

    x, w = jnp.ones((128, 256)), jnp.ones((10, 256, 256))
    compiled = jax.jit(f).lower(x, w).compile()
    costs = hlo.hlo_costs(compiled.as_text())
    assert costs["flops"] == 10 * 2 * 128 * 256 * 256
    assert compiled.cost_analysis()["flops"] < costs["flops"] / 5  # what the plan corrects
    # Each step reads its layer of w (not all of it), x, and writes x: about 10 x 0.5 MB.
    assert 10 * 256 * 256 * 4 <= costs["bytes"] <= 10 * (256 * 256 * 4 + 4 * 128 * 256 * 4) * 2


def test_hlo_costs_count_tpu_dots_written_as_convolutions():
    """TPU writes batched dots and weight gradients as convolutions (windows over a head axis
    with padding, or spanning the contracted tokens); each counts its real multiply-adds."""
    try:
        devices = tpu_devices("v5p:2x2x1")[0]
    except ValueError as e:  # no libtpu on this platform
        pytest.skip(f"libtpu cannot build a TPU topology here: {e}")
    mesh = Mesh(np.array(devices).reshape(4), ("fsdp",))
    b, t, d, h, k = 8, 256, 512, 4, 64

    def loss(x, w, o):
        q = jnp.einsum("btd,dhk->bthk", x, w)
        y = jnp.einsum("bthk,hkd->btd", q, o).astype(jnp.float32)
        return (y * y).sum()  # a cotangent that is not a constant: no backward dot simplifies

    batch = NamedSharding(mesh, PartitionSpec("fsdp"))
    whole = NamedSharding(mesh, PartitionSpec())
    args = (jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16, sharding=batch),
            jax.ShapeDtypeStruct((d, h, k), jnp.bfloat16, sharding=whole),
            jax.ShapeDtypeStruct((h, k, d), jnp.bfloat16, sharding=whole))
    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
    forward = 2 * 2 * (b // 4) * t * d * h * k  # two einsums, one device's quarter of the batch
    assert hlo.hlo_costs(text)["flops"] == pytest.approx(3 * forward, rel=0.02)

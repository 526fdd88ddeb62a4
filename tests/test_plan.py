"""`hcjax.plan` compiles the learner and decode steps for a small TPU topology (libtpu's
compile-only devices) from this CPU host, and reports fit, bytes over and clear errors."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from hcjax import config as hcfg
from hcjax import plan as plan_lib
from hcjax.model import ModelConfig
from hcjax.rl.learner import LearnerConfig
from hcjax.sharding import MeshConfig


def _libtpu_reason() -> str | None:
    try:
        plan_lib.tpu_devices("v5p:2x2x1")
    except Exception as e:  # no libtpu on this platform
        return f"libtpu cannot build a TPU topology here: {e}"
    return None


_REASON = _libtpu_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

SMALL = plan_lib.PlanConfig(topology="v5p:2x2x1", global_batch_tokens=2048, seq_len=256,
                            decode_batch=8, kv_len=256)


def _tiny() -> ModelConfig:
    hcfg.bind(["tiny_cpu.gin"], [])
    return ModelConfig()


def test_libtpu_leaves_the_test_backend_on_cpu():
    assert jax.default_backend() == "cpu"
    assert all(d.platform == "cpu" for d in jax.devices())


@pytest.mark.slow
def test_tiny_plan_compiles_both_steps_and_fits(tmp_path):
    result = plan_lib.main([
        "--gin_file", "tiny_cpu.gin", "--gin_param", "ModelConfig.num_layers = 2",
        "--gin_param", "MeshConfig.fsdp = 2",
        "--gin_param", "MeshConfig.tensor = 2", "--topology", "v5p:2x2x1",
        "--global_batch_tokens", "2048", "--seq_len", "256", "--decode_batch", "8",
        "--kv_len", "256", "--output_dir", str(tmp_path),
    ])
    assert result["chips"] == 4 and result["hbm_bytes_per_chip"] > 0
    for name in ("train_step", "decode_step"):
        step = result[name]
        assert step["compiled"] and step["fits"], name
        assert step["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2, "expert": 1} if name == "train_step" else {"data": 2, "fsdp": 1, "tensor": 2, "expert": 1}
        for key in ("arguments", "outputs", "temp", "total"):
            assert step["bytes_per_chip"][key] > 0, (name, key)
        for key in ("flops_per_chip", "model_flops", "collective_bytes_per_chip",
                    "estimated_step_s", "estimated_mfu", "bound_step_s", "mfu_upper_bound"):
            assert step[key] > 0, (name, key)
    assert result["decode_step"]["tokens_per_s_estimate"] > 0
    assert result["transfer"]["bytes"] > 0 and result["transfer"]["estimated_s"] > 0
    assert result["compile_seconds"] > 0
    for f in ("config.gin", "operative_config.gin", "summary.txt", "plan.json"):
        assert (tmp_path / f).is_file(), f


def test_oversized_batch_does_not_fit_and_says_by_how_much():
    # A v5e chip holds 15.75 GiB; the logits of 2048 tokens over a 4M-token vocabulary (34 GB)
    # do not fit. A huge vocabulary rather than a huge batch: libtpu gives up on it in seconds,
    # where 16M tokens of activations kept it searching for rematerialisations for minutes.
    model = dataclasses.replace(_tiny(), num_layers=2, vocab_size=1 << 22)
    pc = dataclasses.replace(SMALL, topology="v5e:2x2", seq_len=256, decode=False)
    # Whole-row logits (logprob_chunk=0): in slices the learner would not hold them at all.
    step = plan_lib.plan(pc, model, LearnerConfig(logprob_chunk=0))["train_step"]
    # Far over HBM libtpu may not finish the compile at all; the record then carries XLA's
    # out-of-memory figure instead of a full memory analysis.
    assert not step["fits"]
    hbm = int(plan_lib.CHIP_SPECS["v5e"].hbm_bytes)
    assert step["bytes_over"] == step["bytes_per_chip"]["total"] - hbm > 0
    if step["compiled"]:
        assert step["largest_buffers"] and step["largest_buffers"][0]["bytes"] > 0
    else:
        assert "RESOURCE_EXHAUSTED" in step["error"]


def test_roofline_bound_and_estimate_by_hand():
    """bound = max of the parts (perfect overlap); estimate = compute + HBM + the activation
    exchanges + the weight/gradient collectives beyond the compute time."""
    spec = plan_lib.ChipSpec(peak_bf16_flops=100.0, hbm_bytes=1e9, hbm_bytes_per_s=10.0,
                             ici_bytes_per_s=4.0)
    step = {"flops_per_chip": 200.0, "hbm_bytes_accessed_per_chip": 5.0,
            "collective_bytes_per_chip": 16.0,
            "collectives": {"ragged-all-to-all": {"count": 1, "bytes": 4.0},
                            "all-gather": {"count": 1, "bytes": 12.0}}}
    plan_lib.roofline(step, spec, devices=2, model_flops=300.0)
    # compute 2 s, HBM 0.5 s, collectives 4 s (1 s exchanges, 3 s overlappable: 1 s beyond compute)
    assert step["bound_step_s"] == 4.0 and step["bound_by"] == "collective"
    assert step["mfu_upper_bound"] == 300.0 / (2 * 100.0 * 4.0)
    assert step["exposed_collective_s"] == 1.0 + 1.0
    assert step["estimated_step_s"] == 2.0 + 0.5 + 2.0
    assert step["estimated_mfu"] == 300.0 / (2 * 100.0 * 4.5)


def test_unknown_topology_is_named():
    with pytest.raises(ValueError, match="v9z:2x2"):
        plan_lib.tpu_devices("v9z:2x2")
    with pytest.raises(ValueError, match="v5p:3x3x3x3"):
        plan_lib.tpu_devices("v5p:3x3x3x3")


def test_mesh_that_does_not_cover_the_chips_is_named():
    model = _tiny()
    pc = dataclasses.replace(SMALL, decode=False)
    with pytest.raises(ValueError, match=r"multiply to 2, not the 4 devices"):
        plan_lib.plan(pc, model, mesh_cfg=MeshConfig(fsdp=2))
    with pytest.raises(ValueError, match="do not divide"):
        plan_lib.plan(pc, model, mesh_cfg=MeshConfig(fsdp=-1, tensor=3))


def test_batch_that_does_not_divide_the_mesh_is_named():
    model = _tiny()
    pc = dataclasses.replace(SMALL, global_batch_tokens=256 * 2, decode=False)
    with pytest.raises(ValueError, match="2 rows"):
        plan_lib.plan(pc, model, mesh_cfg=MeshConfig(fsdp=4))


def test_collectives_parser_counts_loop_trips():
    hlo = """HloModule m

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
    out = plan_lib.collectives(hlo)
    assert out["all-gather"] == {"count": 3, "bytes": 3 * 32 * 4}
    assert out["all-reduce"] == {"count": 1, "bytes": 32}
    assert out["reduce-scatter"] == {"count": 1, "bytes": 32}  # the operand, the larger side


def test_loops_that_step_by_two_count_half_their_bound():
    """TPU's windowed einsums (collective matmuls over the FSDP axis) loop `i = 0, 2, .. < 4`,
    taking a block from each neighbour per step: 2 trips, not 4 (the bound alone said 4, which
    doubled those matmuls' FLOPs and collective-permutes in the plan). The step and the start
    are read through the copies TPU inserts; a loop counting by 1 from 1 runs bound - 1 times."""
    hlo = """HloModule m

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
    out = plan_lib.collectives(hlo)
    assert out["collective-permute"] == {"count": 2, "bytes": 2 * 32}
    assert out["all-gather"] == {"count": 4, "bytes": 4 * 128}


@pytest.mark.slow
def test_pallas_kernels_compile_for_tpu_inside_the_sharded_model(sort_only_sampler_in_test):
    """With impl "auto" the kernels are chosen for the mesh's platform (TPU here, on a CPU host),
    run on local shards under shard_map, and compile through Mosaic (not interpret mode)."""
    model = dataclasses.replace(_tiny(), num_layers=2, attention_impl="auto", moe_impl="auto")
    pc = dataclasses.replace(SMALL, topology="v5p:2x2x1")
    # The decode step's kernels do not depend on the learner's expert parallelism: compiled once.
    for ep, decode_too in (("none", False), ("all_to_all", True)):
        cfg = dataclasses.replace(model, expert_parallel=ep)
        result = plan_lib.plan(dataclasses.replace(pc, decode=decode_too), cfg,
                               mesh_cfg=MeshConfig(fsdp=1, tensor=2, expert=2))
        train = result["train_step"]["pallas_kernels"]
        assert train.get("gmm", 0) >= 3 and any("splash" in k or "flash" in k for k in train), (ep, train)
        if decode_too:
            decode = result["decode_step"]["pallas_kernels"]
            assert decode.get("gmm", 0) >= 3 and any("decode_attention" in k for k in decode), decode
    assert jax.default_backend() == "cpu"  # nothing changed the host's platform


@pytest.mark.slow
def test_decode_step_gathers_no_whole_weight(sort_only_sampler_in_test):
    """The default inference layout (tensor x expert, no FSDP) never all-gathers a whole weight
    in a decode step; an FSDP inference mesh does, and the check sees it."""
    # A period of the layer pattern (2 here) under the scan + 1 unrolled tail: gathers inside
    # the loop body and outside it are both seen.
    model = dataclasses.replace(_tiny(), num_layers=3, attention_pattern=("local", "global"),
                                scan_layers=True, expert_parallel="all_to_all")
    assert model.layer_period == 2
    pc = dataclasses.replace(SMALL, topology="v5p:2x2x2", train=False)
    good = plan_lib.plan(pc, model, mesh_cfg=MeshConfig(fsdp=-1, tensor=2, expert=2))
    step = good["decode_step"]
    assert step["mesh"] == {"data": 2, "fsdp": 1, "tensor": 2, "expert": 2}
    assert step["fits"] and step["weight_all_gathers"] == []
    fsdp = dataclasses.replace(pc, inference_mesh=MeshConfig(fsdp=4, tensor=2))
    bad = plan_lib.plan(fsdp, model)["decode_step"]
    assert bad["weight_all_gathers"], "an FSDP-sharded decode step gathers its weights"


def test_hlo_costs_count_loop_bodies_their_trip_count():
    """XLA's cost analysis visits a scan body once; the plan's own count multiplies it out."""

    def f(x, w):
        return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]

    x, w = jnp.ones((128, 256)), jnp.ones((10, 256, 256))
    compiled = jax.jit(f).lower(x, w).compile()
    costs = plan_lib.hlo_costs(compiled.as_text())
    assert costs["flops"] == 10 * 2 * 128 * 256 * 256
    assert compiled.cost_analysis()["flops"] < costs["flops"] / 5  # what the plan corrects
    # Each step reads its layer of w (not all of it), x, and writes x: about 10 x 0.5 MB.
    assert 10 * 256 * 256 * 4 <= costs["bytes"] <= 10 * (256 * 256 * 4 + 4 * 128 * 256 * 4) * 2


def test_hlo_costs_count_tpu_dots_written_as_convolutions():
    """TPU writes batched dots and weight gradients as convolutions (windows over a head axis
    with padding, or spanning the contracted tokens); each counts its real multiply-adds."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = plan_lib.tpu_devices("v5p:2x2x1")[0]
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
    assert plan_lib.hlo_costs(text)["flops"] == pytest.approx(3 * forward, rel=0.02)


def test_two_slices_over_dcn_plan_with_data_across_them():
    """Multi-slice: two v5p:2x2x1 slices (8 chips); only the data axis may cross the slices."""
    model = dataclasses.replace(_tiny(), num_layers=2)
    pc = dataclasses.replace(SMALL, num_slices=2, decode=False)
    result = plan_lib.plan(pc, model, mesh_cfg=MeshConfig(data=2, fsdp=2, tensor=2))
    assert result["chips"] == 8 and result["num_slices"] == 2
    step = result["train_step"]
    assert step["compiled"] and step["fits"] and step["mesh"]["data"] == 2
    with pytest.raises(ValueError, match=r"MeshConfig.data=1 is not a multiple of num_slices=2"):
        plan_lib.plan(pc, model, mesh_cfg=MeshConfig(data=1, fsdp=4, tensor=2))


def test_kv_fit_counts_slot_and_paged_sequences_by_hand():
    """kv_fit on the decode state's shards (4 CPU devices: data 2 x tensor 2): the global
    layer's K/V bytes a token on a chip, and the slot and paged fits, by hand."""
    cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, attention_pattern=("local", "global"), window=16,
                      ffn_pattern=("dense",), d_ff=64, dtype="float32", max_seq_len=512)
    pc = dataclasses.replace(SMALL, decode_batch=8, kv_len=512, serve_dtype=None)
    mesh = plan_lib._mesh(MeshConfig(data=2, tensor=2), jax.devices()[:4], "inference")
    _, (params, state, _), _ = plan_lib._decode_inputs(cfg, pc, mesh)
    fit = plan_lib.kv_fit(state, params, 2**24, max_len=512, mean_len=64, page_size=16)
    per_token = 2 * 2 * 8 * 4 / 2  # k and v, 2 kv heads of 8 fp32 values, heads over tensor 2
    assert fit["batch_shards"] == 2 and fit["global_kv_bytes_per_token_per_chip"] == per_token
    weights = sum(x.size * 4 for x in jax.tree.leaves(params)) / 2  # about half on tensor 2
    assert fit["weight_bytes_per_chip"] < weights * 1.5
    # slot: 512 positions and their int32 `pos`; paged: 64 + 16 positions and 32 page ids.
    rest = fit["slot_bytes_per_sequence_per_chip"] - (per_token + 4) * 512
    assert fit["paged_bytes_per_sequence_per_chip"] == per_token * 80 + 32 * 4 + rest
    free = 2**24 - fit["weight_bytes_per_chip"]
    assert fit["slot_sequences"] == 2 * int(free // fit["slot_bytes_per_sequence_per_chip"])
    assert fit["paged_sequences"] == 2 * int((free - per_token * 512)
                                             // fit["paged_bytes_per_sequence_per_chip"])
    assert fit["paged_over_slot"] > 3


def test_paged_decode_step_compiles_the_paged_kernel_for_tpu(sort_only_sampler_in_test):
    """kv_layout="paged": the decode step on a pool of pages compiles with the paged Mosaic
    kernel under shard_map (pages split with the batch over data, heads over tensor)."""
    model = dataclasses.replace(_tiny(), num_layers=2, attention_pattern=("local", "global"),
                                attention_impl="auto", moe_impl="auto")
    pc = dataclasses.replace(SMALL, topology="v5p:2x2x1", train=False, kv_layout="paged",
                             mean_len=64, page_size=16)
    step = plan_lib.plan(pc, model, mesh_cfg=MeshConfig(fsdp=1, tensor=2))["decode_step"]
    assert step["compiled"] and step["fits"] and "kv_fit" not in step
    assert step["pallas_kernels"].get("paged_decode_attention_tpu", 0) >= 1, step["pallas_kernels"]

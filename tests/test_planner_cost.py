"""hcjax.planner.cost: the roofline bound and estimate and the decode mesh's KV fit, by hand; the
per-device spec read from the chip table (hcjax.hardware)."""

import dataclasses

import jax
import pytest

from hcjax.hardware import CHIPS, LINKS
from hcjax.model import ModelConfig
from hcjax.planner import PlanConfig
from hcjax.planner.compile_steps import decode_inputs, mesh_over
from hcjax.planner.cost import DeviceSpec, kv_fit, roofline
from hcjax.sharding import MeshConfig


def test_roofline_bound_and_estimate_by_hand():
    """bound = max of the parts (perfect overlap); estimate = compute + HBM + the activation
    exchanges + the weight/gradient collectives beyond the compute time."""
    spec = DeviceSpec(peak_flops=100.0, hbm_bytes=1e9, hbm_bytes_per_s=10.0, ici_bytes_per_s=4.0)
    step = {"flops_per_chip": 200.0, "hbm_bytes_accessed_per_chip": 5.0,
            "collective_bytes_per_chip": 16.0,
            "collectives": {"ragged-all-to-all": {"count": 1, "bytes": 4.0},
                            "all-gather": {"count": 1, "bytes": 12.0}}}
    roofline(step, spec, devices=2, model_flops=300.0)
    # compute 2 s, HBM 0.5 s, collectives 4 s (1 s exchanges, 3 s overlappable: 1 s beyond compute)
    assert step["bound_step_s"] == 4.0 and step["bound_by"] == "collective"
    assert step["mfu_upper_bound"] == 300.0 / (2 * 100.0 * 4.0)
    assert step["exposed_collective_s"] == 1.0 + 1.0
    assert step["estimated_step_s"] == 2.0 + 0.5 + 2.0
    assert step["estimated_mfu"] == 300.0 / (2 * 100.0 * 4.5)


def test_kv_fit_counts_slot_and_paged_sequences_by_hand():
    """kv_fit on the decode state's shards (4 CPU devices: data 2 x tensor 2): the global
    layer's K/V bytes a token on a chip, and the slot and paged fits, by hand."""
    cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, attention_pattern=("local", "global"), window=16,
                      ffn_pattern=("dense",), d_ff=64, dtype="float32", max_seq_len=512)
    pc = PlanConfig(global_batch_tokens=2048, seq_len=256, decode_batch=8, kv_len=512,
                    serve_dtype=None)
    mesh = mesh_over(MeshConfig(data=2, tensor=2), jax.devices()[:4], "inference")
    _, (params, state, _), _ = decode_inputs(cfg, pc, mesh)
    fit = kv_fit(state, params, 2**24, max_len=512, mean_len=64, page_size=16)
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


def test_a_device_is_its_chip_or_an_equal_share_of_it():
    """The roofline's peaks come from the chip and link tables; v4 exposes each of a chip's two
    TensorCores as a device, each half of the chip."""
    v5p = DeviceSpec.of("v5p")
    assert v5p == DeviceSpec(459e12, 95.74 * 2**30, 2765e9, 4800e9 / 8)
    assert v5p.peak_flops == CHIPS["v5p"].peak_flops["bfloat16"]
    assert v5p.ici_bytes_per_s == LINKS["v5p-ici"].bytes_per_s
    half = DeviceSpec.of("v4", 2)
    whole = DeviceSpec.of("v4")
    assert dataclasses.astuple(half) == pytest.approx([v / 2 for v in dataclasses.astuple(whole)])

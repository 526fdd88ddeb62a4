"""`hcjax.plan` and the planner behind it (hcjax.planner) compile the learner and decode steps for
a small TPU topology (libtpu's compile-only devices) from this CPU host, and report fit, bytes
over and clear errors; the command loads libtpu without its warnings."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from hcjax import config as hcfg
from hcjax import plan as plan_lib
from hcjax.hardware import CHIPS
from hcjax.model import ModelConfig
from hcjax.planner import PlanConfig, plan
from hcjax.planner.tpu import tpu_devices
from hcjax.rl.learner import LearnerConfig
from hcjax.sharding import MeshConfig


def _libtpu_reason() -> str | None:
    try:
        tpu_devices("v5p:2x2x1")
    except Exception as e:  # no libtpu on this platform
        return f"libtpu cannot build a TPU topology here: {e}"
    return None


REPO = Path(__file__).resolve().parent.parent
_REASON = _libtpu_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

SMALL = PlanConfig(topology="v5p:2x2x1", global_batch_tokens=2048, seq_len=256,
                   decode_batch=8, kv_len=256)


def _tiny() -> ModelConfig:
    hcfg.bind(["tiny_cpu.gin"], [])
    return ModelConfig()


def test_libtpu_leaves_the_test_backend_on_cpu():
    assert jax.default_backend() == "cpu"
    assert all(d.platform == "cpu" for d in jax.devices())



def test_the_command_loads_libtpu_quietly_and_reports_weight_sync_without_compiling():
    """`python -m hcjax.plan` on a host without TPU chips loads libtpu without its "could not
    determine TPU accelerator type" warning and E0000 INVALID_ARGUMENT trace (hcjax.planner.tpu
    sets what libtpu asks for first), and with both compiles off it still reports the
    weight-sync estimate (hcjax.transfer.network)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TPU_ACCELERATOR_TYPE", "TPU_HOST_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS",
                        "TPU_WORKER_HOSTNAMES")}
    done = subprocess.run(
        [sys.executable, "-m", "hcjax.plan", "--gin_file", "tiny_cpu.gin",
         "--topology", "v5p:4x4x4", "--inference_topology", "v5p:2x2x2",
         "--gin_param", "PlanConfig.train = False", "--gin_param", "PlanConfig.decode = False"],
        env=env, text=True, capture_output=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    for line in ("could not determine", "E0000", "INVALID_ARGUMENT", "InitGoogle"):
        assert line not in done.stderr, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    sync = result["weight_sync"]
    assert sync["path"] == "dcn" and sync["full"]["bytes"] > 0
    assert "train_step" not in result and "decode_step" not in result
    # 64 learner chips = 16 hosts, 8 inference chips = 2 hosts x 25 GB/s; the tiny model's
    # inference mesh is 8 one-chip replicas: 7 filled over ICI from the first (600 GB/s a chip)
    full = sync["full"]
    assert full["fanout_s"] == pytest.approx(full["bytes"] / 600e9)
    assert full["estimated_s"] == pytest.approx(full["bytes"] / 50e9 + full["fanout_s"])
    assert sync["links"]["ici"]["source"].startswith("cloud.google.com/tpu/docs/v5p")

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
    step = plan(pc, model, LearnerConfig(logprob_chunk=0))["train_step"]
    # Far over HBM libtpu may not finish the compile at all; the record then carries XLA's
    # out-of-memory figure instead of a full memory analysis.
    assert not step["fits"]
    hbm = int(CHIPS["v5e"].hbm_bytes)
    assert step["bytes_over"] == step["bytes_per_chip"]["total"] - hbm > 0
    if step["compiled"]:
        assert step["largest_buffers"] and step["largest_buffers"][0]["bytes"] > 0
    else:
        assert "RESOURCE_EXHAUSTED" in step["error"]


def test_unknown_topology_is_named():
    with pytest.raises(ValueError, match="v9z:2x2"):
        tpu_devices("v9z:2x2")
    with pytest.raises(ValueError, match="v5p:3x3x3x3"):
        tpu_devices("v5p:3x3x3x3")


def test_mesh_that_does_not_cover_the_chips_is_named():
    model = _tiny()
    pc = dataclasses.replace(SMALL, decode=False)
    with pytest.raises(ValueError, match=r"multiply to 2, not the 4 devices"):
        plan(pc, model, mesh_cfg=MeshConfig(fsdp=2))
    with pytest.raises(ValueError, match="do not divide"):
        plan(pc, model, mesh_cfg=MeshConfig(fsdp=-1, tensor=3))


def test_batch_that_does_not_divide_the_mesh_is_named():
    model = _tiny()
    pc = dataclasses.replace(SMALL, global_batch_tokens=256 * 2, decode=False)
    with pytest.raises(ValueError, match="2 rows"):
        plan(pc, model, mesh_cfg=MeshConfig(fsdp=4))


@pytest.mark.slow
def test_pallas_kernels_compile_for_tpu_inside_the_sharded_model(sort_only_sampler_in_test):
    """With impl "auto" the kernels are chosen for the mesh's platform (TPU here, on a CPU host),
    run on local shards under shard_map, and compile through Mosaic (not interpret mode)."""
    model = dataclasses.replace(_tiny(), num_layers=2, attention_impl="auto", moe_impl="auto")
    pc = dataclasses.replace(SMALL, topology="v5p:2x2x1")
    # The decode step's kernels do not depend on the learner's expert parallelism: compiled once.
    for ep, decode_too in (("none", False), ("all_to_all", True)):
        cfg = dataclasses.replace(model, expert_parallel=ep)
        result = plan(dataclasses.replace(pc, decode=decode_too), cfg,
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
    good = plan(pc, model, mesh_cfg=MeshConfig(fsdp=-1, tensor=2, expert=2))
    step = good["decode_step"]
    assert step["mesh"] == {"data": 2, "fsdp": 1, "tensor": 2, "expert": 2}
    assert step["fits"] and step["weight_all_gathers"] == []
    fsdp = dataclasses.replace(pc, inference_mesh=MeshConfig(fsdp=4, tensor=2))
    bad = plan(fsdp, model)["decode_step"]
    assert bad["weight_all_gathers"], "an FSDP-sharded decode step gathers its weights"


def test_two_slices_over_dcn_plan_with_data_across_them():
    """Multi-slice: two v5p:2x2x1 slices (8 chips); only the data axis may cross the slices."""
    model = dataclasses.replace(_tiny(), num_layers=2)
    pc = dataclasses.replace(SMALL, num_slices=2, decode=False)
    result = plan(pc, model, mesh_cfg=MeshConfig(data=2, fsdp=2, tensor=2))
    assert result["chips"] == 8 and result["num_slices"] == 2
    step = result["train_step"]
    assert step["compiled"] and step["fits"] and step["mesh"]["data"] == 2
    with pytest.raises(ValueError, match=r"MeshConfig.data=1 is not a multiple of num_slices=2"):
        plan(pc, model, mesh_cfg=MeshConfig(data=1, fsdp=4, tensor=2))


def test_paged_decode_step_compiles_the_paged_kernel_for_tpu(sort_only_sampler_in_test):
    """kv_layout="paged": the decode step on a pool of pages compiles with the paged Mosaic
    kernel under shard_map (pages split with the batch over data, heads over tensor)."""
    model = dataclasses.replace(_tiny(), num_layers=2, attention_pattern=("local", "global"),
                                attention_impl="auto", moe_impl="auto")
    pc = dataclasses.replace(SMALL, topology="v5p:2x2x1", train=False, kv_layout="paged",
                             mean_len=64, page_size=16)
    step = plan(pc, model, mesh_cfg=MeshConfig(fsdp=1, tensor=2))["decode_step"]
    assert step["compiled"] and step["fits"] and "kv_fit" not in step
    assert step["pallas_kernels"].get("paged_decode_attention_tpu", 0) >= 1, step["pallas_kernels"]

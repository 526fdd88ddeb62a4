"""The Ray placement (Placement.backend = "ray"): bundles and Ray resources derived from a
Placement (no Ray needed), bad bindings refused by name, and a tiny climb end to end on a local
Ray instance (learner and replica as actors in a placement group) that leaves no Ray process
behind."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hcjax.train.sft  # noqa: F401  (registered before these tests bind: hcjax.climb's main imports it)
from hcjax import config
from hcjax.config import cpu_xla_flags
from hcjax.ray_placement import check_fits, merged_xla_flags
from hcjax.rl.placement import Placement, RayPlacement
from hcjax.sharding import MeshConfig

REPO = Path(__file__).resolve().parent.parent


def ray_placement(**fields):
    return Placement(**{"backend": "ray", **fields})


def test_the_ray_placement_registers_no_configurable_of_its_own():
    """hcjax.climb binds gin with the climb's modules imported, not this one (it starts on Ray
    only): a configurable defined here would be skipped by the driver's bind."""
    source = (REPO / "hcjax" / "ray_placement.py").read_text()
    assert not config._CONFIGURABLE_RE.findall(source)


def test_bundles_follow_the_meshes_on_cpu():
    placement = ray_placement(learner_mesh={"fsdp": 2, "device_offset": 0, "num_devices": 2},
                              inference_meshes=[{"device_offset": 2, "num_devices": 1},
                                                {"fsdp": 1, "tensor": 2, "device_offset": 3}])
    bundles = RayPlacement().bundles(placement)
    assert [(b.role, b.index, b.devices) for b in bundles] == [
        ("learner", 0, 2), ("inference", 0, 1), ("inference", 1, 2)]
    # On CPU a bundle is its CPUs; the devices are XLA host devices of the actor's own process,
    # so every mesh starts at device 0 there.
    assert [b.resources for b in bundles] == [{"CPU": 1.0}] * 3
    assert [b.env["XLA_FLAGS"] for b in bundles] == [
        f"--xla_force_host_platform_device_count={n}" for n in (2, 1, 2)]
    assert all(b.env["JAX_PLATFORMS"] == "cpu" for b in bundles)
    assert bundles[0].mesh == MeshConfig(fsdp=2, device_offset=0, num_devices=2)
    assert bundles[2].mesh == MeshConfig(fsdp=1, tensor=2, device_offset=0, num_devices=2)


def test_actors_keep_the_drivers_other_xla_flags():
    # The bundle's device count replaces the driver's; the optimisation level and a dump folder
    # reach the actor, so it compiles (and hits the compilation cache) as the driver would.
    driver = ("--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=2 "
              "--xla_dump_to=/tmp/d")
    own = "--xla_force_host_platform_device_count=1"
    assert merged_xla_flags(driver, own).split() == [
        "--xla_backend_optimization_level=0", "--xla_dump_to=/tmp/d", own]
    assert merged_xla_flags("", own) == own


def test_bundles_on_gpus_and_tpu_chips():
    placement = ray_placement(learner_mesh={"fsdp": -1, "num_devices": 8},
                              inference_meshes=[{"tensor": 2, "fsdp": 1}] * 2)
    gpu = RayPlacement(accelerator="GPU", cpus_per_actor=4).bundles(placement)
    assert [b.resources for b in gpu] == [{"CPU": 4.0, "GPU": 8.0}, {"CPU": 4.0, "GPU": 2.0},
                                          {"CPU": 4.0, "GPU": 2.0}]
    assert all(b.env == {} for b in gpu)  # Ray sets CUDA_VISIBLE_DEVICES itself
    # A learner over two hosts of 4 chips: two learner actors, each holding half the devices,
    # each building the mesh over all 8 (jax.distributed).
    tpu = RayPlacement(accelerator="TPU", learner_processes=2, strategy="STRICT_SPREAD")
    bundles = tpu.bundles(placement)
    assert [(b.role, b.index, b.resources) for b in bundles] == [
        ("learner", 0, {"CPU": 1.0, "TPU": 4.0}), ("learner", 1, {"CPU": 1.0, "TPU": 4.0}),
        ("inference", 0, {"CPU": 1.0, "TPU": 2.0}), ("inference", 1, {"CPU": 1.0, "TPU": 2.0})]
    assert bundles[1].mesh.num_devices == 8 and bundles[1].devices == 4


def test_check_fits_names_what_is_short():
    bundles = RayPlacement().bundles(ray_placement(
        inference_meshes=[{"num_devices": 1}, {"num_devices": 1}]))
    check_fits(bundles, {"CPU": 3.0, "memory": 1e9})
    with pytest.raises(ValueError, match=r"ask for CPU 3 \(the cluster has 2\).*"
                       "RayPlacement.num_cpus"):
        check_fits(bundles, {"CPU": 2.0})
    gpu = RayPlacement(accelerator="GPU").bundles(ray_placement())
    with pytest.raises(ValueError, match=r"GPU 2 \(the cluster has 0\)"):
        check_fits(gpu, {"CPU": 8.0})


@pytest.mark.parametrize("make, message", [
    (lambda: Placement(backend="slurm"),
     r"Placement.backend='slurm' is not one of \('local', 'ray'\)"),
    (lambda: ray_placement(inference_addresses=["127.0.0.1:5000"]),
     r"Placement.inference_addresses=\['127.0.0.1:5000'\] with Placement.backend='ray'"),
    (lambda: RayPlacement(accelerator="XPU"), r"RayPlacement.accelerator='XPU' is not one of"),
    (lambda: RayPlacement(strategy="TIGHT"), r"RayPlacement.strategy='TIGHT'"),
    (lambda: RayPlacement(cpus_per_actor=0), r"RayPlacement.cpus_per_actor=0 must be > 0"),
    (lambda: RayPlacement(num_cpus=2, address="auto"),
     r"RayPlacement.num_cpus=2 with RayPlacement.address='auto'"),
    (lambda: RayPlacement(learner_processes=3).bundles(
        ray_placement(learner_mesh={"num_devices": 4})),
     r"RayPlacement.learner_processes=3 does not divide the 4 devices of "
     r"Placement.learner_mesh"),
    (lambda: RayPlacement().bundles(ray_placement(inference_meshes=[{"num_devices": 1},
                                                                    {"fsdp": -1}])),
     r"Placement.inference_meshes\[1\]=.*leaves its device count open"),
    (lambda: RayPlacement().bundles(ray_placement(learner_mesh={"fsdp": 2, "num_devices": 3})),
     r"Placement.learner_mesh=.*num_devices=3 does not fit"),
    (lambda: RayPlacement().bundles(ray_placement(inference_meshes=[])),
     r"Placement.inference_meshes is empty"),
    (lambda: RayPlacement().bundles(Placement()),
     r"Placement.backend='local': RayPlacement only places"),
])
def test_bad_bindings_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_gin_selects_the_ray_placement_and_the_cli_refuses_conflicts(tmp_path):
    config.bind(["climb_ray_tiny.gin"], ["RayPlacement.cpus_per_actor = 0.5"])
    placement = Placement()
    assert placement.backend == "ray"
    bundles = RayPlacement().bundles(placement)
    assert [(b.role, b.resources) for b in bundles] == [("learner", {"CPU": 0.5}),
                                                        ("inference", {"CPU": 0.5})]
    config.bind(["climb_tiny.gin"], ["Placement.backend = 'rey'"])
    with pytest.raises(ValueError, match="Placement.backend='rey'"):
        Placement()
    from hcjax.climb import main

    # Before Ray starts: a remote replica address does not go with the Ray placement.
    with pytest.raises(ValueError, match="--inference_address .* with Placement.backend='ray'"):
        main(["--gin_file", "climb_ray_tiny.gin", "--output_dir", str(tmp_path),
              "--inference_address", "127.0.0.1:1"])


# End to end: a tiny climb on a local Ray instance ------------------------------------------------


def ray_processes() -> set[int]:
    """Pids of Ray's own processes (GCS, raylet, workers) on this machine."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path("/proc", entry, "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if any(key in cmdline for key in (b"gcs_server", b"raylet", b"ray::",
                                          b"default_worker.py", b"ray/dashboard")):
            pids.add(int(entry))
    return pids


@pytest.mark.slow
def test_tiny_climb_on_ray_trains_evaluates_and_publishes(tmp_path):
    from tests.test_climb import TINY

    before = ray_processes()
    out = tmp_path / "climb"
    params = [*TINY, "ClimbConfig.num_steps = 3", "Placement.backend = 'ray'",
              "Placement.learner_mesh = {'num_devices': 1}",
              "Placement.inference_meshes = [{'num_devices': 1}]",
              # The tiny base mostly runs out of its 12 tokens: let truncated rollouts train, so
              # that every step trains (as in test_climb_multiprocess).
              "LearnerConfig.mask_truncated = False"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", RAY_USAGE_STATS_ENABLED="0",
               XLA_FLAGS=cpu_xla_flags(2))
    proc = subprocess.run(
        [sys.executable, "-m", "hcjax.climb", "--output_dir", str(out), "--mode", "on_policy",
         *[arg for p in params for arg in ("--gin_param", p)]],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "dropped from weight sync" not in proc.stderr
    assert "inference replicas serving at 127.0.0.1:" in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["placement"] == "ray" and summary["steps"] == 3
    detail = summary["placement_detail"]
    assert [(b["role"], b["resources"]) for b in detail["bundles"]] == [
        ("learner", {"CPU": 1.0}), ("inference", {"CPU": 1.0})]
    assert len(detail["inference"]) == 1 and detail["inference"][0].startswith("127.0.0.1:")
    # Trained: every step has a loss (the learner actor ran them).
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in records if "loss" in r) == [1, 2, 3]
    # Evaluated through the replica (the base, steps 2 and 3, and the final weights) and
    # published: on policy, version 0 at the start, one per step and the final push, each
    # served before the evaluation that reports it (a version that reached no replica would
    # have failed the climb).
    assert [(e["step"], e["version"]) for e in summary["evals"]] == [(0, 0), (2, 2), (3, 3),
                                                                    (3, 4)]
    assert 0.0 <= summary["final_pass_at_1"] <= 1.0
    # The driver prints the JSON summary line; the learner actor wrote the operative config.
    last = json.loads(next(line for line in reversed(proc.stdout.splitlines())
                           if line.startswith('{"base_pass_at_1"')))
    assert last["placement"] == "ray" and last["steps"] == 3
    assert "Placement.backend = 'local'" in (out / "operative_config.gin").read_text()
    assert (out / "checkpoints").is_dir() and (out / "base").is_dir()
    # Ray shut down: no Ray process of this run is left.
    deadline = time.time() + 20
    while (left := ray_processes() - before) and time.time() < deadline:
        time.sleep(0.5)
    assert not left, f"Ray processes left behind: {sorted(left)}"

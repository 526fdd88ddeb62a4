"""The launch scripts' --dry_run: what each would start, and that every printed hcjax.climb
command line is accepted by the climb's own flag parser."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from hcjax import climb, config

LAUNCH = Path(__file__).resolve().parent.parent / "launch"


def run(script, *args):
    return subprocess.run(["bash", str(LAUNCH / script), *args], capture_output=True, text=True,
                          timeout=60)


def climb_args(command: str) -> list[str]:
    """The arguments after `-m hcjax.climb` in a printed command (shell-unquoted)."""
    words = shlex.split(command)
    i = words.index("hcjax.climb")
    return words[i + 1:]


def parse(args):
    return config.parse_flags(args, description="", extra_args=climb._extra_args).extra


def test_local_dry_run_starts_servers_then_the_learner():
    out = run("local.sh", "--dry_run", "--num_inference", "2", "--base_port", "6000",
              "--output_dir", "/tmp/x", "--", "--gin_param", "ClimbConfig.num_steps = 3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["inference", "inference", "learner"]
    servers = [parse(climb_args(line)) for line in lines[:2]]
    assert [(s.role, s.host, s.port) for s in servers] == [("inference", "127.0.0.1", 6000),
                                                          ("inference", "127.0.0.1", 6001)]
    learner = parse(climb_args(lines[2]))
    assert learner.role == "climb"
    assert learner.inference_address == ["127.0.0.1:6000", "127.0.0.1:6001"]
    # A binding with spaces survives the shell quoting intact.
    flags = config.parse_flags(climb_args(lines[2]), description="", extra_args=climb._extra_args)
    assert flags.gin_params == ["ClimbConfig.num_steps = 3"]
    assert flags.output_dir == "/tmp/x"
    assert "xla_force_host_platform_device_count=1" in lines[2]


@pytest.mark.parametrize("args, message", [
    (["--num_inference", "0"], "--num_inference=0"),
    (["--bogus"], "unknown argument '--bogus'"),
])
def test_local_rejects_bad_arguments(args, message):
    out = run("local.sh", "--dry_run", *args)
    assert out.returncode == 2 and message in out.stderr


def test_tpu_pod_dry_run_runs_every_host():
    out = run("tpu_pod.sh", "--dry_run", "--tpu", "pod", "--zone", "us-x", "--num_hosts", "4",
              "--learner_hosts", "1", "--", "--mode", "on_policy")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    workers = [int(line.split("--worker=")[1].split()[0]) for line in lines]
    assert sorted(workers) == [0, 1, 2, 3]
    for line in lines:
        inner = line.split('--command="', 1)[1].rsplit('"', 1)[0]
        # Addresses are looked up when the command runs: stand in a placeholder for $(...).
        inner = re.sub(r"\$\(gcloud .*?\)'\)", "HOST", inner)
        ns = parse(climb_args(inner.split("&&", 1)[1]))
        assert ns.mode == "on_policy"
        if "--worker=0" in line:
            assert ns.role == "climb" and ns.num_processes == 1 and ns.process_id == 0
            assert line.count("--inference_address") == 3
            assert "--coordinator_address" in line
        else:
            assert ns.role == "inference" and ns.host == "0.0.0.0"


@pytest.mark.parametrize("args, message", [
    (["--zone", "z", "--num_hosts", "2"], "--tpu is required"),
    (["--tpu", "t", "--zone", "z", "--num_hosts", "2", "--learner_hosts", "2"],
     "need 1 <= --learner_hosts=2 < --num_hosts=2"),
])
def test_tpu_pod_rejects_bad_arguments(args, message):
    out = run("tpu_pod.sh", "--dry_run", *args)
    assert out.returncode == 2 and message in out.stderr


def test_gpu_slurm_dry_run_places_learner_on_the_first_node():
    out = run("gpu_slurm.sbatch", "--dry_run", "--nodes", "gpu1 gpu2 gpu3", "--port", "7000")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["inference", "inference", "learner"]
    assert "-w gpu2" in lines[0] and "-w gpu3" in lines[1] and "-w gpu1" in lines[2]
    learner = parse(climb_args(lines[2]))
    assert learner.inference_address == ["gpu2:7000", "gpu3:7000"]
    assert parse(climb_args(lines[0])).role == "inference"


def test_gpu_slurm_needs_nodes_outside_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    out = run("gpu_slurm.sbatch", "--dry_run")
    assert out.returncode == 2 and "not inside a SLURM job" in out.stderr
    out = run("gpu_slurm.sbatch", "--dry_run", "--nodes", "only1")
    assert out.returncode == 2 and "need at least 2 nodes" in out.stderr

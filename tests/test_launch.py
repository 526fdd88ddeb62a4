"""The launch scripts' --dry_run: what each would start, and that every printed hcjax.climb and
hcjax.serve command line is accepted by that entry point's own flag parser."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from hcjax import climb, config, serve

LAUNCH = Path(__file__).resolve().parent.parent / "launch"


def run(script, *args):
    return subprocess.run(["bash", str(LAUNCH / script), *args], capture_output=True, text=True,
                          timeout=60)


def module_args(command: str, module: str) -> list[str]:
    """The arguments after `-m MODULE` in a printed command (shell-unquoted)."""
    words = shlex.split(command)
    i = words.index(module)
    assert words[i - 1] == "-m", command
    return words[i + 1:]


def climb_args(command: str) -> list[str]:
    return module_args(command, "hcjax.climb")


def parse(args):
    return config.parse_flags(args, description="", extra_args=climb._extra_args).extra


def parse_serve(command: str) -> config.Flags:
    """The flags of a printed `python -m hcjax.serve` command, parsed as hcjax.serve does."""
    return config.parse_flags(module_args(command, "hcjax.serve"), description="",
                              default_gin_files=["tiny_cpu.gin"], extra_args=serve._extra_args)


def check_sizes(ns, max_prefill_length=32, max_concurrent_decodes=128, max_target_length=None):
    assert (ns.max_prefill_length, ns.max_concurrent_decodes, ns.max_target_length) == (
        max_prefill_length, max_concurrent_decodes, max_target_length)


def test_local_dry_run_starts_servers_then_the_learner():
    out = run("local.sh", "--dry_run", "--num_inference", "2", "--base_port", "6000",
              "--output_dir", "/tmp/x", "--", "--gin_param", "ClimbConfig.num_steps = 3",
              "--mode", "on_policy")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["inference", "inference", "learner"]
    servers = [parse_serve(line) for line in lines[:2]]
    assert [(s.extra.host, s.extra.port) for s in servers] == [("127.0.0.1", 6000),
                                                              ("127.0.0.1", 6001)]
    for s in servers:  # the learner's gin (climb_tiny.gin, the binding), not its other flags
        assert s.gin_files == ["climb_tiny.gin"]
        assert s.gin_params == ["ClimbConfig.num_steps = 3"]
        check_sizes(s.extra)
    learner = parse(climb_args(lines[2]))
    assert learner.mode == "on_policy"
    assert learner.inference_address == ["127.0.0.1:6000", "127.0.0.1:6001"]
    # A binding with spaces survives the shell quoting intact.
    flags = config.parse_flags(climb_args(lines[2]), description="", extra_args=climb._extra_args)
    assert flags.gin_params == ["ClimbConfig.num_steps = 3"]
    assert flags.output_dir == "/tmp/x"
    assert "xla_force_host_platform_device_count=1" in lines[2]


def test_local_dry_run_passes_engine_sizes_and_gin_files_to_the_servers(monkeypatch):
    monkeypatch.setenv("MAX_PREFILL_LENGTH", "64")
    monkeypatch.setenv("MAX_CONCURRENT_DECODES", "16")
    monkeypatch.setenv("MAX_TARGET_LENGTH", "200")
    out = run("local.sh", "--dry_run", "--", "--gin_file", "tiny_cpu.gin", "--quiet",
              "--gin_param=ModelConfig.num_layers = 2")
    assert out.returncode == 0, out.stderr
    server = parse_serve(out.stdout.splitlines()[0])
    check_sizes(server.extra, 64, 16, 200)
    assert server.gin_files == ["tiny_cpu.gin"]
    assert server.gin_params == ["ModelConfig.num_layers = 2"]


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
        if "--worker=0" in line:
            ns = parse(climb_args(inner.split("&&", 1)[1]))
            assert ns.mode == "on_policy"
            assert ns.num_processes == 1 and ns.process_id == 0
            assert line.count("--inference_address") == 3
            assert "--coordinator_address" in line
        else:
            # Weights are pulled from the learner host only.
            assert inner.split("&&", 1)[1].split()[0] == "HCJAX_TRUSTED_PEERS=HOST"
            server = parse_serve(inner)
            assert server.extra.host == "0.0.0.0" and server.extra.port == 50151
            assert server.gin_files == ["climb_tiny.gin"] and server.gin_params == []
            check_sizes(server.extra)


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
    for line in lines[:2]:
        assert "env HCJAX_TRUSTED_PEERS=gpu1 " in line  # weights only from the learner node
        server = parse_serve(line)
        assert server.extra.host == "0.0.0.0" and server.extra.port == 7000
        check_sizes(server.extra)


def test_gpu_slurm_needs_nodes_outside_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    out = run("gpu_slurm.sbatch", "--dry_run")
    assert out.returncode == 2 and "not inside a SLURM job" in out.stderr
    out = run("gpu_slurm.sbatch", "--dry_run", "--nodes", "only1")
    assert out.returncode == 2 and "need at least 2 nodes" in out.stderr


def test_multi_host_launchers_need_a_token_before_starting_anything(monkeypatch):
    # Their inference processes serve 0.0.0.0, which hcjax.serve refuses without a token.
    for var in ("HCJAX_TOKEN", "HCJAX_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    out = run("gpu_slurm.sbatch", "--nodes", "gpu1 gpu2")
    assert out.returncode == 2 and "set HCJAX_TOKEN or HCJAX_TOKEN_FILE" in out.stderr
    assert out.stdout == ""
    out = run("tpu_pod.sh", "--tpu", "t", "--zone", "z", "--num_hosts", "2")
    assert out.returncode == 2 and "set HCJAX_TOKEN_FILE" in out.stderr
    assert out.stdout == ""

"""The launch scripts' --dry_run: what each would start, and that every printed hcjax.climb and
hcjax.serve command line is accepted by that entry point's own flag parser."""

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
    """The engine sizes a serve command line gives (a flag it leaves out is absent: serve then
    takes ServeOptions' default)."""
    sizes = tuple(getattr(ns, name, None) for name in
                  ("max_prefill_length", "max_concurrent_decodes", "max_target_length"))
    assert sizes == (max_prefill_length, max_concurrent_decodes, max_target_length)


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


def remote_script(line: str) -> tuple[str, str, int, str]:
    """(role, TPU, worker, the script run there) of a tpu_pod.sh --dry_run line."""
    role, rest = line.split(": ", 1)
    words = shlex.split(rest)
    assert words[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"], line
    worker = int(next(w for w in words if w.startswith("--worker=")).split("=")[1])
    command = next(w for w in words if w.startswith("--command="))[len("--command="):]
    return role, words[5], worker, command


def steps(script: str) -> list[str]:
    """The top-level && steps of a process's script (braced groups kept whole)."""
    out, depth, current = [], 0, []
    for word in script.split(" "):
        depth += word.count("{") - word.count("}") if word in ("{", "}", "};") else 0
        if word == "&&" and depth == 0:
            out.append(" ".join(current))
            current = []
        else:
            current.append(word)
    return [*out, " ".join(current)]


def env_and_args(step: str, module: str) -> tuple[dict, list[str]]:
    words = shlex.split(step)
    env = {}
    if words[0] == "env":
        words = words[1:]
        while "=" in words[0]:
            k, v = words.pop(0).split("=", 1)
            env[k] = v
    i = words.index(module)
    return env, words[i + 1:]


TPU = ["--dry_run", "--zone", "z"]


@pytest.mark.parametrize("learner, learner_type, inference, hosts", [
    ("l0", "v5p-8", "i0", {"l0": 1}),  # single-host learner slice + 1 inference slice
    ("la lb", "v5p-16", "i0 i1", {"la": 2, "lb": 2}),  # 2 learner slices over DCN + 2 replicas
])
def test_tpu_pod_dry_run_gives_every_host_of_each_slice_its_process(learner, learner_type,
                                                                    inference, hosts):
    out = run("tpu_pod.sh", *TPU, "--learner_tpus", learner, "--learner_type", learner_type,
              "--inference_tpus", inference, "--inference_type", "v5p-8",
              "--output_dir", "gs://bkt/run", "--", "--mode", "on_policy")
    assert out.returncode == 0, out.stderr
    procs = [remote_script(line) for line in out.stdout.strip().splitlines()]
    servers = [p for p in procs if p[0] == "inference"]
    learners = [p for p in procs if p[0] == "learner"]
    assert [p[1] for p in servers] == inference.split() and all(p[2] == 0 for p in servers)
    # Every host of every learner slice runs a learner process of one JAX job.
    assert [(p[1], p[2]) for p in learners] == [(t, w) for t, n in hosts.items()
                                                for w in range(n)]
    learner_hosts = [f"{t}-w{w}" for t, n in hosts.items() for w in range(n)]
    addresses = [f"{t}-w0:50151" for t in inference.split()]
    for pid, (_, tpu, _worker, script) in enumerate(learners):
        assert script.startswith("cd $HOME/hcjax && ")
        st = steps(script.split(" && ", 1)[1])
        assert "'jax[tpu]>=0.9,<0.11'" in st[0] and "python3 -m venv .venv-accel" in st[0]
        assert "gcsfuse --implicit-dirs bkt /mnt/gcs/bkt" in st[1]
        assert st[2] == ".venv-accel/bin/python -m hcjax.cluster.storage /mnt/gcs/bkt/run"
        assert st[3] == ".venv-accel/bin/python -m hcjax.cluster.wait_ready " + " ".join(addresses)
        env, args = env_and_args(st[4], "hcjax.climb")
        flags = config.parse_flags(args, description="", extra_args=climb._extra_args)
        ns = flags.extra
        assert flags.output_dir == "/mnt/gcs/bkt/run" and ns.mode == "on_policy"
        assert ns.inference_address == addresses
        if len(learner_hosts) > 1:
            assert (ns.coordinator_address, ns.num_processes, ns.process_id) == (
                f"{learner_hosts[0]}:8476", len(learner_hosts), pid)
        else:
            assert ns.coordinator_address is None
        if len(hosts) > 1:  # multislice over DCN
            assert env == {"MEGASCALE_COORDINATOR_ADDRESS": f"{learner_hosts[0]}:8081",
                           "MEGASCALE_NUM_SLICES": str(len(hosts)),
                           "MEGASCALE_SLICE_ID": str(list(hosts).index(tpu)),
                           "MEGASCALE_PORT": "8081"}
        else:
            assert env == {}
    for _, _, _, script in servers:
        st = steps(script.split(" && ", 1)[1])
        assert len(st) == 2 and "'jax[tpu]>=0.9,<0.11'" in st[0]
        env, args = env_and_args(st[1], "hcjax.serve")
        assert env == {"HCJAX_TRUSTED_PEERS": ",".join(learner_hosts)}
        server = config.parse_flags(args, description="", default_gin_files=["tiny_cpu.gin"],
                                    extra_args=serve._extra_args)
        assert server.extra.host == "0.0.0.0" and server.extra.port == 50151
        assert server.gin_files == ["climb_tiny.gin"]
        check_sizes(server.extra)


def test_tpu_pod_passes_security_settings_and_refuses_multi_host_inference(monkeypatch, tmp_path):
    monkeypatch.setenv("HCJAX_TOKEN_FILE", str(tmp_path / "token"))
    out = run("tpu_pod.sh", *TPU, "--learner_tpus", "l", "--learner_type", "v5p-8",
              "--inference_tpus", "i", "--inference_type", "v5p-8", "--output_dir", "/shared")
    assert out.returncode == 0, out.stderr
    for line in out.stdout.splitlines():
        assert f"HCJAX_TOKEN_FILE={tmp_path / 'token'}" in remote_script(line)[3]
    out = run("tpu_pod.sh", *TPU, "--learner_tpus", "l", "--learner_type", "v5p-8",
              "--inference_tpus", "i", "--inference_type", "v5p-16", "--output_dir", "/shared")
    assert out.returncode == 2 and "inference slice 'i' has 2 hosts" in out.stderr


@pytest.mark.parametrize("args, message", [
    (["--learner_tpus", "l", "--learner_type", "v5p-8", "--inference_tpus", "i",
      "--inference_type", "v5p-8"], "--output_dir is required"),
    (["--learner_tpus", "l", "--learner_type", "v9-8", "--inference_tpus", "i",
      "--inference_type", "v5p-8", "--output_dir", "/s"], "accelerator type 'v9-8'"),
])
def test_tpu_pod_rejects_bad_arguments(args, message):
    out = run("tpu_pod.sh", *TPU, *args)
    assert out.returncode == 2 and message in out.stderr


def test_tpu_slice_shapes():
    from hcjax.cluster.layout import tpu_slice

    assert (tpu_slice("v5p-8").chips, tpu_slice("v5p-8").hosts) == (4, 1)
    s = tpu_slice("v5p-64")
    assert (s.chips, s.hosts, s.gke_topology, s.gke_accelerator) == (
        32, 8, "2x4x4", "tpu-v5p-slice")
    assert (tpu_slice("v6e-16").hosts, tpu_slice("v5litepod-8").hosts) == (4, 1)


def slurm_processes(stdout: str) -> list[tuple[str, str, list[str]]]:
    out = []
    for line in stdout.strip().splitlines()[1:]:
        role, rest = line.split(": ", 1)
        words = shlex.split(rest)
        assert words[:4] == ["srun", "--nodes=1", "--ntasks=1", "-w"] and words[5:7] == [
            "bash", "-c"], line
        out.append((role, words[4], steps(words[7])))
    return out


@pytest.mark.parametrize("nodes, learner_nodes", [("gpu1 gpu2 gpu3", 1),
                                                  ("g1 g2 g3 g4 g5 g6", 4)])
def test_gpu_slurm_dry_run_runs_a_multi_node_learner_after_health_checks(nodes, learner_nodes):
    out = run("gpu_slurm.sbatch", "--dry_run", "--nodes", nodes, "--learner_nodes",
              str(learner_nodes), "--port", "7000", "--output_dir", "/shared/run")
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert first.startswith("install: ") and "'jax[cuda12]>=0.9,<0.11'" in first
    names = nodes.split()
    learners, servers = names[:learner_nodes], names[learner_nodes:]
    procs = slurm_processes(out.stdout)
    assert [(r, n) for r, n, _ in procs] == [("inference", n) for n in servers] + [
        ("learner", n) for n in learners]
    addresses = [f"{n}:7000" for n in servers]
    for pid, (_, _node, st) in enumerate(procs[len(servers):]):
        assert st[0] == ".venv-accel/bin/python -m hcjax.cluster.storage /shared/run"
        assert st[1] == ".venv-accel/bin/python -m hcjax.cluster.wait_ready " + " ".join(addresses)
        assert not any("sleep" in s for s in st)
        env, args = env_and_args(st[2], "hcjax.climb")
        assert env == {}
        ns = parse(args)
        assert ns.inference_address == addresses
        if learner_nodes > 1:
            assert (ns.coordinator_address, ns.num_processes, ns.process_id) == (
                f"{learners[0]}:8476", learner_nodes, pid)
        else:
            assert ns.coordinator_address is None
    for _, _, st in procs[:len(servers)]:
        env, args = env_and_args(st[-1], "hcjax.serve")
        assert env == {"HCJAX_TRUSTED_PEERS": ",".join(learners)}  # weights only from learners
        server = config.parse_flags(args, description="", default_gin_files=["tiny_cpu.gin"],
                                    extra_args=serve._extra_args)
        assert server.extra.host == "0.0.0.0" and server.extra.port == 7000
        check_sizes(server.extra)


def test_gpu_slurm_needs_nodes_outside_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    out = run("gpu_slurm.sbatch", "--dry_run")
    assert out.returncode == 2 and "not inside a SLURM job" in out.stderr
    out = run("gpu_slurm.sbatch", "--dry_run", "--nodes", "only1")
    assert out.returncode == 2 and "need at least 2 nodes" in out.stderr
    out = run("gpu_slurm.sbatch", "--dry_run", "--nodes", "a b", "--learner_nodes", "2")
    assert out.returncode == 2 and "learner_nodes=2" in out.stderr


def test_storage_check_refuses_local_disk(tmp_path):
    from hcjax.cluster import storage

    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nfs:/x {tmp_path}/shared nfs4 rw 0 0\n")
    with pytest.raises(ValueError, match="local to this host"):
        storage.check(str(tmp_path / "local"), mounts=str(mounts))
    assert storage.check(str(tmp_path / "shared" / "run"), mounts=str(mounts)) == "nfs4"
    assert storage.check(str(tmp_path / "local"), allow_local=True, mounts=str(mounts)) == "ext4"
    assert storage.gcs_mount("gs://b/x/y") == ("/mnt/gcs/b/x/y", "b")


def test_multi_host_launchers_need_a_token_before_starting_anything(monkeypatch):
    # Their inference processes serve 0.0.0.0, which hcjax.serve refuses without a token.
    for var in ("HCJAX_TOKEN", "HCJAX_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    out = run("gpu_slurm.sbatch", "--nodes", "gpu1 gpu2")
    assert out.returncode == 2 and "set HCJAX_TOKEN or HCJAX_TOKEN_FILE" in out.stderr
    assert out.stdout == ""
    out = run("tpu_pod.sh", "--zone", "z", "--learner_tpus", "l", "--learner_type", "v5p-8",
              "--inference_tpus", "i", "--inference_type", "v5p-8", "--output_dir", "/s")
    assert out.returncode == 2 and "set HCJAX_TOKEN_FILE" in out.stderr
    assert out.stdout == ""


@pytest.mark.parametrize("slices, replicas", [(1, 1), (2, 2)])
def test_jobset_manifest_places_each_role_on_whole_slices(slices, replicas):
    import yaml

    from hcjax.cluster.jobset import jobset

    text = jobset(name="c", image="img", learner_topology="v5p-16", learner_slices=slices,
                  inference_topology="v5p-8", inference_replicas=replicas,
                  output_dir="gs://bkt/run", token_secret="tok", extra=["--mode", "on_policy"])
    doc = yaml.safe_load(text)
    assert doc["kind"] == "JobSet"
    jobs = {j["name"]: j for j in doc["spec"]["replicatedJobs"]}
    learner, inference = jobs["learner"], jobs["inference"]
    assert (learner["replicas"], learner["template"]["spec"]["parallelism"]) == (slices, 2)
    assert inference["replicas"] == replicas
    pod = learner["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                   "cloud.google.com/gke-tpu-topology": "2x2x2"}
    [container] = pod["containers"]
    assert container["resources"]["limits"]["google.com/tpu"] == 4
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["HCJAX_TOKEN_FILE"] == "/var/run/hcjax/token"
    if slices > 1:
        assert env["MEGASCALE_NUM_SLICES"] == "2"
        assert env["MEGASCALE_COORDINATOR_ADDRESS"] == "c-learner-0-0.c:8081"
        assert "job-index" in env["MEGASCALE_SLICE_ID"]["fieldRef"]["fieldPath"]
    else:
        assert "MEGASCALE_NUM_SLICES" not in env
    script = container["command"][2]
    st = steps(script)
    assert st[0] == "python -m hcjax.cluster.storage /mnt/gcs/bkt/run"
    assert st[1] == "python -m hcjax.cluster.wait_ready " + " ".join(
        f"c-inference-{r}-0.c:50151" for r in range(replicas))
    # Every pod's process id follows from its slice and worker index; the rest parses.
    climb_line = st[2].replace("$((SLICE_ID * 2 + WORKER_ID))", "0")
    ns = parse(shlex.split(climb_line)[3:])
    assert ns.num_processes == 2 * slices and ns.mode == "on_policy"
    assert ns.coordinator_address == "c-learner-0-0.c:8476"
    serve_pod = inference["template"]["spec"]["template"]["spec"]["containers"][0]
    assert "hcjax.cluster.wait_ready" in serve_pod["readinessProbe"]["exec"]["command"]
    server = parse_serve(serve_pod["command"][2])
    assert server.extra.host == "0.0.0.0"
    with pytest.raises(ValueError, match="single-host slice"):
        jobset(name="c", image="i", learner_topology="v5p-16", learner_slices=1,
               inference_topology="v5p-16", inference_replicas=1, output_dir="/s")

"""Who runs where: the environment and command line of every process of a climb on a TPU pod
(whole slices per role, every host of the learner's slices in one JAX job, multi-slice over DCN)
or a SLURM GPU cluster (a multi-node learner, inference on their own nodes). The shell launchers
and the JobSet generator print and run these; tests check them. Standard library only.

`python -m hcjax.cluster.layout tpu|slurm ...` prints one process a line: ROLE HOST ENV... COMMAND.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from collections.abc import Mapping, Sequence

from hcjax.cluster.storage import gcs_mount

__all__ = ["Process", "SliceShape", "slurm_processes", "tpu_processes", "tpu_slice"]

JAX_VERSION = ">=0.9,<0.11"  # requirements.txt's line
MEGASCALE_PORT = 8081  # the DCN port multislice JAX (and Ray's, XPK's launchers) use
COORDINATOR_PORT = 8476  # jax.distributed's coordinator
SERVE_PORT = 50151
VENV = ".venv-accel"  # not the CPU .venv: the accelerator's jax is installed here


@dataclasses.dataclass(frozen=True)
class SliceShape:
    """One TPU slice: chips, hosts (VMs) and the GKE node labels that select it."""

    accelerator: str
    chips: int
    hosts: int
    gke_accelerator: str
    gke_topology: str

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts


# Chips per TensorCore count and the 3-D (v4, v5p) or 2-D (v5e, v6e) topologies GKE names.
_TOPOLOGY_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
                256: "4x8x8", 512: "8x8x8", 1024: "8x8x16"}
_TOPOLOGY_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
                256: "16x16"}
_GKE = {"v4": "tpu-v4-podslice", "v5p": "tpu-v5p-slice", "v5litepod": "tpu-v5-lite-podslice",
        "v6e": "tpu-v6e-slice"}


def tpu_slice(accelerator: str) -> SliceShape:
    """The shape of a Cloud TPU accelerator type: v4-N / v5p-N (N TensorCores, 2 per chip,
    4 chips per host) or v5litepod-N / v6e-N (N chips; 8 on one host up to 8, else 4 per host)."""
    family, _, count = accelerator.rpartition("-")
    if family not in _GKE or not count.isdigit():
        raise ValueError(f"accelerator type {accelerator!r}: expected v4-N, v5p-N, v5litepod-N "
                         "or v6e-N (e.g. v5p-64)")
    n = int(count)
    if family in ("v4", "v5p"):
        chips, table = n // 2, _TOPOLOGY_3D
        hosts = max(1, chips // 4)
    else:
        chips, table = n, _TOPOLOGY_2D
        hosts = 1 if chips <= 8 else chips // 4
    if chips not in table:
        raise ValueError(f"accelerator type {accelerator!r} ({chips} chips) is not a slice shape "
                         f"this launcher knows; known chip counts: {sorted(table)}")
    return SliceShape(accelerator, chips, hosts, _GKE[family], table[chips])


@dataclasses.dataclass(frozen=True)
class Process:
    """One process of the climb: its role, where it runs, its environment and command."""

    role: str  # "learner" or "inference"
    host: str  # hostname, IP or TPU worker it runs on
    env: Mapping[str, str]
    argv: Sequence[str]
    group: str = ""  # the TPU slice (or SLURM node) it belongs to
    worker: int = 0  # its index inside that slice
    setup: Sequence[str] = ()  # shell steps run first, in order (install, checks, readiness)

    def script(self) -> str:
        """The setup steps then the command, joined with &&: what the host runs."""
        return " && ".join([*self.setup, self.command()])

    def command(self) -> str:
        """`env K=V ... argv`, shell-quoted."""
        env = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join(["env", *env, *map(shlex.quote, self.argv)] if env else
                        map(shlex.quote, self.argv))

    def line(self) -> str:
        return f"{self.role} {self.host} {self.script()}"


def install_step(accelerator: str, venv: str = VENV) -> str:
    """Create `venv` with hcjax's requirements and the accelerator's jax, once per host."""
    jax = shlex.quote(f"jax[{accelerator}]{JAX_VERSION}")
    return (f"{{ test -x {venv}/bin/python || {{ python3 -m venv {venv} && "
            f"{venv}/bin/pip install -q -r requirements.txt {jax}; }}; }}")


def storage_steps(output_dir: str, python: str) -> tuple[str, list[str]]:
    """(the path processes use, the steps that mount and check it): gs://B/P is mounted with
    gcsfuse at /mnt/gcs/B; every output folder is checked to be shared and writable."""
    path, bucket = gcs_mount(output_dir)
    steps = []
    if bucket:
        mnt = shlex.quote(f"/mnt/gcs/{bucket}")
        steps.append(f"{{ mountpoint -q {mnt} || {{ sudo mkdir -p {mnt} && sudo chown \"$USER\" "
                     f"{mnt} && gcsfuse --implicit-dirs {shlex.quote(bucket)} {mnt}; }}; }}")
    steps.append(f"{python} -m hcjax.cluster.storage {shlex.quote(path)}")
    return path, steps


def wait_step(python: str, addresses: Sequence[str]) -> str:
    return " ".join([python, "-m", "hcjax.cluster.wait_ready", *addresses])


def gin_flags(extra: Sequence[str]) -> list[str]:
    """The --gin_file / --gin_param flags among the learner's extra flags (the inference
    processes build the same model); climb_tiny.gin when no --gin_file is given."""
    out, files = [], False
    i = 0
    while i < len(extra):
        arg = extra[i]
        if arg in ("--gin_file", "--gin_param") and i + 1 < len(extra):
            out += [arg, extra[i + 1]]
            files |= arg == "--gin_file"
            i += 2
            continue
        if arg.startswith(("--gin_file=", "--gin_param=")):
            out.append(arg)
            files |= arg.startswith("--gin_file=")
        i += 1
    return out if files else ["--gin_file", "climb_tiny.gin", *out]


def _security_env(env: Mapping[str, str]) -> dict[str, str]:
    """Security settings passed on to every process (a token file's path, never a token)."""
    return {k: env[k] for k in ("HCJAX_TOKEN_FILE", "HCJAX_TLS_DIR", "HCJAX_TLS_SERVER_NAME")
            if env.get(k)}


def _serve_argv(python: str, port: int, sizes: Sequence[str], extra: Sequence[str]) -> list[str]:
    return [python, "-m", "hcjax.serve", "--host", "0.0.0.0", "--port", str(port), *sizes,
            *gin_flags(extra)]


def _learner_argv(python: str, output_dir: str, coordinator: str, num_processes: int,
                  process_id: int, inference: Sequence[str], extra: Sequence[str]) -> list[str]:
    argv = [python, "-m", "hcjax.climb", "--output_dir", output_dir]
    if num_processes > 1:
        argv += ["--coordinator_address", coordinator, "--num_processes", str(num_processes),
                 "--process_id", str(process_id)]
    for address in inference:
        argv += ["--inference_address", address]
    return argv + list(extra)


def tpu_processes(
    learner_slices: Mapping[str, Sequence[str]],
    inference_slices: Mapping[str, Sequence[str]],
    *,
    output_dir: str,
    extra: Sequence[str] = (),
    sizes: Sequence[str] = (),
    port: int = SERVE_PORT,
    python: str = f"{VENV}/bin/python",
    env: Mapping[str, str] | None = None,
    accelerator: str = "tpu",
) -> list[Process]:
    """Processes of a climb on TPU slices, given each slice's host addresses (worker 0 first).

    Learner: every host of every learner slice in one JAX job (process ids slice by slice, as
    multislice JAX numbers them), coordinator = worker 0 of the first slice; with several slices
    the MEGASCALE_* variables join them over DCN. Inference: one `hcjax.serve` per single-host
    slice; they pull weights only from the learner hosts.
    """
    if not learner_slices or not inference_slices:
        raise ValueError("need at least one learner slice and one inference slice")
    for name, hosts in inference_slices.items():
        if len(hosts) != 1:
            raise ValueError(f"inference slice {name!r} has {len(hosts)} hosts; an inference "
                             "process (hcjax.serve) uses one host's chips: use single-host slices "
                             "(e.g. v5p-8, v5litepod-8, v6e-8) and more replicas")
    sizes_per_slice = {len(h) for h in learner_slices.values()}
    if len(sizes_per_slice) != 1:
        raise ValueError(f"learner slices differ in hosts: "
                         f"{ {n: len(h) for n, h in learner_slices.items()} }")
    security = _security_env(env or {})
    learner_hosts = [h for hosts in learner_slices.values() for h in hosts]
    inference = [f"{hosts[0]}:{port}" for hosts in inference_slices.values()]
    install = install_step(accelerator)
    output_dir, storage = storage_steps(output_dir, python)
    learner_setup = [install, *storage, wait_step(python, inference)]
    procs = [Process("inference", hosts[0], {**security,
                                             "HCJAX_TRUSTED_PEERS": ",".join(learner_hosts)},
                     _serve_argv(python, port, sizes, extra), group=name, setup=[install])
             for name, hosts in inference_slices.items()]
    coordinator = f"{learner_hosts[0]}:{COORDINATOR_PORT}"
    num = len(learner_hosts)
    pid = 0
    for slice_id, (name, hosts) in enumerate(learner_slices.items()):
        for worker, host in enumerate(hosts):
            penv = dict(security)
            if len(learner_slices) > 1:
                penv.update(MEGASCALE_COORDINATOR_ADDRESS=f"{learner_hosts[0]}:{MEGASCALE_PORT}",
                            MEGASCALE_NUM_SLICES=str(len(learner_slices)),
                            MEGASCALE_SLICE_ID=str(slice_id), MEGASCALE_PORT=str(MEGASCALE_PORT))
            procs.append(Process("learner", host, penv,
                                 _learner_argv(python, output_dir, coordinator, num, pid,
                                               inference, extra), group=name, worker=worker,
                                 setup=learner_setup))
            pid += 1
    return procs


def slurm_processes(
    nodes: Sequence[str],
    *,
    learner_nodes: int,
    output_dir: str,
    extra: Sequence[str] = (),
    sizes: Sequence[str] = (),
    port: int = SERVE_PORT,
    python: str = f"{VENV}/bin/python",
    env: Mapping[str, str] | None = None,
    accelerator: str = "cuda12",
) -> list[Process]:
    """Processes of a climb on a SLURM allocation: the first `learner_nodes` nodes run the
    learner, one process per node on all its GPUs (coordinator on the first node); every other
    node runs one inference process."""
    if not 1 <= learner_nodes < len(nodes):
        raise ValueError(f"need 1 <= learner_nodes={learner_nodes} < nodes={len(nodes)} (at "
                         "least one node for inference)")
    security = _security_env(env or {})
    learners, servers = list(nodes[:learner_nodes]), list(nodes[learner_nodes:])
    inference = [f"{n}:{port}" for n in servers]
    # The repository (and its venv) is on the cluster's shared home: the batch script installs
    # once (install_step) before any process starts, rather than every node at once.
    output_dir, storage = storage_steps(output_dir, python)
    learner_setup = [*storage, wait_step(python, inference)]
    procs = [Process("inference", n, {**security, "HCJAX_TRUSTED_PEERS": ",".join(learners)},
                     _serve_argv(python, port, sizes, extra), group=n)
             for n in servers]
    coordinator = f"{learners[0]}:{COORDINATOR_PORT}"
    procs += [Process("learner", n, dict(security),
                      _learner_argv(python, output_dir, coordinator, len(learners), i, inference,
                                    extra), group=n, worker=i, setup=learner_setup)
              for i, n in enumerate(learners)]
    return procs


def _slices(spec: str) -> dict[str, list[str]]:
    """'name=h0,h1;name2=h2,h3' -> {name: [h0, h1], name2: [h2, h3]}."""
    out = {}
    for part in filter(None, spec.split(";")):
        name, _, hosts = part.partition("=")
        if not hosts:
            raise ValueError(f"slice spec {part!r}: expected NAME=HOST[,HOST...]")
        out[name] = hosts.split(",")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("platform", choices=("tpu", "slurm", "install"))
    parser.add_argument("--accelerator", default="cuda12", help="install: jax extra")
    parser.add_argument("--learner", default="", help="tpu: NAME=HOST,...;NAME=HOST,...")
    parser.add_argument("--inference", default="", help="tpu: NAME=HOST;NAME=HOST")
    parser.add_argument("--nodes", default="", help="slurm: the allocation's nodes")
    parser.add_argument("--learner_nodes", type=int, default=1)
    parser.add_argument("--output_dir", default="")
    parser.add_argument("--port", type=int, default=SERVE_PORT)
    parser.add_argument("--python", default=f"{VENV}/bin/python")
    parser.add_argument("--sizes", default="", help="engine size flags for hcjax.serve")
    parser.add_argument("--slice_of_hosts", action="store_true",
                        help="tpu: print HOST SLICE WORKER per host instead")
    args, extra = parser.parse_known_args(argv)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    common = dict(output_dir=args.output_dir, extra=extra, sizes=args.sizes.split(),
                  port=args.port, python=args.python, env=os.environ)
    if args.platform == "install":
        print(install_step(args.accelerator))
        return 0
    try:
        if args.platform == "tpu":
            procs = tpu_processes(_slices(args.learner), _slices(args.inference), **common)
        else:
            procs = slurm_processes(args.nodes.split(), learner_nodes=args.learner_nodes,
                                    **common)
    except ValueError as err:
        print(f"hcjax.cluster.layout: {err}", file=sys.stderr)
        return 2
    for p in procs:
        print(f"{p.host} {p.group} {p.worker}" if args.slice_of_hosts else p.line())
    return 0


if __name__ == "__main__":
    # Not hcjax.config.run_main (it needs gin): the launchers run this with the host's python3
    # before any install step, so only the standard library is there; main prints its own
    # one-line errors and returns the exit status.
    raise SystemExit(main())

"""`Placement`: which role of the climb runs on which devices, in one gin-configured object (the
learner mesh, the inference meshes, or the addresses of remote inference processes), checked
against the devices present before anything is compiled, and how the roles run (`backend`: this
process and the addresses given, or Ray actors in a placement group whose bundles `RayPlacement`
derives from the meshes). No entry point builds a mesh itself; nothing here starts a process."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import gin

from hcjax.sharding import MeshConfig, make_mesh

__all__ = ["BACKENDS", "Placement", "RayBundle", "RayPlacement", "ResolvedPlacement"]

_IN_PROCESS = {"fsdp": -1, "num_devices": 1}
# "local": the learner in this process, inference in-process or at inference_addresses;
# "ray": every role a Ray actor (hcjax.ray_placement), the bundles from RayPlacement.
BACKENDS = ("local", "ray")


def _mesh_config(value: Any, binding: str) -> MeshConfig:
    if isinstance(value, MeshConfig):
        return value
    if isinstance(value, Mapping):
        fields = {f.name for f in dataclasses.fields(MeshConfig)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"{binding}={dict(value)} has unknown keys {unknown}; MeshConfig "
                             f"takes {sorted(fields)}")
        return MeshConfig(**{"fsdp": -1, **value})
    raise ValueError(f"{binding}={value!r} is not a MeshConfig or a dict of its fields "
                     "(e.g. {'fsdp': 2, 'device_offset': 0, 'num_devices': 2})")


@dataclasses.dataclass(frozen=True)
class ResolvedPlacement:
    """The meshes of a placement on this process's devices."""

    learner_mesh: Any
    inference_meshes: tuple[Any, ...]
    inference_addresses: tuple[str, ...]

    @property
    def remote(self) -> bool:
        return bool(self.inference_addresses)

    def describe(self) -> dict[str, Any]:
        def mesh(m) -> dict[str, Any]:
            return {"shape": dict(m.shape), "devices": [int(d.id) for d in m.devices.flat]}

        return {"kind": "remote" if self.remote else "in_process",
                "learner": mesh(self.learner_mesh),
                "inference": ([mesh(m) for m in self.inference_meshes] if not self.remote
                              else list(self.inference_addresses))}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Placement:
    """learner_mesh: the learner's MeshConfig (or a dict of its fields), e.g.
    `Placement.learner_mesh = {"fsdp": 2, "num_devices": 2}`.
    inference_meshes: one MeshConfig per in-process inference replica, on devices disjoint from
    the learner's (each replica is an engine + continuous-batching server; requests go to the
    least loaded).
    inference_addresses: host:port of remote `python -m hcjax.serve` processes; when given, no
    in-process replica is built and weights move by reshard plans over gRPC.
    backend: "local" (the above, from this process) or "ray": the learner and one inference
    replica per inference mesh run as Ray actors, each in its own bundle of a placement group
    (`RayPlacement` says which Ray resources a mesh's devices are), and the climb reaches the
    replicas as remote ones.
    """

    learner_mesh: Any = dataclasses.field(default_factory=lambda: dict(_IN_PROCESS))
    inference_meshes: Sequence[Any] = (
        {"fsdp": -1, "device_offset": 1, "num_devices": 1},)
    inference_addresses: Sequence[str] = ()
    backend: str = "local"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"Placement.backend={self.backend!r} is not one of {BACKENDS}")
        if self.backend == "ray" and self.inference_addresses:
            raise ValueError(
                f"Placement.inference_addresses={list(self.inference_addresses)} with "
                "Placement.backend='ray': the Ray placement starts its own replicas, one per "
                "Placement.inference_meshes entry; give one or the other")

    def resolve(self, devices: Sequence[Any]) -> ResolvedPlacement:
        """Build the meshes on `devices`; every error names the Placement binding at fault."""
        learner_cfg = _mesh_config(self.learner_mesh, "Placement.learner_mesh")
        learner = self._make(learner_cfg, devices, "Placement.learner_mesh")
        addresses = tuple(self.inference_addresses)
        for a in addresses:
            host, _, port = str(a).rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"Placement.inference_addresses has {a!r}; expected host:port")
        if addresses:
            return ResolvedPlacement(learner, (), addresses)
        if not self.inference_meshes:
            raise ValueError("Placement.inference_meshes is empty and no inference_addresses are "
                             "given: the climb has nowhere to generate rollouts")
        taken = {int(d.id): "Placement.learner_mesh" for d in learner.devices.flat}
        meshes = []
        for i, value in enumerate(self.inference_meshes):
            binding = f"Placement.inference_meshes[{i}]"
            mesh = self._make(_mesh_config(value, binding), devices, binding)
            for d in mesh.devices.flat:
                other = taken.get(int(d.id))
                if other is not None:
                    raise ValueError(
                        f"{binding} uses device {int(d.id)}, which {other} uses too; learner and "
                        "inference replicas need disjoint devices (set device_offset)")
                taken[int(d.id)] = binding
            meshes.append(mesh)
        return ResolvedPlacement(learner, tuple(meshes), ())

    @staticmethod
    def _make(cfg: MeshConfig, devices: Sequence[Any], binding: str):
        try:
            return make_mesh(cfg, devices)
        except ValueError as err:
            raise ValueError(
                f"{binding}={cfg} cannot be formed from the {len(devices)} devices present: "
                f"{err}. On CPU, more devices come from "
                "XLA_FLAGS=--xla_force_host_platform_device_count=N (HCJAX_CPU_DEVICES for "
                "python -m hcjax.climb)") from None


# The Ray placement's bundles (no Ray here: hcjax.ray_placement starts the actors) -----------

_ACCELERATORS = ("CPU", "GPU", "TPU")
_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclasses.dataclass(frozen=True)
class RayBundle:
    """One bundle of the Ray placement group and the actor that runs in it.

    role: "learner" or "inference"; index: the learner process id or the replica number;
    resources: the bundle in Ray's resource names (the actor asks for exactly these);
    devices: accelerator devices the actor's process sees; mesh: its mesh in that process
    (device_offset 0: every actor has its own devices); env: its process environment (on CPU,
    XLA's host device count)."""

    role: str
    index: int
    resources: dict[str, float]
    devices: int
    mesh: MeshConfig
    env: dict[str, str]


def _device_count(cfg: MeshConfig, binding: str) -> int:
    """The number of devices a mesh spans, which a bundle must state."""
    sizes = cfg.sizes()
    fill = [a for a, v in sizes.items() if v == -1]
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if cfg.num_devices is None:
        if fill:
            raise ValueError(f"{binding}={cfg} leaves its device count open ({fill[0]}=-1 and "
                             "num_devices=None); a Ray bundle needs one: set num_devices")
        return fixed
    n = cfg.num_devices
    if n < 1 or (n % fixed if fill else n != fixed):
        raise ValueError(f"{binding}={cfg}: num_devices={n} does not fit its axes {sizes}")
    return n


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RayPlacement:
    """How `Placement.backend = "ray"` runs (hcjax.ray_placement): one bundle per learner
    process and per inference replica (`Placement.inference_meshes`), each mesh's devices
    expressed as Ray resources.

    address: an existing Ray cluster ("auto", "HOST:PORT", "ray://HOST:PORT"); None starts a
      local Ray instance for the run and shuts it down after.
    num_cpus: CPUs the local instance offers (None: what the bundles ask for); not with address.
    accelerator: what a mesh's devices are: "CPU" (each actor's process gets that many XLA host
      devices), "GPU" (Ray's GPU resource) or "TPU" (TPU chips, Ray's TPU resource).
    cpus_per_actor: CPUs in each bundle beside its devices.
    learner_processes: learner actors over the learner mesh (jax.distributed; the first also
      runs the controller); each holds learner devices / learner_processes devices.
    strategy: the placement group's strategy (PACK: as few nodes as possible).
    host: the address replicas bind; 127.0.0.1 for one machine; across nodes "0.0.0.0" with
      a shared token (HCJAX_TOKEN) and HCJAX_TRUSTED_PEERS, as for `python -m hcjax.serve`.
    ready_timeout: seconds for the placement group's resources and the replicas to be ready.
    object_store_mb: the local instance's object store (the climb passes little through it).
    """

    address: str | None = None
    num_cpus: int | None = None
    accelerator: str = "CPU"
    cpus_per_actor: float = 1.0
    learner_processes: int = 1
    strategy: str = "PACK"
    host: str = "127.0.0.1"
    ready_timeout: float = 900.0
    object_store_mb: int = 256

    def __post_init__(self) -> None:
        if self.accelerator not in _ACCELERATORS:
            raise ValueError(f"RayPlacement.accelerator={self.accelerator!r} is not one of "
                             f"{_ACCELERATORS}")
        if self.strategy not in _STRATEGIES:
            raise ValueError(f"RayPlacement.strategy={self.strategy!r} is not one of "
                             f"{_STRATEGIES}")
        if not self.cpus_per_actor > 0:
            raise ValueError(f"RayPlacement.cpus_per_actor={self.cpus_per_actor} must be > 0")
        if self.learner_processes < 1:
            raise ValueError(f"RayPlacement.learner_processes={self.learner_processes} must be "
                             ">= 1")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"RayPlacement.num_cpus={self.num_cpus} must be >= 1 or None")
        if self.num_cpus is not None and self.address is not None:
            raise ValueError(f"RayPlacement.num_cpus={self.num_cpus} with RayPlacement.address="
                             f"{self.address!r}: num_cpus sizes a local instance only")
        if not self.ready_timeout > 0:
            raise ValueError(f"RayPlacement.ready_timeout={self.ready_timeout} must be > 0")
        if self.object_store_mb < 80:
            raise ValueError(f"RayPlacement.object_store_mb={self.object_store_mb} is below "
                             "Ray's minimum of 80")

    def bundles(self, placement: Placement) -> list[RayBundle]:
        """The learner processes' bundles, then one per inference replica; errors name the
        binding at fault (Placement.* or RayPlacement.*)."""
        if placement.backend != "ray":
            raise ValueError(f"Placement.backend={placement.backend!r}: RayPlacement only places "
                             "Placement.backend='ray'")
        learner_cfg = _mesh_config(placement.learner_mesh, "Placement.learner_mesh")
        learner_devices = _device_count(learner_cfg, "Placement.learner_mesh")
        processes = self.learner_processes
        if learner_devices % processes:
            raise ValueError(f"RayPlacement.learner_processes={processes} does not divide the "
                             f"{learner_devices} devices of Placement.learner_mesh")
        if not placement.inference_meshes:
            raise ValueError("Placement.inference_meshes is empty: the Ray placement starts one "
                             "inference replica per entry")
        # Every learner process builds the mesh over all of them (jax.distributed).
        learner_mesh = dataclasses.replace(learner_cfg, device_offset=0,
                                           num_devices=learner_devices)
        out = [self._bundle("learner", i, learner_devices // processes, learner_mesh)
               for i in range(processes)]
        for i, value in enumerate(placement.inference_meshes):
            binding = f"Placement.inference_meshes[{i}]"
            cfg = _mesh_config(value, binding)
            n = _device_count(cfg, binding)
            out.append(self._bundle("inference", i, n, dataclasses.replace(
                cfg, device_offset=0, num_devices=n)))
        return out

    def _bundle(self, role: str, index: int, devices: int, mesh: MeshConfig) -> RayBundle:
        resources = {"CPU": float(self.cpus_per_actor)}
        env = {}
        if self.accelerator == "CPU":
            env = {"JAX_PLATFORMS": "cpu",
                   "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        else:
            resources[self.accelerator] = float(devices)
        return RayBundle(role, index, resources, devices, mesh, env)

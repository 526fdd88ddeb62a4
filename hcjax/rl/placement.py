"""`Placement`: which role of the climb runs on which devices, in one gin-configured object (the
learner mesh, the inference meshes, or the addresses of remote inference processes), checked
against the devices present before anything is compiled. No entry point builds a mesh itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import gin

from hcjax.sharding import MeshConfig, make_mesh

__all__ = ["Placement", "ResolvedPlacement"]

_IN_PROCESS = {"fsdp": -1, "num_devices": 1}


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
    """

    learner_mesh: Any = dataclasses.field(default_factory=lambda: dict(_IN_PROCESS))
    inference_meshes: Sequence[Any] = (
        {"fsdp": -1, "device_offset": 1, "num_devices": 1},)
    inference_addresses: Sequence[str] = ()

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

"""Replica expansion: a plan made for one learner group and one inference replica, remapped at run
time onto D learner data-parallel groups feeding disjoint subsets of R inference replicas.

Replicas joining or leaving only change the expansion; the plan itself is never rebuilt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from hcjax.transfer.local import ExecutionResult, execute_entries, source_leaves
from hcjax.transfer.plan import PlanError, TransferEntry, TransferPlan, shard_boxes


def data_parallel_groups(mesh: Mesh, axis: str = "data") -> list[Mesh]:
    """Split a learner mesh along its data-parallel `axis` into one sub-mesh per group."""
    if axis not in mesh.axis_names:
        raise ValueError(f"axis={axis!r} is not an axis of the mesh {mesh.axis_names}")
    k = mesh.axis_names.index(axis)
    names = tuple(n for n in mesh.axis_names if n != axis)
    return [Mesh(np.take(mesh.devices, i, axis=k), names) for i in range(mesh.devices.shape[k])]


def _single_mesh(shardings: Sequence[jax.sharding.Sharding], side: str) -> Mesh:
    meshes = {s.mesh for s in shardings if isinstance(s, NamedSharding)}
    if len(meshes) != 1 or not all(isinstance(s, NamedSharding) for s in shardings):
        raise ValueError(
            f"replica expansion needs every {side} leaf on one NamedSharding mesh; found "
            f"{len(meshes)} meshes and {sum(not isinstance(s, NamedSharding) for s in shardings)} "
            "other shardings"
        )
    return meshes.pop()


def _device_map(template: Mesh, target: Mesh, what: str) -> dict[int, int]:
    if template.devices.shape != target.devices.shape or template.axis_names != target.axis_names:
        raise ValueError(
            f"{what} mesh {dict(target.shape)} does not match the plan's mesh {dict(template.shape)}"
        )
    return {int(a.id): int(b.id) for a, b in zip(template.devices.flat, target.devices.flat)}


def assign_replicas(replicas: Sequence[Hashable], num_groups: int) -> dict[Hashable, int]:
    """Contiguous, balanced chunks: replica k (in sorted order) is fed by group k*D//R."""
    if num_groups <= 0:
        raise ValueError(f"num_groups={num_groups} must be positive")
    ordered = sorted(replicas, key=str)
    return {r: k * num_groups // len(ordered) for k, r in enumerate(ordered)}


@dataclasses.dataclass
class ExpandedPlan:
    plan: TransferPlan
    groups: tuple[Mesh, ...]
    replicas: dict[Hashable, Mesh]
    assignment: dict[Hashable, int]  # replica -> learner group that feeds it
    # Remapped entries per replica, made once: the same list object lets the executor reuse
    # its schedule (chunks and compiled copies) from one execution to the next.
    _entries: dict[Hashable, list[TransferEntry]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def with_replicas(self, replicas: Mapping[Hashable, Mesh]) -> ExpandedPlan:
        """The same plan over another set of live replicas (joined or left)."""
        return expand_plan(self.plan, self.groups, replicas)

    def entries_for(self, replica: Hashable) -> list[TransferEntry]:
        if replica not in self._entries:
            self._entries[replica] = self._remapped_entries(replica)
        return self._entries[replica]

    def _remapped_entries(self, replica: Hashable) -> list[TransferEntry]:
        src_map = _device_map(self.plan_source_mesh, self.groups[self.assignment[replica]], "group")
        dst_map = _device_map(self.plan_destination_mesh, self.replicas[replica], "replica")
        devices = {d.id: d for d in jax.devices()}
        return [
            dataclasses.replace(
                e,
                src_device=src_map[e.src_device],
                src_process=devices[src_map[e.src_device]].process_index,
                dst_device=dst_map[e.dst_device],
                dst_process=devices[dst_map[e.dst_device]].process_index,
            )
            for e in self.plan.entries
        ]

    def destination_shardings(self, replica: Hashable) -> dict[str, NamedSharding]:
        mesh = self.replicas[replica]
        return {p: NamedSharding(mesh, s.sharding.spec) for p, s in self.plan.dst_leaves.items()}

    @property
    def plan_source_mesh(self) -> Mesh:
        return _single_mesh([s.sharding for s in self.plan.src_leaves.values()], "source")

    @property
    def plan_destination_mesh(self) -> Mesh:
        return _single_mesh([s.sharding for s in self.plan.dst_leaves.values()], "destination")

    @property
    def bytes_moved(self) -> int:
        return self.plan.bytes_moved * len(self.replicas)

    def _check_source(self, leaves: Mapping[str, Any]) -> None:
        """Each group must hold the same boxes as the plan's template group (params replicated
        across data-parallel groups); otherwise remapped entries would read the wrong data."""
        problems = []
        for g, group in enumerate(self.groups):
            dev_map = _device_map(self.plan_source_mesh, group, "group")
            for path, spec in self.plan.src_leaves.items():
                template = {d.id: b for d, b in shard_boxes(spec.sharding, spec.shape).items()}
                actual = {
                    d.id: b for d, b in shard_boxes(leaves[path].sharding, spec.shape).items()
                }
                for t_id, box in template.items():
                    if actual.get(dev_map[t_id]) != box:
                        problems.append(
                            f"{path}: group {g} device {dev_map[t_id]} holds "
                            f"{actual.get(dev_map[t_id])}, the plan expects {box}"
                        )
                        break
        if problems:
            raise PlanError(problems)

    def execute(self, source: Any, max_bytes_in_flight: int = 64 << 20) -> dict[Hashable, Any]:
        """Every group feeds its replicas in its own thread; returns replica -> fresh tree."""
        leaves = source_leaves(self.plan, source)
        self._check_source(leaves)

        def feed(group: int) -> dict[Hashable, ExecutionResult]:
            return {
                r: execute_entries(
                    self.plan,
                    leaves,
                    self.entries_for(r),
                    self.destination_shardings(r),
                    max_bytes_in_flight=max_bytes_in_flight,
                )
                for r, g in self.assignment.items()
                if g == group
            }

        with ThreadPoolExecutor(max_workers=len(self.groups)) as pool:
            results = {}
            for part in pool.map(feed, range(len(self.groups))):
                results.update(part)
        return {r: self.plan.unflatten(res.leaves) for r, res in results.items()}

    def __str__(self) -> str:
        lines = [
            f"ExpandedPlan: {len(self.groups)} learner groups -> {len(self.replicas)} replicas, "
            f"{len(self.plan.entries)} entries per replica"
        ]
        for g in range(len(self.groups)):
            fed = [str(r) for r, a in self.assignment.items() if a == g]
            lines.append(f"  group {g} feeds {fed or 'nothing'}")
        return "\n".join(lines)


def expand_plan(
    plan: TransferPlan, groups: Sequence[Mesh], replicas: Mapping[Hashable, Mesh]
) -> ExpandedPlan:
    """Expand `plan` (made on one group's mesh and one replica's mesh) to all groups/replicas."""
    if not groups:
        raise ValueError("groups=[] : at least one learner group is needed")
    expanded = ExpandedPlan(
        plan, tuple(groups), dict(replicas), assign_replicas(list(replicas), len(groups))
    )
    # Check the meshes now rather than on first execute.
    src_mesh, dst_mesh = expanded.plan_source_mesh, expanded.plan_destination_mesh
    for g, group in enumerate(groups):
        _device_map(src_mesh, group, f"group {g}")
    used: dict[int, Hashable] = {}
    for r, mesh in replicas.items():
        _device_map(dst_mesh, mesh, f"replica {r!r}")
        for d in mesh.devices.flat:
            if d.id in used:
                raise ValueError(f"replica {r!r} shares device {d.id} with replica {used[d.id]!r}")
            used[d.id] = r
    return expanded

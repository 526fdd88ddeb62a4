"""Reshard plans (TransferPlan): one entry per overlap of a source shard and a destination shard,
made once from the two sides' shardings.

The plan sees only pytrees of arrays / ShapeDtypeStructs with shardings (never a model); it is
plain data that can be printed, validated and relabelled to processes. It runs nothing and holds
no compiled state: the executors (local.LocalTransfer in-process, remote.PlanSender/PlanReceiver
across processes) take a plan and execute it many times.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from hcjax.transfer.transforms import (
    TRANSFORM_TYPES,
    Box,
    Route,
    Transform,
    apply_to_array,
    box_volume,
    intersect_boxes,
)


class PlanError(ValueError):
    """The two sides of a plan do not fit together; the message lists every problem."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__(
            f"{len(self.problems)} problem(s) in transfer plan:\n  " + "\n  ".join(self.problems)
        )


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: jax.sharding.Sharding


@dataclasses.dataclass(frozen=True)
class TransferEntry:
    """Copy source[src_index] on src_device to destination[dst_index] on dst_device."""

    src_leaf: str
    dst_leaf: str
    src_device: int
    src_process: int
    dst_device: int
    dst_process: int
    src_index: tuple[slice, ...]
    dst_index: tuple[slice, ...]
    transform: str
    wire_dtype: str  # dtype of the bytes that travel
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.dst_index)

    def __str__(self) -> str:
        return (
            f"{self.src_leaf}{_fmt_index(self.src_index)} dev{self.src_device}(p{self.src_process})"
            f" -> {self.dst_leaf}{_fmt_index(self.dst_index)} dev{self.dst_device}"
            f"(p{self.dst_process}) [{self.transform}] {self.nbytes} B {self.wire_dtype}"
        )


def _fmt_index(index: tuple[slice, ...]) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in index) + "]"


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def path_str(keypath: Sequence[Any]) -> str:
    """'/'-joined names of a pytree key path (dict keys, sequence indices, attribute names)."""
    parts = []
    for key in keypath:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    return "/".join(parts)


def _to_box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    return tuple(tuple(s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def _to_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


def shard_boxes(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict[Any, Box]:
    """Device -> the index box of its shard (replicas share a box)."""
    return {d: _to_box(idx, shape) for d, idx in sharding.devices_indices_map(shape).items()}


def _flatten_source(source: Any) -> tuple[dict[str, LeafSpec], list[str]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(source)
    leaves, problems = {}, []
    for keypath, leaf in flat:
        path = path_str(keypath)
        sharding = getattr(leaf, "sharding", None)
        if sharding is None or not hasattr(leaf, "shape"):
            problems.append(f"source leaf {path!r}={type(leaf).__name__} has no sharding")
            continue
        try:
            sharding.shard_shape(tuple(leaf.shape))
        except ValueError as err:
            problems.append(
                f"source leaf {path!r}: sharding does not fit shape {leaf.shape}: {err}"
            )
            continue
        leaves[path] = LeafSpec(tuple(leaf.shape), np.dtype(leaf.dtype), sharding)
    return leaves, problems


def _flatten_destination(destination: Any) -> tuple[dict[str, Any], Any, list[str]]:
    """Path -> Sharding or ShapeDtypeStruct, plus the treedef to rebuild the tree."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(destination)
    leaves, problems = {}, []
    for keypath, leaf in flat:
        path = path_str(keypath)
        if isinstance(leaf, jax.sharding.Sharding) or getattr(leaf, "sharding", None) is not None:
            leaves[path] = leaf
        else:
            problems.append(
                f"destination leaf {path!r}={type(leaf).__name__} is neither a Sharding nor a "
                "ShapeDtypeStruct with a sharding"
            )
    return leaves, treedef, problems


TransformRules = Mapping[str, Transform | Sequence[Transform]] | None


def _chain_for(path: str, rules: TransformRules, used: set[str]) -> tuple[Transform, ...]:
    """First glob pattern (over '/'-joined paths) that matches wins."""
    for pattern, chain in (rules or {}).items():
        if fnmatch.fnmatchcase(path, pattern):
            used.add(pattern)
            chain = tuple(chain) if isinstance(chain, list | tuple) else (chain,)
            for transform in chain:
                if not isinstance(transform, TRANSFORM_TYPES):
                    raise ValueError(
                        f"{path}: transform {transform!r} for pattern {pattern!r} is not one of "
                        f"{[t.__name__ for t in TRANSFORM_TYPES]}"
                    )
            return chain
    return ()


def _route_for_leaf(path: str, spec: LeafSpec, chain: tuple[Transform, ...]) -> Route:
    route = Route(path, path, spec.shape, spec.dtype)
    for transform in chain:
        route = transform(route)
    return route


def _match_destination(
    by_dst: dict[str, Route], dst_raw: dict[str, Any], problems: list[str]
) -> dict[str, LeafSpec]:
    """Destination specs for the leaves both sides have; shape/dtype/sharding mismatches go to
    `problems`."""
    dst_leaves: dict[str, LeafSpec] = {}
    for path in sorted(set(by_dst) & set(dst_raw)):
        route = by_dst[path]
        leaf = dst_raw[path]
        sharding = leaf if isinstance(leaf, jax.sharding.Sharding) else leaf.sharding
        if not isinstance(leaf, jax.sharding.Sharding):
            if tuple(leaf.shape) != route.shape or np.dtype(leaf.dtype) != route.dtype:
                problems.append(
                    f"destination leaf {path!r}: expected {np.dtype(leaf.dtype).name}"
                    f"{list(leaf.shape)}, the transformed source gives {route.dtype.name}"
                    f"{list(route.shape)}"
                )
                continue
        try:
            sharding.shard_shape(route.shape)
        except ValueError as err:
            problems.append(
                f"destination leaf {path!r}: sharding does not fit shape {route.shape}: {err}"
            )
            continue
        dst_leaves[path] = LeafSpec(route.shape, route.dtype, sharding)
    return dst_leaves


def make_plan(
    source: Any,
    destination: Any,
    transforms: TransformRules = None,
    process_of: Callable[[Any], int] | None = None,
) -> TransferPlan:
    """Compile the movement of `source` (arrays or ShapeDtypeStructs with shardings) into
    `destination` (a pytree of Shardings, or ShapeDtypeStructs whose shape/dtype are checked).

    `transforms` maps glob patterns over source leaf paths ('layers/*/attn/*') to a `Cast` or a
    chain of them; the first matching pattern applies. `process_of(device) -> int` overrides
    `device.process_index` (for processes that do not share one JAX runtime).
    """
    process_of = process_of or (lambda d: d.process_index)
    src_leaves, problems = _flatten_source(source)
    dst_raw, dst_treedef, dst_problems = _flatten_destination(destination)
    problems += dst_problems

    used: set[str] = set()
    by_dst: dict[str, Route] = {}
    for path, spec in src_leaves.items():
        try:
            by_dst[path] = _route_for_leaf(path, spec, _chain_for(path, transforms, used))
        except ValueError as err:
            problems.append(str(err))
    problems += [
        f"transform pattern {p!r} matched no source leaf"
        for p in (transforms or {})
        if p not in used
    ]
    missing = sorted(set(by_dst) - set(dst_raw))
    extra = sorted(set(dst_raw) - set(by_dst))
    if missing:
        problems.append(
            f"missing destination leaves (produced from the source, absent in the destination): {missing}"
        )
    if extra:
        problems.append(f"extra destination leaves (absent from the transformed source): {extra}")

    dst_leaves = _match_destination(by_dst, dst_raw, problems)
    if problems:
        raise PlanError(problems)

    entries: list[TransferEntry] = []
    for path, dst in dst_leaves.items():
        entries += _entries_for_leaf(by_dst[path], src_leaves, dst, process_of)

    plan = TransferPlan(
        entries=tuple(entries),
        routes={(r.src_path, r.path): r for r in by_dst.values()},
        src_leaves=src_leaves,
        dst_leaves=dst_leaves,
        dst_paths=[path_str(k) for k, _ in jax.tree_util.tree_flatten_with_path(destination)[0]],
        dst_treedef=dst_treedef,
    )
    plan.validate()
    return plan


def _entries_for_leaf(
    route: Route,
    src_leaves: dict[str, LeafSpec],
    dst: LeafSpec,
    process_of: Callable[[Any], int],
) -> list[TransferEntry]:
    """One entry per overlap of a source shard and a destination shard (both index the same
    elements: a route keeps the shape)."""
    entries = []
    dst_boxes = shard_boxes(dst.sharding, dst.shape)
    # Spread reads over source replicas: after locality, pick the least-loaded replica.
    load: dict[int, int] = defaultdict(int)
    src = src_leaves[route.src_path]
    replicas: dict[Box, list[Any]] = defaultdict(list)
    for device, box in shard_boxes(src.sharding, src.shape).items():
        replicas[box].append(device)
    itemsize = route.wire_dtype.itemsize
    for dst_device in sorted(dst_boxes, key=lambda d: d.id):
        for box, devices in replicas.items():
            overlap = intersect_boxes(box, dst_boxes[dst_device])
            if overlap is None:
                continue
            device = min(
                devices,
                key=lambda d: (
                    d.id != dst_device.id,
                    process_of(d) != process_of(dst_device),
                    load[d.id],
                    d.id,
                ),
            )
            nbytes = box_volume(overlap) * itemsize
            load[device.id] += nbytes
            entries.append(
                TransferEntry(
                    src_leaf=route.src_path,
                    dst_leaf=route.path,
                    src_device=device.id,
                    src_process=process_of(device),
                    dst_device=dst_device.id,
                    dst_process=process_of(dst_device),
                    src_index=_to_slices(overlap),
                    dst_index=_to_slices(overlap),
                    transform=route.describe(),
                    wire_dtype=route.wire_dtype.name,
                    nbytes=nbytes,
                )
            )
    return entries


def assign_processes(
    entries: Sequence[TransferEntry],
    source: int | Mapping[int, int],
    destination: int | Mapping[int, int],
) -> list[TransferEntry]:
    """Entries with src/dst processes set from a process index or a device id -> process map."""

    def lookup(table: int | Mapping[int, int], device: int) -> int:
        if isinstance(table, int):
            return table
        if device not in table:
            raise ValueError(f"device {device} has no process in {dict(table)}")
        return table[device]

    return [
        dataclasses.replace(
            e,
            src_process=lookup(source, e.src_device),
            dst_process=lookup(destination, e.dst_device),
        )
        for e in entries
    ]


@dataclasses.dataclass
class TransferPlan:
    """The entries of a reshard plus the two sides' leaves, to check them and to rebuild the
    destination tree; data only (see local.LocalTransfer to run it)."""

    entries: tuple[TransferEntry, ...]
    routes: dict[tuple[str, str], Route]
    src_leaves: dict[str, LeafSpec]
    dst_leaves: dict[str, LeafSpec]
    dst_paths: list[str]  # flattening order of the destination tree
    dst_treedef: Any

    @property
    def bytes_moved(self) -> int:
        """Bytes the plan copies (source slices as they travel, after source-side casts)."""
        return sum(e.nbytes for e in self.entries)

    @property
    def bytes_across_devices(self) -> int:
        return sum(e.nbytes for e in self.entries if e.src_device != e.dst_device)

    @property
    def bytes_across_processes(self) -> int:
        return sum(e.nbytes for e in self.entries if e.src_process != e.dst_process)

    @property
    def ideal_bytes(self) -> int:
        """Every destination shard's elements, each exactly once, in the dtype on the wire."""
        total = 0
        for path, dst in self.dst_leaves.items():
            wire = next(r for r in self.routes.values() if r.path == path).wire_dtype
            for box in shard_boxes(dst.sharding, dst.shape).values():
                total += box_volume(box) * wire.itemsize
        return total

    def with_processes(
        self, source: int | Mapping[int, int], destination: int | Mapping[int, int]
    ) -> TransferPlan:
        """Relabel process indices (a process, or device id -> process), e.g. for processes that
        each run their own single-process JAX and so cannot see each other's devices."""
        entries = assign_processes(self.entries, source, destination)
        return dataclasses.replace(self, entries=tuple(entries))

    def validate(self) -> None:
        """Raise PlanError unless every destination element is written exactly once from an
        element that its source device holds."""
        problems = []
        by_dst: dict[tuple[str, int], list[TransferEntry]] = defaultdict(list)
        for entry in self.entries:
            by_dst[(entry.dst_leaf, entry.dst_device)].append(entry)
        src_boxes = {p: shard_boxes(s.sharding, s.shape) for p, s in self.src_leaves.items()}
        src_boxes = {p: {d.id: b for d, b in m.items()} for p, m in src_boxes.items()}
        for path, dst in self.dst_leaves.items():
            for device, shard in shard_boxes(dst.sharding, dst.shape).items():
                pieces = [
                    _to_box(e.dst_index, dst.shape) for e in by_dst.pop((path, device.id), [])
                ]
                covered = sum(box_volume(b) for b in pieces)
                if covered != box_volume(shard):
                    problems.append(
                        f"{path} on device {device.id}: entries cover {covered} of "
                        f"{box_volume(shard)} elements of shard {shard}"
                    )
                for i, box in enumerate(pieces):
                    if intersect_boxes(box, shard) != box:
                        problems.append(
                            f"{path} on device {device.id}: entry box {box} leaves shard {shard}"
                        )
                    for other in pieces[i + 1 :]:
                        if intersect_boxes(box, other) is not None:
                            problems.append(
                                f"{path} on device {device.id}: boxes {box} and {other} overlap"
                            )
        for (path, device), stray in by_dst.items():
            problems.append(
                f"{len(stray)} entries write {path!r} on device {device}, which holds no shard of it"
            )
        for entry in self.entries:
            route = self.routes.get((entry.src_leaf, entry.dst_leaf))
            held = src_boxes.get(entry.src_leaf, {}).get(entry.src_device)
            if route is None or held is None:
                problems.append(
                    f"entry reads {entry.src_leaf!r} on device {entry.src_device}, which holds no shard of it"
                )
                continue
            src_box = _to_box(entry.src_index, route.shape)
            if intersect_boxes(src_box, held) != src_box:
                problems.append(f"entry {entry}: source box {src_box} is outside shard {held}")
            if src_box != _to_box(entry.dst_index, route.shape):
                problems.append(f"entry {entry}: source and destination boxes do not correspond")
        if problems:
            raise PlanError(problems)

    def reference(self, source: Any) -> dict[str, np.ndarray]:
        """Destination leaves computed on the host from whole arrays (for checks and baselines;
        this gathers everything, which the plan's executors never do)."""
        flat, _ = jax.tree_util.tree_flatten_with_path(source)
        arrays = {path_str(k): np.asarray(v) for k, v in flat}
        out: dict[str, np.ndarray] = {}
        for (src_path, dst_path), route in self.routes.items():
            out[dst_path] = apply_to_array(route, arrays[src_path])
        return out

    def unflatten(self, leaves: Mapping[str, Any]) -> Any:
        return jax.tree_util.tree_unflatten(self.dst_treedef, [leaves[p] for p in self.dst_paths])

    def __str__(self) -> str:
        lines = [
            f"TransferPlan: {len(self.src_leaves)} source -> {len(self.dst_leaves)} destination "
            f"leaves, {len(self.entries)} entries, {_fmt_bytes(self.bytes_moved)} moved "
            f"(ideal {_fmt_bytes(self.ideal_bytes)}), {_fmt_bytes(self.bytes_across_devices)} "
            f"across devices, {_fmt_bytes(self.bytes_across_processes)} across processes"
        ]
        by_leaf: dict[str, list[TransferEntry]] = defaultdict(list)
        for entry in self.entries:
            by_leaf[entry.dst_leaf].append(entry)
        for path in self.dst_paths:
            dst, leaf_entries = self.dst_leaves[path], by_leaf[path]
            sources = sorted({e.src_leaf for e in leaf_entries})
            src = self.src_leaves[sources[0]] if sources else None
            src_desc = f"{src.dtype.name}{list(src.shape)}" if src else "?"
            transforms = sorted({e.transform for e in leaf_entries}) or ["-"]
            lines.append(
                f"  {path}: {src_desc} -> {dst.dtype.name}{list(dst.shape)} [{', '.join(transforms)}] "
                f"from {sources[0] if len(sources) == 1 else f'{len(sources)} leaves'}: "
                f"{len(leaf_entries)} entries, {_fmt_bytes(sum(e.nbytes for e in leaf_entries))}"
            )
        return "\n".join(lines)

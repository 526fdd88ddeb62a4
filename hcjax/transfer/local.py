"""In-process executor: slice, transform and copy each entry, then assemble destination shards.

Work is issued shard by shard with a bound on bytes in flight, so the whole model is never
copied at once; every destination buffer is fresh (the serving version is never written).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hcjax.transfer.plan import (
    PlanError,
    TransferEntry,
    TransferPlan,
    _to_box,
    path_str,
    shard_boxes,
)
from hcjax.transfer.transforms import Permute, Route, Window


class TransferError(RuntimeError):
    """An entry could not be executed; the message names it."""


@dataclasses.dataclass
class ExecutionResult:
    leaves: dict[str, jax.Array]
    bytes_moved: int
    peak_bytes_in_flight: int


def source_leaves(plan: TransferPlan, source: Any) -> dict[str, Any]:
    """Flatten a source tree (or accept a path -> array dict) and check it against the plan."""
    # A dict keyed by path strings flattens to the same paths, so either form works.
    flat, _ = jax.tree_util.tree_flatten_with_path(source)
    leaves = {path_str(k): v for k, v in flat}
    problems = []
    missing = sorted(set(plan.src_leaves) - set(leaves))
    extra = sorted(set(leaves) - set(plan.src_leaves))
    if missing:
        problems.append(f"source tree lacks leaves {missing}")
    if extra:
        problems.append(f"source tree has leaves the plan does not know: {extra}")
    for path in sorted(set(leaves) & set(plan.src_leaves)):
        spec, leaf = plan.src_leaves[path], leaves[path]
        if tuple(leaf.shape) != spec.shape or np.dtype(leaf.dtype) != spec.dtype:
            problems.append(
                f"source leaf {path!r} is {np.dtype(leaf.dtype).name}{list(leaf.shape)}, "
                f"the plan was made for {spec.dtype.name}{list(spec.shape)}"
            )
    if problems:
        raise PlanError(problems)
    return leaves


class SourceShards:
    """(shard data, index box) of a source leaf on a device, looked up when first needed.

    Lazily, so that a leaf that goes bad (e.g. a buffer donated by the learner's next step)
    fails at its own entry, after earlier leaves moved, and the error can name it.
    """

    def __init__(self, leaves: Mapping[str, Any]):
        self._leaves = leaves
        self._cache: dict[str, tuple[dict[int, jax.Array], dict[int, Any]]] = {}

    def __call__(self, path: str, device: int) -> tuple[jax.Array, Any]:
        if path not in self._cache:
            leaf = self._leaves[path]
            self._cache[path] = (
                {s.device.id: s.data for s in leaf.addressable_shards},
                {d.id: b for d, b in shard_boxes(leaf.sharding, tuple(leaf.shape)).items()},
            )
        data, boxes = self._cache[path]
        return data[device], boxes[device]


# The jitted helpers below are cached by shapes and relative offsets only, so one compilation
# serves every layer of the same shapes (a model repeats a few shapes many times).


@functools.lru_cache(maxsize=1024)
def _taker(sizes: tuple[int, ...], casts: tuple[np.dtype, ...]):
    def take(data, starts):
        piece = jax.lax.dynamic_slice(data, starts, sizes)
        for dtype in casts:
            piece = piece.astype(dtype)
        return piece

    return jax.jit(take)


def slice_source(entry: TransferEntry, route: Route, data: jax.Array, shard_box) -> jax.Array:
    """The entry's slice of a source shard, with the casts that shrink it (sender side)."""
    starts = tuple(s.start - lo for s, (lo, _) in zip(entry.src_index, shard_box, strict=True))
    sizes = tuple(s.stop - s.start for s in entry.src_index)
    src_casts, _ = route.split_casts()
    if sizes == tuple(data.shape) and not src_casts:
        return data  # the whole shard travels as it is: no copy on the sender
    return _taker(sizes, tuple(src_casts))(data, tuple(np.int32(i) for i in starts))


def finish_steps(entry: TransferEntry, route: Route) -> tuple[tuple[str, Any], ...]:
    """Receiver-side work on a piece: index ops (bytes-neutral, so kept off the sender, whose
    devices are fewer) and widening casts, as hashable (kind, argument) steps."""
    box = _to_box(entry.src_index, route.src_shape)
    steps: list[tuple[str, Any]] = []
    for op in route.ops:
        box = op.forward(box)
        if isinstance(op, Permute):
            steps.append(("transpose", op.perm))
        elif not isinstance(op, Window):  # select / insert / reshape only change the shape
            steps.append(("reshape", tuple(hi - lo for lo, hi in box)))
    _, dst_casts = route.split_casts()
    steps += [("cast", np.dtype(d).name) for d in dst_casts]
    return tuple(steps)


def _finish(piece: jax.Array, steps: tuple[tuple[str, Any], ...]) -> jax.Array:
    for kind, arg in steps:
        if kind == "transpose":
            piece = piece.transpose(arg)
        elif kind == "reshape":
            piece = piece.reshape(arg)
        else:
            piece = piece.astype(arg)
    return piece


def _concat_grid(items: list[tuple[tuple[int, ...], jax.Array]], axis: int) -> jax.Array:
    """Pieces that tile a box as a grid, joined by nested concatenation (no zero fill)."""
    if len(items) == 1:
        return items[0][1]
    starts = sorted({offset[axis] for offset, _ in items})
    if len(starts) == 1:
        return _concat_grid(items, axis + 1)
    slabs = [_concat_grid([it for it in items if it[0][axis] == s], axis + 1) for s in starts]
    return jnp.concatenate(slabs, axis=axis)


@functools.lru_cache(maxsize=1024)
def _assembler(
    shape: tuple[int, ...],
    dtype: np.dtype,
    steps: tuple[tuple, ...],
    offsets: tuple[tuple[int, ...], ...],
):
    def assemble(pieces):
        pieces = [_finish(p, st) for p, st in zip(pieces, steps, strict=True)]
        try:  # the pieces of two grid layouts' intersection always form a grid
            out = _concat_grid(list(zip(offsets, pieces, strict=True)), 0)
            if out.shape == shape:
                return out.astype(dtype)
        except (TypeError, ValueError):
            pass
        out = jnp.zeros(shape, dtype)
        for piece, offset in zip(pieces, offsets, strict=True):
            out = jax.lax.dynamic_update_slice(out, piece, offset)
        return out

    return jax.jit(assemble)


def assemble_shard(
    plan: TransferPlan,
    entries: Sequence[TransferEntry],
    pieces: Sequence[jax.Array],
    shard_box,
    dtype: np.dtype,
) -> jax.Array:
    """One destination shard from its pieces (all already on its device), in one dispatch."""
    shape = tuple(hi - lo for lo, hi in shard_box)
    steps = tuple(finish_steps(e, plan.routes[(e.src_leaf, e.dst_leaf)]) for e in entries)
    if len(entries) == 1 and entries[0].shape == shape and not steps[0]:
        return pieces[0]  # one piece is the whole shard, nothing to do on arrival
    offsets = tuple(
        tuple(s.start - lo for s, (lo, _) in zip(e.dst_index, shard_box, strict=True))
        for e in entries
    )
    return _assembler(shape, np.dtype(dtype), steps, offsets)(tuple(pieces))


def execute_entries(
    plan: TransferPlan,
    source: Any,
    entries: Sequence[TransferEntry],
    dst_shardings: Mapping[str, jax.sharding.Sharding] | None = None,
    max_bytes_in_flight: int = 64 << 20,
) -> ExecutionResult:
    """Execute `entries` (the plan's own, or an expansion's) and build fresh destination arrays.

    A destination shard's pieces are issued together; before issuing more, the oldest
    unfinished shards are waited for until the bytes in flight fit `max_bytes_in_flight`
    (a single shard larger than the bound is issued alone).
    """
    if max_bytes_in_flight <= 0:
        raise ValueError(f"max_bytes_in_flight={max_bytes_in_flight} must be positive")
    leaves = source_leaves(plan, source)
    dst_shardings = dict(dst_shardings or {p: s.sharding for p, s in plan.dst_leaves.items()})
    devices = {d.id: d for d in jax.devices()}

    groups: dict[tuple[str, int], list[TransferEntry]] = defaultdict(list)
    for entry in entries:
        groups[(entry.dst_leaf, entry.dst_device)].append(entry)

    shard_of = SourceShards(leaves)

    order = {path: i for i, path in enumerate(plan.dst_paths)}
    pending: deque[tuple[int, jax.Array]] = deque()
    in_flight = peak = moved = 0
    shards: dict[str, dict[int, jax.Array]] = defaultdict(dict)
    for (path, dst_id), group in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        need = sum(e.nbytes for e in group)
        while pending and in_flight + need > max_bytes_in_flight:
            nbytes, done = pending.popleft()
            done.block_until_ready()
            in_flight -= nbytes
        pieces = []
        for entry in group:
            route = plan.routes[(entry.src_leaf, entry.dst_leaf)]
            try:
                data, box = shard_of(entry.src_leaf, entry.src_device)
                piece = slice_source(entry, route, data, box)
                piece = jax.device_put(piece, devices[dst_id])
                pieces.append(piece)
            except Exception as err:  # name the entry: a bare XLA error says nothing about it
                raise TransferError(f"transfer failed at entry {entry}: {err}") from err
        sharding = dst_shardings[path]
        spec = plan.dst_leaves[path]
        dst_device = devices[dst_id]
        shard_box = _to_box(sharding.devices_indices_map(spec.shape)[dst_device], spec.shape)
        shard = assemble_shard(plan, group, pieces, shard_box, spec.dtype)
        shards[path][dst_id] = shard
        pending.append((need, shard))
        in_flight += need
        moved += need
        peak = max(peak, in_flight)

    out = {}
    for path, spec in plan.dst_leaves.items():
        sharding = dst_shardings[path]
        per_device = shards.get(path, {})
        arrays = []
        for device, index in sharding.addressable_devices_indices_map(spec.shape).items():
            if device.id in per_device:
                arrays.append(per_device[device.id])
            else:  # only empty shards have no entries
                shape = tuple(hi - lo for lo, hi in _to_box(index, spec.shape))
                arrays.append(jax.device_put(np.zeros(shape, spec.dtype), device))
        out[path] = jax.make_array_from_single_device_arrays(spec.shape, sharding, arrays)
    for path in out:
        out[path].block_until_ready()
    return ExecutionResult(out, moved, peak)

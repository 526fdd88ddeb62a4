"""In-process executor (LocalTransfer): move a plan's entries between devices and assemble
destination shards. The executor owns the compiled schedules it derives from a plan; the plan
stays data.

Small pieces are batched (per chunk, a few jitted packs, one device_put, a few jitted unpacks);
large pieces travel one by one. Work is issued in chunks with a bound on bytes in flight, so the
whole model is never copied at once; every destination buffer is fresh (the serving version is
never written). The per-piece helpers (slice_source, assemble_shard) also serve remote.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hcjax.transfer.reshard_plan import (
    PlanError,
    TransferEntry,
    TransferPlan,
    _to_box,
    path_str,
    shard_boxes,
)
from hcjax.transfer.transforms import Route


class TransferError(RuntimeError):
    """An entry could not be executed; the message names it."""


@dataclasses.dataclass
class ExecutionResult:
    leaves: dict[str, jax.Array]
    bytes_moved: int
    peak_bytes_in_flight: int
    copies: int = 0  # buffers sent between devices (packed buffers and whole shards)


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


def finish_steps(route: Route) -> tuple[tuple[str, Any], ...]:
    """Receiver-side work on a piece: the widening casts (the narrowing ones ran on the sender),
    as hashable ("cast", dtype name) steps."""
    _, dst_casts = route.split_casts()
    return tuple(("cast", np.dtype(d).name) for d in dst_casts)


def _finish(piece: jax.Array, steps: tuple[tuple[str, Any], ...]) -> jax.Array:
    for _, dtype in steps:
        piece = piece.astype(dtype)
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


def _place(
    shape: tuple[int, ...],
    dtype: np.dtype,
    pieces: Sequence[jax.Array],
    offsets: Sequence[tuple[int, ...]],
) -> jax.Array:
    """One shard of `shape` from finished pieces at `offsets` (traced inside a jitted function)."""
    try:  # the pieces of two grid layouts' intersection always form a grid
        out = _concat_grid(list(zip(offsets, pieces, strict=True)), 0)
        if out.shape == shape:
            return out.astype(dtype)
    except (TypeError, ValueError):
        pass
    out = jnp.zeros(shape, dtype)
    for piece, offset in zip(pieces, offsets, strict=True):
        out = jax.lax.dynamic_update_slice(out, piece.astype(dtype), offset)
    return out


@functools.lru_cache(maxsize=1024)
def _assembler(
    shape: tuple[int, ...],
    dtype: np.dtype,
    steps: tuple[tuple, ...],
    offsets: tuple[tuple[int, ...], ...],
):
    def assemble(pieces):
        pieces = [_finish(p, st) for p, st in zip(pieces, steps, strict=True)]
        return _place(shape, dtype, pieces, offsets)

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
    steps = tuple(finish_steps(plan.routes[(e.src_leaf, e.dst_leaf)]) for e in entries)
    if len(entries) == 1 and entries[0].shape == shape and not steps[0]:
        return pieces[0]  # one piece is the whole shard, nothing to do on arrival
    offsets = tuple(
        tuple(s.start - lo for s, (lo, _) in zip(e.dst_index, shard_box, strict=True))
        for e in entries
    )
    return _assembler(shape, np.dtype(dtype), steps, offsets)(tuple(pieces))




# ---------------------------------------------------------------------------------------------
# The batched executor. Destination shards are grouped into chunks of bounded bytes; per chunk
# every source device runs one jitted function that slices and casts all of its pieces into a
# few flat buffers per (destination device, wire dtype), the buffers travel in one batched
# device_put, and every destination device runs one jitted function that cuts its buffers back
# into pieces, finishes them and assembles all of its shards of the chunk. A chunk thus costs a
# few dispatches and copies per device whatever the number of leaves, instead of two or three
# per entry. The schedule (chunks, specs, compiled functions) is made once per LocalTransfer;
# the first execution pays for compiling them (XLA:CPU: tens of ms per destination shard).

# Pieces smaller than this are packed; per-piece dispatch costs as much as copying ~100 KiB.
PACK_BELOW = 1 << 20
# Chunks this small let each chunk's buffers be reused by the next (on CPU, 6.6M parameters:
# 7 MiB of extra memory at 1 MiB chunks, 25 MiB as one chunk) at a few dispatches per chunk.
CHUNK_BYTES = 4 << 20
# XLA:CPU fuses slices into a concatenation of up to about 8 operands; past that it first
# materialises every piece (memory_analysis: 10 MiB of temporaries for a 3.6 MiB buffer of 71
# pieces, 0.1 MiB as buffers of 8), so a buffer holds at most this many pieces.
PIECES_PER_BUFFER = 8

# Hashable specs of the two jitted halves:
#   pack:   per output buffer, its pieces as (input index, starts, sizes, casts)
#   unpack: per shard (shape, dtype, pieces as (input index, flat start or -1 for a whole
#           input, wire shape, finish steps, offset in the shard))
_PackSpec = tuple[tuple[tuple[int, tuple[int, ...], tuple[int, ...], tuple[str, ...]], ...], ...]
_UnpackSpec = tuple[tuple[tuple[int, ...], str, tuple[tuple[Any, ...], ...]], ...]


@functools.lru_cache(maxsize=256)
def _packer(spec: _PackSpec):
    def pack(inputs):
        buffers = []
        for pieces in spec:
            flat = []
            for i, starts, sizes, casts in pieces:
                stops = tuple(s + n for s, n in zip(starts, sizes, strict=True))
                piece = jax.lax.slice(inputs[i], starts, stops)
                for dtype in casts:
                    piece = piece.astype(dtype)
                flat.append(piece.reshape(-1))
            buffers.append(flat[0] if len(flat) == 1 else jnp.concatenate(flat))
        return tuple(buffers)

    return jax.jit(pack)


@functools.lru_cache(maxsize=256)
def _unpacker(spec: _UnpackSpec):
    def unpack(inputs):
        shards = []
        for shape, dtype, pieces in spec:
            finished, offsets = [], []
            for i, start, wire_shape, steps, offset in pieces:
                piece = inputs[i]
                if start >= 0:
                    size = math.prod(wire_shape)
                    piece = jax.lax.slice(piece, (start,), (start + size,)).reshape(wire_shape)
                finished.append(_finish(piece, steps))
                offsets.append(offset)
            shards.append(_place(shape, np.dtype(dtype), finished, offsets))
        return tuple(shards)

    return jax.jit(unpack)


@dataclasses.dataclass(frozen=True)
class _Shard:
    """One destination shard and the entries that fill it."""

    path: str
    dst_id: int
    entries: tuple[TransferEntry, ...]
    box: tuple[tuple[int, int], ...]
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in self.box)


@dataclasses.dataclass
class _Send:
    """One source device's pack: the source leaves it reads and where its buffers go."""

    src_id: int
    inputs: tuple[str, ...]
    dst_ids: tuple[int, ...]
    entries: tuple[TransferEntry, ...]  # to name the culprit when it fails
    fn: Any


@dataclasses.dataclass
class _Receive:
    """One destination device's unpack: the payloads it reads and the shards it makes."""

    inputs: tuple[int, ...]  # indices into the chunk's payloads
    shards: tuple[_Shard, ...]
    fn: Any


@dataclasses.dataclass
class _Chunk:
    nbytes: int
    sends: list[_Send]
    large: list[tuple[TransferEntry, bool]]  # (entry, sliced on the sender), after the packs
    receives: list[_Receive]
    assembled: list[tuple[_Shard, tuple[int, ...], Any]]  # shards of large pieces only
    ready: list[tuple[_Shard, int]]  # shards that are a payload as it arrives


@dataclasses.dataclass
class _Schedule:
    chunks: list[_Chunk]
    copies: int  # buffers sent between devices per execution


def _plan_chunk(
    plan: TransferPlan,
    shards: Sequence[_Shard],
    src_boxes: Mapping[tuple[str, int], Any],
    pack_below: int,
) -> _Chunk:
    """Pack and unpack functions for one chunk of destination shards.

    Pieces under `pack_below` bytes are packed; larger ones travel alone (sliced on the sender
    by a function shared by all pieces of their shape, or not at all when they are a whole
    source shard): they gain nothing from batching and XLA's many-operand concatenation copies
    far slower than a slice.
    """
    packs: dict[int, dict[tuple[int, str], list[TransferEntry]]] = defaultdict(
        lambda: defaultdict(list)
    )
    large: list[tuple[TransferEntry, bool]] = []
    for shard in shards:
        for e in shard.entries:
            if e.nbytes < pack_below:
                packs[e.src_device][(e.dst_device, e.wire_dtype)].append(e)
                continue
            src_casts, _ = plan.routes[(e.src_leaf, e.dst_leaf)].split_casts()
            box = src_boxes[(e.src_leaf, e.src_device)]
            whole = tuple((s.start, s.stop) for s in e.src_index) == tuple(box)
            large.append((e, not whole or bool(src_casts)))

    sends: list[_Send] = []
    where: dict[int, tuple[int, int]] = {}  # id(entry) -> (payload, flat start or -1)
    payload = 0
    for src_id in sorted(packs):
        inputs: dict[str, int] = {}
        spec, dst_ids, members = [], [], []
        buffers = [
            (dst_id, group[i : i + PIECES_PER_BUFFER])
            for (dst_id, _), group in sorted(packs[src_id].items())
            for i in range(0, len(group), PIECES_PER_BUFFER)
        ]
        for dst_id, group in buffers:
            pieces, start = [], 0
            for e in group:
                box = src_boxes[(e.src_leaf, src_id)]
                src_casts, _ = plan.routes[(e.src_leaf, e.dst_leaf)].split_casts()
                pieces.append((
                    inputs.setdefault(e.src_leaf, len(inputs)),
                    tuple(s.start - lo for s, (lo, _) in zip(e.src_index, box, strict=True)),
                    tuple(s.stop - s.start for s in e.src_index),
                    tuple(np.dtype(d).name for d in src_casts),
                ))
                where[id(e)] = (payload, start)
                start += math.prod(s.stop - s.start for s in e.src_index)
            spec.append(tuple(pieces))
            dst_ids.append(dst_id)
            members += group
            payload += 1
        fn = _packer(tuple(spec))
        sends.append(_Send(src_id, tuple(inputs), tuple(dst_ids), tuple(members), fn))
    for e, _ in large:
        where[id(e)] = (payload, -1)
        payload += 1

    # Receiver side: per destination device one unpack for the shards with packed pieces;
    # shards of large pieces only are assembled alone (as their pieces are big, the dispatch
    # is cheap, and the function is shared by all shards of the same layout).
    by_device: dict[int, list[_Shard]] = defaultdict(list)
    assembled: list[tuple[_Shard, tuple[int, ...], Any]] = []
    ready: list[tuple[_Shard, int]] = []
    for shard in shards:
        steps = tuple(finish_steps(plan.routes[(e.src_leaf, e.dst_leaf)]) for e in shard.entries)
        if any(where[id(e)][1] >= 0 for e in shard.entries):
            by_device[shard.dst_id].append(shard)
        elif len(shard.entries) == 1 and shard.entries[0].shape == shard.shape and not steps[0]:
            ready.append((shard, where[id(shard.entries[0])][0]))  # nothing to do on arrival
        else:
            offsets = tuple(
                tuple(s.start - lo for s, (lo, _) in zip(e.dst_index, shard.box, strict=True))
                for e in shard.entries
            )
            dtype = np.dtype(plan.dst_leaves[shard.path].dtype)
            fn = _assembler(shard.shape, dtype, steps, offsets)
            assembled.append((shard, tuple(where[id(e)][0] for e in shard.entries), fn))
    receives = []
    for _, members in sorted(by_device.items()):
        inputs_of: dict[int, int] = {}
        spec = []
        for shard in members:
            pieces = []
            for e in shard.entries:
                index, start = where[id(e)]
                pieces.append((
                    inputs_of.setdefault(index, len(inputs_of)),
                    start,
                    tuple(s.stop - s.start for s in e.src_index),
                    finish_steps(plan.routes[(e.src_leaf, e.dst_leaf)]),
                    tuple(s.start - lo for s, (lo, _) in zip(e.dst_index, shard.box, strict=True)),
                ))
            dtype = plan.dst_leaves[shard.path].dtype
            spec.append((shard.shape, np.dtype(dtype).name, tuple(pieces)))
        fn = _unpacker(tuple(spec))
        receives.append(_Receive(tuple(inputs_of), tuple(members), fn))
    return _Chunk(sum(s.nbytes for s in shards), sends, large, receives, assembled, ready)


def _destination_shards(plan: TransferPlan, devices: Mapping[int, Any]) -> list[_Shard]:
    """Every destination shard that has entries, in the destination tree's order."""
    groups: dict[tuple[str, int], list[TransferEntry]] = defaultdict(list)
    for entry in plan.entries:
        groups[(entry.dst_leaf, entry.dst_device)].append(entry)
    order = {path: i for i, path in enumerate(plan.dst_paths)}
    shards = []
    for (path, dst_id), group in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        spec = plan.dst_leaves[path]
        index = spec.sharding.devices_indices_map(spec.shape)[devices[dst_id]]
        box = _to_box(index, spec.shape)
        shards.append(_Shard(path, dst_id, tuple(group), box, sum(e.nbytes for e in group)))
    return shards


def chunked(items: Sequence[Any], max_bytes: int) -> list[list[Any]]:
    """Consecutive items (anything with `nbytes`: entries, shards) in groups of at most
    `max_bytes`; an item bigger than that goes alone."""
    chunks: list[list[Any]] = []
    size = 0
    for item in items:
        if not chunks or size + item.nbytes > max_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += item.nbytes
    return chunks


def _make_schedule(
    plan: TransferPlan, leaves: Mapping[str, Any], max_chunk_bytes: int, pack_below: int
) -> _Schedule:
    devices = {d.id: d for d in jax.devices()}
    src_boxes = {}
    for path in {e.src_leaf for e in plan.entries}:
        leaf = leaves[path]
        for d, box in shard_boxes(leaf.sharding, tuple(leaf.shape)).items():
            src_boxes[(path, d.id)] = box
    shards = _destination_shards(plan, devices)
    chunks = [
        _plan_chunk(plan, group, src_boxes, pack_below)
        for group in chunked(shards, max_chunk_bytes)
    ]
    copies = sum(len(s.dst_ids) for c in chunks for s in c.sends)
    return _Schedule(chunks, copies + sum(len(c.large) for c in chunks))


def _culprit(entries: Sequence[TransferEntry], shard_of: SourceShards) -> TransferEntry:
    """The first entry whose source shard is unusable (e.g. deleted), else the first entry."""
    for e in entries:
        try:
            data, _ = shard_of(e.src_leaf, e.src_device)
            if data.is_deleted():
                return e
        except Exception:
            return e
    return entries[0]


def _issue_chunk(
    plan: TransferPlan, chunk: _Chunk, shard_of: SourceShards, devices: Mapping[int, Any]
) -> dict[tuple[str, int], jax.Array]:
    """Dispatch one chunk (packs and slices, one batched device_put, unpacks); nothing waits."""
    payloads, targets = [], []
    for send in chunk.sends:
        try:
            payloads += send.fn(tuple(shard_of(path, send.src_id)[0] for path in send.inputs))
        except Exception as err:  # name the entry: a bare XLA error says nothing about it
            culprit = _culprit(send.entries, shard_of)
            raise TransferError(f"transfer failed at entry {culprit}: {err}") from err
        targets += [devices[d] for d in send.dst_ids]
    for e, sliced in chunk.large:
        try:
            data, box = shard_of(e.src_leaf, e.src_device)
            if data.is_deleted():
                raise RuntimeError("Array has been deleted")
            if sliced:
                data = slice_source(e, plan.routes[(e.src_leaf, e.dst_leaf)], data, box)
        except Exception as err:
            raise TransferError(f"transfer failed at entry {e}: {err}") from err
        payloads.append(data)
        targets.append(devices[e.dst_device])
    try:
        arrived = jax.device_put(payloads, targets)
    except Exception as err:
        entries = [e for s in chunk.sends for e in s.entries] + [e for e, _ in chunk.large]
        raise TransferError(f"transfer failed at entry {_culprit(entries, shard_of)}: {err}") from err
    out = {(shard.path, shard.dst_id): arrived[i] for shard, i in chunk.ready}
    for shard, inputs, fn in chunk.assembled:
        out[(shard.path, shard.dst_id)] = fn(tuple(arrived[i] for i in inputs))
    for receive in chunk.receives:
        made = receive.fn(tuple(arrived[i] for i in receive.inputs))
        for shard, array in zip(receive.shards, made, strict=True):
            out[(shard.path, shard.dst_id)] = array
    return out


class LocalTransfer:
    """Executes one TransferPlan in this process, many times: `transfer(source)` returns a fresh
    destination tree; `transfer.run(source)` also says what moved.

    Destination shards move in chunks of at most min(chunk_bytes, max_bytes_in_flight / 2) wire
    bytes (a single shard larger than that is a chunk alone), so that several chunks can be in
    flight; before a chunk is issued the oldest unfinished ones are waited for until the bytes
    in flight fit `max_bytes_in_flight`. Memory beyond the returned tree is then the packed or
    sliced buffers on the senders plus their copies on the receivers of the chunks in flight, at
    most 2 * max(max_bytes_in_flight, largest destination shard in wire bytes), plus XLA's
    temporaries inside one pack or unpack (kept small by PIECES_PER_BUFFER).

    Pieces under `pack_below` bytes are batched: per chunk, one slice-and-cast function per
    source device, one device_put of all buffers, one unpack-and-assemble function per
    destination device; larger pieces travel one by one (pack_below=0: every piece alone).

    The executor owns what it derives from the plan: the schedule (chunks, specs, compiled
    functions) is made at the first execution for the layout the source arrives in and kept, so
    executing again costs only the copies. The plan stays data and is never written.
    """

    # Schedules kept, one per source layout seen (the learner's layout does not change, so one
    # is the rule; the bound only keeps a caller that varies it from growing without end).
    SCHEDULES_KEPT = 8

    def __init__(
        self,
        plan: TransferPlan,
        *,
        max_bytes_in_flight: int = 64 << 20,
        pack_below: int = PACK_BELOW,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        if max_bytes_in_flight <= 0:
            raise ValueError(f"max_bytes_in_flight={max_bytes_in_flight} must be positive")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be positive")
        self.plan = plan
        self.max_bytes_in_flight = max_bytes_in_flight
        self.pack_below = pack_below
        self.chunk_bytes = max(1, min(chunk_bytes, max_bytes_in_flight // 2))
        # By the source leaves' shardings, in sorted path order.
        self.schedules: dict[tuple[jax.sharding.Sharding, ...], _Schedule] = {}
        self._lock = threading.Lock()  # threads may share one executor

    def __call__(self, source: Any) -> Any:
        """Run the plan on `source` (the source tree, or a path -> array dict); returns a fresh
        destination tree."""
        return self.plan.unflatten(self.run(source).leaves)

    def _schedule(self, leaves: Mapping[str, Any]) -> _Schedule:
        """The schedule for the layout of `leaves` (path -> source array), made on first use."""
        key = tuple(leaves[p].sharding for p in sorted(self.plan.src_leaves))
        with self._lock:
            kept = self.schedules.get(key)
        if kept is not None:
            return kept
        schedule = _make_schedule(self.plan, leaves, self.chunk_bytes, self.pack_below)
        with self._lock:
            self.schedules[key] = schedule
            while len(self.schedules) > self.SCHEDULES_KEPT:
                self.schedules.pop(next(iter(self.schedules)))
        return schedule

    def run(self, source: Any) -> ExecutionResult:
        """Execute every entry of the plan; the destination leaves by path, and what moved."""
        plan = self.plan
        leaves = source_leaves(plan, source)
        devices = {d.id: d for d in jax.devices()}
        schedule = self._schedule(leaves)
        shard_of = SourceShards(leaves)

        pending: deque[tuple[int, list[jax.Array]]] = deque()
        in_flight = peak = moved = 0
        made: dict[tuple[str, int], jax.Array] = {}
        for chunk in schedule.chunks:
            while pending and in_flight + chunk.nbytes > self.max_bytes_in_flight:
                nbytes, done = pending.popleft()
                jax.block_until_ready(done)
                in_flight -= nbytes
            out = _issue_chunk(plan, chunk, shard_of, devices)
            made.update(out)
            pending.append((chunk.nbytes, list(out.values())))
            in_flight += chunk.nbytes
            moved += chunk.nbytes
            peak = max(peak, in_flight)

        out = {}
        for path, spec in plan.dst_leaves.items():
            arrays = []
            for device, index in spec.sharding.addressable_devices_indices_map(spec.shape).items():
                if (path, device.id) in made:
                    arrays.append(made[(path, device.id)])
                else:  # only empty shards have no entries
                    shape = tuple(hi - lo for lo, hi in _to_box(index, spec.shape))
                    arrays.append(jax.device_put(np.zeros(shape, spec.dtype), device))
            out[path] = jax.make_array_from_single_device_arrays(spec.shape, spec.sharding, arrays)
        jax.block_until_ready(out)
        return ExecutionResult(out, moved, peak, schedule.copies)

"""Per-leaf transforms of a transfer plan (cast, transpose, reshape, split, stack/unstack layers).

Each user-facing transform turns one route (leaf path, shape, dtype, ops) into one or more routes;
each elementary op knows how index boxes map through it, so the plan never materialises a tensor.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

Box = tuple[tuple[int, int], ...]  # one half-open (start, stop) per axis


def box_volume(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def intersect_boxes(a: Box, b: Box) -> Box | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return None if any(start >= stop for start, stop in out) else out


def _interval_to_box(start: int, stop: int, dims: Sequence[int]) -> Box | None:
    """Row-major interval [start, stop) over `dims` as a box, or None when it is not one."""
    for k in range(len(dims) - 1, -1, -1):
        inner = math.prod(dims[k + 1 :])
        outer = inner * dims[k]
        if start % inner or stop % inner or start // outer != (stop - 1) // outer:
            continue
        box = []
        for axis, size in enumerate(dims):
            stride = math.prod(dims[axis + 1 :])
            if axis < k:
                digit = (start // stride) % size
                box.append((digit, digit + 1))
            elif axis == k:
                box.append(((start // stride) % size, ((stop - 1) // stride) % size + 1))
            else:
                box.append((0, size))
        return tuple(box)
    return None


def _box_to_interval(box: Box, dims: Sequence[int]) -> tuple[int, int] | None:
    """A box over `dims` as a row-major interval, or None when its elements are not contiguous."""
    # Contiguous iff, past the first axis with more than one index, every axis is full.
    seen_range = False
    for (start, stop), size in zip(box, dims, strict=True):
        if seen_range and (start, stop) != (0, size):
            return None
        if stop - start > 1:
            seen_range = True
    first = int(np.ravel_multi_index([s for s, _ in box], dims)) if dims else 0
    last = int(np.ravel_multi_index([e - 1 for _, e in box], dims)) if dims else 0
    return first, last + 1


class BoxError(ValueError):
    """A shard box cannot be carried through an index op as a single box."""


# ---------------------------------------------------------------------------------------------
# Elementary ops. Each maps shapes and boxes source -> destination (`forward`), destination ->
# source (`backward`), and applies itself to a piece whose boxes are a matching pair.


@dataclasses.dataclass(frozen=True)
class Permute:
    perm: tuple[int, ...]

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape[p] for p in self.perm)

    def forward(self, box: Box) -> Box | None:
        return tuple(box[p] for p in self.perm)

    def backward(self, box: Box) -> Box:
        out = [None] * len(box)
        for k, p in enumerate(self.perm):
            out[p] = box[k]
        return tuple(out)

    def apply(self, piece: Any, out_shape: tuple[int, ...]) -> Any:
        return piece.transpose(self.perm)

    def __str__(self) -> str:
        return f"transpose{self.perm}"


@dataclasses.dataclass(frozen=True)
class Window:
    """Output = source[start:start + size] along `axis` (one part of a split)."""

    axis: int
    start: int
    size: int

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[: self.axis] + (self.size,) + shape[self.axis + 1 :]

    def forward(self, box: Box) -> Box | None:
        lo, hi = box[self.axis]
        lo, hi = max(lo, self.start), min(hi, self.start + self.size)
        if lo >= hi:
            return None
        return box[: self.axis] + ((lo - self.start, hi - self.start),) + box[self.axis + 1 :]

    def backward(self, box: Box) -> Box:
        lo, hi = box[self.axis]
        return box[: self.axis] + ((lo + self.start, hi + self.start),) + box[self.axis + 1 :]

    def apply(self, piece: Any, out_shape: tuple[int, ...]) -> Any:
        return piece  # the source slice already selected the window

    def __str__(self) -> str:
        return f"split(axis={self.axis},{self.start}:{self.start + self.size})"


@dataclasses.dataclass(frozen=True)
class Select:
    """Output = source[index] along `axis` (one layer of a stacked tensor)."""

    axis: int
    index: int

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[: self.axis] + shape[self.axis + 1 :]

    def forward(self, box: Box) -> Box | None:
        lo, hi = box[self.axis]
        if not lo <= self.index < hi:
            return None
        return box[: self.axis] + box[self.axis + 1 :]

    def backward(self, box: Box) -> Box:
        return box[: self.axis] + ((self.index, self.index + 1),) + box[self.axis :]

    def apply(self, piece: Any, out_shape: tuple[int, ...]) -> Any:
        return piece.reshape(out_shape)

    def __str__(self) -> str:
        return f"select(axis={self.axis},{self.index})"


@dataclasses.dataclass(frozen=True)
class Insert:
    """Output[index] along a new `axis` = source (one layer into a stacked tensor of `size`)."""

    axis: int
    index: int
    size: int

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[: self.axis] + (self.size,) + shape[self.axis :]

    def forward(self, box: Box) -> Box | None:
        return box[: self.axis] + ((self.index, self.index + 1),) + box[self.axis :]

    def backward(self, box: Box) -> Box:
        return box[: self.axis] + box[self.axis + 1 :]

    def apply(self, piece: Any, out_shape: tuple[int, ...]) -> Any:
        return piece.reshape(out_shape)

    def __str__(self) -> str:
        return f"insert(axis={self.axis},{self.index}/{self.size})"


@dataclasses.dataclass(frozen=True)
class ReshapeOp:
    """Split one axis into consecutive axes, or merge consecutive axes into one."""

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    lead: int  # axes before the reshaped group, identical on both sides
    in_group: tuple[int, ...]
    out_group: tuple[int, ...]

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return self.out_shape

    def _map(self, box: Box, src: tuple[int, ...], dst: tuple[int, ...]) -> Box | None:
        n_src = len(src)
        group = box[self.lead : self.lead + n_src]
        if n_src == 1:  # split: interval over one axis -> box over several
            mapped = _interval_to_box(group[0][0], group[0][1], dst)
        else:  # merge: box over several axes -> interval over one
            interval = _box_to_interval(group, src)
            mapped = None if interval is None else (interval,)
        if mapped is None:
            raise BoxError(
                f"reshape {self.in_shape}->{self.out_shape}: index box {group} over axes "
                f"{src} does not map to a box over {dst}; shard boundaries must align to whole "
                f"rows of the split axes"
            )
        return box[: self.lead] + tuple(mapped) + box[self.lead + n_src :]

    def forward(self, box: Box) -> Box | None:
        return self._map(box, self.in_group, self.out_group)

    def backward(self, box: Box) -> Box:
        return self._map(box, self.out_group, self.in_group)

    def apply(self, piece: Any, out_shape: tuple[int, ...]) -> Any:
        return piece.reshape(out_shape)

    def __str__(self) -> str:
        return f"reshape{self.in_shape}->{self.out_shape}"


IndexOp = Permute | Window | Select | Insert | ReshapeOp


# ---------------------------------------------------------------------------------------------
# Routes and user-facing transforms.


@dataclasses.dataclass(frozen=True)
class Route:
    """How one destination leaf (or a layer of it) is computed from one source leaf."""

    src_path: str
    path: str  # destination path
    src_shape: tuple[int, ...]
    shape: tuple[int, ...]  # destination shape (after all index ops)
    src_dtype: np.dtype
    casts: tuple[np.dtype, ...] = ()  # dtypes in the order they are applied
    ops: tuple[IndexOp, ...] = ()
    stack_group: tuple[int, int] | None = None  # (axis, index) when produced by Stack

    @property
    def dtype(self) -> np.dtype:
        return self.casts[-1] if self.casts else self.src_dtype

    def split_casts(self) -> tuple[tuple[np.dtype, ...], tuple[np.dtype, ...]]:
        """Casts run on the source up to the narrowest dtype, the rest on the destination.

        Moving the narrowing casts to the sender shrinks the bytes on the wire; widening casts
        run on the receiver for the same reason. Casts commute with index ops, so this is exact.
        """
        if not self.casts:
            return (), ()
        sizes = [self.src_dtype.itemsize] + [np.dtype(d).itemsize for d in self.casts]
        cut = int(np.argmin(sizes))  # first narrowest point; 0 means nothing on the source
        return self.casts[:cut], self.casts[cut:]

    @property
    def wire_dtype(self) -> np.dtype:
        src_casts, _ = self.split_casts()
        return src_casts[-1] if src_casts else self.src_dtype

    def describe(self) -> str:
        src_casts, dst_casts = self.split_casts()
        parts = [f"cast({np.dtype(d).name})@src" for d in src_casts]
        parts += [str(op) for op in self.ops]
        parts += [f"cast({np.dtype(d).name})@dst" for d in dst_casts]
        return " | ".join(parts) if parts else "copy"


def _replace_component(path: str, new: str) -> str:
    head, _, _ = path.rpartition("/")
    return f"{head}/{new}" if head else new


def _normalise_axis(axis: int, ndim: int, what: str) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what}: axis={axis} is out of range for rank {ndim}")
    return axis % ndim


@dataclasses.dataclass(frozen=True)
class Cast:
    """Change the dtype (runs on whichever side moves fewer bytes)."""

    dtype: Any

    def __call__(self, route: Route) -> list[Route]:
        return [dataclasses.replace(route, casts=route.casts + (np.dtype(self.dtype),))]


@dataclasses.dataclass(frozen=True)
class Transpose:
    """Destination = source.transpose(perm)."""

    perm: tuple[int, ...]

    def __call__(self, route: Route) -> list[Route]:
        perm = tuple(int(p) for p in self.perm)
        if sorted(perm) != list(range(len(route.shape))):
            raise ValueError(
                f"{route.src_path}: perm={perm} is not a permutation of {len(route.shape)} axes"
            )
        op = Permute(perm)
        return [dataclasses.replace(route, shape=op.shape(route.shape), ops=route.ops + (op,))]


@dataclasses.dataclass(frozen=True)
class Reshape:
    """Split one axis into consecutive axes, or merge consecutive axes into one."""

    shape: tuple[int, ...]

    def __call__(self, route: Route) -> list[Route]:
        src, dst = tuple(route.shape), tuple(int(d) for d in self.shape)
        if math.prod(src) != math.prod(dst):
            raise ValueError(f"{route.src_path}: cannot reshape {src} to {dst}")
        lead = 0
        while lead < min(len(src), len(dst)) and src[lead] == dst[lead]:
            lead += 1
        tail = 0
        while (
            tail < min(len(src), len(dst)) - lead
            and src[len(src) - 1 - tail] == dst[len(dst) - 1 - tail]
        ):
            tail += 1
        in_group, out_group = src[lead : len(src) - tail], dst[lead : len(dst) - tail]
        if src == dst:
            return [route]
        if min(len(in_group), len(out_group)) != 1:
            raise ValueError(
                f"{route.src_path}: reshape {src}->{dst} must split one axis or merge "
                f"consecutive axes, not map {in_group} to {out_group}"
            )
        op = ReshapeOp(src, dst, lead, in_group, out_group)
        return [dataclasses.replace(route, shape=dst, ops=route.ops + (op,))]


@dataclasses.dataclass(frozen=True)
class Split:
    """One leaf -> sibling leaves `names` (its last path component replaced), cut along `axis`."""

    axis: int
    sizes: tuple[int, ...]
    names: tuple[str, ...]

    def __call__(self, route: Route) -> list[Route]:
        axis = _normalise_axis(self.axis, len(route.shape), f"{route.src_path}: split")
        if len(self.sizes) != len(self.names):
            raise ValueError(
                f"{route.src_path}: split has sizes={self.sizes} but names={self.names}"
            )
        if sum(self.sizes) != route.shape[axis]:
            raise ValueError(
                f"{route.src_path}: split sizes={self.sizes} sum to {sum(self.sizes)}, "
                f"not to axis {axis} of shape {route.shape}"
            )
        out, start = [], 0
        for size, name in zip(self.sizes, self.names, strict=True):
            op = Window(axis, start, int(size))
            out.append(
                dataclasses.replace(
                    route,
                    path=_replace_component(route.path, name),
                    shape=op.shape(route.shape),
                    ops=route.ops + (op,),
                )
            )
            start += size
        return out


@dataclasses.dataclass(frozen=True)
class Unstack:
    """Stacked layers -> one leaf per layer; the layer index becomes path component `at`."""

    axis: int = 0
    at: int = -1  # position of the new component in the destination path (negative: from end)

    def __call__(self, route: Route) -> list[Route]:
        axis = _normalise_axis(self.axis, len(route.shape), f"{route.src_path}: unstack")
        parts = route.path.split("/")
        at = self.at if self.at >= 0 else len(parts) + 1 + self.at
        if not 0 <= at <= len(parts):
            raise ValueError(f"{route.src_path}: unstack at={self.at} is outside the path")
        out = []
        for i in range(route.shape[axis]):
            op = Select(axis, i)
            path = "/".join(parts[:at] + [str(i)] + parts[at:])
            out.append(
                dataclasses.replace(
                    route, path=path, shape=op.shape(route.shape), ops=route.ops + (op,)
                )
            )
        return out


@dataclasses.dataclass(frozen=True)
class Stack:
    """Per-layer leaves -> one stacked leaf; path component `at` (the layer index) is removed.

    The number of layers is the number of source leaves that land on the same destination path;
    Stack must be the last index transform of its chain (casts may follow).
    """

    axis: int = 0
    at: int = -2

    def __call__(self, route: Route) -> list[Route]:
        parts = route.path.split("/")
        at = self.at if self.at >= 0 else len(parts) + self.at
        if not 0 <= at < len(parts) or not parts[at].isdigit():
            raise ValueError(
                f"{route.src_path}: stack at={self.at} does not name a layer-index component"
            )
        axis = _normalise_axis(self.axis, len(route.shape) + 1, f"{route.src_path}: stack")
        path = "/".join(parts[:at] + parts[at + 1 :])
        return [dataclasses.replace(route, path=path, stack_group=(axis, int(parts[at])))]


Transform = Cast | Transpose | Reshape | Split | Unstack | Stack
TRANSFORM_TYPES = (Cast, Transpose, Reshape, Split, Unstack, Stack)


def apply_to_array(route: Route, array: np.ndarray) -> np.ndarray:
    """The whole-array meaning of a route (used by baselines; the plan itself never does this)."""
    out = array
    for op in route.ops:
        if isinstance(op, Window):
            index = [slice(None)] * out.ndim
            index[op.axis] = slice(op.start, op.start + op.size)
            out = out[tuple(index)]
        elif isinstance(op, Select):
            out = np.take(out, op.index, axis=op.axis)
        else:
            out = op.apply(out, op.shape(out.shape))
    for dtype in route.casts:
        out = out.astype(dtype)
    return out

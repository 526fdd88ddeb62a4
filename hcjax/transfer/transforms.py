"""Per-leaf routes of a transfer plan: which source leaf feeds which destination leaf, with the
dtype casts on the way (`Cast`, each run on the side that moves fewer bytes), and the index-box
arithmetic the plan works in. The plan never materialises a tensor."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

Box = tuple[tuple[int, int], ...]  # one half-open (start, stop) per axis


def box_volume(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def intersect_boxes(a: Box, b: Box) -> Box | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return None if any(start >= stop for start, stop in out) else out


@dataclasses.dataclass(frozen=True)
class Route:
    """How one destination leaf is computed from one source leaf of the same shape."""

    src_path: str
    path: str  # destination path
    shape: tuple[int, ...]
    src_dtype: np.dtype
    casts: tuple[np.dtype, ...] = ()  # dtypes in the order they are applied

    @property
    def dtype(self) -> np.dtype:
        return self.casts[-1] if self.casts else self.src_dtype

    def split_casts(self) -> tuple[tuple[np.dtype, ...], tuple[np.dtype, ...]]:
        """Casts run on the source up to the narrowest dtype, the rest on the destination.

        Moving the narrowing casts to the sender shrinks the bytes on the wire; widening casts
        run on the receiver for the same reason.
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
        parts += [f"cast({np.dtype(d).name})@dst" for d in dst_casts]
        return " | ".join(parts) if parts else "copy"


@dataclasses.dataclass(frozen=True)
class Cast:
    """Change the dtype (runs on whichever side moves fewer bytes)."""

    dtype: Any

    def __call__(self, route: Route) -> Route:
        return dataclasses.replace(route, casts=route.casts + (np.dtype(self.dtype),))


Transform = Cast
TRANSFORM_TYPES = (Cast,)


def apply_to_array(route: Route, array: np.ndarray) -> np.ndarray:
    """The whole-array meaning of a route (used by baselines; the plan itself never does this)."""
    out = array
    for dtype in route.casts:
        out = out.astype(dtype)
    return out

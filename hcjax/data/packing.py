"""First-fit sequence packing into fixed-length rows with segment ids, restarting positions and
loss masks, as a checkpointable grain iterator over a random-access dataset of documents.

A row holds whole documents; `segment_ids` number them 1, 2, … (0 = padding) so attention never
crosses documents, and `positions` restart at 0 for each. The iterator's state is a few integers
per open bin (document indices), so a restored iterator yields exactly the next batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

OVERLONG_MODES = ("truncate", "error")


class FirstFitBins:
    """At most `num_open_bins` bins of capacity `row_len`; a document goes into the first open
    bin with room, else the oldest bin is closed (emitted) and a new one opened."""

    def __init__(self, row_len: int, num_open_bins: int) -> None:
        if row_len < 1:
            raise ValueError(f"row_len={row_len} must be >= 1")
        if num_open_bins < 1:
            raise ValueError(f"num_open_bins={num_open_bins} must be >= 1")
        self.row_len = row_len
        self.num_open_bins = num_open_bins
        self.bins: list[list[int]] = []  # document indices per open bin, oldest first
        self.fill: list[int] = []

    def add(self, index: int, length: int) -> list[list[int]]:
        """Place document `index` of `length` tokens; returns the bins closed by this step."""
        if not 1 <= length <= self.row_len:
            raise ValueError(f"document {index} has length={length}, not in [1, {self.row_len}]")
        for b, used in enumerate(self.fill):
            if used + length <= self.row_len:
                self.bins[b].append(index)
                self.fill[b] += length
                return []
        closed: list[list[int]] = []
        if len(self.bins) == self.num_open_bins:
            closed.append(self.bins.pop(0))
            self.fill.pop(0)
        self.bins.append([index])
        self.fill.append(length)
        return closed

    def flush(self) -> list[list[int]]:
        closed, self.bins, self.fill = self.bins, [], []
        return closed


def build_row(docs: Sequence[dict[str, np.ndarray]], row_len: int) -> dict[str, np.ndarray]:
    """Concatenate documents (each with "tokens" and "loss_mask") into one padded row."""
    tokens = np.zeros(row_len, np.int32)
    loss_mask = np.zeros(row_len, np.int32)
    segment_ids = np.zeros(row_len, np.int32)
    positions = np.zeros(row_len, np.int32)
    start = 0
    for seg, doc in enumerate(docs, start=1):
        n = len(doc["tokens"])
        if start + n > row_len:
            raise ValueError(f"documents of total length {start + n} exceed row_len={row_len}")
        tokens[start : start + n] = doc["tokens"]
        loss_mask[start : start + n] = doc["loss_mask"]
        segment_ids[start : start + n] = seg
        positions[start : start + n] = np.arange(n)
        start += n
    return {
        "tokens": tokens,
        "loss_mask": loss_mask,
        "segment_ids": segment_ids,
        "positions": positions,
    }


class PackedBatchIterator(grain.DatasetIterator):
    """Batches of packed rows read in order from a random-access dataset of tokenized documents
    (dicts with int "tokens" and "loss_mask"; a `grain.MapDataset`, possibly infinite).

    overlong: "truncate" cuts documents longer than `row_len` (counted in `num_truncated`, with a
    warning) or "error" raises. A finite dataset ends with a batch padded by empty rows.
    """

    def __init__(
        self,
        dataset: Any,
        row_len: int,
        batch_size: int,
        num_open_bins: int = 8,
        overlong: str = "truncate",
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if overlong not in OVERLONG_MODES:
            raise ValueError(f"overlong={overlong!r} is not one of {OVERLONG_MODES}")
        if len(dataset) == 0:
            raise ValueError("the dataset is empty; nothing to pack")
        self._ds = dataset
        self._row_len = row_len
        self._batch_size = batch_size
        self._overlong = overlong
        self._bins = FirstFitBins(row_len, num_open_bins)
        self._ready: list[list[int]] = []  # closed rows not yet batched
        self._cursor = 0
        self._cache: dict[int, dict[str, np.ndarray]] = {}
        self.num_truncated = 0
        self._exhausted = False

    def _doc(self, index: int, first_read: bool = False) -> dict[str, np.ndarray]:
        doc = self._cache.get(index)
        if doc is None:
            raw = self._ds[index]
            tokens = np.asarray(raw["tokens"], np.int32)
            mask = np.asarray(raw["loss_mask"], np.int32)
            if tokens.shape != mask.shape or tokens.ndim != 1:
                raise ValueError(
                    f"document {index}: tokens shape {tokens.shape} and loss_mask shape "
                    f"{mask.shape} must be equal and 1-D"
                )
            if len(tokens) > self._row_len:
                if self._overlong == "error":
                    raise ValueError(
                        f"document {index} has {len(tokens)} tokens > row_len={self._row_len} "
                        "(set overlong='truncate' to cut it)"
                    )
                if first_read:
                    self.num_truncated += 1
                # Warn at counts 1, 10, 100, ... so a long run does not flood the log.
                if first_read and str(self.num_truncated).rstrip("0") == "1":
                    warnings.warn(
                        f"document {index} truncated from {len(tokens)} to row_len="
                        f"{self._row_len} tokens ({self.num_truncated} so far)",
                        stacklevel=3,
                    )
                tokens, mask = tokens[: self._row_len], mask[: self._row_len]
            doc = {"tokens": tokens, "loss_mask": mask}
            self._cache[index] = doc
        return doc

    def _fill_ready(self) -> None:
        while len(self._ready) < self._batch_size and not self._exhausted:
            if self._cursor >= len(self._ds):
                self._ready.extend(self._bins.flush())
                self._exhausted = True
                break
            index = self._cursor
            self._cursor += 1
            doc = self._doc(index, first_read=True)
            if len(doc["tokens"]) == 0:
                del self._cache[index]
                continue
            self._ready.extend(self._bins.add(index, len(doc["tokens"])))

    def __next__(self) -> dict[str, np.ndarray]:
        self._fill_ready()
        if not self._ready:
            raise StopIteration
        rows, self._ready = self._ready[: self._batch_size], self._ready[self._batch_size :]
        built = [build_row([self._doc(i) for i in row], self._row_len) for row in rows]
        empty = build_row([], self._row_len)
        built += [empty] * (self._batch_size - len(built))
        # Drop cached documents that no open bin or ready row still needs.
        live = {i for row in self._ready + self._bins.bins for i in row}
        self._cache = {i: d for i, d in self._cache.items() if i in live}
        return {k: np.stack([r[k] for r in built]) for k in built[0]}

    def get_state(self) -> dict[str, Any]:
        return {
            "cursor": self._cursor,
            "open_bins": [list(b) for b in self._bins.bins],
            "ready": [list(r) for r in self._ready],
            "num_truncated": self.num_truncated,
            "exhausted": self._exhausted,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self._cursor = int(state["cursor"])
        self._ready = [[int(i) for i in r] for r in state["ready"]]
        self._bins = FirstFitBins(self._row_len, self._bins.num_open_bins)
        self._cache = {}
        for b in state["open_bins"]:
            self._bins.bins.append([int(i) for i in b])
            self._bins.fill.append(sum(len(self._doc(int(i))["tokens"]) for i in b))
        self.num_truncated = int(state["num_truncated"])
        self._exhausted = bool(state["exhausted"])

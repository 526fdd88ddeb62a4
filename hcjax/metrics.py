"""Metric writers and progress: per-step scalars to `metrics.jsonl` and TensorBoard event files,
a progress bar with ETA and tokens/s (drawn by hcjax.display), a human-readable summary and a
loss-curve PNG."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tensorboardX import SummaryWriter

from hcjax.display import StepBar


def _scalar(v: Any) -> float:
    x = float(np.asarray(v))
    return x


class MetricsWriter:
    """Appends `{"step": s, "time": t, name: value, ...}` lines to `<dir>/metrics.jsonl` and the
    same scalars to TensorBoard (tensorboardX; no TensorFlow needed) under `<dir>/tb`."""

    def __init__(self, output_dir: str, tensorboard: bool = True) -> None:
        os.makedirs(output_dir, exist_ok=True)
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._tb = None
        if tensorboard:
            self._tb = SummaryWriter(os.path.join(output_dir, "tb"))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        values = {k: _scalar(v) for k, v in metrics.items()}
        record = {"step": int(step), "time": time.time(), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, int(step))

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str) -> list[dict[str, float]]:
    """All records of a metrics.jsonl file (missing file → error naming it)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"metrics file {path!r} does not exist")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class Progress:
    """A bar over training steps showing loss, tokens/s, elapsed time and the ETA
    (hcjax.display.StepBar: redrawn in place on a terminal).

    Steps are dispatched asynchronously, so tokens/s is measured between synchronised steps
    (`synced=True`, e.g. where metrics were fetched), not per dispatched step.
    """

    def __init__(self, total_steps: int, initial: int = 0, disable: bool = False,
                 description: str = "training") -> None:
        self._bar = None if disable else StepBar(total_steps, initial, description)
        self._last = time.perf_counter()
        self._tokens = 0
        self.tokens_per_s = 0.0

    def update(self, loss: float, tokens: int, synced: bool = True) -> float:
        """Advance one step of `tokens` tokens; returns the latest tokens/s measurement."""
        self._tokens += tokens
        fields = {}
        if synced:
            now = time.perf_counter()
            self.tokens_per_s = self._tokens / max(now - self._last, 1e-9)
            self._last, self._tokens = now, 0
            fields = {"loss": f"{loss:.4f}", "tok/s": f"{self.tokens_per_s:,.0f}"}
        if self._bar is not None:
            self._bar.update(1, **fields)
        return self.tokens_per_s

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def write_summary(output_dir: str, title: str, items: Mapping[str, Any]) -> str:
    """Write `summary.txt`: a title line and aligned `key: value` lines. Returns the text."""
    width = max((len(k) for k in items), default=0)
    lines = [title, "=" * len(title)]
    for k, v in items.items():
        if isinstance(v, float):
            v = f"{v:.6g}"
        lines.append(f"{k.ljust(width)} : {v}")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(output_dir, "summary.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    return text


def plot_curves(
    records: Sequence[Mapping[str, float]],
    path: str,
    keys: Sequence[str] = ("loss",),
    title: str = "training loss",
) -> None:
    """Save a PNG of `keys` against step (matplotlib, Agg backend: no display needed)."""
    # optional: matplotlib (0.25 s to import), loaded only when a plot is written
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the Agg backend is chosen

    fig, ax = plt.subplots(figsize=(6, 4))
    plotted = False
    for key in keys:
        pts = [
            (r["step"], r[key]) for r in records if key in r and math.isfinite(float(r[key]))
        ]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, label=key)
            plotted = True
    if not plotted:
        plt.close(fig)
        raise ValueError(f"no finite values of {list(keys)} to plot")
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

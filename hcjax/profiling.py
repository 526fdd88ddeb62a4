"""XProf traces of a step range: `StepTracer(start, stop, dir)` starts `jax.profiler` before step
`start` and stops it after step `stop - 1`; the trace is viewable in TensorBoard / XProf."""

from __future__ import annotations

import os

import jax


class StepTracer:
    """Traces steps [start, stop) into `<log_dir>/plugins/profile/<run>/` (empty range = off).
    Entry points expose the range as gin parameters (e.g. `run_sft.profile_start/stop`).

    Call `before_step(step)` before dispatching a step and `after_step(step, block_on)` after;
    the trace is closed once the last traced step's outputs are ready, so it holds the work.
    """

    def __init__(self, log_dir: str, start: int = -1, stop: int = -1) -> None:
        if start >= 0 and stop <= start:
            raise ValueError(f"profile range start={start}, stop={stop} is empty (need stop > start)")
        self.log_dir = log_dir
        self.start = start
        self.stop = stop
        self.active = False

    @property
    def enabled(self) -> bool:
        return self.start >= 0

    def before_step(self, step: int) -> None:
        if self.enabled and not self.active and self.start <= step < self.stop:
            os.makedirs(self.log_dir, exist_ok=True)
            jax.profiler.start_trace(self.log_dir)
            self.active = True

    def after_step(self, step: int, block_on: object = None) -> None:
        if self.active and step >= self.stop - 1:
            if block_on is not None:
                jax.block_until_ready(block_on)
            jax.profiler.stop_trace()
            self.active = False

    def close(self) -> None:
        """Stop a trace left open (the run ended inside the range)."""
        if self.active:
            jax.profiler.stop_trace()
            self.active = False

"""XProf traces: tracing steps [a, b) writes trace files; outside the range nothing is traced."""

import os

import jax
import jax.numpy as jnp
import pytest

from hcjax.profiling import StepTracer


def trace_files(log_dir: str) -> list[str]:
    """Paths of the trace files (`*.xplane.pb`, `*.trace.json.gz`) written under `log_dir`."""
    out = []
    for root, _, files in os.walk(log_dir):
        out += [os.path.join(root, f) for f in files
                if f.endswith((".xplane.pb", ".trace.json.gz"))]
    return sorted(out)


def test_trace_files_appear_for_the_step_range(tmp_path):
    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
    x = jnp.ones((64, 64))
    tracer = StepTracer(str(tmp_path / "profile"), start=2, stop=4)
    started = []
    for step in range(6):
        tracer.before_step(step)
        started.append(tracer.active)
        y = f(x)
        tracer.after_step(step, y)
    assert started == [False, False, True, True, False, False]
    files = trace_files(str(tmp_path / "profile"))
    assert any(p.endswith(".xplane.pb") for p in files), files


def test_disabled_and_bad_range(tmp_path):
    tracer = StepTracer(str(tmp_path / "p"))
    tracer.before_step(0)
    assert not tracer.active and not tracer.enabled
    assert trace_files(str(tmp_path / "p")) == []
    with pytest.raises(ValueError, match="start=5, stop=5"):
        StepTracer(str(tmp_path), start=5, stop=5)

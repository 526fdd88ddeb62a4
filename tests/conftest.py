"""Test setup: 8 fake CPU devices (set before JAX is imported) and fp32-friendly defaults."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# LLVM's -O0 for the code XLA generates on CPU: the suite's tiny programs spend most of their time
# compiling, and -O0 compiles them about 30% faster (tests/test_model_scale.py 105 s -> 75 s, the
# climb's subprocess tests 78 s -> 56 s). XLA's own HLO passes and the numerics are unchanged
# (no fast-math either way). The processes tests start keep it: they build their XLA_FLAGS with
# hcjax.config.cpu_xla_flags. HCJAX_TEST_XLA_OPT=1 compiles as production does.
# XLA's older elemental emitters instead of its fusion emitters: another ~20% off compiles of the
# suite's programs (the engine and model-scale tests 134 s -> 109 s; the sampler alone 2.7 s ->
# 1.9 s) from the same HLO. HCJAX_TEST_XLA_OPT=1 turns these off.
if os.environ.get("HCJAX_TEST_XLA_OPT", "0") != "1":
    if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
    if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
    # One LLVM module per program instead of parts compiled on parallel threads: the suite's
    # workers already fill both cores, and the split's own overhead goes (the model and family
    # tests: 193 -> 167 CPU-seconds, backend compile 86 -> 74 s). Same code, same numerics.
    if "xla_cpu_parallel_codegen_split_count" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_cpu_parallel_codegen_split_count=1"

# One persistent compilation cache for the whole test run, this process and every subprocess it
# starts (they inherit the environment): the suite compiles the same tiny models' steps in dozens
# of tests and entry-point processes, and a cache hit costs a fraction of a compile. The folder is
# new for each run (nothing carries over between CI runs) and removed at the end. Source metadata
# is part of the key, so an executable is only reused for the same code (profiles stay named).
# HCJAX_TEST_COMPILATION_CACHE=0 turns it off.
_OWN_CACHE_DIR = None
if os.environ.get("HCJAX_TEST_COMPILATION_CACHE", "1") != "0" and \
        "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _OWN_CACHE_DIR = tempfile.mkdtemp(prefix="hcjax-test-jit-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE_DIR
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    os.environ.setdefault("JAX_COMPILATION_CACHE_INCLUDE_METADATA_IN_KEY", "1")

# One scratch folder for the whole test run, shared the same way (the xdist workers inherit its
# name) and removed at the end by the process that made it: what tests build once per run for
# every worker (the tiny base, tests/test_climb.py shared_base).
_OWN_RUN_DIR = None
if "HCJAX_TEST_RUN_DIR" not in os.environ:
    import tempfile

    _OWN_RUN_DIR = tempfile.mkdtemp(prefix="hcjax-test-run-")
    os.environ["HCJAX_TEST_RUN_DIR"] = _OWN_RUN_DIR

import gin  # noqa: E402
import pytest  # noqa: E402

from tests.ceiling import pytest_runtest_makereport  # noqa: E402, F401 - the per-test ceiling


@pytest.fixture(scope="session")
def tiny_base():
    """tests/test_climb.py's TINY base, pre-trained once per run for every worker: the
    --base_checkpoint of the climb tests that do not test pre-training the base."""
    from tests.test_climb import shared_base

    return shared_base()


@pytest.fixture(autouse=True)
def _fresh_gin_config():
    """Every test starts and ends with empty gin bindings (gin state is process-global)."""
    gin.clear_config()
    yield
    gin.clear_config()


def _sort_only_sampling():
    """For tests whose engines or decode steps test something else than the sampler (KV layouts,
    model families, TPU plans): no candidate level on any platform, so the sampler's last level
    (a sort of the row, up to SORT_UP_TO ids) decides every row. Every setting draws
    bit-identical tokens (hcjax.rollout.sampling; tests/test_rollout_sampling.py checks it), and
    this one compiles in about a third of the time (XLA:CPU, 4 rows x 272 ids: 1.2 s against
    3.2 s; libtpu, the tiny decode step: 9 s against 18-24 s), which each engine pays in every
    prefill and decode program. tests/test_rollout_engine.py and test_plan's tiny plan keep the
    platforms' tuning."""
    import jax

    from hcjax.rollout import sampling

    tuned = dict(sampling.SAMPLER_TUNING)
    for platform in tuned:
        sampling.SAMPLER_TUNING[platform] = ((2**31 - 1,), sampling.SORT_UP_TO)
    try:
        yield
    finally:
        sampling.SAMPLER_TUNING.update(tuned)
        jax.clear_caches()  # no program traced under it outlives it


@pytest.fixture(scope="module")
def sort_only_sampler():
    """`_sort_only_sampling` for a module: `pytestmark = pytest.mark.usefixtures(...)`."""
    yield from _sort_only_sampling()


@pytest.fixture
def sort_only_sampler_in_test():
    """`_sort_only_sampling` for one test."""
    yield from _sort_only_sampling()


_TIMELINE = os.environ.get("HCJAX_TEST_TIMELINE")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """HCJAX_TEST_TIMELINE=FILE: append one JSON line per test (worker, start, end, id)."""
    if not _TIMELINE:
        yield
        return
    import json
    import time

    t0 = time.time()
    yield
    with open(_TIMELINE, "a") as f:
        f.write(json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                            "start": t0, "end": time.time(), "id": item.nodeid}) + "\n")


# A weights push whose receiver was killed (the fault tests do that on purpose) leaves a sender
# thread blocked inside a transfer pull that never returns; at interpreter exit such a thread
# aborts the process (or, with executor threads, hangs it). After the session has reported, exit
# with its status without finalising those threads.
_EXIT_STATUS = {"status": 0}


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS["status"] = int(exitstatus)


def pytest_unconfigure(config):
    import shutil
    import sys
    import threading

    for own in (_OWN_CACHE_DIR, _OWN_RUN_DIR):
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)

    if any(t.is_alive() and t.name.startswith("plan-send-") for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS["status"])

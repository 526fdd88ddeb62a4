"""Test setup: 8 fake CPU devices (set before JAX is imported) and fp32-friendly defaults."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gin  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_gin_config():
    """Every test starts and ends with empty gin bindings (gin state is process-global)."""
    gin.clear_config()
    yield
    gin.clear_config()


# A weights push whose receiver was killed (the fault tests do that on purpose) leaves a sender
# thread blocked inside a transfer pull that never returns; at interpreter exit such a thread
# aborts the process (or, with executor threads, hangs it). After the session has reported, exit
# with its status without finalising those threads.
_EXIT_STATUS = {"status": 0}


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS["status"] = int(exitstatus)


def pytest_unconfigure(config):
    import sys
    import threading

    if any(t.is_alive() and t.name.startswith("plan-send-") for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS["status"])

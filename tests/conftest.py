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

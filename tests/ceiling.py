"""The suite's per-test ceiling: a test whose set-up and call together take longer than
CEILING_S seconds fails by name with its time, so one slow test cannot quietly eat the suite's
20-minute budget (README, "Two commands"). HCJAX_TEST_CEILING_S overrides the figure (the
guard's own test uses a tiny one). tests/conftest.py installs the hook; it is a plugin of its own
(`pytest -p tests.ceiling`) so that the guard can be tested without JAX."""

import os

import pytest

CEILING_S = 240.0


def ceiling_seconds() -> float:
    raw = os.environ.get("HCJAX_TEST_CEILING_S")
    if raw is None:
        return CEILING_S
    try:
        value = float(raw)
    except ValueError:
        raise pytest.UsageError(
            f"HCJAX_TEST_CEILING_S={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise pytest.UsageError(f"HCJAX_TEST_CEILING_S={raw!r} must be > 0")
    return value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "setup":
        item.stash[_SETUP_S] = report.duration
        return
    if call.when != "call" or not report.passed:
        return
    seconds = item.stash.get(_SETUP_S, 0.0) + report.duration
    ceiling = ceiling_seconds()
    if seconds > ceiling:
        report.outcome = "failed"
        setup = seconds - report.duration
        report.longrepr = (f"{item.nodeid} took {seconds:.1f} s (set-up {setup:.1f} s + call "
                           f"{report.duration:.1f} s), over the suite's per-test ceiling "
                           f"of {ceiling:g} s: make it faster or split it")


_SETUP_S = pytest.StashKey[float]()

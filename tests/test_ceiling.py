"""The per-test ceiling (tests/ceiling.py) fails a test that passes it, by name and time, and
leaves faster tests, and tests that fail on their own, as they are."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BODY = '''
import time

def test_fast():
    pass

def test_slow():
    time.sleep(1.5)

def test_slow_and_failing():
    time.sleep(1.5)
    assert 1 == 2
'''


def _run(tmp_path, ceiling):
    (tmp_path / "test_timed.py").write_text(BODY)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HCJAX_TEST_CEILING_S": ceiling}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.ceiling", "-p",
                           "no:cacheprovider", "-q", "-rA", "test_timed.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_test_over_the_ceiling_fails_by_name_and_time(tmp_path):
    proc = _run(tmp_path, "1.0")
    out = proc.stdout
    assert proc.returncode == 1, out
    assert "PASSED test_timed.py::test_fast" in out
    assert "FAILED test_timed.py::test_slow " in out
    took = re.search(r"test_timed.py::test_slow took (\d+\.\d) s", out)
    assert took and float(took.group(1)) >= 1.5, out
    assert "over the suite's per-test ceiling of 1 s" in out
    # its own failure is reported as it is, not as the ceiling's
    assert "assert 1 == 2" in out
    assert "2 failed, 1 passed" in out


def test_under_the_ceiling_everything_passes_and_a_bad_ceiling_is_named(tmp_path):
    proc = _run(tmp_path, "30")
    assert "1 failed, 2 passed" in proc.stdout, proc.stdout
    bad = _run(tmp_path, "soon")
    assert bad.returncode != 0
    assert "HCJAX_TEST_CEILING_S='soon' is not a number of seconds" in bad.stdout + bad.stderr

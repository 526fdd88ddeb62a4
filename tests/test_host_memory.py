"""Host malloc set-up (hcjax/host_memory.py): with it, XLA:CPU's per-call temporaries reuse freed
pages (page faults per call counted, not timed); HCJAX_HOST_MALLOC=system leaves glibc as it is;
a bad value is a clear error."""

import os
import subprocess
import sys
import textwrap

import pytest

from hcjax import host_memory

# Faults per call of a step whose two 21 MB temporaries live in a loop carry.
_FAULTS = textwrap.dedent("""
    import resource, jax, jax.numpy as jnp
    import hcjax

    def step(x):
        def body(i, c):
            a, b = c
            return a.at[i].set(x * i), b.at[i].set(x + i)
        a, b = jax.lax.fori_loop(0, 3, body, (jnp.zeros((319, 64, 256)), jnp.zeros((319, 64, 256))))
        return a[:5].sum() + b[:5].sum()

    step = jax.jit(step)
    x = jnp.ones((64, 256))
    for _ in range(3):
        jax.block_until_ready(step(x))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        jax.block_until_ready(step(x))
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
""")


def _faults_per_call(setting: str) -> float:
    env = dict(os.environ, HCJAX_HOST_MALLOC=setting, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux's")
def test_freed_pages_are_reused_and_system_opts_out():
    assert host_memory.keep_freed_memory()  # applied at `import hcjax` (conftest imports it)
    kept, system = _faults_per_call("keep"), _faults_per_call("system")
    # 42 MB of temporaries are 10,000 fresh 4 kB pages a call when glibc unmaps them on free.
    assert system > 5000, system
    assert kept < system / 5, (kept, system)


def test_a_bad_setting_names_itself(monkeypatch):
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setenv("HCJAX_HOST_MALLOC", "tcmalloc")
    with pytest.raises(ValueError, match="HCJAX_HOST_MALLOC='tcmalloc'"):
        host_memory.keep_freed_memory()

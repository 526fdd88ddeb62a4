"""Host malloc set-up (hcjax/host_memory.py): with it, XLA:CPU's per-call temporaries reuse freed
pages (page faults per call counted, not timed); it is off unless a training-only entry point or
HCJAX_HOST_MALLOC=keep asks, =system keeps it off; a bad value is a clear error."""

import os
import subprocess
import sys
import textwrap

import pytest

from hcjax import host_memory

# Faults in the median call (of 11) of a step whose two 21 MB temporaries live in a loop carry; the
# process set-up runs as an entry point's run_main does (JAX imported, not started), `ask` as a
# training-only one's (keep_freed_memory=True).
_FAULTS = textwrap.dedent("""
    import resource, sys, jax, jax.numpy as jnp
    from hcjax import host_memory
    from hcjax.config import setup_process
    setup_process(keep_freed_memory=sys.argv[1] == "ask")

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
    faults = []
    for _ in range(11):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        jax.block_until_ready(step(x))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(host_memory.kept(), sorted(faults)[5])
""")


def _run(setting: str | None, ask: bool) -> tuple[bool, float]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("HCJAX_HOST_MALLOC", None)
    if setting is not None:
        env["HCJAX_HOST_MALLOC"] = setting
    out = subprocess.run([sys.executable, "-c", _FAULTS, "ask" if ask else "no"], env=env,
                         capture_output=True, text=True, timeout=300, check=True)
    kept, faults = out.stdout.strip().splitlines()[-1].split()
    return kept == "True", float(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux's")
def test_freed_pages_are_reused_when_asked_and_off_by_default():
    default = _run(None, ask=False)
    asked = _run(None, ask=True)
    by_env = _run("keep", ask=False)
    opted_out = _run("system", ask=True)
    assert not default[0] and asked[0] and by_env[0] and not opted_out[0]
    # 42 MB of temporaries are 10,000 fresh 4 kB pages a call when glibc unmaps them on free.
    assert default[1] > 5000 and opted_out[1] > 5000, (default, opted_out)
    # The median call, so that a call in which the heap still grows (or another thread's
    # allocations land) does not decide the test.
    assert asked[1] < default[1] / 5 and by_env[1] < default[1] / 5, (asked, by_env, default)


def test_a_bad_setting_names_itself(monkeypatch):
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setenv("HCJAX_HOST_MALLOC", "tcmalloc")
    with pytest.raises(ValueError, match="HCJAX_HOST_MALLOC='tcmalloc'"):
        host_memory.keep_freed_memory()

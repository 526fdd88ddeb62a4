"""Host memory: freed heap pages stay with the process for the next call instead of going back to
the OS. Process set-up only; nothing here allocates or knows about JAX.

XLA:CPU allocates an executable's temporary buffers on every call. glibc's malloc serves large
requests with fresh `mmap`s (and unmaps them on free), and its per-thread arenas create and delete
64 MB heaps, so each call page-faults its temporaries in again: measured on the 2-core machine,
a learner step of `bench.learner`'s larger config took ~100,000 minor faults (400 MB of zeroed
pages), the E=64, k=8 MoE bench ~31,000, 7-10% of the step. `keep_freed_memory()` sets one arena,
no mmap'd chunks and no trimming, after which the same step takes a few hundred.

The one arena is also one lock for every thread's malloc. That costs where many small calls
run on several threads: the tiny engine's decode step (128 slots) went from ~4.7 to ~6.5 ms, and
the default climb, whose generation shares the process with the learner, made fewer steps a
minute (133 and 163 against 194 and 176 for dc93019's code in back-to-back 3-minute climbs; fewer
arenas than one per thread, 4, brought the faults back). So it is not a default: the processes
that only train ask for it (`python -m hcjax.sft`, `bench.learner`, `bench.moe`:
`run_main(main, keep_freed_memory=True)`), and HCJAX_HOST_MALLOC=keep turns it on in any other
hcjax process (`hcjax.config.setup_process`, which every entry point's `run_main` calls: a learner
process of a multi-process placement), =system turns it off everywhere. It must run before JAX
starts its threads (an arena is chosen by a thread's first allocation). Outside glibc (macOS,
musl) it does nothing. The cost is that a process keeps its peak heap until it exits, as with tcmalloc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

_applied: bool | None = None


def _setting() -> str:
    setting = os.environ.get("HCJAX_HOST_MALLOC", "")
    if setting not in ("", "keep", "system"):
        raise ValueError(f"HCJAX_HOST_MALLOC={setting!r} must be 'keep', 'system' or unset")
    return setting


def apply_from_environment() -> bool:
    """`keep_freed_memory()` if HCJAX_HOST_MALLOC=keep, else nothing (`setup_process` calls it)."""
    return keep_freed_memory() if _setting() == "keep" else False


def keep_freed_memory() -> bool:
    """Tune glibc's malloc so freed memory is reused (see the module docstring). Idempotent;
    returns whether the settings are in effect (False outside glibc or when
    HCJAX_HOST_MALLOC=system)."""
    global _applied
    if _applied is not None:
        return _applied
    setting = _setting()
    _applied = False
    if setting == "system":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # Each call returns 1 on success; trim only above 2 GB of free heap top.
    _applied = all(mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1)))
    return _applied


def kept() -> bool:
    """Whether `keep_freed_memory()` is in effect in this process (benchmarks report it)."""
    return bool(_applied)

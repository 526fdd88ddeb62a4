"""Run a pure function under a wall-clock limit: SIGALRM in the main thread, otherwise a spawned
helper process that is killed and restarted on timeout (signals only work in the main thread)."""

from __future__ import annotations

import gc
import importlib
import multiprocessing
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any


class TimeLimitExceeded(BaseException):
    """The function ran longer than its limit.  A BaseException, so that library code that
    catches Exception (math-verify does) cannot swallow the interruption."""


def call_with_time_limit(fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
    """fn(*args), raising TimeLimitExceeded after `timeout_s` seconds.

    Off the main thread, `fn` and `args` must be picklable (the call runs in a helper process).
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} is not positive")
    if threading.current_thread() is threading.main_thread():
        return _with_alarm(fn, args, timeout_s)
    return _HELPER.call(fn, args, timeout_s)


_REPEAT_S = 0.05  # the alarm repeats until disarmed: a deferred or dropped raise is retried


def _raise_would_be_dropped(frame) -> bool:
    """True when `frame` runs inside code whose exceptions Python prints as "Exception ignored"
    and drops: a __del__, the unraisable hook (which is formatting such an exception), or a GC
    callback.  A raise there would not stop `fn`, and inside the hook it breaks the hook itself."""
    hook = getattr(sys.unraisablehook, "func", sys.unraisablehook)
    dropping = {getattr(f, "__code__", None) for f in (hook, *gc.callbacks)} - {None}
    while frame is not None:
        if frame.f_code.co_name == "__del__" or frame.f_code in dropping:
            return True
        frame = frame.f_back
    return False


def _with_alarm(fn, args, timeout_s):
    # The handler raises only where the raise reaches `fn`'s caller: inside a __del__, the
    # unraisable hook or a GC callback it waits, and the timer, repeating every _REPEAT_S until
    # the call returns, tries again once that code has finished.  A raise can still land where
    # Python drops it unseen (a weakref callback); the repeat covers that too.
    armed = [True]

    def on_alarm(signum, frame):
        if armed[0] and not _raise_would_be_dropped(frame):
            raise TimeLimitExceeded(f"exceeded {timeout_s} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s, _REPEAT_S)
    try:
        return fn(*args)
    finally:
        while armed[0]:  # a raise landing before the flag drops is late, not news: drop it
            try:
                armed[0] = False
            except TimeLimitExceeded:
                pass
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _import(module: str) -> None:
    """The helper's start: `module` imported, and its `before_time_limit()` run if it has one
    (what its functions import lazily), so that no call's limit pays for imports."""
    prepare = getattr(importlib.import_module(module), "before_time_limit", None)
    if prepare is not None:
        prepare()


def _serve(conn) -> None:
    while True:
        fn, args = conn.recv()
        try:
            conn.send((True, fn(*args)))
        except BaseException as e:  # the caller re-raises it
            conn.send((False, e))


_STARTUP_S = 120.0  # importing the function's module (e.g. sympy) is not part of its limit


class _Helper:
    """One long-lived spawned process (spawn, not fork: the caller may hold threads and locks)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc = None
        self._conn = None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self._proc.start()
        child.close()

    def call(self, fn, args, timeout_s):
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
                self._conn.send((_import, (fn.__module__,)))
                if not self._conn.poll(_STARTUP_S):
                    raise RuntimeError(f"time-limit helper did not start in {_STARTUP_S} s")
                self._conn.recv()
            self._conn.send((fn, args))
            if not self._conn.poll(timeout_s):
                self._proc.kill()
                self._proc.join()
                self._proc = None
                raise TimeLimitExceeded(f"exceeded {timeout_s} s")
            ok, value = self._conn.recv()
        if not ok:
            raise value
        return value


_HELPER = _Helper()

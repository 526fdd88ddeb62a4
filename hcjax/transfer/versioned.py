"""Atomic weight versions on the inference side: a new tree is built in fresh buffers and swapped
in one step; a transfer that fails half-way leaves the previous version serving.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax


class TransferFailed(RuntimeError):
    """Version `version` could not be installed; `serving` is the version still served."""

    def __init__(self, version: int, serving: int, cause: BaseException):
        self.version, self.serving, self.cause = version, serving, cause
        super().__init__(
            f"weights version {version} failed to transfer ({type(cause).__name__}: {cause}); "
            f"still serving version {serving}"
        )


class VersionedWeights:
    """The tree being served and its version; readers always see one consistent pair."""

    def __init__(self, tree: Any = None, version: int = -1):
        self._lock = threading.Lock()
        self._tree, self._version = tree, version
        self.last_error: TransferFailed | None = None

    @property
    def version(self) -> int:
        return self._version

    def current(self) -> tuple[int, Any]:
        with self._lock:
            return self._version, self._tree

    def swap(self, tree: Any, version: int) -> None:
        """Install a complete tree. Versions only move forward."""
        with self._lock:
            if version <= self._version:
                raise ValueError(f"version={version} is not newer than the served {self._version}")
            self._tree, self._version = tree, version

    def update(self, build: Callable[[], Any], version: int) -> Any:
        """Run `build()` (e.g. `lambda: transfer(params)` with a LocalTransfer), wait for every
        buffer, then swap.

        On any failure the served version is untouched, the error is kept in `last_error` and
        raised as TransferFailed.
        """
        if version <= self._version:
            raise ValueError(f"version={version} is not newer than the served {self._version}")
        try:
            tree = jax.block_until_ready(build())
        except Exception as err:
            self.last_error = TransferFailed(version, self._version, err)
            raise self.last_error from err
        self.swap(tree, version)
        self.last_error = None
        return tree

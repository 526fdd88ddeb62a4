"""The gRPC server every hcjax service runs on: an asyncio server on its own event-loop thread,
so a call that waits (a queued Generate stream) holds no thread, and quick calls (Health,
Metrics) answer whatever the load. Handlers that block (the weights service's transfers) are
wrapped with `blocking` and run in a small pool of their own, which no other call uses.
Callers stay synchronous: add handlers and ports, start, stop. Knows no particular service.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from hcjax.rpc.auth import Security, add_port

__all__ = ["RpcServer", "blocking"]

_MB = 1 << 20


class RpcServer:
    """An asyncio gRPC server with our message limits and token check, driven from sync code.

    The same surface as a `grpc.Server` where hcjax uses one (`add_generic_rpc_handlers`,
    `add_insecure_port`, `add_secure_port`, `start`, `stop(grace).wait()`), plus `bind` (TLS
    when configured). No cap on concurrent RPCs: services bound what a call may hold themselves
    (the rollout service's admission), and a cap would refuse Health along with a flood.
    """

    def __init__(self, security: Security, *, max_receive_mb: int = 64, max_send_mb: int = 256,
                 blocking_workers: int = 8) -> None:
        self.security = security
        self.blocking_pool = ThreadPoolExecutor(blocking_workers,
                                                thread_name_prefix="rpc-blocking")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rpc-loop",
                                        daemon=True)
        self._thread.start()
        options = [("grpc.max_send_message_length", max_send_mb * _MB),
                   ("grpc.max_receive_message_length", max_receive_mb * _MB)]

        async def make() -> grpc.aio.Server:
            return grpc.aio.server(interceptors=security.server_interceptors(), options=options,
                                   migration_thread_pool=self.blocking_pool)

        self._server = self._run(make())
        self._stopped = threading.Event()

    def _run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _in_loop(self, fn: Callable[[], Any]) -> Any:
        async def call():
            return fn()

        return self._run(call())

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._in_loop(lambda: self._server.add_generic_rpc_handlers(tuple(handlers)))

    def add_insecure_port(self, address: str) -> int:
        return self._in_loop(lambda: self._server.add_insecure_port(address))

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        return self._in_loop(lambda: self._server.add_secure_port(address, credentials))

    def bind(self, address: str) -> int:
        """Bind `address` (TLS when the security settings say so); returns the bound port."""
        return add_port(self, address, self.security)

    def start(self) -> RpcServer:
        self._run(self._server.start())
        return self

    def stop(self, grace: float | None = None) -> threading.Event:
        """Stop accepting calls, cancel those still running after `grace` s, end the loop;
        returns an Event that is set once stopped (`.wait()` like grpc.Server.stop's)."""
        if self._stopped.is_set():
            return self._stopped
        try:
            self._run(self._server.stop(grace))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            # A transfer stuck on a dead peer must not keep the process from exiting.
            self.blocking_pool.shutdown(wait=False, cancel_futures=True)
            self._stopped.set()
        return self._stopped


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code, self.details = code, details


class BlockingContext:
    """What a `blocking` handler sees of its call: `peer`, `is_active` (False once the client
    cancelled or the deadline passed), `abort` (ends the call with a status, like a sync
    grpc.ServicerContext's) and `time_remaining`."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self._active = True
        self._peer = context.peer()

    def peer(self) -> str:
        return self._peer

    def is_active(self) -> bool:
        return self._active

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Aborted(code, details)


def blocking(fn: Callable[[Any, BlockingContext], Any], pool: ThreadPoolExecutor) -> Callable:
    """A unary-unary behaviour for an `RpcServer` that runs `fn(request, context)` in `pool`
    (the server's `blocking_pool`): the event loop never waits for it, and a call the client
    gives up marks the context inactive, which `fn` can poll to stop waiting itself."""

    async def behaviour(request: Any, context: grpc.aio.ServicerContext) -> Any:
        ctx = BlockingContext(context)
        future = asyncio.get_running_loop().run_in_executor(pool, fn, request, ctx)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            ctx._active = False  # the thread sees it and gives up
            raise
        except _Aborted as err:
            await context.abort(err.code, err.details)

    return behaviour

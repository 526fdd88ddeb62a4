"""gRPC transport for a `RolloutServer`: a streaming Generate call plus Health and Metrics, and the
matching client. Generic method handlers with our own byte format (wire.py), so no protoc step.

The service runs on an asyncio server (hcjax.rpc.server): a Generate stream waiting in the queue
holds no thread, and Health and Metrics answer in the event loop whatever Generate traffic is in
flight. Each client host (the peer address without its port) is a lane of the server's fair
queues and holds at most its share of the server's work (RolloutServer, scheduler.py). A request
refused for that share takes a place in its host's line (scheduler.Admission) and waits there,
holding no thread, asked again each time the host gives work back, until the host has given
nothing back for `hold_seconds`; asked again after that, it is recognised by a digest of its
message and keeps its place.

Every request is parsed and checked in full (wire format, option types and ranges, continuation
records, the engine's limits, `RequestLimits`) before it is queued, so no message can fail the
server. Status codes: INVALID_ARGUMENT (with the reason) for any malformed or out-of-limit
request, RESOURCE_EXHAUSTED (naming the limit and by how much, and carrying a retry-after hint in
its message and in the trailing metadata `retry-after-ms`; read it with `retry_after`) when the
client's share has no room and its line does not move, or its line or the server's capacity has
none, UNAVAILABLE when the server is stopping or failed, UNAUTHENTICATED without the shared token
(hcjax.rpc.auth). The service keeps serving after any of them.

Health answers {"status": "SERVING" | "NOT_SERVING", "version", ...}: NOT_SERVING when the
server's threads failed or when requests are in flight and no token has streamed for
`stall_seconds` (a hung engine). Health is authenticated like every other RPC (a probe without
the token could map the cluster's replicas and versions); `wait_ready` and the launchers' probes
read the token from the environment like any client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import re
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator

import grpc

from hcjax.rollout.request import GenerateRequest, SampledRollout, TokenEvent, request_from_dict
from hcjax.rollout.server import QueueFull, RequestHandle, RolloutServer, ServerStopped
from hcjax.rollout.wire import (
    decode,
    encode,
    events_from_arrays,
    events_to_arrays,
    record_from_wire,
    record_to_wire,
)
from hcjax.rpc.auth import Security, open_channel
from hcjax.rpc.server import RpcServer

__all__ = ["NOT_SERVING", "RETRY_AFTER_KEY", "SERVING", "RequestLimits", "RolloutClient",
           "RolloutServicer", "retry_after", "rpc_server", "wait_ready"]

SERVICE = "hcjax.Rollout"
SERVING, NOT_SERVING = "SERVING", "NOT_SERVING"
RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata of a RESOURCE_EXHAUSTED: when to ask again
_RETRY_AFTER_TEXT = re.compile(r"retry after (\d+(?:\.\d+)?) s")
_MB = 1 << 20


def retry_after(err: grpc.RpcError) -> float | None:
    """The server's retry-after hint (s) in a RESOURCE_EXHAUSTED: from the trailing metadata,
    else from the message; None when it gives none (a server without hints, or gRPC's own
    message-size refusal)."""
    try:
        metadata = err.trailing_metadata() or ()
    except AttributeError:  # an RpcError that is not a call (a test's fake, a wrapper)
        metadata = ()
    for key, value in metadata:
        if key == RETRY_AFTER_KEY:
            try:
                return max(0.0, float(value) / 1000.0)
            except ValueError:
                break
    details = err.details() if hasattr(err, "details") else None
    match = _RETRY_AFTER_TEXT.search(details or "")
    return float(match.group(1)) if match else None


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one request, and one client, may ask of a rollout service (beyond the engine's own
    limits on prompt length, prompt + max_tokens and stop tokens, which always apply).

    max_n: samples per request. max_tokens / max_prompt_len: caps below the engine's (None: the
    engine's). max_message_mb: the largest request message the server accepts. (What one client
    host may hold of the server is the server's `queue_share`.)
    """

    max_n: int = 256
    max_tokens: int | None = None
    max_prompt_len: int | None = None
    max_message_mb: int = 64

    def __post_init__(self) -> None:
        for name in ("max_n", "max_tokens", "max_prompt_len", "max_message_mb"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"RequestLimits.{name}={value!r} must be a positive integer")

    def check(self, request: GenerateRequest) -> None:
        if request.n > self.max_n:
            raise ValueError(f"n={request.n} exceeds the service's max_n={self.max_n}")
        if self.max_tokens is not None and request.max_tokens > self.max_tokens:
            raise ValueError(f"max_tokens={request.max_tokens} exceeds the service's "
                             f"max_tokens={self.max_tokens}")
        if self.max_prompt_len is not None and len(request.prompt) > self.max_prompt_len:
            raise ValueError(f"prompt length {len(request.prompt)} exceeds the service's "
                             f"max_prompt_len={self.max_prompt_len}")


def _request_to_bytes(request: GenerateRequest) -> bytes:
    meta = request.to_dict()
    arrays, records = {}, []
    for i, rec in enumerate(request.continue_from):
        rmeta, rarrays = record_to_wire(rec, f"c{i}")
        records.append(rmeta)
        arrays.update(rarrays)
    return encode({"options": meta, "continue_from": records}, arrays)


def _request_from_bytes(data: bytes) -> GenerateRequest:
    """Parse a Generate message; ValueError naming what is wrong, whatever the bytes are."""
    meta, arrays = decode(data)
    unknown = sorted(set(meta) - {"options", "continue_from"})
    if unknown:
        raise ValueError(f"unknown request message fields {unknown}")
    if not isinstance(meta.get("options"), dict):
        raise ValueError("request message has no 'options' object")
    prior_meta = meta.get("continue_from", [])
    if not isinstance(prior_meta, list):
        raise ValueError(f"continue_from is a {type(prior_meta).__name__}, not a list")
    names = {f"c{i}" for i in range(len(prior_meta))}
    stray = sorted(a for a in arrays if a.split(".", 1)[0] not in names)
    if stray:
        raise ValueError(f"arrays {stray[:4]} belong to no record of continue_from")
    prior = [record_from_wire(m, arrays, f"c{i}") for i, m in enumerate(prior_meta)]
    return request_from_dict(meta["options"], prior)


def _client_of(context: grpc.ServicerContext) -> str:
    """The peer's host ('ipv4:10.0.0.5:41234' -> 'ipv4:10.0.0.5'): the unit of queue share."""
    peer = context.peer() or "unknown"
    return peer.rsplit(":", 1)[0] if peer.startswith(("ipv4:", "ipv6:")) else peer


class RolloutServicer:
    """Adapts a RolloutServer to gRPC (on an `RpcServer`); one instance may be registered on any
    number of servers."""

    def __init__(self, server: RolloutServer, limits: RequestLimits | None = None, *,
                 stall_seconds: float = 120.0, hold_seconds: float = 2.0) -> None:
        """stall_seconds: requests in flight with no token streamed for this long make Health
        answer NOT_SERVING (the step-progress watchdog's server-side half). hold_seconds: a
        request refused for its host's share waits in the host's line, asked again each time
        the host gives work back, and gets RESOURCE_EXHAUSTED once the host has given nothing
        back for this long (0: at once)."""
        if stall_seconds <= 0:
            raise ValueError(f"stall_seconds={stall_seconds} must be positive")
        if hold_seconds < 0:
            raise ValueError(f"hold_seconds={hold_seconds} must be >= 0")
        self.server = server
        self.stall_seconds = stall_seconds
        self.hold_seconds = hold_seconds
        # Streams held in their host's line, by host: (their event loop, the event that wakes
        # them). Woken from the server's threads when the host gives work back.
        self._held: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        server.admission.add_listener(self._released)
        self._last_progress = time.monotonic()
        self.limits = limits or RequestLimits()
        self._inflight: Counter[str] = Counter()  # streams per client host
        self._lock = threading.Lock()
        self._routing_dims: tuple[int, int] | None = None
        self.rejected = Counter()  # status code name -> requests refused, for metrics

    # Validation ------------------------------------------------------------------------------
    def _engine_routing_dims(self) -> tuple[int, int]:
        """(MoE layers, experts per token) of the engine's routing record."""
        if self._routing_dims is None:
            layers, k = self.server.engine.routing_shape
            self._routing_dims = (int(layers), int(k))
        return self._routing_dims

    def validate(self, request: GenerateRequest) -> None:
        """Everything about `request` that the server's threads would otherwise trip over."""
        self.limits.check(request)
        vocab = self.server.engine.vocab_size
        for rec in request.continue_from:
            if vocab is not None and rec.response_len and int(rec.response_ids.max()) >= vocab:
                raise ValueError(f"sample {rec.sample_index} has response token id "
                                 f"{int(rec.response_ids.max())} >= vocab_size={vocab}")
            if rec.routing is None:  # the server records routing afresh from the prefill
                continue
            layers, k = self._engine_routing_dims()
            if rec.routing.shape[0] != layers or rec.routing.shape[2] != k:
                raise ValueError(f"sample {rec.sample_index} has routing shape "
                                 f"{list(rec.routing.shape)}; this engine records "
                                 f"[{layers}, P + R - 1, {k}]")

    def _parse(self, data: bytes) -> tuple[GenerateRequest, bytes]:
        """The request in `data`, checked, and its admission ticket (a digest of the message: a
        retry sends the same bytes); ValueError naming what is wrong, whatever the bytes."""
        try:
            request = _request_from_bytes(data)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - any parse failure is the message's fault
            raise ValueError(f"malformed request message ({type(e).__name__}: {e})") from None
        self.validate(request)
        return request, hashlib.blake2b(data, digest_size=16).digest()

    def _enter(self, client: str) -> None:
        with self._lock:
            if not self._inflight:  # work arrives at an idle server: the progress clock starts
                self._last_progress = time.monotonic()
            self._inflight[client] += 1

    def _leave(self, client: str) -> None:
        with self._lock:
            self._inflight[client] -= 1
            if self._inflight[client] <= 0:
                del self._inflight[client]

    def _released(self, client: str) -> None:
        """Admission's listener (a server thread): wake the streams held in `client`'s line."""
        with self._lock:
            held = list(self._held.get(client, ()))
        for loop, wake in held:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # that loop closed: its server stopped
                pass

    async def _submit(self, request: GenerateRequest, client: str, ticket: bytes
                      ) -> RequestHandle:
        """Submit the request; refused for its host's share with a place in the host's line, it
        waits there (holding no thread) and is submitted again each time the host gives work
        back or its hint comes due, until hold_seconds pass with nothing given back; then the
        last QueueFull."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.hold_seconds
        entry = (loop, asyncio.Event())
        with self._lock:  # before the first try: a release in between still wakes it
            self._held.setdefault(client, set()).add(entry)
        try:
            while True:
                entry[1].clear()
                try:
                    return self.server.submit(request, block=False, client=client, ticket=ticket)
                except QueueFull as e:
                    remaining = deadline - loop.time()
                    if not e.in_line or remaining <= 0:
                        raise
                    try:
                        await asyncio.wait_for(entry[1].wait(), min(remaining, e.retry_after))
                        deadline = loop.time() + self.hold_seconds  # its line moves: it stays
                    except TimeoutError:
                        pass
        except asyncio.CancelledError:  # its client went away while it waited: no place kept
            self.server.admission.withdraw(client, ticket)
            raise
        finally:
            with self._lock:
                held = self._held[client]
                held.discard(entry)
                if not held:
                    del self._held[client]

    async def _abort(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode,
                     message: str, trailing_metadata: tuple = ()):
        with self._lock:
            self.rejected[code.name] += 1
        await context.abort(code, message, trailing_metadata)

    # RPCs ------------------------------------------------------------------------------------
    async def generate(self, data: bytes, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        try:  # a large message is parsed off the event loop
            request, ticket = await loop.run_in_executor(None, self._parse, data)
        except ValueError as e:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        client = _client_of(context)
        try:
            handle = await self._submit(request, client, ticket)
        except ValueError as e:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFull as e:
            await self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e),
                              ((RETRY_AFTER_KEY, str(round(e.retry_after * 1000))),))
        except ServerStopped as e:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        self._enter(client)
        try:
            async for message in self._stream(handle, context):
                yield message
        finally:
            self._leave(client)
            if not handle.done:  # the client went away: free its slots
                handle.cancel()

    async def _stream(self, handle: RequestHandle, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[bytes]:
        """The handle's events as messages, woken by the server's threads (no thread waits)."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def notify() -> None:  # from the server's threads
            if not wake.is_set():  # a wake-up already on its way covers this event too
                try:
                    loop.call_soon_threadsafe(wake.set)
                except RuntimeError:  # the loop closed: the service is stopping
                    pass

        handle.set_notifier(notify)
        while True:
            wake.clear()
            try:
                batch, finished = handle.drain()
            except ServerStopped as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            if batch:
                with self._lock:
                    self._last_progress = time.monotonic()
                yield self._message(batch)
            if finished:
                return
            await wake.wait()

    def _message(self, batch: list) -> bytes:
        tokens = [e for e in batch if isinstance(e, TokenEvent)]
        records = [e for e in batch if isinstance(e, SampledRollout)]
        arrays = events_to_arrays(tokens)
        metas = []
        for i, rec in enumerate(records):
            m, a = record_to_wire(rec, f"r{i}")
            metas.append(m)
            arrays.update(a)
        return encode({"records": metas, "version": self.server.version}, arrays)

    def health_status(self) -> dict:
        """SERVING or NOT_SERVING (with the reason), the served weights version, requests in
        flight and seconds since the last streamed token."""
        state = self.server.health()
        with self._lock:
            inflight = sum(self._inflight.values())
            quiet = time.monotonic() - self._last_progress
        error = state.get("error")
        if state.get("ok") and inflight and quiet > self.stall_seconds:
            error = (f"stalled: {inflight} requests in flight and no token for {quiet:.0f} s "
                     f"(stall_seconds={self.stall_seconds})")
        ok = bool(state.get("ok")) and error is None
        return {"status": SERVING if ok else NOT_SERVING, "ok": ok, "error": error,
                "version": self.server.version, "inflight": inflight,
                "seconds_since_progress": round(quiet, 3) if inflight else 0.0}

    async def health(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return json.dumps(self.health_status()).encode()

    async def metrics(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        with self._lock:
            rejected = dict(self.rejected)
            streams = dict(self._inflight)
        return json.dumps({**self.server.metrics(), "rejected": rejected,
                           "streams_by_host": streams}).encode()

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Generate": grpc.unary_stream_rpc_method_handler(self.generate),
                "Health": grpc.unary_unary_rpc_method_handler(self.health),
                "Metrics": grpc.unary_unary_rpc_method_handler(self.metrics),
            },
        )


def rpc_server(security: Security, *, max_receive_mb: int = 64) -> RpcServer:
    """The server a rollout service runs on, with our message limits and the token check."""
    return RpcServer(security, max_receive_mb=max_receive_mb)


class RolloutClient:
    """Client of one rollout service. grpc.RpcError carries the server's status and message."""

    def __init__(self, address: str, security: Security | None = None) -> None:
        """security None: from the environment, like the servers (auth.py)."""
        self.address = address
        self._channel = open_channel(
            address, security, options=[("grpc.max_receive_message_length", 256 * _MB),
                                        ("grpc.max_send_message_length", 256 * _MB)],
        )
        self._generate = self._channel.unary_stream(f"/{SERVICE}/Generate")
        self._calls: set = set()  # Generate calls in flight, for cancel_inflight
        self._calls_lock = threading.Lock()
        self._health = self._channel.unary_unary(f"/{SERVICE}/Health")
        self._metrics = self._channel.unary_unary(f"/{SERVICE}/Metrics")

    def stream(
        self, request: GenerateRequest, timeout: float | None = None
    ) -> Iterator[TokenEvent | SampledRollout]:
        """TokenEvents as they are generated, then each sample's record when it ends."""
        call = self._generate(_request_to_bytes(request), timeout=timeout)
        with self._calls_lock:
            self._calls.add(call)
        try:
            for data in call:
                meta, arrays = decode(data)
                yield from events_from_arrays(arrays)
                for i, m in enumerate(meta["records"]):
                    yield record_from_wire(m, arrays, f"r{i}")
        finally:
            with self._calls_lock:
                self._calls.discard(call)

    def cancel_inflight(self) -> int:
        """Cancel every Generate call of this client still streaming (their callers see
        grpc.RpcError CANCELLED); returns how many. The router's watchdog uses it to route
        around a replica that stopped making progress."""
        with self._calls_lock:
            calls = list(self._calls)
        for call in calls:
            call.cancel()
        return len(calls)

    def generate(
        self,
        request: GenerateRequest,
        timeout: float | None = None,
        on_event: Callable[[TokenEvent], None] | None = None,
    ) -> list[SampledRollout]:
        records = []
        for item in self.stream(request, timeout):
            if isinstance(item, SampledRollout):
                records.append(item)
            elif on_event is not None:
                on_event(item)
        if len(records) != request.n:
            raise ConnectionError(f"stream ended with {len(records)} of {request.n} records")
        return sorted(records, key=lambda r: r.sample_index)

    def health(self, timeout: float = 5.0) -> dict:
        """The service's Health reply: {"status": "SERVING" | "NOT_SERVING", "version", ...}."""
        return json.loads(self._health(b"", timeout=timeout))

    def metrics(self, timeout: float = 5.0) -> dict:
        return json.loads(self._metrics(b"", timeout=timeout))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_ready(
    addresses: list[str] | tuple[str, ...],
    *,
    timeout: float = 600.0,
    require: str = "all",
    initial_backoff: float = 0.2,
    max_backoff: float = 10.0,
    security: Security | None = None,
    log: Callable[[str], None] | None = None,
) -> list[str]:
    """Poll each service's Health with exponential backoff until it answers SERVING.

    require "all": return once every address is ready, TimeoutError (naming the laggards and
    their last answer) after `timeout` s; "any": return as soon as one is ready. Returns the
    ready addresses. An UNAUTHENTICATED answer is a configuration error and raises at once.
    """
    if require not in ("all", "any"):
        raise ValueError(f"require={require!r}; expected 'all' or 'any'")
    if not addresses:
        raise ValueError("wait_ready needs at least one address")
    deadline = time.monotonic() + timeout
    clients = {a: RolloutClient(a, security) for a in addresses}
    backoff = {a: initial_backoff for a in addresses}
    due = {a: 0.0 for a in addresses}
    last: dict[str, str] = {a: "not asked yet" for a in addresses}
    ready: list[str] = []
    try:
        while True:
            now = time.monotonic()
            for a in [a for a in addresses if a not in ready and due[a] <= now]:
                try:
                    reply = clients[a].health(timeout=max(0.5, min(5.0, deadline - now)))
                    status = reply.get("status", SERVING if reply.get("ok") else NOT_SERVING)
                    last[a] = status if status == SERVING else f"{status}: {reply.get('error')}"
                except grpc.RpcError as err:
                    if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                        raise PermissionError(f"{a}: {err.details()} (set HCJAX_TOKEN or "
                                              "HCJAX_TOKEN_FILE to the service's token)") from None
                    status, last[a] = None, f"{err.code().name}: {err.details()}"
                if status == SERVING:
                    ready.append(a)
                    if log:
                        log(f"{a} ready")
                else:
                    due[a] = time.monotonic() + backoff[a]
                    backoff[a] = min(max_backoff, backoff[a] * 2)
            if len(ready) == len(addresses) or (require == "any" and ready):
                return ready
            now = time.monotonic()
            if now >= deadline:
                waiting = {a: last[a] for a in addresses if a not in ready}
                raise TimeoutError(f"not ready after {timeout} s: {waiting}")
            time.sleep(max(0.01, min([due[a] for a in addresses if a not in ready]) - now))
    finally:
        for c in clients.values():
            c.close()

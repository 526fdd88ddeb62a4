"""gRPC transport for a `RolloutServer`: a streaming Generate call plus Health and Metrics, and the
matching client. Generic method handlers with our own byte format (wire.py), so no protoc step.

Status codes: INVALID_ARGUMENT for bad requests, RESOURCE_EXHAUSTED when the queue is full,
UNAVAILABLE when the server is stopping or failed. The service keeps serving after any of them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc

from hcjax.rollout.request import GenerateRequest, SampledRollout, TokenEvent, request_from_dict
from hcjax.rollout.server import QueueFull, RolloutServer, ServerStopped
from hcjax.rollout.wire import (
    decode,
    encode,
    events_from_arrays,
    events_to_arrays,
    record_from_wire,
    record_to_wire,
)

__all__ = ["RolloutClient", "RolloutServicer", "serve_grpc"]

SERVICE = "hcjax.Rollout"


def _request_to_bytes(request: GenerateRequest) -> bytes:
    meta = request.to_dict()
    arrays, records = {}, []
    for i, rec in enumerate(request.continue_from):
        rmeta, rarrays = record_to_wire(rec, f"c{i}")
        records.append(rmeta)
        arrays.update(rarrays)
    return encode({"options": meta, "continue_from": records}, arrays)


def _request_from_bytes(data: bytes) -> GenerateRequest:
    meta, arrays = decode(data)
    if not isinstance(meta.get("options"), dict):
        raise ValueError("request message has no 'options' object")
    prior = [record_from_wire(m, arrays, f"c{i}") for i, m in enumerate(meta.get("continue_from", []))]
    return request_from_dict(meta["options"], prior)


class RolloutServicer:
    """Adapts a RolloutServer to gRPC; one instance may be registered on any number of servers."""

    def __init__(self, server: RolloutServer) -> None:
        self.server = server

    def generate(self, data: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            request = _request_from_bytes(data)
            handle = self.server.submit(request, block=False)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFull as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ServerStopped as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        context.add_callback(handle.cancel)  # client went away: free the slots
        finished = False
        while not finished:
            try:
                batch, finished = handle.poll(timeout=1.0)
            except ServerStopped as e:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            if not batch and not finished:
                if not context.is_active():
                    return
                continue
            tokens = [e for e in batch if isinstance(e, TokenEvent)]
            records = [e for e in batch if isinstance(e, SampledRollout)]
            arrays = events_to_arrays(tokens)
            metas = []
            for i, rec in enumerate(records):
                m, a = record_to_wire(rec, f"r{i}")
                metas.append(m)
                arrays.update(a)
            yield encode({"records": metas, "version": self.server.version}, arrays)

    def health(self, data: bytes, context: grpc.ServicerContext) -> bytes:
        return json.dumps(self.server.health()).encode()

    def metrics(self, data: bytes, context: grpc.ServicerContext) -> bytes:
        return json.dumps(self.server.metrics()).encode()

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Generate": grpc.unary_stream_rpc_method_handler(self.generate),
                "Health": grpc.unary_unary_rpc_method_handler(self.health),
                "Metrics": grpc.unary_unary_rpc_method_handler(self.metrics),
            },
        )


def serve_grpc(
    server: RolloutServer, address: str = "127.0.0.1:0", *, max_workers: int = 64
) -> tuple[grpc.Server, int]:
    """Start a gRPC server for `server` on `address`; returns (grpc server, bound port)."""
    grpc_server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=[("grpc.max_send_message_length", 256 << 20),
                 ("grpc.max_receive_message_length", 256 << 20)],
    )
    grpc_server.add_generic_rpc_handlers((RolloutServicer(server).handler(),))
    port = grpc_server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind {address}")
    grpc_server.start()
    return grpc_server, port


class RolloutClient:
    """Client of one rollout service. grpc.RpcError carries the server's status and message."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = grpc.insecure_channel(
            address, options=[("grpc.max_receive_message_length", 256 << 20),
                              ("grpc.max_send_message_length", 256 << 20)],
        )
        self._generate = self._channel.unary_stream(f"/{SERVICE}/Generate")
        self._health = self._channel.unary_unary(f"/{SERVICE}/Health")
        self._metrics = self._channel.unary_unary(f"/{SERVICE}/Metrics")

    def stream(
        self, request: GenerateRequest, timeout: float | None = None
    ) -> Iterator[TokenEvent | SampledRollout]:
        """TokenEvents as they are generated, then each sample's record when it ends."""
        for data in self._generate(_request_to_bytes(request), timeout=timeout):
            meta, arrays = decode(data)
            yield from events_from_arrays(arrays)
            for i, m in enumerate(meta["records"]):
                yield record_from_wire(m, arrays, f"r{i}")

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
        return json.loads(self._health(b"", timeout=timeout))

    def metrics(self, timeout: float = 5.0) -> dict:
        return json.loads(self._metrics(b"", timeout=timeout))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

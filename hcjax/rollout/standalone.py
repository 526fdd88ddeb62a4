"""A standalone inference process's setup: the gin-configured model (or a Hugging Face folder's) on
the gin `MeshConfig` mesh over this process's devices, its Engine and continuous-batching
RolloutServer, and the gRPC services Rollout and Weights in front of them, served until stopped.
`python -m hcjax.serve` and the Ray placement's replicas call `serve`.

Security (hcjax.rpc.auth) is checked before anything is built. This module must not read the
climb's configuration: whoever starts a replica passes its engine sizes in `ServeOptions`.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import gin
import jax
from flax import nnx
from jax.sharding import Mesh

from hcjax.data.tokenizer import load_tokenizer
from hcjax.display import serve_status_line
from hcjax.model import ModelConfig, add_weight_noise, create_sharded
from hcjax.model_io import load_hf_model
from hcjax.rollout.engine import Engine
from hcjax.rollout.request import GenerateRequest
from hcjax.rollout.server import RolloutServer
from hcjax.rollout.service import RequestLimits, RolloutServicer, rpc_server
from hcjax.rpc.auth import Security, check_exposure
from hcjax.sharding import SERVING_RULES, MeshConfig, make_mesh
from hcjax.transfer.weights_service import weights_service

__all__ = ["ServeOptions", "inference_mesh", "serve"]


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """What `serve` needs besides the gin bindings; one field per flag of `python -m hcjax.serve`
    (see its --help). Engine sizes left None come from the gin `Engine` / `RolloutServer` bindings
    or their defaults."""

    host: str = "127.0.0.1"
    port: int = 0
    token_file: str | None = None
    tls_dir: str | None = None
    allow_unauthenticated: bool = False
    max_n: int = 256
    queue_share: float = 0.5
    max_request_mb: int = 64
    seed: int = 0
    init_noise: float = 0.0
    version: int = 0
    warmup: bool = True
    max_concurrent_decodes: int | None = None
    max_prefill_length: int | None = None
    max_target_length: int | None = None
    max_queue: int | None = None
    hf_checkpoint: str | None = None
    status_every: float = 30.0


def inference_mesh(devices: Sequence[Any] | None = None) -> Mesh:
    """The gin `MeshConfig` mesh over this process's devices (default `jax.local_devices()`);
    a binding the devices cannot form is a ValueError that names it, raised before anything is
    built or compiled."""
    devices = list(jax.local_devices() if devices is None else devices)
    cfg = MeshConfig()
    try:
        return make_mesh(cfg, devices)
    except ValueError as err:
        bound = ", ".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg))
        raise ValueError(
            f"the gin MeshConfig({bound}) cannot form the inference mesh on this process's "
            f"{len(devices)} {devices[0].platform if devices else ''} device(s): {err}. Bind "
            "MeshConfig.data / fsdp / tensor / expert / device_offset / num_devices (e.g. "
            "--gin_param 'MeshConfig.tensor = 1') to fit this process's devices") from None


def _gin_bound(name: str) -> bool:
    try:
        gin.query_parameter(name)
    except ValueError:
        return False
    return True


def serve(options: ServeOptions, *, ready: Callable[[dict], None] | None = None,
          stop: threading.Event | None = None) -> None:
    """Serve the gin-configured model with gRPC services Rollout and Weights until `stop` is set
    (on the main thread SIGTERM/SIGINT set it too); the caller has bound gin.

    Order: security checks, mesh (`inference_mesh`), model, engine, RolloutServer, a first
    compiled generate (unless options.warmup is False), gRPC bind; then `ready(info)` with the
    bound `port`, the served `version`, `max_target_length`, `mesh` axis sizes, `auth`, `tls`
    and, with --hf_checkpoint, `eos_ids`. While serving, a status line goes to stderr every
    `options.status_every` seconds (0: none)."""
    security = Security.from_env(token_file=options.token_file, tls_dir=options.tls_dir)
    check_exposure(options.host, security, allow_unauthenticated=options.allow_unauthenticated)
    limits = RequestLimits(max_n=options.max_n, max_message_mb=options.max_request_mb)
    mesh = inference_mesh()
    info: dict = {}
    if options.hf_checkpoint:
        info["eos_ids"] = list(load_tokenizer(options.hf_checkpoint).eos_ids)
        model, _ = load_hf_model(options.hf_checkpoint, mesh)
    else:
        model = create_sharded(ModelConfig(), mesh, SERVING_RULES, seed=options.seed)
    if options.init_noise > 0:
        nnx.update(model, add_weight_noise(nnx.state(model), options.seed + 1, options.init_noise))

    # Flags override gin bindings; a flag left None leaves the binding (or default) in force.
    sizes = {"max_concurrent_decodes": options.max_concurrent_decodes,
             "max_prefill_length": options.max_prefill_length,
             "max_target_length": options.max_target_length}
    if (options.hf_checkpoint and sizes["max_target_length"] is None
            and not _gin_bound("Engine.max_target_length")):
        sizes["max_target_length"] = min(model.config.max_seq_len, 8192)
    engine = Engine(model, mesh=mesh, **{k: v for k, v in sizes.items() if v is not None})
    params = engine.load_params()
    queue = {} if options.max_queue is None else {"max_queue": options.max_queue}
    server = RolloutServer(engine, params, version=options.version,
                           queue_share=options.queue_share, **queue).start()
    try:
        if options.warmup:  # compile prefill, insert and generate before announcing readiness
            server.generate(GenerateRequest(prompt=[0], max_tokens=2, temperature=0.0, seed=0))
        grpc_srv = rpc_server(security, max_receive_mb=limits.max_message_mb)
        # Weights: the learner's handshake and pulls, in the server's blocking pool; its
        # transfer server binds on --host too.
        grpc_srv.add_generic_rpc_handlers((
            RolloutServicer(server, limits).handler(),
            weights_service(server, params, grpc_srv.blocking_pool, options.host)))
        port = grpc_srv.bind(f"{options.host}:{options.port}")
        grpc_srv.start()
        try:
            stop = stop or threading.Event()
            if threading.current_thread() is threading.main_thread():
                for sig in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, lambda *_: stop.set())
            info.update(port=port, version=options.version,
                        max_target_length=engine.max_target_length,
                        mesh={k: int(v) for k, v in mesh.shape.items()}, **security.describe())
            if ready is not None:
                ready(info)
            every, previous = options.status_every, None
            while not stop.wait(every if every > 0 else None):
                metrics = server.metrics()
                print(serve_status_line(metrics, previous), file=sys.stderr, flush=True)
                previous = metrics
        finally:
            grpc_srv.stop(grace=2.0).wait()
    finally:
        server.stop()

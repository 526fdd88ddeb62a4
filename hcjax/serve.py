"""`python -m hcjax.serve`: the inference process (engine + continuous batching + gRPC services
Rollout and Weights), standalone or as a replica of the multi-process climb.

Builds the gin-configured model on the gin `MeshConfig` mesh over this process's devices, compiles
a first generate, then serves until SIGTERM/SIGINT (or `stop`), printing one JSON line
{"event": "serving", "port": ...} once it accepts requests (launchers and tests read it). Weights
are the seeded initialisation, optionally with noise (`--init_noise`, for tests and benchmarks of
an untrained model), or a Hugging Face folder's (`--hf_checkpoint DIR`, whose tokenizer's stop ids
the serving line reports as `eos_ids`); new versions arrive from a learner's
`hcjax.rl.weight_sync.WeightPublisher` through the Weights service, pulled by the reshard plan.
Security (hcjax.rpc.auth): loopback unless --host says otherwise, a shared token (--token_file
or $HCJAX_TOKEN / $HCJAX_TOKEN_FILE) on every RPC of both services, TLS with --tls_dir, weights
pulled only from loopback or $HCJAX_TRUSTED_PEERS; per-request limits (`RequestLimits`) with
--max_n, --queue_share, --max_request_mb. This module must not read the climb's configuration:
whoever starts a replica passes its engine sizes as flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from hcjax import config as hcfg

__all__ = ["ServeOptions", "inference_mesh", "main", "serve"]


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

    @classmethod
    def from_flags(cls, ns: Any) -> ServeOptions:
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


_DEFAULT = ServeOptions()

EXAMPLES = """examples:
  python -m hcjax.serve                                   # the tiny gin model on 127.0.0.1
  python -m hcjax.serve --hf_checkpoint DIR --port 50051 --output_dir runs/serve
  HCJAX_TOKEN=secret python -m hcjax.serve --host 0.0.0.0 --tls_dir certs --status_every 10

Once it accepts requests it prints {"event": "serving", "port": ...} on stdout (launchers read it);
on a terminal a banner on stderr says where and what it serves.
"""


def _extra_args(parser) -> None:
    d = _DEFAULT
    parser.add_argument("--host", default=d.host,
                        help="address to bind (default loopback only; anything else needs a "
                             "token or --allow_unauthenticated)")
    parser.add_argument("--port", type=int, default=d.port, help="0 picks a free port")
    parser.add_argument("--token_file", default=d.token_file,
                        help="file holding the shared token every RPC must carry (default: "
                             "$HCJAX_TOKEN or $HCJAX_TOKEN_FILE; none: no authentication)")
    parser.add_argument("--tls_dir", default=d.tls_dir,
                        help="serve TLS with DIR/cert.pem and DIR/key.pem (default: "
                             "$HCJAX_TLS_DIR; none: plaintext)")
    parser.add_argument("--allow_unauthenticated", action="store_true",
                        help="serve a non-loopback --host without a token")
    parser.add_argument("--max_n", type=int, default=d.max_n, help="most samples per request")
    parser.add_argument("--queue_share", type=float, default=d.queue_share,
                        help="fraction of the server's capacity (work and requests, in flight "
                             "and queued) one client host may hold; at 0.5 or more one host can "
                             "still fill every slot")
    parser.add_argument("--max_request_mb", type=int, default=d.max_request_mb,
                        help="largest request message accepted")
    parser.add_argument("--seed", type=int, default=d.seed, help="parameter initialisation seed")
    parser.add_argument("--init_noise", type=float, default=d.init_noise,
                        help="std of noise added to every weight (0: plain initialisation)")
    parser.add_argument("--version", type=int, default=d.version,
                        help="version of the initial weights (a learner's pushes must not be "
                             "older)")
    parser.add_argument("--no_warmup", dest="warmup", action="store_false",
                        help="announce readiness before compiling the engine")
    parser.add_argument("--max_concurrent_decodes", type=int, default=None,
                        help="decode slots (default: gin Engine.max_concurrent_decodes, else 8)")
    parser.add_argument("--max_target_length", type=int, default=None,
                        help="prompt + response tokens a slot holds (default: gin "
                             "Engine.max_target_length, else the model's max_seq_len, capped at "
                             "8192 for Hugging Face models, whose max_seq_len is their full "
                             "context)")
    parser.add_argument("--max_prefill_length", type=int, default=None,
                        help="longest prompt (default: gin Engine.max_prefill_length, else half "
                             "of the target length)")
    parser.add_argument("--max_queue", type=int, default=None,
                        help="samples' worth of work the server queues beyond its slots, at "
                             "least as many as the slots (default: gin RolloutServer.max_queue, "
                             "else 64); capacity = slots + max(max_queue, slots) samples of "
                             "max_target_length tokens")
    parser.add_argument("--status_every", type=float, default=d.status_every,
                        help="seconds between one-line status reports on stderr (requests, "
                             "queue, tokens/s, weights version); 0: none")
    hcfg.add_hf_checkpoint_flag(parser)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES


def inference_mesh(devices: Sequence[Any] | None = None):
    """The gin `MeshConfig` mesh over this process's devices (default `jax.local_devices()`);
    a binding the devices cannot form is a ValueError that names it, raised before anything is
    built or compiled."""
    import jax

    from hcjax.sharding import MeshConfig, make_mesh

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
    import gin

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
    and, with --hf_checkpoint, `eos_ids`."""
    from flax import nnx

    from hcjax.model import ModelConfig, create_sharded
    from hcjax.rollout import Engine, GenerateRequest, RolloutServer
    from hcjax.rollout.service import RequestLimits, RolloutServicer, rpc_server
    from hcjax.rollout.testing import perturbed
    from hcjax.rpc.auth import Security, check_exposure
    from hcjax.transfer.weights_service import weights_service

    security = Security.from_env(token_file=options.token_file, tls_dir=options.tls_dir)
    check_exposure(options.host, security, allow_unauthenticated=options.allow_unauthenticated)
    limits = RequestLimits(max_n=options.max_n, max_message_mb=options.max_request_mb)
    mesh = inference_mesh()
    info: dict = {}
    if options.hf_checkpoint:
        from hcjax.data.tokenizer import load_tokenizer
        from hcjax.distill.sft import load_hf_model

        info["eos_ids"] = list(load_tokenizer(options.hf_checkpoint).eos_ids)
        model, _ = load_hf_model(options.hf_checkpoint, mesh)
    else:
        model = create_sharded(ModelConfig(), mesh, seed=options.seed)
    if options.init_noise > 0:
        nnx.update(model, perturbed(nnx.state(model), options.seed + 1, options.init_noise))

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
            from hcjax.display import serve_status_line

            every, previous = options.status_every, None
            while not stop.wait(every if every > 0 else None):
                metrics = server.metrics()
                print(serve_status_line(metrics, previous), file=sys.stderr, flush=True)
                previous = metrics
        finally:
            grpc_srv.stop(grace=2.0).wait()
    finally:
        server.stop()


def main(argv: Sequence[str] | None = None) -> None:
    flags = hcfg.parse_flags(
        argv, description=__doc__.splitlines()[0], default_gin_files=["tiny_cpu.gin"],
        extra_args=_extra_args,
    )
    hcfg.bind(flags.gin_files, flags.gin_params)
    if flags.output_dir:
        hcfg.write_config(flags.output_dir, flags)

    def announce(info: dict) -> None:
        if flags.output_dir:
            hcfg.write_operative_config(flags.output_dir)
        print(json.dumps({"event": "serving", **info}), flush=True)
        if sys.stderr.isatty():
            from hcjax.display import serve_banner

            print(serve_banner(info, flags.extra.host, _model_name(flags.extra.hf_checkpoint)),
                  file=sys.stderr, flush=True)

    serve(ServeOptions.from_flags(flags.extra), ready=announce)


def _model_name(hf_checkpoint: str | None) -> str:
    if hf_checkpoint:
        return f"Hugging Face folder {hf_checkpoint}"
    from hcjax.model import ModelConfig

    c = ModelConfig()
    return (f"gin ModelConfig: {c.num_layers} layers, d_model {c.d_model}, {c.num_experts} "
            f"experts, vocab {c.vocab_size}, max_seq_len {c.max_seq_len}")


if __name__ == "__main__":
    hcfg.run_main(main)

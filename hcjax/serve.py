"""`python -m hcjax.serve`: a standalone rollout server (engine + continuous batching + gRPC).

Builds the gin-configured model on the inference mesh, serves it until SIGTERM/SIGINT, and prints
one JSON line {"event": "serving", "port": ...} once it is compiled and accepts requests (launchers and tests read
it). Weights are the seeded initialisation, optionally with noise (`--init_noise`, for tests and
benchmarks of an untrained model), or a Hugging Face folder's (`--hf_checkpoint DIR`, whose
tokenizer's stop ids the serving line reports as `eos_ids`); new weights arrive through
`RolloutServer.update_weights`. Security (hcjax.rollout.auth): loopback unless --host says
otherwise, a shared token (--token_file or $HCJAX_TOKEN / $HCJAX_TOKEN_FILE) on every RPC, TLS
with --tls_dir; per-request limits (`RequestLimits`) with --max_n, --queue_share,
--max_request_mb.
"""

from __future__ import annotations

import json
import signal
import sys
import threading

from hcjax import config as hcfg


def _extra_args(parser) -> None:
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default loopback only; anything else needs a "
                             "token or --allow_unauthenticated)")
    parser.add_argument("--token_file", default=None,
                        help="file holding the shared token every RPC must carry (default: "
                             "$HCJAX_TOKEN or $HCJAX_TOKEN_FILE; none: no authentication)")
    parser.add_argument("--tls_dir", default=None,
                        help="serve TLS with DIR/cert.pem and DIR/key.pem (default: "
                             "$HCJAX_TLS_DIR; none: plaintext)")
    parser.add_argument("--allow_unauthenticated", action="store_true",
                        help="serve a non-loopback --host without a token")
    parser.add_argument("--max_n", type=int, default=256, help="most samples per request")
    parser.add_argument("--queue_share", type=float, default=0.5,
                        help="fraction of the request queue one client host may hold")
    parser.add_argument("--max_request_mb", type=int, default=64,
                        help="largest request message accepted")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--seed", type=int, default=0, help="parameter initialisation seed")
    parser.add_argument("--init_noise", type=float, default=0.0,
                        help="std of noise added to every weight (0: plain initialisation)")
    parser.add_argument("--version", type=int, default=0, help="version of the served weights")
    parser.add_argument("--no_warmup", dest="warmup", action="store_false",
                        help="announce readiness before compiling the engine")
    parser.add_argument("--max_concurrent_decodes", type=int, default=8, help="decode slots")
    parser.add_argument("--max_target_length", type=int, default=None,
                        help="prompt + response tokens a slot holds (default: the model's "
                             "max_seq_len, capped at 8192 for Hugging Face models, whose "
                             "max_seq_len is their full context)")
    parser.add_argument("--max_prefill_length", type=int, default=None,
                        help="longest prompt (default: half of --max_target_length)")
    hcfg.add_hf_checkpoint_flag(parser)


def main(argv=None) -> None:
    flags = hcfg.parse_flags(
        argv, description=__doc__.splitlines()[0], default_gin_files=["tiny_cpu.gin"],
        extra_args=_extra_args,
    )
    hcfg.bind(flags.gin_files, flags.gin_params)
    if flags.output_dir:
        hcfg.write_config(flags.output_dir, flags)

    from flax import nnx

    from hcjax.model import ModelConfig, create_sharded
    from hcjax.rollout import Engine, GenerateRequest, RolloutServer
    from hcjax.rollout.auth import Security, check_exposure
    from hcjax.rollout.service import RequestLimits, serve_grpc
    from hcjax.rollout.testing import perturbed
    from hcjax.sharding import MeshConfig, make_mesh

    args = flags.extra
    security = Security.from_env(token_file=args.token_file, tls_dir=args.tls_dir)
    check_exposure(args.host, security, allow_unauthenticated=args.allow_unauthenticated)
    limits = RequestLimits(max_n=args.max_n, queue_share=args.queue_share,
                           max_message_mb=args.max_request_mb)
    mesh = make_mesh(MeshConfig())
    serving: dict = {}
    if args.hf_checkpoint:
        from hcjax.data.tokenizer import load_tokenizer
        from hcjax.distill.sft import load_hf_model

        serving["eos_ids"] = list(load_tokenizer(args.hf_checkpoint).eos_ids)
        model, _ = load_hf_model(args.hf_checkpoint, mesh)
    else:
        model = create_sharded(ModelConfig(), mesh, seed=args.seed)
    if args.init_noise > 0:
        nnx.update(model, perturbed(nnx.state(model), args.seed + 1, args.init_noise))
    max_len = args.max_target_length
    if max_len is None and args.hf_checkpoint:
        max_len = min(model.config.max_seq_len, 8192)
    engine = Engine(model, mesh=mesh, max_concurrent_decodes=args.max_concurrent_decodes,
                    max_prefill_length=args.max_prefill_length, max_target_length=max_len)
    serving["max_target_length"] = engine.max_target_length
    server = RolloutServer(engine, version=args.version).start()
    if args.warmup:  # compile prefill, insert and generate before announcing readiness
        server.generate(GenerateRequest(prompt=[0], max_tokens=2, temperature=0.0, seed=0))
    grpc_server, port = serve_grpc(server, f"{args.host}:{args.port}", security=security,
                                   limits=limits)
    serving.update(security.describe())
    if flags.output_dir:
        hcfg.write_operative_config(flags.output_dir)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(json.dumps({"event": "serving", "port": port, "version": args.version, **serving}),
          flush=True)
    stop.wait()
    grpc_server.stop(grace=2.0).wait()
    server.stop()


if __name__ == "__main__":
    main(sys.argv[1:])

"""`python -m hcjax.serve`: the inference process (engine + continuous batching + gRPC services
Rollout and Weights), standalone or as a replica of the multi-process climb.

Flags → gin → `hcjax.rollout.standalone.serve`: the gin-configured model on the gin `MeshConfig`
mesh over this process's devices, a first compiled generate, then serving until SIGTERM/SIGINT;
one JSON line {"event": "serving", "port": ...} once it accepts requests (launchers and tests
read it). Weights
are the seeded initialisation, optionally with noise (`--init_noise`, for tests and benchmarks of
an untrained model), or a Hugging Face folder's (`--hf_checkpoint DIR`, whose tokenizer's stop ids
the serving line reports as `eos_ids`); new versions arrive from a learner's
`hcjax.transfer.weights_service.WeightPublisher` through the Weights service, pulled by the reshard plan.
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
import sys
from collections.abc import Sequence

from hcjax import config as hcfg
from hcjax.display import serve_banner

__all__ = ["main"]

EXAMPLES = """examples:
  python -m hcjax.serve                                   # the tiny gin model on 127.0.0.1
  python -m hcjax.serve --hf_checkpoint DIR --port 50051 --output_dir runs/serve
  HCJAX_TOKEN=secret python -m hcjax.serve --host 0.0.0.0 --tls_dir certs --status_every 10

Once it accepts requests it prints {"event": "serving", "port": ...} on stdout (launchers read it);
on a terminal a banner on stderr says where and what it serves.
"""

# A flag left out leaves its `ServeOptions` default (hcjax.rollout.standalone), written once there.
_UNSET = argparse.SUPPRESS


def _extra_args(parser) -> None:
    parser.add_argument("--host", default=_UNSET,
                        help="address to bind (default loopback only; anything else needs a "
                             "token or --allow_unauthenticated)")
    parser.add_argument("--port", type=int, default=_UNSET, help="0 picks a free port")
    parser.add_argument("--token_file", default=_UNSET,
                        help="file holding the shared token every RPC must carry (default: "
                             "$HCJAX_TOKEN or $HCJAX_TOKEN_FILE; none: no authentication)")
    parser.add_argument("--tls_dir", default=_UNSET,
                        help="serve TLS with DIR/cert.pem and DIR/key.pem (default: "
                             "$HCJAX_TLS_DIR; none: plaintext)")
    parser.add_argument("--allow_unauthenticated", action="store_true", default=_UNSET,
                        help="serve a non-loopback --host without a token")
    parser.add_argument("--max_n", type=int, default=_UNSET,
                        help="most samples per request")
    parser.add_argument("--queue_share", type=float, default=_UNSET,
                        help="fraction of the server's capacity (work and requests, in flight "
                             "and queued) one client host may hold; at 0.5 or more one host can "
                             "still fill every slot")
    parser.add_argument("--max_request_mb", type=int, default=_UNSET,
                        help="largest request message accepted")
    parser.add_argument("--seed", type=int, default=_UNSET,
                        help="parameter initialisation seed")
    parser.add_argument("--init_noise", type=float, default=_UNSET,
                        help="std of noise added to every weight (0: plain initialisation)")
    parser.add_argument("--version", type=int, default=_UNSET,
                        help="version of the initial weights (a learner's pushes must not be "
                             "older)")
    parser.add_argument("--no_warmup", dest="warmup", action="store_false", default=_UNSET,
                        help="announce readiness before compiling the engine")
    parser.add_argument("--max_concurrent_decodes", type=int, default=_UNSET,
                        help="decode slots (default: gin Engine.max_concurrent_decodes, else 8)")
    parser.add_argument("--max_target_length", type=int, default=_UNSET,
                        help="prompt + response tokens a slot holds (default: gin "
                             "Engine.max_target_length, else the model's max_seq_len, capped at "
                             "8192 for Hugging Face models, whose max_seq_len is their full "
                             "context)")
    parser.add_argument("--max_prefill_length", type=int, default=_UNSET,
                        help="longest prompt (default: gin Engine.max_prefill_length, else half "
                             "of the target length)")
    parser.add_argument("--max_queue", type=int, default=_UNSET,
                        help="samples' worth of work the server queues beyond its slots, at "
                             "least as many as the slots (default: gin RolloutServer.max_queue, "
                             "else 64); capacity = slots + max(max_queue, slots) samples of "
                             "max_target_length tokens")
    parser.add_argument("--status_every", type=float, default=_UNSET,
                        help="seconds between one-line status reports on stderr (requests, "
                             "queue, tokens/s, weights version); 0: none")
    hcfg.add_hf_checkpoint_flag(parser)
    hcfg.set_examples(parser, EXAMPLES)


def main(argv: Sequence[str] | None = None) -> None:
    flags = hcfg.parse_flags(
        argv, description=__doc__.splitlines()[0], default_gin_files=["tiny_cpu.gin"],
        extra_args=_extra_args,
    )
    # After the flags, so --help stays fast; it registers what a replica reads from gin
    # (ModelConfig, MeshConfig, Engine and RolloutServer sizes).
    from hcjax.model import ModelConfig
    from hcjax.rollout.standalone import ServeOptions, serve

    hcfg.bind(flags.gin_files, flags.gin_params)
    given = vars(flags.extra)
    options = ServeOptions(**{f.name: given[f.name] for f in dataclasses.fields(ServeOptions)
                              if f.name in given})
    if flags.output_dir:
        hcfg.write_config(flags.output_dir, flags)

    def announce(info: dict) -> None:
        if flags.output_dir:
            hcfg.write_operative_config(flags.output_dir)
        print(json.dumps({"event": "serving", **info}), flush=True)
        if sys.stderr.isatty():
            model = (f"Hugging Face folder {options.hf_checkpoint}" if options.hf_checkpoint
                     else _describe(ModelConfig()))
            print(serve_banner(info, options.host, model), file=sys.stderr, flush=True)

    serve(options, ready=announce)


def _describe(c) -> str:
    """The banner's one-line description of the gin ModelConfig `c`."""
    return (f"gin ModelConfig: {c.num_layers} layers, d_model {c.d_model}, {c.num_experts} "
            f"experts, vocab {c.vocab_size}, max_seq_len {c.max_seq_len}")


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)

"""Small models and a bare rollout gRPC service for the rollout tests: `TINY_TEST_CONFIG`,
`tiny_model` (its weights given noise, so generation depends on the context) and `serve_grpc`
(the Rollout service alone; `python -m hcjax.serve` adds the weights service beside it)."""

from __future__ import annotations

import dataclasses

from flax import nnx

from hcjax.model import ModelConfig, Transformer, add_weight_noise
from hcjax.rollout.server import RolloutServer
from hcjax.rollout.service import RequestLimits, RolloutServicer, rpc_server
from hcjax.rpc.auth import Security
from hcjax.rpc.server import RpcServer

# Window 8 < typical prompt + response, so the local layers' ring buffers wrap in every test.
TINY_TEST_CONFIG = ModelConfig(
    vocab_size=64, d_model=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
    attention_pattern=("local", "global"), window=8, ffn_pattern=("moe", "dense"), d_ff=64,
    num_experts=4, experts_per_token=2, moe_latent_dim=16, moe_d_ff=32, dtype="float32",
    max_seq_len=64,
)


def tiny_model(seed: int = 0, cfg: ModelConfig | None = None, **overrides) -> Transformer:
    """A Transformer (TINY_TEST_CONFIG unless `cfg` is given, plus overrides), weights given noise."""
    cfg = dataclasses.replace(cfg or TINY_TEST_CONFIG, **overrides)
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)))
    return nnx.merge(graphdef, add_weight_noise(state, seed + 1))


def serve_grpc(
    server: RolloutServer,
    address: str = "127.0.0.1:0",
    *,
    security: Security | None = None,
    limits: RequestLimits | None = None,
    hold_seconds: float = 2.0,
) -> tuple[RpcServer, int]:
    """Start a gRPC server for `server` on `address`; returns (the RpcServer, bound port).

    security None: from the environment (HCJAX_TOKEN / HCJAX_TOKEN_FILE / HCJAX_TLS_DIR).
    hold_seconds: as RolloutServicer's."""
    security = Security.from_env() if security is None else security
    limits = limits or RequestLimits()
    host = rpc_server(security, max_receive_mb=limits.max_message_mb)
    host.add_generic_rpc_handlers(
        (RolloutServicer(server, limits, hold_seconds=hold_seconds).handler(),))
    port = host.bind(address)
    host.start()
    return host, port

"""hcjax.rollout: the JetStream-API engine, prefix reuse, sampling, continuous-batching server,
gRPC, router."""

from hcjax.rollout.engine import Engine
from hcjax.rollout.engine_api import DecodeState, Prefix, ResultTokens, VersionedParams
from hcjax.rollout.offline import generate
from hcjax.rollout.prefix_cache import PrefixCache
from hcjax.rollout.request import GenerateRequest, SampledRollout, SamplingOptions, TokenEvent
from hcjax.rollout.server import QueueFull, RequestHandle, RolloutServer, ServerStopped

__all__ = [
    "DecodeState",
    "Engine",
    "GenerateRequest",
    "Prefix",
    "PrefixCache",
    "QueueFull",
    "RequestHandle",
    "ResultTokens",
    "RolloutServer",
    "SampledRollout",
    "SamplingOptions",
    "ServerStopped",
    "TokenEvent",
    "VersionedParams",
    "generate",
]

"""hcjax.rollout: the JetStream-API engine, sampling, continuous-batching server, gRPC, router."""

from hcjax.rollout.engine import DecodeState, Engine, Prefix, ResultTokens, SamplingParams
from hcjax.rollout.offline import generate
from hcjax.rollout.request import GenerateRequest, SampledRollout, TokenEvent
from hcjax.rollout.server import QueueFull, RequestHandle, RolloutServer, ServerStopped

__all__ = [
    "DecodeState",
    "Engine",
    "GenerateRequest",
    "Prefix",
    "QueueFull",
    "RequestHandle",
    "ResultTokens",
    "RolloutServer",
    "SampledRollout",
    "SamplingParams",
    "ServerStopped",
    "TokenEvent",
    "generate",
]

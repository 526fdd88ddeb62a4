"""In-process generation over a model: `local_server` (a RolloutServer on an Engine of the model,
the inference client of the evaluator and of scripts) and `generate` (records for a list of
prompts). The one generate path: the same engine, sampler and continuous-batching server as the
climb and `python -m hcjax.serve`; no decode loop of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from flax import nnx

from hcjax.rollout.engine import Engine
from hcjax.rollout.request import GenerateRequest, SampledRollout, SamplingOptions
from hcjax.rollout.server import RolloutServer

__all__ = ["generate", "local_server"]

_GOLDEN = 0x9E3779B1  # spreads per-prompt seeds so prompts do not share key streams


def local_server(
    model: nnx.Module,
    *,
    max_prompt_len: int,
    max_tokens: int,
    max_concurrent_decodes: int = 8,
    max_queue: int = 64,
    version: int = 0,
) -> RolloutServer:
    """A RolloutServer (not yet started: `with local_server(...) as server`) on a new Engine of
    `model`, for prompts of up to `max_prompt_len` tokens and `max_concurrent_decodes` samples
    at a time. Its `generate(request)` is the
    climb's inference-client call. Requests whose prompt plus max_tokens exceed the model's
    max_seq_len fail, naming both."""
    max_len = getattr(getattr(model, "config", None), "max_seq_len", max_prompt_len + max_tokens)
    engine = Engine(
        model,
        max_concurrent_decodes=max_concurrent_decodes,
        max_prefill_length=min(max(8, max_prompt_len), max_len - 1),
        max_target_length=max_len,
    )
    return RolloutServer(engine, nnx.state(model), version=version, max_queue=max_queue)


def generate(
    model: nnx.Module | None,
    prompts: Sequence[Sequence[int]],
    options: SamplingOptions,
    *,
    n: int = 1,
    engine: Engine | None = None,
    max_concurrent_decodes: int = 8,
    version: int = 0,
) -> list[SampledRollout]:
    """n samples of each prompt with `options`, one record per sample, prompt-major then sample
    index: [p0s0, p0s1, ..., p1s0, ...]. Response ids keep the stop token that ended a sample.

    Prompt j uses seed (options.seed + j * 0x9E3779B1) mod 2**32 (options.seed None: 0). Pass
    `engine` to reuse compiled functions across calls (then `model` may be None and the engine's
    parameters are used).
    """
    seed = options.seed or 0
    requests = [
        GenerateRequest.of(options, prompt=tuple(p), n=n, seed=(seed + j * _GOLDEN) % 2**32,
                           group_id=j, request_id=str(j))
        for j, p in enumerate(prompts)
    ]
    queue = max(1, len(requests))
    if engine is not None:
        params = engine.load_params() if model is None else nnx.state(model)
        server = RolloutServer(engine, params, version=version, max_queue=queue)
    elif model is None:
        raise ValueError("generate needs a model or an engine")
    else:
        server = local_server(model, max_prompt_len=max((len(p) for p in prompts), default=1),
                              max_tokens=options.max_tokens,
                              max_concurrent_decodes=max_concurrent_decodes, max_queue=queue,
                              version=version)
    with server as srv:
        handles = [srv.submit(r) for r in requests]
        return [rec for h in handles for rec in h.result()]

"""In-process generation over a model: `local_engine` and `local_server` (a RolloutServer on an
Engine of the model, the inference client of the evaluator and of scripts) and `generate`
(records for a list of prompts). The one generate path: the same engine, sampler and
continuous-batching server as the climb and `python -m hcjax.serve`; no decode loop of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from flax import nnx

from hcjax.rollout.engine import Engine
from hcjax.rollout.request import GenerateRequest, SampledRollout, SamplingOptions
from hcjax.rollout.server import RolloutServer

__all__ = ["generate", "local_engine", "local_server"]

_GOLDEN = 0x9E3779B1  # spreads per-prompt seeds so prompts do not share key streams


def local_engine(model: nnx.Module, *, max_tokens: int, max_prompt_len: int | None,
                 max_concurrent_decodes: int = 8) -> Engine:
    """An Engine of `model` for `max_concurrent_decodes` samples at a time of prompts of up to
    `max_prompt_len` tokens and responses of up to `max_tokens`: each slot holds their sum, what
    it serves, not the model's context (a longer request fails, naming both lengths).
    max_prompt_len None: any prompt that leaves the response room in the model's max_seq_len
    (multi-turn tool episodes, whose prompts grow); the KV cache is then the whole context's.
    An engine whose KV cache would not fit in memory is refused (kv_budget.KVCacheTooLarge)."""
    max_len = getattr(getattr(model, "config", None), "max_seq_len", None)
    if max_len is None:
        raise ValueError(f"{type(model).__name__} has no config.max_seq_len to size an engine")
    if max_prompt_len is None:
        prefill, target = max(1, max_len - max_tokens), max_len
    else:
        prefill, target = max_prompt_len, max_prompt_len + max_tokens
        if target > max_len:
            raise ValueError(f"prompts of up to {max_prompt_len} tokens + max_tokens={max_tokens} "
                             f"exceeds the model's max_seq_len={max_len}")
    return Engine(model, max_concurrent_decodes=max_concurrent_decodes,
                  max_prefill_length=prefill, max_target_length=target)


def local_server(
    model: nnx.Module,
    *,
    max_tokens: int,
    max_prompt_len: int | None,
    max_concurrent_decodes: int = 8,
    max_queue: int = 64,
    version: int = 0,
    engine: Engine | None = None,
) -> RolloutServer:
    """A RolloutServer (not yet started: `with local_server(...) as server`) serving `model`'s
    state on `engine`, or on a new `local_engine` (sized by max_prompt_len + max_tokens) when
    None. Reusing an engine that `serves` the
    model (one built for a model of the same class, config and shapes) reuses its compiled
    functions. Its `generate(request)` is the climb's inference-client call."""
    if engine is None:
        engine = local_engine(model, max_tokens=max_tokens, max_prompt_len=max_prompt_len,
                              max_concurrent_decodes=max_concurrent_decodes)
    elif not engine.serves(model):
        raise ValueError(f"this engine was built for another model than this "
                         f"{type(model).__name__} (class, config or parameter shapes differ)")
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
    parameters are used); without one, a `local_engine` sized to the longest prompt.
    """
    seed = options.seed or 0
    requests = [
        GenerateRequest.of(options, prompt=tuple(p), n=n, seed=(seed + j * _GOLDEN) % 2**32,
                           group_id=j, request_id=str(j))
        for j, p in enumerate(prompts)
    ]
    queue = max(1, len(requests))
    if model is None:
        if engine is None:
            raise ValueError("generate needs a model or an engine")
        server = RolloutServer(engine, engine.load_params(), version=version, max_queue=queue)
    else:
        longest = max((len(p) for p in prompts), default=1)
        server = local_server(model, max_tokens=options.max_tokens, max_prompt_len=longest,
                              max_concurrent_decodes=max_concurrent_decodes, max_queue=queue,
                              version=version, engine=engine)
    with server as srv:
        handles = [srv.submit(r) for r in requests]
        return [rec for h in handles for rec in h.result()]

"""`generate`: sample rollouts for a list of prompts in-process, for evaluation and scripts.

It runs the same engine, sampling and continuous-batching server as `python -m hcjax.serve`.
"""

from __future__ import annotations

from collections.abc import Sequence

from flax import nnx

from hcjax.rollout.engine import Engine
from hcjax.rollout.request import GenerateRequest, SampledRollout
from hcjax.rollout.server import RolloutServer

__all__ = ["generate"]

_GOLDEN = 0x9E3779B1  # spreads per-prompt seeds so prompts do not share key streams


def generate(
    model: nnx.Module | None,
    prompts: Sequence[Sequence[int]],
    *,
    n: int = 1,
    max_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_tokens: Sequence[int] = (),
    engine: Engine | None = None,
    max_concurrent_decodes: int = 8,
    version: int = 0,
) -> list[SampledRollout]:
    """One record per sample, prompt-major then sample index: [p0s0, p0s1, ..., p1s0, ...].

    Prompt j uses seed (seed + j * 0x9E3779B1) mod 2**32. Pass `engine` to reuse compiled
    functions across calls (then `model` may be None and the engine's parameters are used).
    """
    if engine is None:
        if model is None:
            raise ValueError("generate needs a model or an engine")
        longest = max((len(p) for p in prompts), default=1)
        max_len = getattr(getattr(model, "config", None), "max_seq_len", longest + max_tokens)
        engine = Engine(
            model,
            max_concurrent_decodes=max_concurrent_decodes,
            max_prefill_length=min(max(8, longest), max_len - 1),
            max_target_length=max_len,
        )
    params = engine.load_params() if model is None else nnx.state(model)
    requests = [
        GenerateRequest(
            prompt=tuple(p), n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            seed=(seed + j * _GOLDEN) % 2**32, stop_tokens=tuple(stop_tokens), group_id=j,
            request_id=str(j),
        )
        for j, p in enumerate(prompts)
    ]
    with RolloutServer(engine, params, version=version, max_queue=max(1, len(requests))) as srv:
        handles = [srv.submit(r) for r in requests]
        return [rec for h in handles for rec in h.result()]

"""What a client asks the rollout server for (`GenerateRequest`) and what it gets back per sample
(`SampledRollout`, the learner's `Rollout` plus sampling metadata and resumable state).

Plain dataclasses of Python scalars and numpy arrays; validation errors name the bad value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hcjax.rl.records import Rollout

__all__ = ["GenerateRequest", "SampledRollout", "TokenEvent", "request_from_dict"]


@dataclasses.dataclass
class SampledRollout(Rollout):
    """A generated sample: the `Rollout` record plus what is needed to resume or audit it.

    `partial` is True when the request's `token_budget` ran out before a stop token or
    `max_tokens` (finish_reason is then "length"); pass the record to
    `GenerateRequest.continuation` to continue it later without regenerating its tokens.
    """

    raw_logprobs: np.ndarray | None = None  # f32 [R], model log-prob at temperature 1
    seed: int = 0
    sample_index: int = 0
    top_p: float = 1.0
    max_tokens: int = 0
    stop_tokens: tuple[int, ...] = ()
    partial: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.raw_logprobs is not None:
            self.raw_logprobs = np.asarray(self.raw_logprobs, np.float32)

    @property
    def tokens(self) -> np.ndarray:
        """The generated token ids (the same array as `response_ids`)."""
        return self.response_ids


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One generated token of one sample, as streamed while the sample is being generated."""

    sample_index: int
    token: int
    logprob: float
    raw_logprob: float
    n_kept: int
    threshold_logit: float
    routing: np.ndarray  # [num_moe_layers, k] experts chosen when the token was fed
    position: int
    version: int


_FIELDS = (
    "prompt n max_tokens temperature top_p seed stop_tokens token_budget request_id group_id"
).split()


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """n samples of one prompt (a GRPO group), or the continuation of partial samples.

    token_budget: at most this many new tokens per sample in this call (partial rollouts); a
    sample that hits it comes back with `partial=True`. seed None lets the server pick one (the
    records carry the seed used). continue_from: partial records of this prompt to resume.
    """

    prompt: tuple[int, ...]
    n: int = 1
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 0.97
    seed: int | None = None
    stop_tokens: tuple[int, ...] = ()
    token_budget: int | None = None
    request_id: str = ""
    group_id: str | int = 0
    continue_from: tuple[SampledRollout, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        object.__setattr__(self, "continue_from", tuple(self.continue_from))
        if not self.prompt:
            raise ValueError("prompt is empty; it must hold at least one token id")
        if any(t < 0 for t in self.prompt):
            raise ValueError(f"prompt has negative token ids {[t for t in self.prompt if t < 0]}")
        _positive_int("n", self.n)
        _positive_int("max_tokens", self.max_tokens)
        if self.token_budget is not None:
            _positive_int("token_budget", self.token_budget)
        if not isinstance(self.temperature, int | float) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be a number >= 0")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**32):
            raise ValueError(f"seed={self.seed!r} must be an integer in [0, 2**32)")
        if self.continue_from:
            if self.n != len(self.continue_from):
                raise ValueError(
                    f"n={self.n} must equal the {len(self.continue_from)} records to continue"
                )
            for rec in self.continue_from:
                if not rec.partial:
                    raise ValueError(
                        f"sample {rec.sample_index} finished ({rec.finish_reason}); only partial "
                        "records can be continued"
                    )
                if tuple(rec.prompt_ids.tolist()) != self.prompt:
                    raise ValueError(f"sample {rec.sample_index} was generated for another prompt")
                if rec.response_len >= self.max_tokens:
                    raise ValueError(
                        f"sample {rec.sample_index} already has {rec.response_len} tokens, "
                        f"max_tokens={self.max_tokens}"
                    )

    @classmethod
    def continuation(
        cls, records: Sequence[SampledRollout], *, token_budget: int | None = None
    ) -> GenerateRequest:
        """Continue partial samples of one prompt with their original sampling options."""
        if not records:
            raise ValueError("continuation needs at least one partial record")
        first = records[0]
        return cls(
            prompt=tuple(first.prompt_ids.tolist()),
            n=len(records),
            max_tokens=first.max_tokens,
            temperature=first.temperature,
            top_p=first.top_p,
            seed=first.seed,
            stop_tokens=first.stop_tokens,
            token_budget=token_budget,
            group_id=first.group_id,
            continue_from=tuple(records),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able options (without continue_from, which travels as arrays)."""
        return {name: getattr(self, name) for name in _FIELDS}


def request_from_dict(
    options: Mapping[str, Any], continue_from: Sequence[SampledRollout] = ()
) -> GenerateRequest:
    """Build a request from wire options; unknown option names are an error, not ignored."""
    unknown = sorted(set(options) - set(_FIELDS))
    if unknown:
        raise ValueError(f"unknown request options {unknown}; known: {sorted(_FIELDS)}")
    if "prompt" not in options:
        raise ValueError("request has no prompt")
    opts = dict(options)
    for name in ("prompt", "stop_tokens"):
        if name in opts:
            opts[name] = tuple(opts[name])
    return GenerateRequest(**opts, continue_from=tuple(continue_from))


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")

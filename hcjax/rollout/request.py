"""What a client asks the rollout server for (`GenerateRequest`: a prompt and its
`SamplingOptions`, the one sampling-options type of the engine, the server and the rollout
workers) and what it gets back per sample (`SampledRollout`, the learner's `Rollout` plus sampling
metadata and resumable state).

Plain dataclasses of Python scalars and numpy arrays; validation errors name the bad value.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import gin
import numpy as np

from hcjax.rollout.records import Rollout, array_field, tuple_field

__all__ = [
    "GenerateRequest",
    "SampledRollout",
    "SamplingOptions",
    "TokenEvent",
    "request_from_dict",
    "sampling_options_from_gin",
]


@dataclasses.dataclass
class SampledRollout(Rollout):
    """A generated sample: the `Rollout` record plus what is needed to resume or audit it.

    `partial` is True when the request's `token_budget` ran out before a stop token or
    `max_tokens` (finish_reason is then "length"); pass the record to
    `GenerateRequest.continuation` to continue it later without regenerating its tokens.
    Its fields extend the Rollout record schema (hcjax.rollout.records), so the wire and store
    formats carry them too.
    """

    # f32 [R], model log-prob at temperature 1
    raw_logprobs: np.ndarray | None = array_field(np.float32, per_token=True, optional=True)
    seed: int = 0
    sample_index: int = 0
    top_p: float = 1.0
    max_tokens: int = 0
    stop_tokens: tuple[int, ...] = tuple_field(())
    partial: bool = False

    def __post_init__(self) -> None:
        # Scalars first: a record may come off the wire, and a wrong type must be a ValueError
        # naming the field, not a TypeError from a comparison further down.
        _sampling_options(self.temperature, self.top_p)
        _integer("seed", self.seed, 0, _UINT32)
        _integer("sample_index", self.sample_index, 0, _INT32)
        _integer("max_tokens", self.max_tokens, 0, _INT32)  # 0: not recorded (the default)
        _group_id(self.group_id)
        self.stop_tokens = _token_ids("stop_tokens", self.stop_tokens)
        if not isinstance(self.partial, bool | np.bool_):
            raise ValueError(f"partial={self.partial!r:.80} must be a boolean")
        if not isinstance(self.finish_reason, str):
            raise ValueError(f"finish_reason={self.finish_reason!r:.80} must be a string")
        super().__post_init__()  # casts and checks raw_logprobs with the other [R] arrays

    @property
    def tokens(self) -> np.ndarray:
        """The generated token ids (the same array as `response_ids`)."""
        return self.response_ids


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One generated token of one sample, as streamed while the sample is being generated.

    A batch of events travels as one array per field (wire.events_to_arrays), of the dtype that
    the field's `array_field` gives.
    """

    sample_index: int = array_field(np.int32)
    token: int = array_field(np.int32)
    logprob: float = array_field(np.float32)
    raw_logprob: float = array_field(np.float32)
    n_kept: int = array_field(np.int32)
    threshold_logit: float = array_field(np.float32)
    # [num_moe_layers, k] experts chosen when the token was fed
    routing: np.ndarray = array_field(np.int32)
    position: int = array_field(np.int32)
    version: int = array_field(np.int32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """How samples are drawn, with the one set of defaults: the options of a `GenerateRequest`
    (which extends this type), the per-slot parameters of the engine, and the settings of the
    rollout workers (hcjax.rl.workers), which copy them into each request.

    temperature 0 is greedy; top_p 1 keeps the whole distribution. stop_tokens end a sample (the
    stop token is kept). seed None lets the server pick one (the records carry the seed used; the
    engine alone uses 0). token_budget: at most this many new tokens per sample in one call
    (Kimi partial rollouts); a sample that hits it comes back with `partial=True`. priority: an
    integer in [-8, 8]; among the server's waiting work, a lane of higher priority gets
    2**priority times the slots of a priority-0 lane (fair queueing, never starvation).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 0.97
    stop_tokens: tuple[int, ...] = ()
    seed: int | None = None
    token_budget: int | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_tokens", _token_ids("stop_tokens", self.stop_tokens))
        _positive_int("max_tokens", self.max_tokens)
        if self.token_budget is not None:
            _positive_int("token_budget", self.token_budget)
        _sampling_options(self.temperature, self.top_p)
        if self.seed is not None:
            _integer("seed", self.seed, 0, _UINT32)
        _integer("priority", self.priority, -_MAX_PRIORITY, _MAX_PRIORITY + 1)

    def options(self) -> SamplingOptions:
        """These options alone (a GenerateRequest's, without its prompt and ids)."""
        return SamplingOptions(**_option_values(self))


# A run's sampling options in gin (`SamplingOptions.max_tokens = 24`, or `@SamplingOptions()`):
# a wrapper registered in its place, so options built in code never pick up those bindings.
_GinSamplingOptions = gin.external_configurable(SamplingOptions, module="hcjax.rollout.request")


def sampling_options_from_gin() -> SamplingOptions:
    """SamplingOptions with gin's `SamplingOptions.*` bindings over the defaults: a run's sampling
    (the climb's `ClimbConfig.sampling`, whose response budget rejection sampling and long2short
    take by default)."""
    return _GinSamplingOptions().options()


def _option_values(options: SamplingOptions) -> dict[str, Any]:
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(SamplingOptions)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateRequest(SamplingOptions):
    """n samples of one prompt (a GRPO group), or the continuation of partial samples, drawn
    with the request's `SamplingOptions` fields (a request is its options plus what it is for,
    so every client passes them as keywords and the wire carries them flat).

    continue_from: partial records of this prompt to resume. request_id / group_id: the caller's
    names for the request and its group (the records carry group_id).
    """

    prompt: tuple[int, ...]
    n: int = 1
    request_id: str = ""
    group_id: str | int = 0
    continue_from: tuple[SampledRollout, ...] = ()

    @classmethod
    def of(cls, options: SamplingOptions, **fields: Any) -> GenerateRequest:
        """A request for `fields` (prompt, n, seed, ids, ...) with `options`' sampling fields;
        a field given in both is taken from `fields`."""
        return cls(**{**_option_values(options), **fields})

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", _token_ids("prompt", self.prompt))
        super().__post_init__()
        if not isinstance(self.continue_from, Sequence | np.ndarray):
            raise ValueError(f"continue_from={self.continue_from!r:.80} must be a sequence of "
                             "records")
        object.__setattr__(self, "continue_from", tuple(self.continue_from))
        if not self.prompt:
            raise ValueError("prompt is empty; it must hold at least one token id")
        _positive_int("n", self.n)
        if not isinstance(self.request_id, str) or len(self.request_id) > _MAX_ID_CHARS:
            raise ValueError(f"request_id={self.request_id!r:.80} must be a string of at most "
                             f"{_MAX_ID_CHARS} characters")
        _group_id(self.group_id)
        if self.continue_from:
            self._check_continuation()

    def _check_continuation(self) -> None:
        if self.n != len(self.continue_from):
            raise ValueError(
                f"n={self.n} must equal the {len(self.continue_from)} records to continue"
            )
        seen = set()
        for rec in self.continue_from:
            if not isinstance(rec, SampledRollout):
                raise ValueError(f"continue_from holds a {type(rec).__name__}, not a "
                                 "SampledRollout")
            if rec.sample_index in seen:
                raise ValueError(f"continue_from holds sample {rec.sample_index} twice")
            seen.add(rec.sample_index)
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
            bad = rec.response_ids[(rec.response_ids < 0)]
            if bad.size:
                raise ValueError(f"sample {rec.sample_index} has negative response token ids "
                                 f"{bad[:4].tolist()}")
            for name in ("logprobs", "raw_logprobs", "threshold_logit"):
                values = getattr(rec, name)
                if values is not None and not np.all(np.isfinite(values)):
                    raise ValueError(f"sample {rec.sample_index} has non-finite {name}")
            if rec.routing is not None and np.any(rec.routing < 0):
                raise ValueError(f"sample {rec.sample_index} has negative expert ids in routing")

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


# The wire options of a request: every field but continue_from, which travels as arrays.
_FIELDS = tuple(f.name for f in dataclasses.fields(GenerateRequest) if f.name != "continue_from")


def request_from_dict(
    options: Mapping[str, Any], continue_from: Sequence[SampledRollout] = ()
) -> GenerateRequest:
    """Build a request from wire options; unknown option names are an error, not ignored."""
    if not isinstance(options, Mapping):
        raise ValueError(f"request options are a {type(options).__name__}, not an object")
    unknown = sorted(map(str, set(options) - set(_FIELDS)))
    if unknown:
        raise ValueError(f"unknown request options {unknown}; known: {sorted(_FIELDS)}")
    if "prompt" not in options:
        raise ValueError("request has no prompt")
    opts = dict(options)
    for name in ("prompt", "stop_tokens"):
        if name in opts and not isinstance(opts[name], list | tuple):
            raise ValueError(f"{name}={opts[name]!r:.80} must be a list of token ids")
    return GenerateRequest(**opts, continue_from=tuple(continue_from))


_INT32 = 2**31
_UINT32 = 2**32
_MAX_PRIORITY = 8
_MAX_ID_CHARS = 256


def _integer(name: str, value: Any, low: int, high: int) -> None:
    """value must be an integer (Python or numpy, not bool) in [low, high)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool | np.bool_):
        raise ValueError(f"{name}={value!r:.80} must be an integer")
    if not low <= value < high:
        raise ValueError(f"{name}={value!r} must be in [{low}, {high})")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool | np.bool_) or value <= 0:
        raise ValueError(f"{name}={value!r:.80} must be a positive integer")
    if value >= _INT32:
        raise ValueError(f"{name}={value!r} must be < 2**31")


def _real(name: str, value: Any, *, low: float, high: float = math.inf) -> None:
    """value must be a finite real number in [low, high]."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool | np.bool_):
        raise ValueError(f"{name}={value!r:.80} must be a number")
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be finite")
    if not low <= value <= high:
        raise ValueError(f"{name}={value!r} must be in [{low:g}, {high:g}]")


# Sampling runs in float32 and the learner divides logits by the temperature: values outside
# these ranges would round to 0 or infinity there, and the record would misstate its sampling.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3
MIN_TOP_P = 1e-6


def _sampling_options(temperature: Any, top_p: Any) -> None:
    _real("temperature", temperature, low=0.0, high=MAX_TEMPERATURE)
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature={temperature!r} must be 0 (greedy) or in "
                         f"[{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]")
    _real("top_p", top_p, low=MIN_TOP_P, high=1.0)


def _token_ids(name: str, ids: Any) -> tuple[int, ...]:
    """ids as a tuple of ints in [0, 2**31); floats, bools and strings are refused, not cast."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(f"{name} must be a 1-D integer array, got {ids.dtype}{list(ids.shape)}")
        ids = ids.tolist()
    elif not isinstance(ids, Sequence) or isinstance(ids, str | bytes):
        raise ValueError(f"{name}={ids!r:.80} must be a sequence of token ids")
    out = []
    for i, t in enumerate(ids):
        if not isinstance(t, numbers.Integral) or isinstance(t, bool | np.bool_):
            raise ValueError(f"{name}[{i}]={t!r:.40} is not an integer token id")
        if not 0 <= t < _INT32:
            raise ValueError(f"{name}[{i}]={t} is not a token id in [0, 2**31)")
        out.append(int(t))
    return tuple(out)


def _group_id(value: Any) -> None:
    if isinstance(value, str):
        if len(value) > _MAX_ID_CHARS:
            raise ValueError(f"group_id of {len(value)} characters exceeds {_MAX_ID_CHARS}")
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool | np.bool_):
        raise ValueError(f"group_id={value!r:.80} must be a string or an integer")
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"group_id={value} must fit in 64 bits")

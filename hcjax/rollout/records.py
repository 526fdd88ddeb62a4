"""The Rollout record that crosses from the rollout side to the learner, and the top-p support
record helpers that both sides share. Plain numpy and Python scalars only; no model code here.

Top-p support record, per generated token: the kept set of top-p sampling is the `n_kept` tokens
with the largest temperature-scaled logit, ties broken by the lower token id; `threshold_logit` is
the scaled logit of the last kept token (a diagnostic). The learner rebuilds the kept set *by rank*
from its own logits (`support_mask_from_record`) and sets every other logit to -inf before the
log-softmax. Rank-based replay is exact whenever learner and sampler order the logits alike, which
is the design: it never depends on the two sides agreeing on logit values to the last bit.
`n_kept == 0` means "no record" (e.g. a tool-observation token that was not sampled): full vocab.

Record schema: the Rollout dataclass's own fields are the one list of what a record holds. Each
array field says its dtype through `array_field`; fields set after sampling say so through
`graded_field`. `record_schema(cls)` reads that back as `FieldSpec`s, and the gRPC wire format
(hcjax/rollout/wire.py) and the JSON rollout store (hcjax/rl/store.py) are built from it with
`rollout_arrays`, `rollout_scalars` and `rollout_from_parts`, so a field added here (or in a
subclass such as SampledRollout) reaches both formats with no other edit.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "FINISH_REASONS",
    "ROLLOUT_SCHEMA",
    "FieldSpec",
    "Rollout",
    "array_field",
    "graded_field",
    "order_keys",
    "record_schema",
    "rollout_arrays",
    "rollout_from_parts",
    "rollout_scalars",
    "support_mask_at_threshold",
    "support_mask_from_record",
    "support_mask_from_thresholds",
    "support_thresholds",
    "tuple_field",
]

FINISH_REASONS = ("stop", "length", "aborted", "error")

_SPEC_KEY = "hcjax.record"  # dataclass field metadata key holding a field's serialisation facts
KINDS = ("array", "scalar", "tuple", "mapping")


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """How one field of a record is serialised; derived from the dataclass by `record_schema`.

    kind: "array" (numpy array of `dtype`), "scalar" (a JSON scalar: str, int, float, bool or
      None), "tuple" (a tuple of JSON scalars, a list in JSON) or "mapping" (str -> float).
    optional: the field may be None (an absent array on the wire, null in the store).
    per_token: an array of shape [R], one entry per response token (checked by validate).
    on_wire: False for fields set after sampling (grading, advantages): the rollout service
      neither sends nor accepts them.
    has_default: the dataclass gives a default, so a reader may leave the field out.
    """

    name: str
    kind: str = "scalar"
    dtype: np.dtype | None = None
    optional: bool = False
    per_token: bool = False
    on_wire: bool = True
    has_default: bool = False


def array_field(dtype: Any, *, per_token: bool = False, optional: bool = False) -> Any:
    """A dataclass field holding a numpy array of `dtype` (None allowed, and the default, when
    `optional`). __post_init__ casts it; the wire and store formats carry it as an array."""
    meta = {_SPEC_KEY: {"kind": "array", "dtype": np.dtype(dtype), "per_token": per_token}}
    return dataclasses.field(default=None if optional else dataclasses.MISSING, metadata=meta)


def graded_field(default: Any = None, *, kind: str = "scalar", default_factory: Any = None) -> Any:
    """A field set after sampling (reward, advantage...): stored, never on the rollout wire."""
    meta = {_SPEC_KEY: {"kind": kind, "on_wire": False}}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def tuple_field(default: tuple = ()) -> Any:
    """A field holding a tuple of JSON scalars (a list in JSON, a tuple again when read)."""
    return dataclasses.field(default=default, metadata={_SPEC_KEY: {"kind": "tuple"}})


@functools.cache
def record_schema(cls: type, *, wire: bool = False) -> tuple[FieldSpec, ...]:
    """The FieldSpecs of record class `cls` (Rollout or a dataclass subclass), in field order;
    with `wire`, only the fields the rollout service carries."""
    specs = []
    for f in dataclasses.fields(cls):
        facts = dict(f.metadata.get(_SPEC_KEY, {}))
        kind = facts.pop("kind", "scalar")
        if kind not in KINDS:
            raise ValueError(f"{cls.__name__}.{f.name} has kind={kind!r}, not one of {KINDS}")
        has_default = (f.default is not dataclasses.MISSING
                       or f.default_factory is not dataclasses.MISSING)
        spec = FieldSpec(f.name, kind, optional=has_default and f.default is None,
                         has_default=has_default, **facts)
        if not wire or spec.on_wire:
            specs.append(spec)
    return tuple(specs)


@dataclasses.dataclass
class Rollout:
    """One sampled response to one prompt, as token ids plus everything the learner replays.

    P = len(prompt_ids), R = len(response_ids). The learner feeds the model `prompt + response`
    minus its last token (P + R - 1 positions, exactly the tokens the sampler fed its model), so
    `routing` covers those P + R - 1 positions; the last response token is never an input.

    Fields:
      prompt_ids: int32 [P].
      response_ids: int32 [R]; in multi-turn rollouts this includes tool-observation tokens.
      logprobs: float32 [R], the sampling log-prob of each response token under the distribution
        actually sampled from (temperature-scaled, top-p truncated, renormalised). 0 where
        loss_mask is False.
      n_kept: int32 [R], top-p support record (0 = no record: full vocabulary).
      threshold_logit: float32 [R], scaled logit of the last kept token (diagnostic only).
      routing: int32 [num_moe_layers, P + R - 1, experts_per_token], experts chosen at sampling
        time for every token fed to the model, or None when not recorded. A model without MoE
        layers records an empty [0, P + R - 1, 0].
      loss_mask: bool [R], True for policy tokens, False for tool observations.
      versions: int32 [R], the policy version that produced each token (partial rollouts span
        several versions); -1 for tokens no policy produced (tool observations).
      finish_reason: one of FINISH_REASONS.
      temperature: sampling temperature (0 = greedy; then n_kept is 1 and logprobs are 0).
      group_id: the problem this response answers; advantages are normalised within a group.
      reward: the scalar reward (None until graded; never set for aborted rollouts).
      reward_components: named parts of the reward, for logging.
      advantage: set by hcjax.rl.advantages (None until then).
    """

    prompt_ids: np.ndarray = array_field(np.int32)
    response_ids: np.ndarray = array_field(np.int32)
    logprobs: np.ndarray = array_field(np.float32, per_token=True)
    n_kept: np.ndarray = array_field(np.int32, per_token=True)
    threshold_logit: np.ndarray = array_field(np.float32, per_token=True)
    loss_mask: np.ndarray = array_field(np.bool_, per_token=True)
    versions: np.ndarray = array_field(np.int32, per_token=True)
    finish_reason: str
    routing: np.ndarray | None = array_field(np.int32, optional=True)
    temperature: float = 1.0
    group_id: str | int = 0
    reward: float | None = graded_field(None)
    reward_components: Mapping[str, float] = graded_field(kind="mapping", default_factory=dict)
    advantage: float | None = graded_field(None)

    def __post_init__(self) -> None:
        for spec in record_schema(type(self)):
            value = getattr(self, spec.name)
            if spec.kind == "array" and value is not None:
                setattr(self, spec.name, np.asarray(value, spec.dtype))
        if self.routing is not None and self.routing.size == 0 and self.routing.ndim != 3:
            # Store lines written before arrays kept their shape hold an empty record (no MoE
            # layer) as [], which lost its [0, P + R - 1, 0] shape.
            self.routing = self.routing.reshape(0, self.input_len, 0)
        self.validate()

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def response_len(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def input_len(self) -> int:
        """Tokens the learner feeds to the model for this rollout: P + R - 1."""
        return self.prompt_len + self.response_len - 1

    def validate(self) -> None:
        """Raise ValueError naming the first field whose shape or value breaks the contract."""
        if self.prompt_ids.ndim != 1 or self.prompt_len < 1:
            raise ValueError(f"prompt_ids shape {self.prompt_ids.shape} must be [P] with P >= 1")
        if self.response_ids.ndim != 1 or self.response_len < 1:
            raise ValueError(
                f"response_ids shape {self.response_ids.shape} must be [R] with R >= 1"
            )
        r = self.response_len
        for spec in record_schema(type(self)):
            value = getattr(self, spec.name)
            if spec.per_token and value is not None and value.shape != (r,):
                raise ValueError(
                    f"{spec.name} shape {value.shape} must be [R]=({r},) like response_ids"
                )
        if np.any(self.n_kept < 0):
            raise ValueError(f"n_kept has negative entries {self.n_kept[self.n_kept < 0][:4]}")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason={self.finish_reason!r} is not in {FINISH_REASONS}")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if self.routing is not None:
            if self.routing.ndim != 3 or self.routing.shape[1] != self.input_len:
                raise ValueError(
                    f"routing shape {self.routing.shape} must be [num_moe_layers, P + R - 1="
                    f"{self.input_len}, experts_per_token]"
                )

    @property
    def aborted(self) -> bool:
        """Infrastructure failures: never scored, kept out of group statistics and the loss."""
        return self.finish_reason in ("aborted", "error")


ROLLOUT_SCHEMA = record_schema(Rollout)


def rollout_arrays(
    r: Rollout, specs: tuple[FieldSpec, ...] | None = None
) -> dict[str, np.ndarray]:
    """The array fields of `r` that are set (None ones left out), in schema order; `specs`
    defaults to the full schema of type(r)."""
    specs = record_schema(type(r)) if specs is None else specs
    out = {}
    for spec in specs:
        value = getattr(r, spec.name)
        if spec.kind == "array" and value is not None:
            out[spec.name] = np.asarray(value, spec.dtype)
    return out


def rollout_scalars(r: Rollout, specs: tuple[FieldSpec, ...] | None = None) -> dict[str, Any]:
    """The non-array fields of `r` as JSON-able values (tuples as lists, numpy scalars as Python
    ones, mappings as {str: float}); `specs` defaults to the full schema of type(r)."""
    specs = record_schema(type(r)) if specs is None else specs
    out: dict[str, Any] = {}
    for spec in specs:
        value = getattr(r, spec.name)
        if spec.kind == "array":
            continue
        if spec.kind == "tuple":
            value = [_plain(v) for v in value]
        elif spec.kind == "mapping":
            value = {str(k): float(v) for k, v in value.items()}
        else:
            value = _plain(value)
        out[spec.name] = value
    return out


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def rollout_from_parts(
    scalars: Mapping[str, Any],
    arrays: Mapping[str, Any],
    cls: type[Rollout] = Rollout,
    *,
    specs: tuple[FieldSpec, ...] | None = None,
    strict: bool = True,
) -> Rollout:
    """Build a `cls` from its non-array fields (`scalars`, as rollout_scalars wrote them) and its
    array fields (`arrays`, absent or None for unset optional ones): the inverse of
    rollout_scalars + rollout_arrays. `specs` (default: the full schema of cls) are the fields
    expected; any other field of cls keeps its default. With `strict`, every expected non-array
    field must be present; otherwise one with a default may be missing (a line written before
    the field existed). A name outside `specs` is always an error, as is a missing required
    array. ValueError names the field; cls's own validation runs last.
    """
    specs = record_schema(cls) if specs is None else specs
    by_name = {s.name: s for s in specs}
    if not isinstance(scalars, Mapping):
        raise ValueError(f"record fields are a {type(scalars).__name__}, not an object")
    want = {s.name for s in specs if s.kind != "array" and (strict or not s.has_default)}
    missing = sorted(want - set(scalars))
    unknown = sorted(map(str, set(scalars) - {s.name for s in specs if s.kind != "array"}))
    if missing or unknown:
        raise ValueError(f"missing fields {missing}, unknown fields {unknown}")
    unknown = sorted(map(str, set(arrays) - {s.name for s in specs if s.kind == "array"}))
    if unknown:
        raise ValueError(f"unknown arrays {unknown}")
    kwargs: dict[str, Any] = {}
    for name, value in scalars.items():
        spec = by_name[name]
        if spec.kind == "tuple":
            if not isinstance(value, list | tuple):
                raise ValueError(f"{name}={value!r:.80} is not a list")
            value = tuple(value)
        elif spec.kind == "mapping":
            if not isinstance(value, Mapping) or not all(
                isinstance(k, str) and isinstance(v, numbers.Real) for k, v in value.items()
            ):
                raise ValueError(f"{name}={value!r:.80} is not an object of numbers")
            value = dict(value)
        kwargs[name] = value
    for spec in specs:
        if spec.kind != "array":
            continue
        value = arrays.get(spec.name)
        if value is None and not spec.optional:
            raise ValueError(f"no array {spec.name!r}")
        if value is not None:
            kwargs[spec.name] = value
    return cls(**kwargs)


def order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys that order like the float32 values (-0.0 taken as +0.0, so the two tie): the
    sign bit flipped for non-negatives, every bit flipped for negatives. The kept-set order of the
    sampler (`hcjax.rollout.sampling`) and of the learner's rebuilt support, one function for both."""
    x = jnp.asarray(x, jnp.float32)
    # A select, not `x + 0.0`: XLA simplifies that add away inside jit, and -0.0 kept its sign
    # bit (a key below +0.0's).
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0.0, 0.0, x), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _nth_largest_key(keys: jax.Array, n: jax.Array) -> jax.Array:
    """The key of the n-th largest entry along the last axis ([..., 1]; n >= 1, [..., 1]): the
    largest K with at least n keys >= K, built one bit at a time from the top. 32 counting passes
    over the row instead of a sort (XLA's CPU sort costs ~100 ns per element)."""
    found = jnp.zeros(keys.shape[:-1] + (1,), jnp.uint32)
    for bit in range(31, -1, -1):
        trial = found | jnp.uint32(1 << bit)
        enough = jnp.sum(keys >= trial, axis=-1, keepdims=True, dtype=jnp.int32) >= n
        found = jnp.where(enough, trial, found)
    return found


def support_thresholds(logits_v: jax.Array, n_kept: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(v, cut), each [..., 1]: the kept set of `support_mask_from_record` as two numbers per
    row, so it can be rebuilt from any slice of the vocabulary (`support_mask_from_thresholds`)
    without a [..., V] array kept between passes. v is the order key of the n-th largest entry
    (n = n_kept; every entry when n_kept <= 0); cut is an id bound: of the entries tied at v the
    ones with id < cut are kept (the lowest ids, as many as the slots left after those above v).

    Only reductions over the last axis (no sort, no cumulative sum), so a vocabulary sharded over
    a mesh axis stays sharded: 32 counting passes for v, and, only when some row has more ties at
    v than slots, `vocab.bit_length()` more for cut.
    """
    logits_v = jnp.asarray(logits_v)
    n_kept = jnp.asarray(n_kept, jnp.int32)
    vocab = logits_v.shape[-1]
    n = jnp.where(n_kept <= 0, vocab, jnp.minimum(n_kept, vocab))[..., None]
    keys = order_keys(logits_v)
    v = _nth_largest_key(keys, n)
    tied = keys == v
    slots = n - jnp.sum(keys > v, axis=-1, keepdims=True, dtype=jnp.int32)
    n_tied = jnp.sum(tied, axis=-1, keepdims=True, dtype=jnp.int32)
    ids = jax.lax.broadcasted_iota(jnp.int32, keys.shape, keys.ndim - 1)
    bits = max(1, vocab.bit_length())  # 2**bits - 1 >= vocab: "keep every tie"

    def cut_ids():
        # The largest t with at most `slots` ties of id < t, one bit at a time from the top.
        found = jnp.zeros_like(slots)
        for bit in range(bits - 1, -1, -1):
            trial = found | (1 << bit)
            count = jnp.sum(tied & (ids < trial), axis=-1, keepdims=True, dtype=jnp.int32)
            found = jnp.where(count <= slots, trial, found)
        return found

    keep_all = jnp.full_like(slots, (1 << bits) - 1)
    cut = jax.lax.cond(jnp.any(n_tied > slots), cut_ids, lambda: keep_all)
    return v, cut


def support_mask_at_threshold(logits_v: jax.Array, n_kept: jax.Array,
                              threshold: jax.Array) -> jax.Array:
    """`support_mask_from_record(logits_v, n_kept)` when the n_kept-th largest value is known:
    `threshold` [...] is it (the sampler records it, `SampleOutput.threshold_logit`). Then no
    counting passes find it: entries above it are kept, and of those tied with it the lowest ids
    fill the slots left (a running count of the ties, only when some row has more ties than
    slots). Same result as `support_mask_from_record` whenever `threshold` is that value."""
    logits_v = jnp.asarray(logits_v)
    vocab = logits_v.shape[-1]
    n_kept = jnp.asarray(n_kept, jnp.int32)[..., None]
    keys = order_keys(logits_v)
    v = order_keys(jnp.asarray(threshold))[..., None]
    above, tied = keys > v, keys == v
    slots = jnp.minimum(n_kept, vocab) - jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)

    def lowest_ties():
        return above | (tied & (jnp.cumsum(tied, axis=-1, dtype=jnp.int32) <= slots))

    too_many = jnp.any(jnp.sum(tied, axis=-1, keepdims=True, dtype=jnp.int32) > slots)
    mask = jax.lax.cond(too_many, lowest_ties, lambda: above | tied)
    return mask | (n_kept <= 0)


def support_mask_from_thresholds(keys_v: jax.Array, ids_v: jax.Array, v: jax.Array,
                                 cut: jax.Array) -> jax.Array:
    """bool[..., V']: which of the entries with order keys `keys_v` and vocabulary ids `ids_v`
    (any slice of the vocabulary) the kept set (v, cut) of `support_thresholds` holds."""
    return (keys_v > v) | ((keys_v == v) & (ids_v < cut))


def support_mask_from_record(logits_v: jax.Array, n_kept: jax.Array) -> jax.Array:
    """bool[..., V]: True for the top-`n_kept` entries of `logits_v` (ties: lower id first).

    Batched over leading axes (`n_kept` has the leading shape of `logits_v`). n_kept == 0 means
    no record and keeps every token. Pass the temperature-scaled logits, as the sampler ranked
    those (scaling by a positive temperature can only merge values into ties, never reorder).

    No sort: the n_kept-th largest value v (found by counting, `_nth_largest_key`) splits the
    vocabulary into "certainly kept" (> v) and "tied at v"; among the ties the lowest ids fill
    the remaining slots (`support_thresholds`).
    """
    logits_v = jnp.asarray(logits_v)
    v, cut = support_thresholds(logits_v, n_kept)
    keys = order_keys(logits_v)
    ids = jax.lax.broadcasted_iota(jnp.int32, keys.shape, keys.ndim - 1)
    return support_mask_from_thresholds(keys, ids, v, cut)

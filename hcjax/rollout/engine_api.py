"""JetStream's Engine API as data (jetstream/engine/engine_api.py of google-jetstream 0.2.2): the
records that prefill, insert and generate pass (`Prefix`, `DecodeState`, `ResultTokens`,
`ResultBlock`), the parameters they take, and the tokenizer metadata and adapter. Plain records
and host code only: what runs on them lives in engine.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hcjax.rollout.request import SamplingOptions

__all__ = [
    "DecodeState",
    "FlatParams",
    "JetStreamTokenizer",
    "Prefix",
    "ResultBlock",
    "ResultTokens",
    "SlotData",
    "TokenizerParameters",
    "VersionedParams",
    "next_pow2",
    "split_params",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VersionedParams:
    """The `params` argument of prefill / generate tagged with its weight version.

    Bare parameters (what `load_params` returns, what JetStream passes back) are version 0. The
    version is static metadata, so `jax.tree.map` over a VersionedParams maps the parameters only.
    """

    params: Any
    version: int = dataclasses.field(default=0, metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class FlatParams:
    """Parameters flattened once (`Engine.flatten_params`): the leaves, their tree structure and
    the weight version. `generate_block` takes them without walking the parameter tree (an
    nnx.State of hundreds of leaves is flattened in Python) on every call."""

    leaves: tuple
    treedef: Any
    version: int = 0


def split_params(params: Any) -> tuple[Any, int]:
    """(the parameter tree, its weight version) of bare, versioned or flattened parameters."""
    if isinstance(params, VersionedParams):
        return params.params, int(params.version)
    if isinstance(params, FlatParams):
        return jax.tree.unflatten(params.treedef, params.leaves), int(params.version)
    return params, 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything the generate step needs, one row per slot ([B, ...] leaves)."""

    cache: Any  # the model's KV cache with batch = number of slots
    logits: jax.Array  # [B, V] f32: next-token logits of each row (from its last forward)
    logits_version: jax.Array  # [B] int32: weight version that computed `logits`
    positions: jax.Array  # [B] int32: absolute position of the next token to sample
    seeds: jax.Array  # [B] uint32
    sample_index: jax.Array  # [B] int32
    temperature: jax.Array  # [B] f32
    top_p: jax.Array  # [B] f32
    remaining: jax.Array  # [B] int32: tokens this slot may still generate
    generated: jax.Array  # [B] int32: tokens this slot generated since its insert
    stop_tokens: jax.Array  # [B, S] int32, -1 = unused
    active: jax.Array  # [B] bool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotData:
    """One slot's share of a ResultTokens (JetStream's SlotData): [samples, 1] tokens and
    validity, [samples] lengths."""

    tokens: Any
    valid: Any
    lengths: Any


_INDEX = dict(static=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ResultTokens:
    """One generate step's output for every slot, in JetStream's layout plus the RL extras.

    `data` [B, 3] int32 holds (token, valid, length) per slot so JetStream copies one array to the
    host; `length` counts the tokens the slot has generated since its insert, this one included.
    The extras are fields JetStream never reads. Rows with valid=0 carry no token.
    """

    data: Any  # [B, 3] int32
    tokens_idx: tuple[int, int] = dataclasses.field(metadata=_INDEX)
    valid_idx: tuple[int, int] = dataclasses.field(metadata=_INDEX)
    length_idx: tuple[int, int] = dataclasses.field(metadata=_INDEX)
    samples_per_slot: int = dataclasses.field(metadata=_INDEX)
    logprobs: Any  # [B] f32, sampling distribution (temperature, top-p, renormalised)
    raw_logprobs: Any  # [B] f32, model distribution at temperature 1
    n_kept: Any  # [B] int32, top-p support record
    threshold_logit: Any  # [B] f32
    routing: Any  # [B, num_moe_layers, k] int32: experts chosen when the token was fed
    positions: Any  # [B] int32, position of the token
    versions: Any  # [B] int32, weight version whose logits the token was drawn from
    done: Any  # [B] bool: this token ended the slot (stop token or token limit)

    @property
    def tokens(self) -> Any:
        return self.data[:, self.tokens_idx[0]]

    @property
    def valid(self) -> Any:
        return self.data[:, self.valid_idx[0]] != 0

    @property
    def lengths(self) -> Any:
        return self.data[:, self.length_idx[0]]

    def get_result_at_slot(self, slot: int) -> SlotData:
        """The `samples_per_slot` rows of `slot`."""
        lo, hi = slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot
        rows = self.data[lo:hi]
        return SlotData(
            tokens=rows[:, self.tokens_idx[0] : self.tokens_idx[1]],
            valid=rows[:, self.valid_idx[0] : self.valid_idx[1]],
            lengths=rows[:, self.length_idx[0] : self.length_idx[1]][:, 0],
        )

    def copy_to_host_async(self) -> None:
        """Start every device-to-host copy (a no-op for numpy leaves)."""
        for leaf in jax.tree.leaves(self):
            if isinstance(leaf, jax.Array):
                leaf.copy_to_host_async()

    def convert_to_numpy(self) -> ResultTokens:
        """The same result with numpy leaves (extras included)."""
        return jax.tree.map(np.asarray, self)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefix:
    """A prefilled prompt ready to be inserted into one or more slots (what `prefill` returns)."""

    cache: Any  # batch-1 cache in the decode layout, holding the prompt
    logits: Any  # [V] f32 logits after the last prompt token
    routing: Any  # [num_moe_layers, length, k] int32 experts of the prompt tokens
    length: int = dataclasses.field(metadata=dict(static=True))  # = position of the first token
    version: int = dataclasses.field(metadata=dict(static=True))
    sampling: SamplingOptions = dataclasses.field(metadata=dict(static=True))
    tokens: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    # Prefix-cache block uids whose stored KV this cache holds exactly at positions 0.. (block i
    # at [i * block_size, (i + 1) * block_size)): the paged layout maps cached pages for them.
    blocks: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ResultBlock:
    """`steps` decode steps of every slot (`Engine.generate_block`): [K, B] leaves, row i the
    ResultTokens of step i (K = the block's compiled size; rows from `steps` on are invalid)."""

    tokens: Any  # [K, B] int32
    valid: Any  # [K, B] bool: the row's slot drew a token at this step
    lengths: Any  # [K, B] int32: tokens the slot generated since its insert, this one included
    logprobs: Any  # [K, B] f32
    raw_logprobs: Any  # [K, B] f32
    n_kept: Any  # [K, B] int32
    threshold_logit: Any  # [K, B] f32
    routing: Any  # [K, B, num_moe_layers, k] int32
    positions: Any  # [K, B] int32
    versions: Any  # [K, B] int32
    done: Any  # [K, B] bool
    steps: Any  # [] int32: steps run

    def step(self, i: int) -> dict:
        """Row i as a dict of the ResultTokens fields (tests compare it with `generate`)."""
        return {f.name: getattr(self, f.name)[i] for f in dataclasses.fields(self)
                if f.name != "steps"}


@dataclasses.dataclass(frozen=True)
class TokenizerParameters:
    """What `get_tokenizer` returns: the fields of JetStream's TokenizerParameters proto. `path` is
    "byte" (hcjax's ByteTokenizer) or a Hugging Face model folder."""

    path: str = "byte"
    extra_ids: int = 0


class JetStreamTokenizer:
    """JetStream's tokenizer interface (tokenizer_api.Tokenizer) over an hcjax tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, s: str, **kwargs) -> tuple[np.ndarray, int]:
        """(padded ids, true length): BOS first unless is_bos=False, padded with pad_id to a power
        of two no longer than max_prefill_length (a longer prompt is an error, not truncated)."""
        ids = list(self.tokenizer.encode(s))
        if kwargs.get("is_bos", True):
            ids = [self.bos_id] + ids
        limit = kwargs.get("max_prefill_length")
        if limit is not None and len(ids) > limit:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds max_prefill_length={limit}")
        width = next_pow2(max(len(ids), 1))
        if limit is not None:
            width = min(width, limit)
        padded = np.full((width,), self.pad_id, np.int32)
        padded[: len(ids)] = ids
        return (jnp.asarray(padded) if kwargs.get("jax_padding") else padded), len(ids)

    def decode(self, token_ids: Sequence[int], **kwargs) -> str:
        return self.tokenizer.decode([int(t) for t in token_ids])

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_id)

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_id)

    @property
    def bos_id(self) -> int:
        return int(self.tokenizer.bos_id)  # HFTokenizer raises a clear error when it has none

    @property
    def stop_tokens(self) -> set[int]:
        return {*getattr(self.tokenizer, "eos_ids", (self.eos_id,)), self.pad_id}


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): the padded widths few programs compile for."""
    return 1 << max(0, n - 1).bit_length()

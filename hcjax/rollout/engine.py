"""The generation engine, written to JetStream's Engine API (prefill / insert / generate) with the
RL extras (sampling and raw log-probs, top-p kept-set record, expert ids, weight version) computed
inside the jitted step, so one host copy per step carries everything.

It runs on the model's KV-cache path: one cache row per decode slot, rows independent, local layers
in ring buffers. It knows nothing of requests, threads or losses; the server (server.py) does.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import gin
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hcjax.rollout.sampling import sample, sampling_keys

__all__ = ["DecodeState", "Engine", "Prefix", "ResultTokens", "SamplingParams"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples. temperature 0 = greedy; top_p 1 = no truncation."""

    temperature: float = 1.0
    top_p: float = 0.97
    seed: int = 0
    max_tokens: int = 256
    stop_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        if not (isinstance(self.temperature, int | float) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature!r} must be a number >= 0")
        if not (isinstance(self.top_p, int | float) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed={self.seed!r} must be an integer in [0, 2**32)")
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be a positive integer")


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
    stop_tokens: jax.Array  # [B, S] int32, -1 = unused
    active: jax.Array  # [B] bool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ResultTokens:
    """One generate step's output for every slot; rows with valid=False carry no token."""

    tokens: jax.Array  # [B] int32
    logprobs: jax.Array  # [B] f32, sampling distribution (temperature, top-p, renormalised)
    raw_logprobs: jax.Array  # [B] f32, model distribution at temperature 1
    n_kept: jax.Array  # [B] int32, top-p support record
    threshold_logit: jax.Array  # [B] f32
    routing: jax.Array  # [B, num_moe_layers, k] int32: experts chosen when the token was fed
    positions: jax.Array  # [B] int32, position of the token
    versions: jax.Array  # [B] int32, weight version whose logits the token was drawn from
    valid: jax.Array  # [B] bool: the slot was active and produced this token
    done: jax.Array  # [B] bool: this token ended the slot (stop token or token limit)


@dataclasses.dataclass
class Prefix:
    """A prefilled prompt ready to be inserted into one or more slots."""

    cache: Any  # batch-1 cache holding the prompt
    logits: jax.Array  # [V] f32 logits after the last prompt token
    length: int  # tokens in the cache = position of the first generated token
    routing: jax.Array  # [num_moe_layers, length, k] int32 experts of the prompt tokens
    version: int
    sampling: SamplingParams


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _batch_axes(init_cache_fn: Callable[[int, int], Any], max_len: int) -> Any:
    """The batch axis of every cache leaf, found by comparing batch-1 and batch-2 shapes."""
    one = jax.eval_shape(lambda: init_cache_fn(1, max_len))
    two = jax.eval_shape(lambda: init_cache_fn(2, max_len))

    def axis(a, b):
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        if len(diff) != 1:
            raise ValueError(f"cache leaf of shape {a.shape} has no single batch axis")
        return diff[0]

    return jax.tree.map(axis, one, two)


@gin.configurable
class Engine:
    """JetStream-style engine over an NNX model with the hcjax forward contract.

    `model(tokens, positions=..., cache=...)` must return an object with `.logits` [B, T, V],
    `.routing` (tuple of [B, T, k], one per MoE layer) and `.cache`. Prompts are padded to a
    power-of-two bucket with position -1 on the padding, which the model's cache never stores.
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        mesh: Mesh | None = None,
        max_concurrent_decodes: int = 8,
        max_prefill_length: int | None = None,
        max_target_length: int | None = None,
        max_stop_tokens: int = 8,
        init_cache_fn: Callable[[int, int], Any] | None = None,
    ) -> None:
        cfg = getattr(model, "config", None)
        if init_cache_fn is None:
            from hcjax.model import init_cache

            init_cache_fn = lambda b, n: init_cache(cfg, b, n)
        if max_target_length is None:
            max_target_length = cfg.max_seq_len
        if max_prefill_length is None:  # leave as much room for the response as for the prompt
            max_prefill_length = max(1, max_target_length // 2)
        for name, value in [
            ("max_concurrent_decodes", max_concurrent_decodes),
            ("max_prefill_length", max_prefill_length),
            ("max_target_length", max_target_length),
            ("max_stop_tokens", max_stop_tokens),
        ]:
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if max_prefill_length >= max_target_length:
            raise ValueError(
                f"max_prefill_length={max_prefill_length} must be < "
                f"max_target_length={max_target_length}"
            )
        self._graphdef, self._params = nnx.split(model)
        self._vocab = None if cfg is None else int(cfg.vocab_size)
        self._mesh = mesh
        self._num_slots = max_concurrent_decodes
        self._max_prefill = max_prefill_length
        self._max_len = max_target_length
        self._max_stop = max_stop_tokens
        self._init_cache_fn = init_cache_fn
        self._batch_axes = _batch_axes(init_cache_fn, max_target_length)
        self._free = list(range(max_concurrent_decodes))
        self._free_lock = threading.Lock()
        replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        self._prefill_jit = jax.jit(self._prefill_impl, donate_argnums=(1,))
        self._init_prefill_jit = jax.jit(self._new_prefill_cache, out_shardings=replicated)
        self._insert_jit = jax.jit(self._insert_impl, donate_argnums=(0,))
        self._generate_jit = jax.jit(self._generate_impl, donate_argnums=(1,))
        self._deactivate_jit = jax.jit(self._deactivate_impl, donate_argnums=(0,))
        self._init_decode_jit = jax.jit(
            self._init_decode_impl, static_argnums=0, out_shardings=replicated
        )

    # JetStream Engine API: properties ---------------------------------------------------------
    @property
    def max_concurrent_decodes(self) -> int:
        return self._num_slots

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill

    @property
    def max_target_length(self) -> int:
        return self._max_len

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def mesh(self) -> Mesh | None:
        return self._mesh

    @property
    def colocated_cpus(self) -> None:
        return None

    @property
    def max_stop_tokens(self) -> int:
        return self._max_stop

    @property
    def vocab_size(self) -> int | None:
        return self._vocab

    def load_params(self) -> Any:
        """The model's parameters (an nnx.State), the `params` every call takes."""
        return self._params

    def get_prefix_destination_sharding(self) -> Any:
        return None if self._mesh is None else NamedSharding(self._mesh, PartitionSpec())

    def get_tokenizer(self) -> None:
        # Rollouts travel as token ids (RECIPE §6); tokenisation belongs to hcjax.data.
        return None

    def build_tokenizer(self, metadata: Any = None) -> None:
        return None

    # Slot bookkeeping ------------------------------------------------------------------------
    def allocate_slots(self, n: int) -> list[int]:
        """Take up to `n` free slots (fewer if fewer are free)."""
        with self._free_lock:
            taken, self._free = self._free[:n], self._free[n:]
        return taken

    def free_resource(self, slot: int) -> None:
        """Return a slot whose sample has finished (or been deactivated) to the free pool."""
        if not 0 <= slot < self._num_slots:
            raise ValueError(f"slot={slot} is not in [0, {self._num_slots})")
        with self._free_lock:
            if slot in self._free:
                raise ValueError(f"slot={slot} is already free")
            self._free.append(slot)

    @property
    def num_free_slots(self) -> int:
        with self._free_lock:
            return len(self._free)

    # Decode state ----------------------------------------------------------------------------
    def _init_decode_impl(self, vocab: int):
        b = self._num_slots
        return DecodeState(
            cache=self._init_cache_fn(b, self._max_len),
            logits=jnp.zeros((b, vocab), jnp.float32),
            logits_version=jnp.zeros((b,), jnp.int32),
            positions=jnp.zeros((b,), jnp.int32),
            seeds=jnp.zeros((b,), jnp.uint32),
            sample_index=jnp.zeros((b,), jnp.int32),
            temperature=jnp.ones((b,), jnp.float32),
            top_p=jnp.ones((b,), jnp.float32),
            remaining=jnp.zeros((b,), jnp.int32),
            stop_tokens=jnp.full((b, self._max_stop), -1, jnp.int32),
            active=jnp.zeros((b,), bool),
        )

    def init_decode_state(self, vocab_size: int | None = None) -> DecodeState:
        """A decode state with every slot empty."""
        vocab = vocab_size or self._vocab
        if vocab is None:
            raise ValueError("init_decode_state needs vocab_size for a model without .config")
        return self._init_decode_jit(int(vocab))

    # Prefill ---------------------------------------------------------------------------------
    def _new_prefill_cache(self):
        return self._init_cache_fn(1, self._max_len)

    def _prefill_impl(self, params, cache, tokens_t, start, length):
        """One prompt chunk: `length` real tokens at positions start.., then padding."""
        model = nnx.merge(self._graphdef, params)
        idx = jnp.arange(tokens_t.shape[0], dtype=jnp.int32)
        positions = jnp.where(idx < length, start + idx, -1)  # -1: padding, never cached
        out = model(tokens_t[None], positions=positions[None], cache=cache)
        logits = out.logits[0, length - 1].astype(jnp.float32)
        routing = _stack_routing(out.routing, 1, tokens_t.shape[0])[0]  # [T, L, k]
        return out.cache, logits, jnp.transpose(routing, (1, 0, 2))

    def prefill(
        self,
        *,
        params: Any,
        padded_tokens: Sequence[int] | np.ndarray,
        true_length: int,
        sampling: SamplingParams | None = None,
        version: int = 0,
        existing_prefix: Prefix | None = None,
    ) -> tuple[Prefix, None]:
        """Run the prompt through the model into a fresh batch-1 cache.

        Chunks of at most max_prefill_length tokens, each padded to a power-of-two bucket so few
        shapes compile; a resumed partial rollout (prompt + earlier response) may span several
        chunks. Returns (prefix, None): the first token is drawn at generate time from
        `prefix.logits` with each sample's own key, so the n samples of a `bulk_insert` differ.
        """
        if existing_prefix is not None:
            raise NotImplementedError("prefix caching (existing_prefix) is not supported")
        tokens = np.asarray(padded_tokens, np.int32).reshape(-1)
        if not 0 < true_length <= tokens.shape[0]:
            raise ValueError(
                f"true_length={true_length} must be in [1, len(padded_tokens)={tokens.shape[0]}]"
            )
        if true_length >= self._max_len:
            raise ValueError(
                f"prompt length {true_length} leaves no room in max_target_length={self._max_len}"
            )
        if self._vocab is not None and int(tokens[:true_length].max()) >= self._vocab:
            raise ValueError(
                f"token id {int(tokens[:true_length].max())} is >= vocab_size={self._vocab}"
            )
        cache = self._init_prefill_jit()
        routings = []
        for start in range(0, true_length, self._max_prefill):
            n = min(self._max_prefill, true_length - start)
            bucket = min(_next_pow2(max(n, 8)), self._max_prefill)
            chunk = np.zeros((bucket,), np.int32)
            chunk[:n] = tokens[start : start + n]
            cache, logits, routing = self._prefill_jit(
                params, cache, chunk, np.int32(start), np.int32(n)
            )
            routings.append(routing[:, :n])
        prefix = Prefix(
            cache=cache,
            logits=logits,
            length=true_length,
            routing=routings[0] if len(routings) == 1 else jnp.concatenate(routings, axis=1),
            version=int(version),
            sampling=sampling or SamplingParams(),
        )
        return prefix, None

    # Insert ----------------------------------------------------------------------------------
    def _insert_impl(self, state, cache, logits, version, length, slot, sample_index, seed,
                     temperature, top_p, remaining, stop_tokens):
        def put(full, one, axis):
            start = [0] * full.ndim
            start[axis] = slot
            return jax.lax.dynamic_update_slice(full, one.astype(full.dtype), start)

        def row(arr, value):
            return arr.at[slot].set(value)

        return DecodeState(
            cache=jax.tree.map(put, state.cache, cache, self._batch_axes),
            logits=row(state.logits, logits),
            logits_version=row(state.logits_version, version),
            positions=row(state.positions, length),
            seeds=row(state.seeds, seed),
            sample_index=row(state.sample_index, sample_index),
            temperature=row(state.temperature, temperature),
            top_p=row(state.top_p, top_p),
            remaining=row(state.remaining, remaining),
            stop_tokens=row(state.stop_tokens, stop_tokens),
            active=row(state.active, True),
        )

    def insert(
        self,
        prefix: Prefix,
        decode_state: DecodeState,
        slot: int,
        *,
        sample_index: int = 0,
        max_tokens: int | None = None,
    ) -> DecodeState:
        """Put a prefilled prompt into `slot` as sample `sample_index` (its key depends on it).

        `max_tokens` overrides the sampling params' limit (used for partial-rollout budgets).
        """
        if not 0 <= slot < self._num_slots:
            raise ValueError(f"slot={slot} is not in [0, {self._num_slots})")
        sp = prefix.sampling
        budget = sp.max_tokens if max_tokens is None else max_tokens
        if budget <= 0:
            raise ValueError(f"max_tokens={budget} must be positive")
        if prefix.length + budget > self._max_len:
            raise ValueError(
                f"prompt length {prefix.length} + max_tokens {budget} exceeds "
                f"max_target_length={self._max_len}"
            )
        if len(sp.stop_tokens) > self._max_stop:
            raise ValueError(
                f"{len(sp.stop_tokens)} stop tokens exceed max_stop_tokens={self._max_stop}"
            )
        stop = np.full((self._max_stop,), -1, np.int32)
        stop[: len(sp.stop_tokens)] = sp.stop_tokens
        return self._insert_jit(
            decode_state, prefix.cache, prefix.logits, np.int32(prefix.version),
            np.int32(prefix.length), np.int32(slot), np.int32(sample_index),
            np.uint32(sp.seed), np.float32(sp.temperature), np.float32(sp.top_p),
            np.int32(budget), stop,
        )

    def bulk_insert(
        self,
        prefix: Prefix,
        decode_state: DecodeState,
        slots: Sequence[int],
        *,
        sample_indices: Sequence[int] | None = None,
        max_tokens: int | None = None,
    ) -> DecodeState:
        """Insert one prefill into several slots: the n samples of a GRPO group share it."""
        if sample_indices is None:
            sample_indices = range(len(slots))
        if len(sample_indices) != len(slots):
            raise ValueError(f"{len(sample_indices)} sample indices for {len(slots)} slots")
        for slot, index in zip(slots, sample_indices):
            decode_state = self.insert(
                prefix, decode_state, slot, sample_index=index, max_tokens=max_tokens
            )
        return decode_state

    def _deactivate_impl(self, state, slot):
        return dataclasses.replace(state, active=state.active.at[slot].set(False))

    def deactivate(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Stop a slot before it finishes by itself (cancelled request)."""
        return self._deactivate_jit(decode_state, np.int32(slot))

    # Generate --------------------------------------------------------------------------------
    def _generate_impl(self, params, state, version):
        keys = sampling_keys(state.seeds, state.sample_index, state.positions)
        drawn = sample(state.logits, keys, state.temperature, state.top_p)
        valid = state.active
        # Feed the drawn token at once: its expert ids and the next logits come from this same
        # forward. Idle rows feed a token too (fixed shapes); their cache row is rewritten on
        # insert, and their position is clamped to stay inside the cache.
        feed_pos = jnp.minimum(state.positions, self._max_len - 1)
        model = nnx.merge(self._graphdef, params)
        out = model(drawn.tokens[:, None], positions=feed_pos[:, None], cache=state.cache)
        b = drawn.tokens.shape[0]
        routing = _stack_routing(out.routing, b, 1)[:, 0]  # [B, L, k]
        hit_stop = jnp.any(drawn.tokens[:, None] == state.stop_tokens, axis=-1)
        remaining = state.remaining - valid.astype(jnp.int32)
        done = valid & (hit_stop | (remaining <= 0))
        result = ResultTokens(
            tokens=drawn.tokens,
            logprobs=drawn.logprobs,
            raw_logprobs=drawn.raw_logprobs,
            n_kept=drawn.n_kept,
            threshold_logit=drawn.threshold_logit,
            routing=routing,
            positions=state.positions,
            versions=state.logits_version,
            valid=valid,
            done=done,
        )
        new_state = dataclasses.replace(
            state,
            cache=out.cache,
            logits=jnp.where(valid[:, None], out.logits[:, 0].astype(jnp.float32), state.logits),
            logits_version=jnp.where(valid, version, state.logits_version),
            positions=state.positions + valid.astype(jnp.int32),
            remaining=remaining,
            active=valid & ~done,
        )
        return new_state, result

    def generate(
        self, params: Any, decode_state: DecodeState, *, version: int = 0
    ) -> tuple[DecodeState, ResultTokens]:
        """One decode step for every slot: sample from each row's logits, feed the token."""
        return self._generate_jit(params, decode_state, np.int32(version))


def _stack_routing(routing: tuple, b: int, t: int) -> jax.Array:
    """[B, T, L, k] from the model's per-MoE-layer tuple (L may be 0)."""
    if not routing:
        return jnp.zeros((b, t, 0, 0), jnp.int32)
    return jnp.stack([r.astype(jnp.int32) for r in routing], axis=2)

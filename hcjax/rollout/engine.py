"""The generation engine: JetStream's `Engine` interface (jetstream/engine/engine_api.py of
google-jetstream 0.2.2: prefill / insert / generate, `ResultTokens`, tokenizer metadata) with the RL
extras (sampling and raw log-probs, top-p kept-set record, expert ids, weight version) computed
inside the jitted step, so one host copy per step carries everything, and prefix reuse across
requests (prefix_cache.py).

It runs on the model's KV-cache path: one cache row per decode slot, rows independent, local layers
in ring buffers; where global layers keep their positions is the KV layout chosen once at build
(kv_layout.py: a slot's own rows, or pages of a shared pool, page_table.py). The records it takes
and returns are engine_api.py's. It knows nothing of requests, threads or losses; the server
(server.py) does. JetStream is optional: when it imports, `Engine` and `ResultTokens` are registered
as virtual subclasses of its abstract classes (`register_with_jetstream`); hcjax never needs it.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import gin
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hcjax.data.tokenizer import load_tokenizer
from hcjax.model import init_cache
from hcjax.rollout import kv_budget
from hcjax.rollout import prefix_cache as pc
from hcjax.rollout.engine_api import (
    DecodeState,
    FlatParams,
    JetStreamTokenizer,
    Prefix,
    ResultBlock,
    ResultTokens,
    TokenizerParameters,
    next_pow2,
    split_params,
)
from hcjax.rollout.kv_layout import batch_shards, make_kv_layout
from hcjax.rollout.request import SamplingOptions
from hcjax.rollout.sampling import exact_logprobs, sample, sampling_keys

__all__ = ["Engine", "register_with_jetstream"]


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
    """JetStream engine over an NNX model with the hcjax forward contract.

    `model(tokens, positions=..., cache=...)` must return an object with `.logits` [B, T, V],
    `.routing` (tuple of [B, T, k], one per MoE layer) and `.cache`. Prompts are padded to a
    power-of-two bucket with position -1 on the padding, which the model's cache never stores.

    default_sampling: what a prefill without `sampling` uses (JetStream passes none); its token
      limit is clipped to the room left in max_target_length.
    tokenizer: "byte" or a Hugging Face model folder, for get_tokenizer / build_tokenizer.
    prefix_cache_blocks: blocks of prompt KV kept for reuse across requests (0 = no reuse);
      prefix_block_size tokens each (prefix_cache.py).
    kv_layout: "slot" (every global layer keeps max_target_length positions per slot) or
      "paged" (global layers share a pool of `num_pages` pages of `page_size` positions that
      slots take as they grow and give back on `free_resource`; kv_layout.PagedLayout). num_pages
      None = enough for every slot at max_target_length (no saving; size it to the load).
      Admission (`num_free_slots`) then counts pages as well as slots. With prefix reuse
      (prefix_block_size must equal page_size), sequences whose prompts start with a cached
      block map its page instead of writing their own. Prefill keeps the slot layout (batch 1,
      or one row a prompt in `bulk_prefill`); the prefix cache's own copy of each block stays
      outside the pool (prefill runs without the decode state, so it cannot read pages).
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
        default_sampling: SamplingOptions | None = None,
        tokenizer: str = "byte",
        prefix_cache_blocks: int = 0,
        prefix_block_size: int = 16,
        kv_layout: str = "slot",
        page_size: int = 16,
        num_pages: int | None = None,
    ) -> None:
        cfg = getattr(model, "config", None)
        # Exact mode (ModelConfig.batch_invariant): log-probs recorded as the learner computes them.
        self._exact = bool(getattr(cfg, "batch_invariant", False))
        if kv_layout not in ("slot", "paged"):
            raise ValueError(f"kv_layout={kv_layout!r} is not 'slot' or 'paged'")
        if kv_layout == "paged" and (cfg is None or init_cache_fn is not None):
            raise ValueError("kv_layout='paged' needs a model with .config and no init_cache_fn")
        if init_cache_fn is None:
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
            ("prefix_block_size", prefix_block_size),
        ]:
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not isinstance(prefix_cache_blocks, int) or prefix_cache_blocks < 0:
            raise ValueError(f"prefix_cache_blocks={prefix_cache_blocks!r} must be an integer >= 0")
        if max_prefill_length >= max_target_length:
            raise ValueError(
                f"max_prefill_length={max_prefill_length} must be < "
                f"max_target_length={max_target_length}"
            )
        self._graphdef, self._params = nnx.split(model)
        self._vocab = None if cfg is None else int(cfg.vocab_size)
        self._model_type, self._model_config = type(model), cfg
        self._mesh = mesh
        self._num_slots = max_concurrent_decodes
        self._max_prefill = max_prefill_length
        self._max_len = max_target_length
        self._max_stop = max_stop_tokens
        self._default_sampling = default_sampling or SamplingOptions()
        self._tokenizer_path = tokenizer
        self._batch_axes = _batch_axes(init_cache_fn, max_target_length)
        self.prefix_cache = (
            pc.PrefixCache(prefix_block_size, prefix_cache_blocks) if prefix_cache_blocks else None
        )
        self._routing_shape: tuple[int, int] | None = None
        self._stats = {"prompt_tokens": 0, "computed_tokens": 0, "reused_tokens": 0, "prefills": 0}
        self._free = list(range(max_concurrent_decodes))
        # Guards the free slots, the stats and the layout's page pool (which takes it again).
        self._free_lock = threading.RLock()
        if kv_layout == "paged" and prefix_cache_blocks and prefix_block_size != page_size:
            raise ValueError(
                f"prefix_block_size={prefix_block_size} must equal page_size={page_size} with "
                "kv_layout='paged' and prefix reuse (a cached block is shared as one page)")
        self._kv = make_kv_layout(
            kv_layout, cfg=cfg, init_cache_fn=init_cache_fn, batch_axes=self._batch_axes,
            slots=max_concurrent_decodes, max_len=max_target_length, page_size=page_size,
            num_pages=num_pages, mesh=mesh, lock=self._free_lock)
        replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        # Prefill runs on batch-1 (or batched) caches in the slot layout, wide enough to hold
        # every position of every layer (prefix_cache.py says why).
        self._caches = pc.PrefillCaches(
            jax.eval_shape(lambda: init_cache_fn(1, max_target_length)), self._batch_axes,
            max_target_length, self.prefix_cache, replicated)
        self._prefill_jit = jax.jit(self._prefill_impl, donate_argnums=(1,))
        self._prefill_rows_jit = jax.jit(self._prefill_rows_impl, donate_argnums=(1,))
        self._insert_jit = jax.jit(self._insert_impl, donate_argnums=(0,))
        self._bulk_insert_jit = jax.jit(self._bulk_insert_impl, donate_argnums=(0,))
        self._generate_jit = jax.jit(self._generate_impl, donate_argnums=(1,))
        self._block_jit = jax.jit(self._block_impl, static_argnums=(0, 4), donate_argnums=(2,))
        self._deactivate_jit = jax.jit(self._deactivate_impl, donate_argnums=(0,))
        self._init_decode_jit = {}  # by vocab size: jit with the state's shardings
        self._check_memory(page_size)

    def _check_memory(self, page_size: int) -> None:
        """Refuse (kv_budget.KVCacheTooLarge, a ValueError naming the bytes needed and free) a
        decode state that would not fit in the memory its devices use, before it is allocated:
        its arrays' bytes as `init_decode_state` places them, from shapes alone."""
        vocab = self._vocab or 1  # a model without a config: its logits rows are not counted
        shapes = jax.eval_shape(lambda: self._init_decode_impl(vocab))
        shardings = self.decode_state_shardings(vocab)
        device = jax.devices()[0] if self._mesh is None else None

        def local(placed: dict) -> dict:  # another process's devices are its own to check
            return {d: n for d, n in placed.items() if d.process_index == jax.process_index()}

        need = local(kv_budget.placed_bytes(shapes, shardings, device))
        cache = local(kv_budget.placed_bytes(shapes.cache, shardings and shardings.cache, device))
        kv_budget.check_decode_state(
            need, cache, kv_budget.memory_available(list(need)), cfg=self._model_config,
            slots=self._num_slots, max_len=self._max_len, kv_layout=self._kv.name,
            page_size=page_size, num_pages=self.page_stats().get("num_pages"),
            batch_shards=batch_shards(self._mesh, self._num_slots))

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

    def serves(self, model: nnx.Module) -> bool:
        """Whether `model`'s state can be served as this engine's parameters: a model of the
        same class and config, whose parameters have the same shapes and dtypes (two models built
        from one config have unequal graphdefs, whose static parts are distinct equal objects)."""
        def layout(state: Any) -> Any:
            return jax.tree.map(lambda x: (x.shape, x.dtype), state)

        return (type(model) is self._model_type
                and getattr(model, "config", None) == self._model_config
                and layout(nnx.state(model)) == layout(self._params))

    def load_params(self, *args, **kwargs) -> Any:
        """The model's parameters (an nnx.State), version 0; wrap them as
        `VersionedParams(params, version)` to tag another version."""
        return self._params

    def get_prefix_destination_sharding(self) -> Any:
        return None if self._mesh is None else NamedSharding(self._mesh, PartitionSpec())

    def get_tokenizer(self) -> TokenizerParameters:
        return TokenizerParameters(path=self._tokenizer_path)

    def build_tokenizer(self, metadata: Any) -> JetStreamTokenizer:
        """A JetStream tokenizer over hcjax.data's tokenizer at `metadata.path`."""
        path = getattr(metadata, "path", None)
        if not path:
            raise ValueError(f"tokenizer metadata {metadata!r} has no path")
        return JetStreamTokenizer(load_tokenizer(path))

    @property
    def routing_shape(self) -> tuple[int, int]:
        """(MoE layers, experts per token) of the routing records, from the prefill's shapes."""
        if self._routing_shape is None:
            chunk = jax.ShapeDtypeStruct((8,), jnp.int32)
            scalar = jax.ShapeDtypeStruct((), jnp.int32)
            _, _, routing = jax.eval_shape(
                self._prefill_impl, self._params, self._caches.wide_shapes, chunk, scalar, scalar
            )
            self._routing_shape = (int(routing.shape[0]), int(routing.shape[2]))
        return self._routing_shape

    def prefill_stats(self) -> dict:
        """Prompt tokens prefilled so far: total, computed by the model, reused from the cache."""
        with self._free_lock:
            return dict(self._stats)

    # Slot bookkeeping ------------------------------------------------------------------------
    def allocate_slots(self, n: int) -> list[int]:
        """Take up to `n` free slots (fewer if fewer are free)."""
        with self._free_lock:
            taken, self._free = self._free[:n], self._free[n:]
        return taken

    def free_resource(self, slot: int) -> None:
        """Return a slot whose sample has finished (or been deactivated) to the free pool, and
        its pages to the page pool (paged layout)."""
        if not 0 <= slot < self._num_slots:
            raise ValueError(f"slot={slot} is not in [0, {self._num_slots})")
        with self._free_lock:
            if slot in self._free:
                raise ValueError(f"slot={slot} is already free")
            self._free.append(slot)
            self._kv.release(slot)

    @property
    def num_free_slots(self) -> int:
        """Free slots; with the paged layout, no more than the free pages admit: each new
        sequence counted at a max_prefill_length prompt and a budget to max_target_length, and
        admitted only while every sequence in flight can still finish (`PagePool.admissible`).
        Sequences take pages as they grow, so this is not a reservation of their budget."""
        with self._free_lock:
            return self._kv.admissible(self._free, self._max_prefill)

    @property
    def kv_layout(self) -> str:
        return self._kv.name

    def page_stats(self) -> dict:
        """Pages of the paged layout (`PagePool.stats`: total, free, in use, waits, cached,
        shared, reclaimed, batch shards); empty for the slot layout."""
        return self._kv.stats()

    # Decode state ----------------------------------------------------------------------------
    def _init_decode_impl(self, vocab: int):
        b = self._num_slots
        return DecodeState(
            cache=self._kv.init_cache(b, self._max_len),
            logits=jnp.zeros((b, vocab), jnp.float32),
            logits_version=jnp.zeros((b,), jnp.int32),
            positions=jnp.zeros((b,), jnp.int32),
            seeds=jnp.zeros((b,), jnp.uint32),
            sample_index=jnp.zeros((b,), jnp.int32),
            temperature=jnp.ones((b,), jnp.float32),
            top_p=jnp.ones((b,), jnp.float32),
            remaining=jnp.zeros((b,), jnp.int32),
            generated=jnp.zeros((b,), jnp.int32),
            stop_tokens=jnp.full((b, self._max_stop), -1, jnp.int32),
            active=jnp.zeros((b,), bool),
        )

    def init_decode_state(self, vocab_size: int | None = None) -> DecodeState:
        """A decode state with every slot empty."""
        vocab = vocab_size or self._vocab
        if vocab is None:
            raise ValueError("init_decode_state needs vocab_size for a model without .config")
        vocab = int(vocab)
        if vocab not in self._init_decode_jit:
            self._init_decode_jit[vocab] = jax.jit(
                functools.partial(self._init_decode_impl, vocab),
                out_shardings=self.decode_state_shardings(vocab))
        return self._init_decode_jit[vocab]()

    def decode_state_shardings(self, vocab_size: int | None = None):
        """Shardings of the decode state on the engine's mesh (None without one): every
        slot-indexed leaf split over the decode batch axes (data, fsdp, expert, as many as divide
        the slots) on its batch dimension (a stacked scanned cache has its layers first), and a
        KV cache's heads ([.., B, S, heads, head_dim]) over the tensor axis when they divide, as
        the projections that write them are. Nothing that grows with the number of sequences or
        the KV length is replicated."""
        mesh = self._mesh
        if mesh is None:
            return None
        state = jax.eval_shape(lambda: self._init_decode_impl(int(vocab_size or self._vocab)))
        axes, size = [], 1
        for a in ("data", "fsdp", "expert"):
            n = mesh.shape.get(a, 1)
            if n > 1 and self._num_slots % (size * n) == 0:
                axes.append(a)
                size *= n
        tensor = mesh.shape.get("tensor", 1)

        def one(x, b):
            spec = [None] * x.ndim
            if axes:
                spec[b] = tuple(axes)
            if x.ndim == b + 4 and tensor > 1 and x.shape[b + 2] % tensor == 0:
                spec[b + 2] = "tensor"
            return NamedSharding(mesh, PartitionSpec(*spec))

        cache = self._kv.cache_shardings(state.cache, one)
        rest = {f.name: jax.tree.map(lambda x: one(x, 0), getattr(state, f.name))
                for f in dataclasses.fields(state) if f.name != "cache"}
        return dataclasses.replace(state, cache=cache, **rest)

    # Prefill ---------------------------------------------------------------------------------
    def _prefill_impl(self, params, cache, tokens_t, start, length):
        """One prompt chunk: `length` real tokens at positions start.., then padding."""
        model = nnx.merge(self._graphdef, params)
        idx = jnp.arange(tokens_t.shape[0], dtype=jnp.int32)
        positions = jnp.where(idx < length, start + idx, -1)  # -1: padding, never cached
        out = model(tokens_t[None], positions=positions[None], cache=cache)
        logits = out.logits[0, length - 1].astype(jnp.float32)
        routing = _stack_routing(out.routing, 1, tokens_t.shape[0])[0]  # [T, L, k]
        return out.cache, logits, jnp.transpose(routing, (1, 0, 2))

    def _prefill_rows_impl(self, params, cache, tokens_bt, start_b, length_b):
        """`_prefill_impl` for a batch of rows, each its own prompt: row i holds length_b[i]
        real tokens at positions start_b[i].., then padding. Returns (cache, logits [B, V],
        routing [B, L, T, k])."""
        model = nnx.merge(self._graphdef, params)
        b, t = tokens_bt.shape
        idx = jnp.arange(t, dtype=jnp.int32)[None]
        positions = jnp.where(idx < length_b[:, None], start_b[:, None] + idx, -1)
        out = model(tokens_bt, positions=positions, cache=cache)
        logits = jnp.take_along_axis(out.logits, (length_b - 1)[:, None, None], axis=1)[:, 0]
        routing = _stack_routing(out.routing, b, t)  # [B, T, L, k]
        return out.cache, logits.astype(jnp.float32), jnp.transpose(routing, (0, 2, 1, 3))

    def prefill(
        self,
        *,
        params: Any,
        existing_prefix: Prefix | None = None,
        padded_tokens: Sequence[int] | np.ndarray | jax.Array,
        true_length: int,
        sampling: SamplingOptions | None = None,
    ) -> Prefix:
        """Run the prompt through the model into a fresh batch-1 cache (JetStream's prefill).

        `params` is what load_params returns or a `VersionedParams`. `existing_prefix`: the
        tokens are appended to that prefix's prompt (its blocks are reused when prefix reuse is
        on, else recomputed). With prefix reuse, the longest stored block prefix is copied in and
        only the rest is computed. Chunks of at most max_prefill_length tokens, each padded to a
        power-of-two bucket so few shapes compile. The first token is drawn at generate time from
        `prefix.logits` with each sample's own key, so the n samples of a `bulk_insert` differ.
        `sampling` (an hcjax extra JetStream never passes) defaults to `default_sampling`.
        """
        weights, version = split_params(params)
        tokens, sampling = self._prompt(padded_tokens, true_length, existing_prefix, sampling)
        total = int(tokens.shape[0])
        chain = self._caches.lookup(tokens, version)
        done = self._caches.reused(chain)
        cache = self._caches.restore(chain) if chain else self._caches.empty()
        routings = [block.routing for block in chain]
        for start in range(done, total, self._max_prefill):
            n = min(self._max_prefill, total - start)
            chunk = np.zeros((self.prefill_bucket(n),), np.int32)
            chunk[:n] = tokens[start : start + n]
            cache, logits, routing = self._prefill_jit(
                weights, cache, chunk, np.int32(start), np.int32(n)
            )
            routings.append(np.asarray(routing)[:, :n])
        routing = np.concatenate(routings, axis=1)
        blocks = self._caches.store_blocks(cache, tokens, version, chain, routing)
        self._count_prefill(total, done)
        return Prefix(
            cache=self._caches.fold(cache, np.int32(total)),
            logits=logits,
            routing=routing,
            length=total,
            version=version,
            sampling=sampling,
            tokens=tuple(int(t) for t in tokens),
            blocks=blocks,
        )

    def prefill_bucket(self, n: int) -> int:
        """The compiled length of a prefill chunk of `n` tokens: a power of two, at least 8, at
        most max_prefill_length."""
        return min(next_pow2(max(n, 8)), self._max_prefill)

    def _prompt(self, padded_tokens, true_length, existing_prefix, sampling):
        """(the prompt's tokens, its sampling options) of a prefill, or a clear error."""
        tokens = np.asarray(padded_tokens, np.int32).reshape(-1)
        if not isinstance(true_length, int | np.integer) or not 0 < true_length <= tokens.shape[0]:
            raise ValueError(
                f"true_length={true_length!r} must be in [1, len(padded_tokens)={tokens.shape[0]}]"
            )
        tokens = tokens[:true_length]
        if existing_prefix is not None:
            if not isinstance(existing_prefix, Prefix):
                raise TypeError(f"existing_prefix must be a Prefix, got {type(existing_prefix)}")
            tokens = np.concatenate([np.asarray(existing_prefix.tokens, np.int32), tokens])
            sampling = sampling or existing_prefix.sampling
        total = int(tokens.shape[0])
        if total >= self._max_len:
            raise ValueError(
                f"prompt length {total} leaves no room in max_target_length={self._max_len}"
            )
        if self._vocab is not None and (int(tokens.max()) >= self._vocab or int(tokens.min()) < 0):
            bad = int(tokens.max()) if int(tokens.max()) >= self._vocab else int(tokens.min())
            raise ValueError(f"token id {bad} is not in [0, vocab_size={self._vocab})")
        if sampling is None:
            room = self._max_len - total
            sampling = dataclasses.replace(
                self._default_sampling, max_tokens=min(self._default_sampling.max_tokens, room)
            )
        return tokens, sampling

    def _count_prefill(self, total: int, done: int) -> None:
        with self._free_lock:
            self._stats["prompt_tokens"] += total
            self._stats["computed_tokens"] += total - done
            self._stats["reused_tokens"] += done
            self._stats["prefills"] += 1

    def bulk_prefill(
        self,
        *,
        params: Any,
        prompts: Sequence[Sequence[int] | np.ndarray],
        samplings: Sequence[SamplingOptions | None] | None = None,
    ) -> list[Prefix]:
        """Prefill several prompts in one device call (an hcjax extra): the Prefix of each is
        `prefill`'s for it alone (same cache entries, logits, routing; prefix reuse as there).

        The prompts' computed parts (past any prefix-cache hit) run as the rows of one batch,
        padded to the longest one's bucket (`prefill`'s powers of two up to max_prefill_length)
        and to a power-of-two number of rows, so at most log2(rows) x buckets programs compile.
        A prompt whose computed part is longer than max_prefill_length is prefilled in chunks
        alone (`prefill`). Raises ValueError naming the first bad prompt before running any.
        """
        if samplings is None:
            samplings = [None] * len(prompts)
        if len(samplings) != len(prompts):
            raise ValueError(f"{len(samplings)} sampling options for {len(prompts)} prompts")
        weights, version = split_params(params)
        checked = []
        for i, (prompt, sp) in enumerate(zip(prompts, samplings)):
            prompt = np.asarray(prompt, np.int32).reshape(-1)
            try:
                checked.append(self._prompt(prompt, int(prompt.shape[0]), None, sp))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        out: list[Prefix | None] = [None] * len(checked)
        rows = []  # (index, tokens, sampling, chain, done)
        for i, (tokens, sp) in enumerate(checked):
            chain = self._caches.lookup(tokens, version)
            done = self._caches.reused(chain)
            if tokens.shape[0] - done > self._max_prefill:
                out[i] = self.prefill(params=params, padded_tokens=tokens,
                                      true_length=int(tokens.shape[0]), sampling=sp)
            else:
                rows.append((i, tokens, sp, chain, done))
        if len(rows) == 1:
            i, tokens, sp, _, _ = rows[0]
            out[i] = self.prefill(params=params, padded_tokens=tokens,
                                  true_length=int(tokens.shape[0]), sampling=sp)
        elif rows:
            for i, prefix in zip([r[0] for r in rows], self._prefill_rows(weights, version, rows)):
                out[i] = prefix
        return out

    def _prefill_rows(self, weights, version, rows) -> list[Prefix]:
        """One batched chunk for rows of (index, tokens, sampling, prefix-cache chain, tokens
        reused), each computing at most max_prefill_length tokens."""
        b = next_pow2(len(rows))
        width = self.prefill_bucket(max(int(t.shape[0]) - done for _, t, _, _, done in rows))
        chunk = np.zeros((b, width), np.int32)
        starts = np.zeros((b,), np.int32)
        lengths = np.ones((b,), np.int32)  # padding rows: one token at position 0
        caches = []
        for r, (_, tokens, _, chain, done) in enumerate(rows):
            n = int(tokens.shape[0]) - done
            chunk[r, :n] = tokens[done:]
            starts[r], lengths[r] = done, n
            caches.append(self._caches.restore(chain) if chain else None)
        if any(c is not None for c in caches):
            empty = self._caches.empty()
            caches = [empty if c is None else c for c in caches]
            caches += [empty] * (b - len(rows))
            cache = self._caches.stack(caches)
        else:
            cache = self._caches.empty_rows(b)
        cache, logits, routing = self._prefill_rows_jit(weights, cache, chunk, starts, lengths)
        totals = np.ones((b,), np.int32)
        totals[: len(rows)] = [int(t.shape[0]) for _, t, _, _, _ in rows]
        split = self._caches.split_rows(cache, logits, totals)
        routing = np.asarray(routing)  # [b, L, width, k]
        out = []
        for r, (_, tokens, sp, chain, done) in enumerate(rows):
            total = int(tokens.shape[0])
            routed = np.concatenate([block.routing for block in chain]
                                    + [routing[r][:, : total - done]], axis=1)
            blocks = ()
            if self.prefix_cache is not None:
                blocks = self._caches.store_blocks(self._caches.row(cache, np.int32(r)), tokens,
                                                   version, chain, routed)
            self._count_prefill(total, done)
            out.append(Prefix(
                cache=split[r][0],
                logits=split[r][1],
                routing=routed,
                length=total,
                version=version,
                sampling=sp,
                tokens=tuple(int(t) for t in tokens),
                blocks=blocks,
            ))
        return out

    # Insert ----------------------------------------------------------------------------------
    def _insert_impl(self, state, cache, logits, version, length, slot, sample_index, seed,
                     temperature, top_p, remaining, stop_tokens, pages=()):
        """`cache` (a Prefix's) into `slot`; `pages`: what the layout's `admit` gave the slot."""
        def row(arr, value):
            return arr.at[slot].set(value)

        return DecodeState(
            cache=self._kv.put(state.cache, cache, slot, pages),
            logits=row(state.logits, logits),
            logits_version=row(state.logits_version, version),
            positions=row(state.positions, length),
            seeds=row(state.seeds, seed),
            sample_index=row(state.sample_index, sample_index),
            temperature=row(state.temperature, temperature),
            top_p=row(state.top_p, top_p),
            remaining=row(state.remaining, remaining),
            generated=row(state.generated, 0),
            stop_tokens=row(state.stop_tokens, stop_tokens),
            active=row(state.active, True),
        )

    def _bulk_insert_impl(self, state, cache, logits, version, length, slots, sample_indices,
                          count, seed, temperature, top_p, remaining, stop_tokens, pages=()):
        """`_insert_impl` for slots[:count] (one loop inside one call, in place); `pages`: the
        layout's per-slot arguments, row i for slots[i]."""
        def body(i, state):
            return self._insert_impl(state, cache, logits, version, length, slots[i],
                                     sample_indices[i], seed, temperature, top_p, remaining,
                                     stop_tokens, tuple(p[i] for p in pages))

        return jax.lax.fori_loop(0, count, body, state)

    def _check_insert(self, prefix: Prefix, slots: Sequence[int], max_tokens: int | None):
        """(token budget, stop-token row, seed) of inserting `prefix` into `slots`, or a clear
        error. A prefix whose options leave the seed to the server (None) draws with seed 0 here:
        the server always resolves it first, and JetStream passes no options at all."""
        if not isinstance(prefix, Prefix):
            raise TypeError(f"insert expects the Prefix that prefill returned, got {type(prefix)}")
        for slot in slots:
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
        return budget, stop, np.uint32(0 if sp.seed is None else sp.seed)

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

        `max_tokens` (an hcjax extra) overrides the sampling params' limit (partial-rollout
        budgets).
        """
        budget, stop, seed = self._check_insert(prefix, [slot], max_tokens)
        sp = prefix.sampling
        decode_state, pages = self._admit(decode_state, prefix, [slot], budget, width=1)
        return self._insert_jit(
            decode_state, prefix.cache, prefix.logits, np.int32(prefix.version),
            np.int32(prefix.length), np.int32(slot), np.int32(sample_index),
            seed, np.float32(sp.temperature), np.float32(sp.top_p),
            np.int32(budget), stop, tuple(p[0] for p in pages),
        )

    def _admit(self, state, prefix, slots, budget, width):
        """The KV layout's admission of `prefix` into `slots`: (state, its per-slot arguments
        of the insert, `width` rows)."""
        blocks = prefix.blocks if self.prefix_cache is not None else ()
        return self._kv.admit(state, slots, prefix.length, budget, blocks, width)

    def bulk_insert(
        self,
        prefix: Prefix,
        decode_state: DecodeState,
        slots: Sequence[int],
        *,
        sample_indices: Sequence[int] | None = None,
        max_tokens: int | None = None,
    ) -> DecodeState:
        """Insert one prefill into several slots: the n samples of a GRPO group share it. One
        device call whatever the number of slots (the same state as `insert` slot by slot)."""
        slots = [int(s) for s in slots]
        if sample_indices is None:
            sample_indices = range(len(slots))
        sample_indices = [int(i) for i in sample_indices]
        if len(sample_indices) != len(slots):
            raise ValueError(f"{len(sample_indices)} sample indices for {len(slots)} slots")
        if not slots:
            return decode_state
        if len(slots) > self._num_slots:
            raise ValueError(f"{len(slots)} slots exceed max_concurrent_decodes={self._num_slots}")
        budget, stop, seed = self._check_insert(prefix, slots, max_tokens)
        sp = prefix.sampling
        padded = np.zeros((2, self._num_slots), np.int32)  # one shape: compiled once
        padded[0, : len(slots)] = slots
        padded[1, : len(slots)] = sample_indices
        decode_state, pages = self._admit(decode_state, prefix, slots, budget,
                                          width=self._num_slots)
        return self._bulk_insert_jit(
            decode_state, prefix.cache, prefix.logits, np.int32(prefix.version),
            np.int32(prefix.length), padded[0], padded[1], np.int32(len(slots)),
            seed, np.float32(sp.temperature), np.float32(sp.top_p),
            np.int32(budget), stop, pages,
        )

    def _deactivate_impl(self, state, slot):
        return dataclasses.replace(state, active=state.active.at[slot].set(False))

    def deactivate(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Stop a slot before it finishes by itself (cancelled request)."""
        self._kv.deactivate(slot)  # a slot waiting for a page must not come back active
        return self._deactivate_jit(decode_state, np.int32(slot))

    # Generate --------------------------------------------------------------------------------
    def _generate_impl(self, params, state, version):
        keys = sampling_keys(state.seeds, state.sample_index, state.positions)
        # Idle rows draw greedily: their token is discarded, and a stale flat row must not send
        # the whole batch to the sampler's wider top-p levels.
        temperature = jnp.where(state.active, state.temperature, 0.0)
        drawn = sample(state.logits, keys, temperature, state.top_p)
        if self._exact:
            drawn = exact_logprobs(drawn, state.logits, temperature)
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
        step = valid.astype(jnp.int32)
        remaining = state.remaining - step
        generated = state.generated + step
        done = valid & (hit_stop | (remaining <= 0))
        data = jnp.stack([drawn.tokens.astype(jnp.int32), step, generated], axis=1)
        result = ResultTokens(
            data=data,
            tokens_idx=(0, 1),
            valid_idx=(1, 2),
            length_idx=(2, 3),
            samples_per_slot=1,
            logprobs=drawn.logprobs,
            raw_logprobs=drawn.raw_logprobs,
            n_kept=drawn.n_kept,
            threshold_logit=drawn.threshold_logit,
            routing=routing,
            positions=state.positions,
            versions=state.logits_version,
            done=done,
        )
        new_state = dataclasses.replace(
            state,
            cache=out.cache,
            # Every row's new logits, idle ones too: an idle row draws greedily and its token is
            # discarded, and `insert` rewrites its logits before it is active again, so keeping
            # its old logits bought nothing and cost a pass over [B, V] every step (64 slots,
            # one process: the greedy step 7.3 -> 5.6 ms at 32k ids, 22.3 -> 14.7 ms at 152k).
            logits=out.logits[:, 0].astype(jnp.float32),
            logits_version=jnp.where(valid, version, state.logits_version),
            positions=state.positions + step,
            remaining=remaining,
            generated=generated,
            active=valid & ~done,
        )
        return new_state, result

    def generate(self, params: Any, decode_state: DecodeState) -> tuple[DecodeState, ResultTokens]:
        """One decode step for every slot: sample from each row's logits, feed the token. Tokens
        are tagged with the version of `params` (a VersionedParams; bare params are version 0)."""
        weights, version = split_params(params)
        decode_state = self._kv.reserve(decode_state, 1)  # pages for the token it feeds
        return self._generate_jit(weights, decode_state, np.int32(version))

    def _block_impl(self, treedef, leaves, state, version, max_steps, steps):
        params = jax.tree.unflatten(treedef, leaves)
        def zeros(x):
            return jnp.zeros((max_steps, *x.shape), x.dtype)

        def record(r: ResultTokens) -> dict:
            return dict(tokens=r.data[:, 0], valid=r.data[:, 1] != 0, lengths=r.data[:, 2],
                        logprobs=r.logprobs, raw_logprobs=r.raw_logprobs, n_kept=r.n_kept,
                        threshold_logit=r.threshold_logit, routing=r.routing,
                        positions=r.positions, versions=r.versions, done=r.done)

        def body(i, carry):
            st, buf = carry
            st, r = self._generate_impl(params, st, version)
            buf = jax.tree.map(lambda a, x: jax.lax.dynamic_update_index_in_dim(a, x, i, 0),
                               buf, record(r))
            return st, buf

        shapes = jax.eval_shape(lambda: record(self._generate_impl(params, state, version)[1]))
        buf = jax.tree.map(zeros, shapes)
        state, buf = jax.lax.fori_loop(0, steps, body, (state, buf))
        return state, ResultBlock(**buf, steps=steps)

    def flatten_params(self, params: Any, version: int | None = None) -> FlatParams:
        """`params` (bare, VersionedParams or FlatParams) flattened once for `generate_block`;
        `version` overrides theirs."""
        if isinstance(params, FlatParams):
            return params if version is None else dataclasses.replace(params, version=version)
        weights, v = split_params(params)
        leaves, treedef = jax.tree.flatten(weights)
        return FlatParams(tuple(leaves), treedef, v if version is None else int(version))

    def generate_block(self, params: Any, decode_state: DecodeState, steps: int, *,
                       max_steps: int | None = None) -> tuple[DecodeState, ResultBlock]:
        """`steps` decode steps in one device call (an hcjax extra; JetStream calls `generate`):
        each step is `generate`'s, stop tokens, token limits and done flags evaluated per slot
        on the device, so a slot that ends mid-block stays idle to its end, and the block's
        records come back as [max_steps, slots] arrays, row i equal to the i-th of `steps` calls
        of `generate`. One program per `max_steps` (default `steps`): any `steps` in
        [1, max_steps] runs it, the rows from `steps` on are invalid. `params`: a FlatParams
        (`flatten_params`, flattened once per weight version), a VersionedParams or bare."""
        max_steps = steps if max_steps is None else max_steps
        if not isinstance(max_steps, int | np.integer) or max_steps <= 0:
            raise ValueError(f"max_steps={max_steps!r} must be a positive integer")
        if not isinstance(steps, int | np.integer) or not 1 <= steps <= max_steps:
            raise ValueError(f"steps={steps!r} must be in [1, max_steps={max_steps}]")
        flat = self.flatten_params(params)
        # Paged layout: every occupied slot gets the pages its next `steps` tokens write before
        # the block runs (a slot refused one waits paused, as under `generate`).
        decode_state = self._kv.reserve(decode_state, int(steps))
        return self._block_jit(flat.treedef, list(flat.leaves), decode_state,
                               np.int32(flat.version), int(max_steps), np.int32(steps))


def _stack_routing(routing: tuple, b: int, t: int) -> jax.Array:
    """[B, T, L, k] from the model's per-MoE-layer tuple (L may be 0)."""
    if not routing:
        return jnp.zeros((b, t, 0, 0), jnp.int32)
    return jnp.stack([r.astype(jnp.int32) for r in routing], axis=2)


def register_with_jetstream() -> bool:
    """Register Engine and ResultTokens as virtual subclasses of JetStream's abstract Engine and
    ResultTokens (its orchestrator tells results from requests with isinstance). Returns False
    when jetstream (or an import of it, e.g. seqio) is missing; hcjax works without it."""
    try:
        # optional: jetstream (requirements-jetstream.txt); hcjax runs without it
        from jetstream.engine import engine_api
    except ImportError:
        return False
    engine_api.Engine.register(Engine)
    engine_api.ResultTokens.register(ResultTokens)
    return True


register_with_jetstream()

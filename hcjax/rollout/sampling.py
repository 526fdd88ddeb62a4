"""Token sampling with the RL extras the learner needs: temperature, top-p with a kept-set record,
sampling and raw log-probs, and per-request keys that do not depend on slot placement.

Pure jnp functions of arrays, meant to run inside the engine's jitted step; no model code here.
Top-p avoids sorting the vocabulary: the nucleus is found among the top-k logits, and only a batch
with a row whose nucleus lies outside them sorts. `sample_reference` is the one-sort version that
tests and benchmarks compare against.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p

__all__ = ["DEFAULT_CANDIDATES", "SampleOutput", "sample", "sample_reference", "sampling_keys"]

# Candidate-set sizes tried before a full sort: a confident row's nucleus fits in 64 tokens, a
# flatter one usually in 1024, nearly any in 16384; `lax.top_k` of 16384 costs a sixth of a sort
# of 150k on CPU (bench.rollout --only sampling).
DEFAULT_CANDIDATES = (64, 1024, 16384)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """Per row: the drawn token and what the learner needs to recompute its distribution.

    `n_kept` and `threshold_logit` form the top-p support record (hcjax.rollout.records): the kept set
    is the n_kept tokens with the largest temperature-scaled logit, ties broken by lower token id,
    and `threshold_logit` is the temperature-scaled logit of the last kept token.
    """

    tokens: jax.Array  # [B] int32
    logprobs: jax.Array  # [B] f32, under the truncated, renormalised sampling distribution
    raw_logprobs: jax.Array  # [B] f32, log_softmax of the model's logits (temperature 1)
    n_kept: jax.Array  # [B] int32
    threshold_logit: jax.Array  # [B] f32


def sampling_keys(seeds: jax.Array, sample_index: jax.Array, positions: jax.Array) -> jax.Array:
    """One PRNG key per row from (seed, sample index, absolute position), all [B] integers.

    Folding in the position instead of splitting a running key makes a draw independent of which
    slot serves the request and of when it was scheduled, so a partial rollout resumed later
    draws exactly what an uninterrupted one would have.
    """

    def one(seed, index, pos):
        key = jax.random.key(seed.astype(jnp.uint32))
        return jax.random.fold_in(jax.random.fold_in(key, index), pos)

    return jax.vmap(one)(seeds, sample_index, positions)


def _prepare(logits_bv, keys, temperature, top_p):
    logits = logits_bv.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    top_p = jnp.asarray(top_p, jnp.float32)
    greedy = temperature <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    # -0.0 -> +0.0: a sort orders -0.0 below +0.0, while top_k and the learner's record replay
    # (hcjax.rollout.records) compare them equal and rank the lower id first.
    scaled = jnp.where(scaled == 0.0, 0.0, scaled)
    lse = jax.nn.logsumexp(scaled, axis=-1)  # normaliser over the FULL vocabulary
    lse_raw = jax.nn.logsumexp(logits, axis=-1)
    # Two words per row for the counter-mode noise below (any key implementation gives bits).
    keypair = jax.vmap(lambda k: jax.random.bits(k, (2,), jnp.uint32))(keys)
    return logits, scaled, greedy, top_p, lse, lse_raw, keypair


def _gumbel_at(keypair_b2: jax.Array, ids_bm: jax.Array) -> jax.Array:
    """f32[B, M] standard Gumbel noise indexed by token id: a threefry hash of (row key, id).

    Noise that belongs to a token rather than to a position in an array lets a draw over 64
    candidates, over 1024, over the sorted vocabulary and over the unsorted one all see the same
    numbers, hence draw the same token. Gumbel-max over the kept set (argmax of logit + noise) is
    an exact draw from the renormalised truncated softmax. One hash gives two words: ids 2i and
    2i + 1 share one.
    """
    ids = ids_bm.astype(jnp.uint32)
    y0, y1 = _hash_pairs(keypair_b2, ids >> 1)
    return _bits_to_gumbel(jnp.where((ids & 1) == 1, y1, y0))


def _gumbel_all(keypair_b2: jax.Array, vocab: int) -> jax.Array:
    """f32[B, vocab]: `_gumbel_at` for every id in order, one hash per two ids."""
    pairs = jnp.arange((vocab + 1) // 2, dtype=jnp.uint32)[None, :]
    y0, y1 = _hash_pairs(keypair_b2, pairs)
    bits = jnp.stack([y0, y1], axis=-1).reshape(keypair_b2.shape[0], -1)[:, :vocab]
    return _bits_to_gumbel(bits)


def _hash_pairs(keypair_b2, pairs):
    k0, k1, x0 = jnp.broadcast_arrays(keypair_b2[:, :1], keypair_b2[:, 1:], pairs)
    return threefry2x32_p.bind(k0, k1, x0, jnp.zeros_like(x0))


def _bits_to_gumbel(bits):
    # 23 random mantissa bits -> uniform in [0, 1), kept away from 0 so the log stays finite.
    u = jax.lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0
    u = jnp.maximum(u, jnp.finfo(jnp.float32).tiny)
    return -jnp.log(-jnp.log(u))


def _argmax_lowest_id(z_bm: jax.Array, ids_bm: jax.Array) -> jax.Array:
    """Per row, the id of the largest z; ties go to the lower id whatever the array order."""
    top = jnp.max(z_bm, axis=-1, keepdims=True)
    big = jnp.iinfo(jnp.int32).max
    return jnp.min(jnp.where(z_bm == top, ids_bm, big), axis=-1).astype(jnp.int32)


def _row_blocks(x_bv: jax.Array, block: int) -> jax.Array:
    """[B, ceil(V / block), block]: each row cut into blocks of consecutive ids, the last one
    padded with -inf (never a maximum unless the whole block is)."""
    b, v = x_bv.shape
    return jnp.pad(x_bv, ((0, 0), (0, -v % block)), constant_values=-jnp.inf).reshape(b, -1, block)


def _first_argmax(x_bv: jax.Array, block: int = 128) -> jax.Array:
    """int32[B]: `jnp.argmax` over the last axis (the first maximum, NaN counting as largest) by
    blocks: each block's maximum, the first block holding the row's maximum, then the first
    maximum inside it. Two plain reductions instead of XLA:CPU's variadic argmax reduction,
    which costs 15x more at 32k-150k vocabularies."""
    if x_bv.shape[-1] <= block:
        return jnp.argmax(x_bv, axis=-1).astype(jnp.int32)
    blocks = _row_blocks(x_bv, block)
    which = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
    inner = jnp.take_along_axis(blocks, which[:, None, None], axis=1)[:, 0]
    return (which * block + jnp.argmax(inner, axis=-1)).astype(jnp.int32)


def _at(x_bv: jax.Array, index_b: jax.Array) -> jax.Array:
    return jnp.take_along_axis(x_bv, index_b[:, None], axis=-1)[:, 0]


def _level_sizes(candidates: tuple[int, ...], vocab: int) -> tuple[int, ...]:
    """Increasing candidate-set sizes clipped to the vocabulary; the last is the vocabulary."""
    if not candidates or any(int(c) < 1 for c in candidates):
        raise ValueError(f"candidates={candidates!r} must be positive candidate-set sizes")
    return tuple(sorted({min(int(c), vocab) for c in candidates} | {vocab}))


def _ranked(scaled_bv: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """The m largest scaled logits per row in rank order (ties: lower id first), and their ids.

    `lax.top_k` breaks ties by lower index (tested), and so does its blocked form
    (`_blocked_top_k`, for m small against the vocabulary); the full-vocabulary case keeps the
    stable sort of the negated logits.
    """
    vocab = scaled_bv.shape[-1]
    if m * _PRESELECT_BLOCK * 2 <= vocab:
        return _blocked_top_k(scaled_bv, m)
    if m < vocab:
        vals, ids = jax.lax.top_k(scaled_bv, m)
        return vals, ids.astype(jnp.int32)
    order = jnp.argsort(-scaled_bv, axis=-1, stable=True).astype(jnp.int32)
    return jnp.take_along_axis(scaled_bv, order, axis=-1), order


_PRESELECT_BLOCK = 128


def _blocked_top_k(x_bv: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(x_bv, m)` (ties: lower id first) by way of the m blocks of 128 ids with the
    largest maxima: every one of the m largest entries lies in one of them. Among blocks whose
    maximum ties the m-th largest block maximum, top_k keeps the lower block ids, whose tied
    entries have the lower ids, and the kept blocks are gathered in id order, so the final top_k
    over their m * 128 entries breaks ties exactly as one over the whole row. At a 32k vocabulary
    and m = 64 it reads the row once for the maxima and ranks 8192 entries instead of 32000."""
    b, block = x_bv.shape[0], _PRESELECT_BLOCK
    blocks = _row_blocks(x_bv, block)
    _, chosen = jax.lax.top_k(jnp.max(blocks, axis=-1), m)
    chosen = jnp.sort(chosen, axis=-1)  # id order, for the tie-break
    cand = jnp.take_along_axis(blocks, chosen[:, :, None], axis=1).reshape(b, m * block)
    ids = (chosen[:, :, None] * block + jnp.arange(block)[None, None, :]).reshape(b, m * block)
    vals, pos = jax.lax.top_k(cand, m)
    return vals, jnp.take_along_axis(ids, pos, axis=-1).astype(jnp.int32)


def _blocked_cumsum(p_bm: jax.Array, bounds: tuple[int, ...]) -> jax.Array:
    """Cumulative sum along ranks that restarts its arithmetic at each bound (carrying the total).

    A prefix sum's rounding depends on how the backend groups the additions, which can depend on
    the array length; summing ranks [0, 64) as their own array makes the masses seen by the
    64-candidate level and by the full sort the same floats, so both keep the same tokens.
    """
    edges = [0, *[b for b in bounds if b < p_bm.shape[-1]], p_bm.shape[-1]]
    parts, carry = [], None
    for lo, hi in zip(edges[:-1], edges[1:]):
        c = jnp.cumsum(p_bm[:, lo:hi], axis=-1)
        c = c if carry is None else c + carry[:, None]
        parts.append(c)
        carry = c[:, -1]
    return jnp.concatenate(parts, axis=-1)


def _nucleus(vals_bm, lse_b, top_p_b, bounds, vocab):
    """(n_kept, complete, cumulative mass by rank) from the m top-ranked scaled logits.

    Keep the smallest prefix whose mass reaches top_p: rank r is kept while the mass of the ranks
    above it is still below top_p (at least one is kept). Masses are normalised over the whole
    vocabulary (lse_b), so the answer is final once the candidates' own mass reaches top_p.
    """
    m = vals_bm.shape[-1]
    cum = _blocked_cumsum(jnp.exp(vals_bm - lse_b[:, None]), bounds)
    mass_before = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum[:, :-1]], axis=-1)
    n_kept = jnp.maximum(jnp.sum(mass_before < top_p_b[:, None], axis=-1), 1).astype(jnp.int32)
    complete = jnp.full_like(top_p_b, True, dtype=bool) if m == vocab else cum[:, -1] >= top_p_b
    return n_kept, complete, cum


def _finish(vals_bm, ids_bm, n_kept_b, cum_bm, lse_b, keypair_b2, vocab):
    """(token, n_kept, threshold logit, log-normaliser of the kept set) given the kept count."""
    kept = jnp.arange(vals_bm.shape[-1]) < n_kept_b[:, None]
    z = jnp.where(kept, vals_bm + _gumbel_at(keypair_b2, ids_bm), -jnp.inf)
    token = _argmax_lowest_id(z, ids_bm)
    threshold = _at(vals_bm, n_kept_b - 1)
    # The kept set's normaliser from its mass (an element of the blocked prefix sum) rather than a
    # fresh logsumexp: a reduction's rounding can depend on how many rows are reduced together,
    # and a row's log-prob must not depend on which other rows needed the same level.
    lse_kept = jnp.where(n_kept_b >= vocab, lse_b, lse_b + jnp.log(_at(cum_bm, n_kept_b - 1)))
    return token, n_kept_b, threshold, lse_kept


def _first_rows(mask_b: jax.Array, n: int) -> jax.Array:
    """int32[n]: the indices of the first n True entries, padded with B (out of range)."""
    return jnp.nonzero(mask_b, size=n, fill_value=mask_b.shape[0])[0].astype(jnp.int32)


def _select(mask_b, new, old):
    return jax.tree.map(lambda a, b: jnp.where(mask_b, a, b), new, old)


def _output(state, logits, scaled, greedy, lse_raw) -> SampleOutput:
    token, n_kept, threshold, lse_kept = state
    logprob = jnp.where(greedy, 0.0, _at(scaled, token) - lse_kept)
    raw_logprob = _at(logits, token) - lse_raw
    return SampleOutput(token, logprob, raw_logprob, n_kept, threshold)


def sample(
    logits_bv: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    candidates: tuple[int, ...] = DEFAULT_CANDIDATES,
) -> SampleOutput:
    """Draw one token per row of `logits_bv` [B, V] with per-row temperature and top_p [B].

    temperature 0 means greedy (argmax, lowest id among ties; kept set of one, log-prob 0).
    top_p >= 1 keeps the whole vocabulary. Otherwise the nucleus is searched among the
    `candidates[0]` largest logits (`lax.top_k`, no sort of the vocabulary), then among
    `candidates[1]`, ..., and only a batch holding a row whose nucleus is still incomplete pays
    for a full sort. Every level gives bit-identical results to `sample_reference`.
    """
    logits, scaled, greedy, top_p, lse, lse_raw, keypair = _prepare(
        logits_bv, keys, temperature, top_p)
    b, vocab = logits.shape
    sizes = _level_sizes(candidates, vocab)

    # Greedy for every row first (cheap); the other rows overwrite it below.
    token = _first_argmax(logits)  # first maximum: lowest id
    state = (token, jnp.ones((b,), jnp.int32), _at(logits, token), lse)

    # top_p >= 1: the kept set is the vocabulary, so the draw needs no ranks at all.
    whole = ~greedy & (top_p >= 1.0)

    def keep_all(state):
        tok = _first_argmax(scaled + _gumbel_all(keypair, vocab))  # ids in order: lowest id
        found = (tok, jnp.full((b,), vocab, jnp.int32), jnp.min(scaled, axis=-1), lse)
        return _select(whole, found, state)

    state = jax.lax.cond(jnp.any(whole), keep_all, lambda s: s, state)

    # top_p < 1: widen the candidate set level by level while some row's nucleus is incomplete.
    # After the first level only a few rows are usually left: they are gathered into a batch of
    # 1 or of b/16 rows, so that one flat row does not make every row pay for a wide top-k or a
    # sort. Each row's arithmetic is the same whichever batch it is in (see `_finish`).
    pending = ~greedy & (top_p < 1.0)
    buckets = sorted({1, max(1, b // 16)})

    for level, m in enumerate(sizes):
        bounds = sizes[:level]

        def search(state, pending, rows, m=m, bounds=bounds):
            """Run this level on `rows` [R] (b marks an unused entry; None: every row, with no
            gather) and write back the rows whose nucleus it completes."""
            def sub(x):
                return x if rows is None else jnp.take(x, rows, axis=0, mode="clip")

            vals, ids = _ranked(sub(scaled), m)
            n_kept, complete, cum = _nucleus(vals, sub(lse), sub(top_p), bounds, vocab)
            found = _finish(vals, ids, n_kept, cum, sub(lse), sub(keypair), vocab)
            done = sub(pending) & complete
            if rows is None:
                return _select(done, found, state), pending & ~complete
            state = jax.tree.map(
                lambda old, new: old.at[rows].set(jnp.where(done, new, sub(old)), mode="drop"),
                state, found)
            return state, pending.at[rows].set(sub(pending) & ~complete, mode="drop")

        gathered = buckets if level > 0 else []  # the first level runs on every row anyway
        branches = [lambda s, p: (s, p)]
        branches += [lambda s, p, search=search, n=n: search(s, p, _first_rows(p, n))
                     for n in gathered]
        branches += [lambda s, p, search=search: search(s, p, None)]
        count = jnp.sum(pending)
        # 0: nothing pending; then the smallest bucket that holds the pending rows; else all rows.
        which = jnp.where(count == 0, 0, len(branches) - 1)
        for i, n in reversed(list(enumerate(gathered))):
            which = jnp.where((count > 0) & (count <= n), i + 1, which)
        state, pending = jax.lax.switch(which, branches, state, pending)
    return _output(state, logits, scaled, greedy, lse_raw)


def sample_reference(
    logits_bv: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    candidates: tuple[int, ...] = DEFAULT_CANDIDATES,
) -> SampleOutput:
    """`sample` by one stable sort of the whole vocabulary per row, for tests and benchmarks.

    Same kept set, draw and arithmetic as `sample`; `candidates` only sets where the prefix
    sums restart (see `_blocked_cumsum`), so that the two agree to the bit.
    """
    logits, scaled, greedy, top_p, lse, lse_raw, keypair = _prepare(
        logits_bv, keys, temperature, top_p)
    vocab = logits.shape[-1]
    bounds = _level_sizes(candidates, vocab)[:-1]
    vals, ids = _ranked(scaled, vocab)
    n_kept, _, cum = _nucleus(vals, lse, top_p, bounds, vocab)
    n_kept = jnp.where(greedy, 1, jnp.where(top_p >= 1.0, vocab, n_kept))
    state = _finish(vals, ids, n_kept, cum, lse, keypair, vocab)
    return _output(state, logits, scaled, greedy, lse_raw)

"""Token sampling with the RL extras the learner needs: temperature, top-p with a kept-set record,
sampling and raw log-probs, and per-request keys that do not depend on slot placement.

Pure jnp functions of arrays, meant to run inside the engine's jitted step; no model code here.
Top-p never sorts a large vocabulary: the nucleus is found among the top-k logits, and a row whose
nucleus lies outside them finds its threshold from two mass histograms over the logits' order keys.
Masses are fixed-point integers, so every way of adding them up (a prefix sum in rank order, a
masked sum in id order) gives the same number and every path keeps the same tokens.
`sample_reference` is the one-sort version that tests and benchmarks compare against.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from hcjax.rollout.gumbel import BLOCK_STREAM, gumbel_at, gumbel_range
from hcjax.rollout.records import order_keys, support_mask_at_threshold
from pallas_kernels import backend
from pallas_kernels import batch_invariant as bi

__all__ = ["DEFAULT_CANDIDATES", "SAMPLER_TUNING", "SORT_UP_TO", "SampleOutput", "sample",
           "sample_reference", "sampling_keys", "searched_rows"]

# The sampler's speed knobs, chosen by the platform it is compiled for (`SAMPLER_TUNING`). Every
# setting draws bit-identical tokens (`sample_reference`); they trade speed only.
# Candidate-set sizes tried before the threshold search. `lax.top_k`'s cost on CPU grows with k:
# 32 candidates instead of 64 took the top-p draw of 64 rows from 3.0 to 2.3 ms at a 32k
# vocabulary (greedy 0.75 ms; 40 interleaved rounds, bench.rollout's peaked logits, whose
# confident nuclei hold at most 20 tokens), neutral at 152k. A row whose nucleus is wider goes to
# the threshold search, about a millisecond a row at a 152k vocabulary on CPU (a 26th of a sort,
# a fifth of `lax.top_k` of 16384), so no wider level pays for itself.
DEFAULT_CANDIDATES = (32,)
# Up to this vocabulary the last level sorts the row instead of searching it: a sort of a few
# hundred ids costs less than the search's two 65536-bin histograms, which do not shrink with it
# (at 272 ids the search's branches alone added 0.15 ms to a 0.15 ms greedy draw of 64 rows).
SORT_UP_TO = 4096
# (candidates, sort_up_to) by platform. Both were measured on CPU (above); GPU and TPU have not
# been measured and run the CPU values until `python -m hcjax.bench.rollout` runs there.
SAMPLER_TUNING: dict[str, tuple[tuple[int, ...], int]] = {
    "cpu": (DEFAULT_CANDIDATES, SORT_UP_TO),
    "gpu": (DEFAULT_CANDIDATES, SORT_UP_TO),
    "tpu": (DEFAULT_CANDIDATES, SORT_UP_TO),
}

# Probability 1 in the fixed-point masses. A token's mass is round(p * 2^30) (int32); the
# vocabulary's total stays below 2^31 for any vocabulary under 2^31 tokens, and the rounding
# errors, each under 2^-31, are independent, so a kept set's mass is off by about
# sqrt(n_kept) * 2^-32, well under float32's resolution for any nucleus a decode keeps.
_MASS_ONE = 2**30


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


def _prepare(logits_bv, keys, temperature, top_p, divide: bool = True, rank=None):
    """The per-row inputs. `divide=False` asserts every row's temperature is 0 (greedy) or 1, so
    the scaled logits are the logits themselves: no [B, V] copy is written (at a 152k vocabulary
    and 64 rows that copy took longer than the rest of a greedy draw) and one log-normaliser
    serves both. Signed zeros are left as they are: the threshold search's order keys and the
    reference's sort fold -0.0 into +0.0 themselves, and `_output` folds the threshold.

    `rank(scaled, block_max)`, if given, is the first top-p level's ranking of every row,
    returned last (zeros when no row has top_p < 1). It needs no normaliser, so it is computed in
    one conditional with the log-sum-exp passes and the greedy argmax, and XLA:CPU can run them
    side by side (the ranking is mostly sequential `lax.top_k` calls); a conditional of its own
    ran before or after them. At 64 x 32k ids (300 rounds in random order) the top-p draw took
    2.06 instead of 2.38 ms, a greedy one 1.17 instead of 1.15 ms. Inside the engine's decode
    step the executor does not always overlap them, and the gain there was within noise."""
    logits = logits_bv.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    top_p = jnp.asarray(top_p, jnp.float32)
    greedy = temperature <= 0.0
    # One pass over the row for its 16-id block maxima; the row maximum, the greedy argmax and
    # the first top-p level all start from them.
    # (The barrier keeps XLA from turning the maximum of the maxima back into a second pass.)
    block_max = jax.lax.optimization_barrier(_block_maxima(logits))
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None] if divide else logits

    def independent():
        """What needs only the block maxima: the normalisers and the greedy token."""
        lse_raw = _logsumexp(logits, jnp.max(block_max, axis=-1))
        # The scaled rows' normaliser over the FULL vocabulary.
        lse = jax.nn.logsumexp(scaled, axis=-1) if divide else lse_raw
        # The first maximum (lowest id), only if some row is greedy: a batch of top-p rows does
        # not need it (0.13 ms of a 64 x 32k draw, ~0.7 ms at 152k); the others' placeholder is
        # overwritten.
        token = jax.lax.cond(jnp.any(greedy), lambda: _first_argmax(logits, block_max),
                             lambda: jnp.zeros(logits.shape[:1], jnp.int32))
        return lse, lse_raw, token

    ranked = None
    if rank is None:
        lse, lse_raw, token = independent()
    else:
        def with_ranking():
            return independent(), rank(scaled, block_max)

        def without():
            shapes = jax.eval_shape(with_ranking)[1]
            return independent(), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        (lse, lse_raw, token), ranked = jax.lax.cond(jnp.any(~greedy & (top_p < 1.0)),
                                                     with_ranking, without)
    # Two words per row for the counter-mode noise (gumbel.py; any key implementation gives bits).
    keypair = jax.vmap(lambda k: jax.random.bits(k, (2,), jnp.uint32))(keys)
    return logits, scaled, greedy, top_p, lse, lse_raw, keypair, block_max, token, ranked


def _logsumexp(x_bv, max_b):
    """`jax.nn.logsumexp(x, axis=-1)` given the rows' maxima (the same arithmetic: an infinite or
    NaN maximum is replaced by 0 before the shift)."""
    shift = jnp.where(jnp.isfinite(max_b), max_b, 0.0)
    return jnp.log(jnp.sum(jnp.exp(x_bv - shift[:, None]), axis=-1)) + shift


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


# Ids per block of the row maxima every draw starts from (`_block_maxima`), and blocks of them per
# group in `_first_argmax`.
_BLOCK = 16
_GROUP = 8


def _block_maxima(x_bv: jax.Array) -> jax.Array:
    """f32[B, ceil(V / 16)]: the maximum of each block of 16 consecutive ids, -0.0 given as +0.0
    (the two tie in the kept-set order, as in the reference's sort; `lax.top_k` would rank +0.0
    first)."""
    block_max = jnp.max(_row_blocks(x_bv, _BLOCK), axis=-1)
    return jnp.where(block_max == 0.0, 0.0, block_max)


def _first_argmax(x_bv: jax.Array, block_max: jax.Array | None = None) -> jax.Array:
    """int32[B]: `jnp.argmax` over the last axis (the first maximum) by blocks: the 16-id block maxima (`_block_maxima`, given or computed), their maxima by groups
    of 8 blocks, the first group holding the row's maximum, the first block in it that does,
    then the first maximum inside that block. Plain reductions instead of XLA:CPU's variadic
    argmax reduction over the row, which costs 15x more at 32k-150k vocabularies. A NaN is not
    found as jnp.argmax finds it: XLA:CPU's max reductions pass over NaNs (logits with NaNs are a
    broken model; the draw then returns some id, not an error)."""
    if x_bv.shape[-1] <= _BLOCK * _GROUP:
        return jnp.argmax(x_bv, axis=-1).astype(jnp.int32)
    if block_max is None:
        block_max = _block_maxima(x_bv)
    block = _first_block(block_max)
    inner = _at_row(_row_blocks(x_bv, _BLOCK), block)
    return (block * _BLOCK + jnp.argmax(inner, axis=-1)).astype(jnp.int32)


def _first_block(block_max: jax.Array) -> jax.Array:
    """int32[B]: the first block holding the row's maximum, from the blocks' maxima by groups of
    8 (`_first_argmax`'s first two steps)."""
    groups = _row_blocks(block_max, _GROUP)
    group = jnp.argmax(jnp.max(groups, axis=-1), axis=-1)
    return (group * _GROUP + jnp.argmax(_at_row(groups, group), axis=-1)).astype(jnp.int32)


def _at_row(blocks_bnk: jax.Array, index_b: jax.Array) -> jax.Array:
    """[B, K]: block index_b[b] of each row's [N, K] blocks."""
    return jnp.take_along_axis(blocks_bnk, index_b[:, None, None], axis=1)[:, 0]


def _at_rows(blocks_bnk: jax.Array, index_bm: jax.Array) -> jax.Array:
    """[B, M, K]: blocks index_bm[b, :] of each row's [N, K] blocks."""
    return jnp.take_along_axis(blocks_bnk, index_bm[:, :, None], axis=1)


def _at(x_bv: jax.Array, index_b: jax.Array) -> jax.Array:
    return jnp.take_along_axis(x_bv, index_b[:, None], axis=-1)[:, 0]


def _level_sizes(candidates: tuple[int, ...], vocab: int) -> tuple[int, ...]:
    """Increasing candidate-set sizes below the vocabulary (the threshold search covers the rest)."""
    if not candidates or any(int(c) < 1 for c in candidates):
        raise ValueError(f"candidates={candidates!r} must be positive candidate-set sizes")
    return tuple(sorted({int(c) for c in candidates if int(c) < vocab}))


def _ranked(scaled_bv: jax.Array, m: int, block_max=None):
    """(vals, ids, bound, lanes): the m largest scaled logits per row in rank order (ties: lower
    id first, -0.0 and +0.0 one value), and their ids, exact for the ranks before `bound`;
    `lanes` [B, m, 16], the blocked form's 16-id block of each (see `_blocked_top_k`), else None.

    `bound` (key, id) [B] each: ranks whose token ranks before it (`_ranks_before`) are exact.
    Only the blocked form (`_blocked_top_k`, for m small against the vocabulary) sets one; the
    others (`lax.top_k` over the row, which breaks ties by lower index (tested), or the stable
    sort for the whole vocabulary) rank every token, so their bound ranks after every token.
    """
    vocab = scaled_bv.shape[-1]
    if m * _BLOCK * 2 <= vocab:
        return _blocked_top_k(scaled_bv, m, block_max)
    b = scaled_bv.shape[0]
    scaled_bv = jnp.where(scaled_bv == 0.0, 0.0, scaled_bv)
    after_all = (jnp.zeros((b,), jnp.uint32), jnp.full((b,), jnp.iinfo(jnp.int32).max, jnp.int32))
    if m < vocab:
        vals, ids = jax.lax.top_k(scaled_bv, m)
        return vals, ids.astype(jnp.int32), after_all, None
    order = jnp.argsort(-scaled_bv, axis=-1, stable=True).astype(jnp.int32)
    return jnp.take_along_axis(scaled_bv, order, axis=-1), order, after_all, None


def _ranks_before(key_a, id_a, key_b, id_b):
    """Whether token a (order key, id) ranks before token b: a larger key, or the same at a lower
    id."""
    return (key_a > key_b) | ((key_a == key_b) & (id_a < id_b))


def _blocked_top_k(x_bv: jax.Array, m: int, block_max=None):
    """`_ranked` for m small against the vocabulary, with few `lax.top_k` elements (XLA:CPU's
    top_k is a scalar loop, about 10 ns an element): the m blocks of 16 ids with the largest
    maxima, or with many blocks the two largest blocks of each of the m groups of 8 blocks with
    the largest maxima; then the two largest entries of each chosen block (2m or 4m candidates,
    in id order, so top_k's ties go to the lower id), ranked by one top_k.

    Every entry ranking before the m-th candidate lies in a chosen block (m blocks' first maxima,
    or m groups' first maxima, all candidates, rank before any entry of another block or group),
    so a token ranking before a returned one and not among the candidates is a third entry of a
    chosen block, or lies in a chosen group's other blocks. `bound` is the highest-ranked of those
    (a block counted by its maximum at its first id, at or before its first maximum), and the
    ranks before it are exact. Two top tokens in one block are common (a 32-token head among
    2000 blocks), three rare: on bench.rollout's peaked rows at 32k and 152k ids no row's
    nucleus reached its bound. At a 32k vocabulary (m = 32) top_k reads 250 + 128 entries a row
    where ranking the chosen blocks' maxima and then their 512 entries read 250 + 256 + 512.
    `block_max`: the row's `_block_maxima`, if already computed.

    Also returns the 16 entries of each returned candidate's block ([B, m, 16], -inf past the
    vocabulary), taken from the chosen blocks already read: the draw (`_draw_among`) needs them
    and would otherwise gather them from the rows a second time."""
    b = x_bv.shape[0]
    blocks = _row_blocks(x_bv, _BLOCK)
    if block_max is None:
        block_max = _block_maxima(x_bv)
    n = block_max.shape[-1]
    if n < 4 * _GROUP * m:
        chosen = _top_indices(block_max, m)
        bound = None
        padding_chosen = False  # every chosen block is a real one
    else:
        groups = _row_blocks(block_max, _GROUP)  # padded with -inf: never chosen over a block
        picked = _top_indices(jnp.max(groups, axis=-1), m)
        (_, pos), bound = _two_largest(order_keys(_at_rows(groups, picked)))
        chosen = (picked[:, :, None] * _GROUP + pos).reshape(b, -1)
        bound = (bound[0], (picked * _GROUP + bound[1]) * _BLOCK)  # the block's first id
        bound = _earliest(*bound)
        padding_chosen = n % _GROUP != 0  # the last group's padding blocks may be chosen
    # A padding block (past the last real one, in its group) reads as -inf at ids past the
    # vocabulary: ranked after every real token. Without padding blocks every index is in
    # bounds, and the gather needs no check (0.06 -> 0.024 ms at 64 x 152k ids).
    if padding_chosen:
        lanes = jnp.take_along_axis(blocks, chosen[:, :, None], axis=1, mode="fill",
                                    fill_value=-jnp.inf)
    else:
        lanes = jnp.take_along_axis(blocks, chosen[:, :, None], axis=1, mode="promise_in_bounds")
    (keys, pos), (rest_key, rest_pos) = _two_largest(order_keys(lanes))
    lane_bound = _earliest(rest_key, chosen * _BLOCK + rest_pos)
    bound = lane_bound if bound is None else _earlier(lane_bound, bound)
    cand_ids = (chosen[:, :, None] * _BLOCK + pos).reshape(b, -1)
    vals, at = jax.lax.top_k(_key_value(keys).reshape(b, -1), m)
    # Candidate c is entry c % 2 of chosen block c // 2.
    return (vals, jnp.take_along_axis(cand_ids, at, axis=-1), bound,
            jnp.take_along_axis(lanes, (at // 2)[:, :, None], axis=1))


def _top_indices(x_bn: jax.Array, m: int) -> jax.Array:
    """int32 [B, m]: the indices of the m largest entries of each row, in increasing order (ties:
    the lower index ranks first, as in `lax.top_k`, whose cost on CPU grows with the entries it
    reads). Many entries are first narrowed to those of the m groups of 8 with the largest maxima
    (recursively): an entry among the m largest lies in such a group, since a group left out
    ranks after m groups, each holding an entry that ranks before all of its own. At 64 rows
    of 1187 entries, `lax.top_k` read 1187 a row, this 149 + 256."""
    b, n = x_bn.shape
    if n < 4 * _GROUP * m:
        return jnp.sort(jax.lax.top_k(x_bn, m)[1], axis=-1).astype(jnp.int32)
    groups = _row_blocks(x_bn, _GROUP)  # padded with -inf: ranked after every real entry
    outer = _top_indices(jnp.max(groups, axis=-1), m)
    # The chosen groups' entries, in increasing index order.
    at = jnp.sort(jax.lax.top_k(_at_rows(groups, outer).reshape(b, -1), m)[1], axis=-1)
    return (jnp.take_along_axis(outer, at // _GROUP, axis=-1) * _GROUP + at % _GROUP).astype(
        jnp.int32)


def _two_largest(keys_bnk: jax.Array):
    """Per block of K entries in id order (order keys [B, N, K]): ((keys, positions) [B, N, 2] of
    its two largest entries, in id order; (key, position) [B, N] of its third largest), ties
    ranked by lower position. One pass over the entries, each compared with the running top
    three (XLA fuses it into one loop; argmax, masking and argmax again wrote [B, N, K] arrays
    three times)."""
    shape = keys_bnk.shape[:-1]
    top = [(jnp.zeros(shape, jnp.uint32), jnp.full(shape, -1, jnp.int32)) for _ in range(3)]
    for i in range(keys_bnk.shape[-1]):
        x = (keys_bnk[..., i], jnp.full(shape, i, jnp.int32))
        above = [x[0] > k for k, _ in top]  # strict: an earlier entry stays ahead of a tie
        top = [tuple(jnp.where(above[0], a, b) for a, b in zip(x, top[0])),
               tuple(jnp.where(above[0], a, jnp.where(above[1], c, b))
                     for a, b, c in zip(top[0], top[1], x)),
               tuple(jnp.where(above[1], a, jnp.where(above[2], c, b))
                     for a, b, c in zip(top[1], top[2], x))]
    (k1, p1), (k2, p2), third = top
    p1, p2 = jnp.maximum(p1, 0), jnp.maximum(p2, 0)  # unset only past NaN keys
    swap = p2 < p1
    keys = jnp.stack([jnp.where(swap, k2, k1), jnp.where(swap, k1, k2)], axis=-1)
    pos = jnp.stack([jnp.minimum(p1, p2), jnp.maximum(p1, p2)], axis=-1)
    return (keys, pos), third


def _earliest(key_bn, id_bn):
    """The highest-ranked of N tokens (key, id) [B, N] per row, as (key, id) [B] each."""
    key = jnp.max(key_bn, axis=-1)
    return key, jnp.min(jnp.where(key_bn == key[:, None], id_bn, jnp.iinfo(jnp.int32).max),
                        axis=-1)


def _earlier(a, b):
    """The higher-ranked of two (key, id) bounds."""
    a_first = _ranks_before(*a, *b)
    return tuple(jnp.where(a_first, x, y) for x, y in zip(a, b))


def _fixed_mass(scaled, lse_b):
    """int32 masses round(p * 2^30) of scaled logits [B, ...] under the full-vocabulary normaliser."""
    lse = lse_b.reshape(lse_b.shape + (1,) * (scaled.ndim - 1))
    return jnp.round(jnp.exp(scaled - lse) * _MASS_ONE).astype(jnp.int32)


def _mass_target(top_p_b):
    """int32 [B]: the smallest fixed-point mass that reaches top_p (at least 1, so one token is
    always kept; rows with top_p >= 1 never use it)."""
    return jnp.maximum(jnp.ceil(jnp.clip(top_p_b, 0.0, 1.0) * _MASS_ONE), 1).astype(jnp.int32)


def _nucleus(vals_bm, lse_b, target_b, vocab):
    """(n_kept, complete, kept mass) from the m top-ranked scaled logits.

    Keep the smallest prefix whose mass reaches top_p: rank r is kept while the mass of the ranks
    above it is still below the target. Masses are normalised over the whole vocabulary (lse_b),
    so the answer is final once the candidates' own mass reaches the target.
    """
    q = _fixed_mass(vals_bm, lse_b)
    cum = jnp.cumsum(q, axis=-1)  # integers: exact, whatever order XLA adds them in
    n_kept = jnp.maximum(jnp.sum(cum - q < target_b[:, None], axis=-1), 1).astype(jnp.int32)
    complete = (vals_bm.shape[-1] == vocab) | (cum[:, -1] >= target_b)
    return n_kept, complete, _at(cum, n_kept - 1)


def _kept_lse(n_kept_b, mass_b, lse_b, vocab):
    """The kept set's log-normaliser from its fixed-point mass: a function of the kept set alone,
    not of the level, the batch or the order that found it."""
    mass = mass_b.astype(jnp.float32) * (1.0 / _MASS_ONE)
    return jnp.where(n_kept_b >= vocab, lse_b, lse_b + jnp.log(mass))


def _finish(scaled_bv, vals_bm, ids_bm, n_kept_b, mass_b, lse_b, keypair_b2, vocab,
            lanes=None):
    """(token, n_kept, threshold logit, log-normaliser of the kept set) given the kept count: the
    kept set is the first n_kept of the ranked (vals, ids). Few candidates draw from their own
    blocks (`lanes`: those blocks' entries, if `_ranked` gave them); a set ranked over most of
    the row draws from the whole row's blocks (the same draw)."""
    threshold = _at(vals_bm, n_kept_b - 1)
    if vals_bm.shape[-1] * _BLOCK < vocab:
        token = _draw_among(scaled_bv, lse_b, keypair_b2, vals_bm, ids_bm, n_kept_b, lanes)
    else:
        token = _draw_whole_rows(scaled_bv, lse_b, keypair_b2, order_keys(threshold), n_kept_b)
    return token, n_kept_b, threshold, _kept_lse(n_kept_b, mass_b, lse_b, vocab)


def _draw_whole_rows(scaled_bv, lse_b, keypair_b2, k_b, n_kept_b):
    """The token drawn from the n_kept_b largest logits of whole rows, k_b the key of the last
    kept one: every token above k is kept, the rest of the kept set is tied at k."""
    stats = _block_stats(scaled_bv, lse_b, k_b)
    n_ties_kept = n_kept_b - jnp.sum(stats.n_above, axis=-1)
    return _draw_in_blocks(scaled_bv, lse_b, keypair_b2, k_b, n_ties_kept, stats)


# The draw ----------------------------------------------------------------------------------------
# Gumbel-max in two stages: a 16-id block with probability proportional to its kept mass (the
# block's log-mass plus block noise, `BLOCK_STREAM`), then a kept token inside it (logit plus
# token noise). The largest of Gumbel variables located at x_i is a Gumbel variable located at
# their log-sum-exp, so this is the one-stage draw argmax_i (x_i + G_i) over the kept set in
# distribution, exact but for the float32 rounding of the block masses. It hashes one noise per
# block and 16 per row instead of one per kept token: with three rows whose nuclei hold 45k-108k
# of 152k ids, 7.7 -> 1.5 ms for the draw alone.
#
# Every path (few candidates, the sorted row, the threshold search, the whole vocabulary) computes
# the block masses from the kept set alone and in one form, so they are the same floats and every
# path draws the same token: with k the key of the last kept token (the smallest kept logit, also
# when the whole vocabulary is kept) and e = exp(x - lse),
#   mass(block) = (e of its tokens above k, added in `_lane_sums`'s order)
#                 + (its kept tokens tied at k) * e(k),
# where the tokens tied at k are kept in id order (ties rank by lower id).


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _BlockStats:
    """Per row and 16-id block, against a threshold key k: the tree sum of e over the tokens
    above k and the counts of tokens above and tied at k. [B, ceil(V / 16)] each."""

    above_e: jax.Array
    n_above: jax.Array
    n_tied: jax.Array


def _lane_sums(x_bn16, k_b, lse_b, valid=None):
    """Per 16-id block of x [B, N, 16] against the threshold key k_b [B]: (the sum of e =
    exp(x - lse) over the lanes above k, the count of lanes above k, the count tied at k); lanes
    where `valid` [.., N, 16] is False count as nothing. The lanes are added by halves in one
    fixed order (lane i + lane i + 8, then + 4, + 2, + 1), whatever array holds them, so that a
    block's mass is the same float in every path (XLA does not reassociate it). Each lane is
    computed from its own slice of x: XLA then fuses the whole computation into one pass that
    writes [B, N] sums, where halving a computed [B, N, 16] array wrote that array first (64 rows
    of 152k ids: three [B, V] arrays written and read back)."""
    # Compared as floats with k's value: the same order as the keys' for every non-NaN logit
    # (-0.0 == +0.0 either way), and fewer operations for XLA to compile, 16 times over.
    k = _key_value(k_b)[:, None]
    lse = lse_b[:, None]

    def lane(i):
        x = x_bn16[..., i]
        above, tied = x > k, x == k
        if valid is not None:
            above, tied = above & valid[..., i], tied & valid[..., i]
        return (jnp.where(above, jnp.exp(x - lse), 0.0), above.astype(jnp.int32),
                tied.astype(jnp.int32))

    sums = [lane(i) for i in range(x_bn16.shape[-1])]
    while len(sums) > 1:
        half = len(sums) // 2
        sums = [tuple(a + b for a, b in zip(sums[i], sums[i + half])) for i in range(half)]
    return sums[0]


def _block_mass(above_e, n_tied_kept, tie_e):
    """The kept mass of blocks (the form above); tie_e, e(k), broadcasts against the blocks."""
    return above_e + jnp.where(n_tied_kept > 0, n_tied_kept.astype(jnp.float32) * tie_e, 0.0)


def _block_stats(scaled_bv, lse_b, k_b) -> _BlockStats:
    """`_BlockStats` of whole rows: one pass over them (the lanes past the vocabulary, padding,
    count as nothing)."""
    vocab = scaled_bv.shape[-1]
    x = _row_blocks(scaled_bv, _BLOCK)
    valid = None
    if vocab % _BLOCK:
        valid = jnp.arange(x.shape[1] * _BLOCK).reshape(x.shape[1:]) < vocab
    return _BlockStats(*_lane_sums(x, k_b, lse_b, valid))


def _draw_in_blocks(scaled_bv, lse_b, keypair_b2, k_b, n_ties_kept_b, stats: _BlockStats):
    """The token drawn from whole rows' kept sets: every token above k_b and the first
    n_ties_kept_b tokens tied at k_b (by id). `stats`: `_block_stats(scaled_bv, lse_b, k_b)`."""
    # The ties kept fill the blocks in id order. Usually every tie is kept (one token at k), and
    # the prefix sum over the blocks, which costs XLA:CPU 0.07 ms a row of 9496 blocks (more
    # than the rest of the draw), is skipped.
    def in_id_order():
        before = jnp.cumsum(stats.n_tied, axis=-1) - stats.n_tied
        return jnp.clip(n_ties_kept_b[:, None] - before, 0, stats.n_tied)

    every_tie = jnp.all(n_ties_kept_b >= jnp.sum(stats.n_tied, axis=-1))
    tied_kept = jax.lax.cond(every_tie, lambda: stats.n_tied, in_id_order)
    tie_e = jnp.exp(_key_value(k_b) - lse_b)  # NaN when nothing ties at k: then unused
    mass = _block_mass(stats.above_e, tied_kept, tie_e[:, None])
    # Stored once: `_first_argmax` reads it in several passes, each of which would hash again.
    z = jax.lax.optimization_barrier(
        jnp.log(mass) + gumbel_range(keypair_b2, mass.shape[-1], BLOCK_STREAM))
    block = _first_argmax(z)
    return _token_in_block(scaled_bv, keypair_b2, block, k_b, _at(tied_kept, block))


def _draw_among(scaled_bv, lse_b, keypair_b2, vals_bm, ids_bm, n_kept_b, lanes=None):
    """`_draw_in_blocks` for a kept set given as the first n_kept of m ranked candidates: only the
    blocks holding a kept candidate can be drawn, so only their lanes are read (`lanes` [B, m,
    16]: they, already read; the entries past the vocabulary are never used)."""
    b, m = ids_bm.shape
    vocab = scaled_bv.shape[-1]
    k = order_keys(_at(vals_bm, n_kept_b - 1))[:, None, None]
    last_id = _at(ids_bm, n_kept_b - 1)[:, None, None]  # the ties at k kept are those up to it
    blocks = ids_bm // _BLOCK
    lane_ids = blocks[:, :, None] * _BLOCK + jnp.arange(_BLOCK, dtype=jnp.int32)
    x = lanes
    if x is None:
        x = jnp.take_along_axis(scaled_bv, jnp.minimum(lane_ids, vocab - 1).reshape(b, -1),
                                axis=-1).reshape(lane_ids.shape)
    valid = lane_ids < vocab
    n_tied_kept = jnp.sum(valid & (order_keys(x) == k) & (lane_ids <= last_id), axis=-1,
                          dtype=jnp.int32)
    tie_e = jnp.exp(_key_value(k[:, 0, 0]) - lse_b)
    above_e = _lane_sums(x, k[:, 0, 0], lse_b, valid)[0]
    mass = _block_mass(above_e, n_tied_kept, tie_e[:, None])
    z = jnp.where(jnp.arange(m) < n_kept_b[:, None],
                  jnp.log(mass) + gumbel_at(keypair_b2, blocks, BLOCK_STREAM), -jnp.inf)
    block = _argmax_lowest_id(z, blocks)
    quota = jnp.max(jnp.where(blocks == block[:, None], n_tied_kept, 0), axis=-1)
    # The drawn block's entries: those of the first candidate in it.
    in_block = _at_row(x, jnp.argmax(blocks == block[:, None], axis=-1))
    return _token_in_block(scaled_bv, keypair_b2, block, k[:, 0, 0], quota, in_block)


def _token_in_block(scaled_bv, keypair_b2, block_b, k_b, n_tied_kept_b, vals=None):
    """The draw's second stage: in block_b, the kept token (above k_b, or among the block's first
    n_tied_kept_b tokens tied at k_b) with the largest logit + noise, ties to the lower id.
    `vals` [B, 16]: the block's entries, if already read (those past the vocabulary unused)."""
    vocab = scaled_bv.shape[-1]
    ids = block_b[:, None] * _BLOCK + jnp.arange(_BLOCK, dtype=jnp.int32)[None, :]
    if vals is None:
        vals = jnp.take_along_axis(scaled_bv, jnp.minimum(ids, vocab - 1), axis=-1)
    keys, valid = order_keys(vals), ids < vocab
    tied = valid & (keys == k_b[:, None])
    kept = (valid & (keys > k_b[:, None])) | (
        tied & (jnp.cumsum(tied, axis=-1) <= n_tied_kept_b[:, None]))
    z = jnp.where(kept, vals + gumbel_at(keypair_b2, ids), -jnp.inf)
    return _argmax_lowest_id(z, ids)


_RADIX = 1 << 16  # two histogram passes of 16 key bits each


def _last_bin_reaching(hist_rn, base_r, target_r):
    """(b, mass above b): per row the largest bin b with base + mass of bins >= b reaching the
    target (-1 if none), and base + the mass of the bins above it. The suffix sums run over 256
    blocks of 256 bins, then inside the chosen block: two short prefix sums instead of one over
    65536 bins."""
    r, n = hist_rn.shape
    width = 256
    blocks = hist_rn.reshape(r, n // width, width)

    def suffix(x_rm, base):
        return jnp.flip(jnp.cumsum(jnp.flip(x_rm, -1), -1), -1) + base[:, None]

    def last_reaching(suf_rm, base):
        j = jnp.sum(suf_rm >= target_r[:, None], axis=-1).astype(jnp.int32) - 1
        after = jnp.where(j + 1 < suf_rm.shape[-1],
                          _at(suf_rm, jnp.minimum(j + 1, suf_rm.shape[-1] - 1)), base)
        return j, after

    outer = suffix(jnp.sum(blocks, axis=-1), base_r)
    j, after_j = last_reaching(outer, base_r)
    inner = jnp.take_along_axis(blocks, jnp.maximum(j, 0)[:, None, None], axis=1)[:, 0]
    i, after_i = last_reaching(suffix(inner, after_j), after_j)
    return jnp.where(j >= 0, j * width + i, -1), jnp.where(j >= 0, after_i, base_r)


def _histogram(bins_rv, weights_rv):
    """int32 [R, 65536]: per row, the weights added up by bin (a scatter-add: exact in integers).
    A bin of -1 drops its weight."""
    r = bins_rv.shape[0]
    flat = jnp.where(bins_rv >= 0, jnp.arange(r, dtype=jnp.int32)[:, None] * _RADIX + bins_rv,
                     r * _RADIX).reshape(-1)
    hist = jnp.zeros((r * _RADIX,), jnp.int32).at[flat].add(weights_rv.reshape(-1), mode="drop")
    return hist.reshape(r, _RADIX)


def _key_value(key_b):
    """The float32 whose `order_keys` key is key_b (zero as +0.0)."""
    bits = jnp.where((key_b >> 31) == 1, key_b & jnp.uint32(0x7FFFFFFF), ~key_b)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _searched(scaled_bv, lse_b, target_b, keypair_b2):
    """`_finish`'s result for whole rows, without ranking them.

    The last kept token's key is the largest key k whose tokens at or above it hold the target
    mass. Two mass histograms find it, one over the keys' high 16 bits and one over the low 16
    bits of the keys in the chosen high bin. Every token above k is kept; the tokens tied at k
    (all of one mass) are kept in id order while the mass before them is below the target,
    exactly as in the ranked prefix. Integer masses make every sum exact, so this is the sort's
    answer to the bit. The threshold logit is k's own value (at least one tied token is kept).

    At a few rows of a 152k vocabulary each pass over the rows costs about as much in memory
    traffic as in arithmetic, so few arrays of the rows' size are written: the masses and the
    keys; the second histogram takes the masses as they are and drops the tokens outside the
    chosen bin; one pass by 16-id blocks (`_block_stats`) counts the tokens above and at k and
    gives the blocks' masses for the draw (`_draw_in_blocks`).
    """
    vocab = scaled_bv.shape[-1]
    q = _fixed_mass(scaled_bv, lse_b)
    keys = order_keys(scaled_bv)
    high = (keys >> 16).astype(jnp.int32)
    zero = jnp.zeros_like(target_b)
    b_high, above_bin = _last_bin_reaching(_histogram(high, q), zero, target_b)
    low = jnp.where(high == b_high[:, None], (keys & jnp.uint32(_RADIX - 1)).astype(jnp.int32), -1)
    b_low, mass_above = _last_bin_reaching(_histogram(low, q), above_bin, target_b)
    # No key reaches the target (the whole row's rounded mass falls short): keep every token, the
    # row's minimum being the last kept.
    everything = b_high < 0
    row_min = jax.lax.cond(jnp.any(everything), lambda: jnp.min(scaled_bv, axis=-1),
                           lambda: jnp.zeros_like(lse_b))
    k = jnp.where(everything, order_keys(row_min),
                  (b_high.astype(jnp.uint32) << 16) | b_low.astype(jnp.uint32))
    stats = _block_stats(scaled_bv, lse_b, k)
    n_above = jnp.sum(stats.n_above, axis=-1)
    n_tied = jnp.sum(stats.n_tied, axis=-1)
    # Tied tokens have k's value, hence its mass (k's bin holds mass, so some token has k).
    tie_mass = jnp.where(everything, 0, _fixed_mass(_key_value(k), lse_b))
    room = target_b - mass_above  # > 0: the mass above k is short of the target
    fit = jnp.where(tie_mass > 0, (room + tie_mass - 1) // jnp.maximum(tie_mass, 1), n_tied)
    n_ties_kept = jnp.where(everything, n_tied, jnp.minimum(fit, n_tied))
    n_kept = n_above + n_ties_kept
    mass = mass_above + n_ties_kept * tie_mass  # unused when everything is kept (`_kept_lse`)
    token = _draw_in_blocks(scaled_bv, lse_b, keypair_b2, k, n_ties_kept, stats)
    threshold = _key_value(k)
    return token, n_kept, threshold, _kept_lse(n_kept, mass, lse_b, vocab)


def _search_each(state, pending_b, scaled_bv, lse_b, target_b, keypair_b2):
    """`_searched` on the pending rows, one row at a time, writing each result into `state`.

    A loop over single rows, each read in place (a dynamic slice of the batch, no gathered copy):
    its scratch is one row's (a few row-sized arrays and two 65536-bin histograms) whatever the
    batch and however many rows are searched, and the loop reuses it from row to row. XLA:CPU
    allocates an executable's scratch afresh on every call (the sampler's is larger than malloc
    keeps for reuse, so it is a fresh mmap), and every scratch page a call touches is a page
    fault: searching rows in batches wrote each batch's arrays to new pages. At 64 x 152k ids
    with 3 rows whose nuclei hold 123k ids, a call took 3520 page faults searching them as a
    batch of 4, and 788 (as many as a call that searches nothing) one row at a time; the whole
    draw took 11.0 -> 9.1 ms (7.0 / 7.3 ms without those rows). With 16 such rows 21.5 -> 15.3
    ms, with all 64 56.5 -> 32.5 ms (32k ids: 18.0 -> 11.2 ms). One process, interleaved."""
    order = _first_rows(pending_b, pending_b.shape[0])

    def one_row(i, state):
        r = order[i]

        def row(x):
            return jax.lax.dynamic_slice_in_dim(x, r, 1, axis=0)

        found = _searched(row(scaled_bv), row(lse_b), row(target_b), row(keypair_b2))
        return jax.tree.map(lambda old, new: jax.lax.dynamic_update_slice_in_dim(old, new, r, 0),
                            state, found)

    return jax.lax.fori_loop(0, jnp.sum(pending_b), one_row, state)


def _first_rows(mask_b: jax.Array, n: int) -> jax.Array:
    """int32[n]: the indices of the first n True entries, padded with B (out of range)."""
    return jnp.nonzero(mask_b, size=n, fill_value=mask_b.shape[0])[0].astype(jnp.int32)


def _select(mask_b, new, old):
    return jax.tree.map(lambda a, b: jnp.where(mask_b, a, b), new, old)


def _output(state, logits, scaled, greedy, lse_raw) -> SampleOutput:
    token, n_kept, threshold, lse_kept = state
    logprob = jnp.where(greedy, 0.0, _at(scaled, token) - lse_kept)
    raw_logprob = _at(logits, token) - lse_raw
    # -0.0 and +0.0 tie: whichever the path found, record +0.0.
    threshold = jnp.where(threshold == 0.0, 0.0, threshold)
    return SampleOutput(token, logprob, raw_logprob, n_kept, threshold)


def exact_logprobs(drawn: SampleOutput, logits_bv: jax.Array, temperature: jax.Array
                   ) -> SampleOutput:
    """`drawn` with its log-probs recomputed as the learner computes them in exact mode
    (`hcjax.rl.learner.token_logprobs(..., exact=True)`): the temperature-scaled logits (1 for
    greedy rows), the recorded support kept (`support_mask_at_threshold`: the learner's
    `support_mask_from_record` from the threshold the draw recorded), and the normaliser a
    batch-invariant log-sum-exp. A greedy row keeps one token and gets 0, as before."""
    logits = logits_bv.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    scaled = logits / jnp.where(temperature <= 0.0, 1.0, temperature)[:, None]
    ids = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, 1)
    chosen = ids == drawn.tokens[:, None]
    keep = support_mask_at_threshold(scaled, drawn.n_kept, drawn.threshold_logit) | chosen
    kept = jnp.where(keep, scaled, -jnp.inf)
    logprob = _at(scaled, drawn.tokens) - bi.logsumexp(kept)
    raw = _at(logits, drawn.tokens) - bi.logsumexp(logits)
    return dataclasses.replace(drawn, logprobs=logprob, raw_logprobs=raw)


def sample(
    logits_bv: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    candidates: tuple[int, ...] | None = None,
    sort_up_to: int | None = None,
) -> SampleOutput:
    """Draw one token per row of `logits_bv` [B, V] with per-row temperature and top_p [B].

    temperature 0 means greedy (argmax, lowest id among ties; kept set of one, log-prob 0).
    top_p >= 1 keeps the whole vocabulary. Otherwise the nucleus is searched among the
    `candidates[0]` largest logits (`lax.top_k`, no sort of the vocabulary), then among
    `candidates[1]`, ..., and a row whose nucleus is still incomplete finds its threshold by a
    search over the whole row (`_searched`), or by a sort when the vocabulary has at most
    `sort_up_to` ids. The search takes one row at a time, so its memory is one row's whatever
    the batch. Every path gives bit-identical results to `sample_reference`. `candidates` and
    `sort_up_to` default to `SAMPLER_TUNING` for the platform compiled for.
    """
    candidates, sort_up_to = _tuned(candidates, sort_up_to)
    temperature = jnp.asarray(temperature, jnp.float32)
    # Temperatures of 0 and 1 only (greedy rows and RL's usual T = 1): no division, no copy.
    unit = jnp.all((temperature <= 0.0) | (temperature == 1.0))
    body = functools.partial(_sample, candidates=candidates, sort_up_to=sort_up_to)
    return jax.lax.cond(unit, functools.partial(body, divide=False),
                        functools.partial(body, divide=True), logits_bv, keys, temperature, top_p)


def _tuned(candidates, sort_up_to):
    """The arguments given, else `SAMPLER_TUNING`'s for the platform compiled for (the context
    mesh's, else JAX's default; an unlisted platform gets the CPU values)."""
    tuned = SAMPLER_TUNING.get(backend(), SAMPLER_TUNING["cpu"])
    return (tuned[0] if candidates is None else candidates,
            tuned[1] if sort_up_to is None else sort_up_to)


def _sample(logits_bv, keys, temperature, top_p, candidates, sort_up_to,
            divide, report_searched: bool = False):
    """`sample`'s body; `divide` as in `_prepare`. With `report_searched`, also the rows sent to
    the threshold search (`searched_rows`)."""
    vocab = logits_bv.shape[-1]
    sizes = _level_sizes(candidates, vocab)
    rank = None
    if sizes:
        # Every row at temperature 1: the scaled logits are the logits, whose block maxima are
        # already known.
        def rank(scaled, block_max):
            return _ranked(scaled, sizes[0], None if divide else block_max)
    logits, scaled, greedy, top_p, lse, lse_raw, keypair, block_max, token, ranked = _prepare(
        logits_bv, keys, temperature, top_p, divide, rank)
    b = logits.shape[0]
    target = _mass_target(top_p)

    # Greedy for every row first (cheap); the other rows overwrite it below.
    state = (token, jnp.ones((b,), jnp.int32), _at(logits, token), lse)

    # top_p >= 1: the kept set is the vocabulary, so the draw needs no ranks at all.
    whole = ~greedy & (top_p >= 1.0)

    def keep_all(state):
        row_min = jnp.min(scaled, axis=-1)  # the last kept token's logit
        n_kept = jnp.full((b,), vocab, jnp.int32)
        tok = _draw_whole_rows(scaled, lse, keypair, order_keys(row_min), n_kept)
        found = (tok, n_kept, row_min, lse)
        return _select(whole, found, state)

    state = jax.lax.cond(jnp.any(whole), keep_all, lambda s: s, state)

    # top_p < 1: widen the candidate set level by level while some row's nucleus is incomplete,
    # then search the threshold of what is left, row by row (`_search_each`). After the first
    # level only a few rows are usually left: a wider level gathers them into a batch of 1, b/16
    # or b/4 rows, so that one flat row does not make every row pay for a wide top-k. Each row's
    # arithmetic is the same whichever batch it is in (fixed-point masses; see `_kept_lse`).
    pending = ~greedy & (top_p < 1.0)
    buckets = sorted({1, max(1, b // 16), max(1, b // 4)})

    def ranked_level(m, ranked=None):
        """The level of the m largest logits; `ranked`: their `_ranked` for every row, if already
        computed (the first level's)."""
        def level(scaled, lse, target, keypair, block_max=None):
            vals, ids, bound, lanes = (ranked if ranked is not None
                                       else _ranked(scaled, m, block_max))
            n_kept, complete, mass = _nucleus(vals, lse, target, vocab)
            # The last kept token must rank before the first token the candidates may miss.
            exact = _ranks_before(order_keys(_at(vals, n_kept - 1)), _at(ids, n_kept - 1),
                                  *bound)
            found = _finish(scaled, vals, ids, n_kept, mass, lse, keypair, vocab, lanes)
            return found, complete & exact
        return level

    levels = [ranked_level(m, ranked if i == 0 else None) for i, m in enumerate(sizes)]
    if vocab <= sort_up_to:
        levels.append(ranked_level(vocab))
    for index, level in enumerate(levels):

        def run(state, pending, rows, level=level):
            """Run this level on `rows` [R] (b marks an unused entry; None: every row, with no
            gather) and write back the rows whose nucleus it completes."""
            def sub(x):
                if rows is None:
                    return x
                # Materialised: a gather fused into each pass over the rows costs more (in the
                # threshold search, when it took gathered rows: ~3 of its 11 ms at 3 x 152k).
                return jax.lax.optimization_barrier(jnp.take(x, rows, axis=0, mode="clip"))

            # Every row, temperature 1: the scaled logits are the logits, whose block maxima
            # are already known.
            known = block_max if rows is None and not divide else None
            found, complete = level(sub(scaled), sub(lse), sub(target), sub(keypair), known)
            done = sub(pending) & complete
            if rows is None:
                return _select(done, found, state), pending & ~complete
            state = jax.tree.map(
                lambda old, new: old.at[rows].set(jnp.where(done, new, sub(old)), mode="drop"),
                state, found)
            return state, pending.at[rows].set(sub(pending) & ~complete, mode="drop")

        gathered = buckets if index > 0 else []  # the first level runs on every row anyway
        branches = [lambda s, p: (s, p)]
        branches += [lambda s, p, run=run, n=n: run(s, p, _first_rows(p, n)) for n in gathered]
        branches += [lambda s, p, run=run: run(s, p, None)]
        count = jnp.sum(pending)
        # 0: nothing pending; then the smallest bucket that holds the pending rows; else all rows.
        which = jnp.where(count == 0, 0, len(branches) - 1)
        for i, n in reversed(list(enumerate(gathered))):
            which = jnp.where((count > 0) & (count <= n), i + 1, which)
        state, pending = jax.lax.switch(which, branches, state, pending)
    searched = pending if vocab > sort_up_to else jnp.zeros_like(pending)
    if vocab > sort_up_to:
        state = _search_each(state, pending, scaled, lse, target, keypair)
    out = _output(state, logits, scaled, greedy, lse_raw)
    return (out, searched) if report_searched else out


def searched_rows(
    logits_bv: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    candidates: tuple[int, ...] | None = None,
    sort_up_to: int | None = None,
) -> jax.Array:
    """bool [B]: the rows `sample` (same arguments) finds by the whole-row threshold search, its
    slow path: a nucleus wider than the candidate levels, or one that reaches past a level's
    exactness bound (its candidates may miss a token that ranks inside it, e.g. three of the top
    tokens in one 16-id block). For benchmarks and diagnostics; `sample` itself does not call it.
    """
    candidates, sort_up_to = _tuned(candidates, sort_up_to)
    temperature = jnp.asarray(temperature, jnp.float32)
    return _sample(logits_bv, keys, temperature, top_p, candidates, sort_up_to, divide=True,
                   report_searched=True)[1]


def sample_reference(
    logits_bv: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
) -> SampleOutput:
    """`sample` by one stable sort of the whole vocabulary per row, for tests and benchmarks:
    the nucleus from the prefix sums of the masses in rank order. Same kept set, draw and
    arithmetic as `sample`, to the bit."""
    logits, scaled, greedy, top_p, lse, lse_raw, keypair, _, _, _ = _prepare(
        logits_bv, keys, temperature, top_p)
    vocab = logits.shape[-1]
    vals, ids, _, _ = _ranked(scaled, vocab)  # one sort of the row
    n_kept, _, mass = _nucleus(vals, lse, _mass_target(top_p), vocab)
    n_kept = jnp.where(greedy, 1, jnp.where(top_p >= 1.0, vocab, n_kept))
    mass = jnp.where(top_p >= 1.0, _MASS_ONE, mass)  # unused: a whole-vocabulary set keeps lse
    state = _finish(scaled, vals, ids, n_kept, mass, lse, keypair, vocab)
    return _output(state, logits, scaled, greedy, lse_raw)

"""Token sampling with the RL extras the learner needs: temperature, top-p with a kept-set record,
sampling and raw log-probs, and per-request keys that do not depend on slot placement.

Pure jnp functions of arrays, meant to run inside the engine's jitted step; no model code here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["SampleOutput", "sample", "sampling_keys"]


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


def _sample_row(logits_v, key, temperature, top_p):
    vocab = logits_v.shape[-1]
    greedy = temperature <= 0.0
    scaled = logits_v / jnp.where(greedy, 1.0, temperature)
    # Stable sort of the negated logits: descending order, ties by lower token id, the same
    # tie-break the learner uses to rebuild the kept set from n_kept.
    order = jnp.argsort(-scaled, stable=True)
    sorted_logits = scaled[order]
    probs = jax.nn.softmax(sorted_logits)
    mass_before = jnp.concatenate([jnp.zeros((1,), probs.dtype), jnp.cumsum(probs)[:-1]])
    # Keep the smallest prefix whose mass reaches top_p: token i is kept while the mass of the
    # tokens ranked above it is still below top_p. top_p >= 1 keeps everything outright, so float
    # rounding of the cumulative sum cannot drop the tail.
    n_kept = jnp.sum(mass_before < top_p).astype(jnp.int32)
    n_kept = jnp.where(top_p >= 1.0, vocab, jnp.maximum(n_kept, 1))
    n_kept = jnp.where(greedy, 1, n_kept)
    kept_logits = jnp.where(jnp.arange(vocab) < n_kept, sorted_logits, -jnp.inf)
    rank = jnp.where(greedy, 0, jax.random.categorical(key, kept_logits))
    token = order[rank].astype(jnp.int32)
    logprob = kept_logits[rank] - jax.nn.logsumexp(kept_logits)
    logprob = jnp.where(greedy, 0.0, logprob)
    raw_logprob = jax.nn.log_softmax(logits_v)[token]
    threshold = sorted_logits[n_kept - 1]
    return token, logprob, raw_logprob, n_kept, threshold


def sample(
    logits_bv: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array
) -> SampleOutput:
    """Draw one token per row of `logits_bv` [B, V] with per-row temperature and top_p [B].

    temperature 0 means greedy (argmax, lowest id among ties; kept set of one, log-prob 0).
    """
    logits_bv = logits_bv.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    top_p = jnp.asarray(top_p, jnp.float32)
    tok, lp, raw, n_kept, thr = jax.vmap(_sample_row)(logits_bv, keys, temperature, top_p)
    return SampleOutput(tok, lp, raw, n_kept, thr)

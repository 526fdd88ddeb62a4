"""Sampling with RL extras: kept set vs a numpy top-p reference, log-probs, keys, greedy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcjax.rollout.sampling import sample as sample_eager
from hcjax.rollout.sampling import sampling_keys

sample = jax.jit(sample_eager)  # as the engine runs it; also far fewer dispatches than eager


def reference_top_p(logits, temperature, top_p):
    """Kept token ids (in rank order) of nucleus sampling, computed in float64 by a plain loop."""
    z = np.asarray(logits, np.float64) / temperature
    order = sorted(range(len(z)), key=lambda i: (-z[i], i))
    p = np.exp(z - z.max())
    p /= p.sum()
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += p[i]
        if mass >= top_p:
            break
    return kept, z


def _keys(n, seed=0):
    return sampling_keys(jnp.full((n,), seed), jnp.arange(n), jnp.zeros((n,), jnp.int32))


@pytest.mark.parametrize("temperature,top_p", [(1.0, 0.97), (0.7, 0.9), (1.3, 0.5), (1.0, 1.0)])
def test_kept_set_and_logprobs_match_reference(temperature, top_p):
    rng = np.random.default_rng(0)
    b, v = 16, 50
    logits = rng.normal(size=(b, v)).astype(np.float32) * 3.0
    logits[0, 7] = logits[0, 3]  # a tie: the lower id must rank first
    out = sample(jnp.asarray(logits), _keys(b), jnp.full((b,), temperature), jnp.full((b,), top_p))
    for row in range(b):
        kept, z = reference_top_p(logits[row], temperature, top_p)
        assert int(out.n_kept[row]) == len(kept)
        np.testing.assert_allclose(float(out.threshold_logit[row]), z[kept[-1]], rtol=1e-6)
        tok = int(out.tokens[row])
        assert tok in kept
        # Sampling log-prob: log of the renormalised truncated distribution.
        zk = z[kept]
        expected = z[tok] - (zk.max() + np.log(np.exp(zk - zk.max()).sum()))
        np.testing.assert_allclose(float(out.logprobs[row]), expected, rtol=1e-5, atol=1e-5)
        raw = np.asarray(logits[row], np.float64)
        raw_expected = raw[tok] - (raw.max() + np.log(np.exp(raw - raw.max()).sum()))
        np.testing.assert_allclose(float(out.raw_logprobs[row]), raw_expected, rtol=1e-5, atol=1e-5)


def test_tie_breaks_by_lower_token_id():
    logits = jnp.array([[0.0, 5.0, 1.0, 5.0, 5.0]])
    # Three tied maxima at ids 1, 3, 4 hold ~99% of the mass; top_p just above one third keeps two.
    out = sample(logits, _keys(1), jnp.array([1.0]), jnp.array([0.4]))
    assert int(out.n_kept[0]) == 2
    assert int(out.tokens[0]) in (1, 3)
    greedy = sample(logits, _keys(1), jnp.array([0.0]), jnp.array([0.97]))
    assert int(greedy.tokens[0]) == 1 and int(greedy.n_kept[0]) == 1
    assert float(greedy.logprobs[0]) == 0.0


def test_greedy_is_argmax():
    logits = jax.random.normal(jax.random.key(1), (8, 30))
    out = sample(logits, _keys(8), jnp.zeros((8,)), jnp.full((8,), 0.97))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.argmax(np.asarray(logits), axis=-1))
    np.testing.assert_array_equal(np.asarray(out.n_kept), 1)


def test_empirical_distribution_matches_truncated_softmax():
    logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    n = 20000
    keys = sampling_keys(jnp.zeros((n,), jnp.int32), jnp.arange(n), jnp.zeros((n,), jnp.int32))
    out = sample(jnp.tile(logits, (n, 1)), keys, jnp.ones((n,)), jnp.full((n,), 0.8))
    np.testing.assert_array_equal(np.asarray(out.n_kept), 2)
    freq = np.bincount(np.asarray(out.tokens), minlength=4) / n
    np.testing.assert_allclose(freq, [0.625, 0.375, 0.0, 0.0], atol=0.015)
    np.testing.assert_allclose(
        np.exp(np.asarray(out.logprobs)), np.where(np.asarray(out.tokens) == 0, 0.625, 0.375),
        rtol=1e-5,
    )


def test_keys_depend_only_on_seed_index_position():
    seeds = jnp.array([3, 3, 3, 4])
    idx = jnp.array([0, 1, 0, 0])
    pos = jnp.array([5, 5, 6, 5])
    keys = sampling_keys(seeds, idx, pos)
    data = np.asarray(jax.vmap(jax.random.key_data)(keys))
    assert len({tuple(d) for d in data}) == 4
    # Same triple, different row order (slot placement): same key.
    perm = sampling_keys(seeds[::-1], idx[::-1], pos[::-1])
    np.testing.assert_array_equal(np.asarray(jax.vmap(jax.random.key_data)(perm))[::-1], data)


def test_same_seed_same_tokens_under_jit():
    logits = jax.random.normal(jax.random.key(2), (6, 40))
    fn = jax.jit(lambda lg, k: sample(lg, k, jnp.ones((6,)), jnp.full((6,), 0.97)).tokens)
    a = fn(logits, _keys(6, seed=11))
    b = fn(logits, _keys(6, seed=11))
    c = fn(logits, _keys(6, seed=12))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))

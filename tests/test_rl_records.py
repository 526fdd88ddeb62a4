"""The Rollout record contract and the rank-based top-p support replay."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcjax.rollout.records import (
    Rollout,
    order_keys,
    support_mask_at_threshold,
    support_mask_from_record,
)
from hcjax.rollout.sampling import sample, sampling_keys


def _reference_mask(x, n):
    order = np.argsort(-x, kind="stable")  # descending, ties by lower id
    out = np.zeros(x.shape, bool)
    out[order[: n if n > 0 else x.size]] = True
    return out


def test_support_mask_matches_stable_rank_with_ties():
    rng = np.random.default_rng(0)
    x = rng.integers(-2, 3, size=(64, 11)).astype(np.float32)  # many ties
    n = rng.integers(0, 12, size=(64,))
    got = np.asarray(support_mask_from_record(x, n))
    for i in range(64):
        np.testing.assert_array_equal(got[i], _reference_mask(x[i], n[i]), err_msg=f"row {i}")
    # hand case: ties at 1.0 broken by lower id.
    np.testing.assert_array_equal(
        support_mask_from_record(jnp.array([1.0, 3.0, 1.0, 1.0]), 3), [True, True, True, False])
    np.testing.assert_array_equal(
        support_mask_from_record(jnp.array([1.0, 3.0, 1.0, 1.0]), 2), [True, True, False, False])


@pytest.mark.parametrize("seed", range(4))
def test_support_mask_equals_the_sort_rank_on_real_valued_rows(seed):
    # Wide rows of floats of every sign and scale, with ties, ±0.0, ±inf and huge values, and every
    # n from 0 (no record) past the vocabulary.
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((40, 97)) * 10.0 ** rng.integers(-30, 30, (40, 1))).astype(np.float32)
    x[:, ::7] = x[:, 3:4]  # ties
    x[0, :5] = [0.0, -0.0, 0.0, -0.0, 1e-45]
    x[1, :4] = [np.inf, -np.inf, 3e38, -3e38]
    n = rng.integers(0, 100, size=(40,))
    n[:3] = [0, 97, 1]
    got = np.asarray(support_mask_from_record(x, n))
    jitted = np.asarray(jax.jit(support_mask_from_record)(x, n))
    for i in range(40):
        np.testing.assert_array_equal(got[i], _reference_mask(x[i] + 0.0, n[i]), err_msg=f"row {i}")
        np.testing.assert_array_equal(jitted[i], got[i], err_msg=f"row {i}, jitted")


def test_support_mask_at_the_recorded_threshold_equals_the_counted_one():
    # Exact mode rebuilds the kept set from the threshold the sampler recorded (the n-th largest
    # value) instead of counting for it: the same set, ties at the threshold included.
    rng = np.random.default_rng(7)
    x = rng.integers(-3, 4, size=(64, 23)).astype(np.float32)  # many ties
    x[:8] = rng.standard_normal((8, 23)).astype(np.float32)  # and rows without
    n = rng.integers(1, 24, size=(64,))
    nth = -np.sort(-x, axis=-1)[np.arange(64), n - 1]
    at = jax.jit(support_mask_at_threshold)
    np.testing.assert_array_equal(at(x, n, nth), support_mask_from_record(x, n))
    for i in range(64):
        np.testing.assert_array_equal(np.asarray(at(x, n, nth))[i], _reference_mask(x[i], n[i]))
    # n_kept 0 (no record) keeps every entry, as support_mask_from_record does.
    assert np.asarray(at(x[:2], np.zeros(2, np.int32), nth[:2])).all()


@pytest.mark.parametrize("jit", [False, True])
def test_signed_zeros_tie_in_the_support_order_also_under_jit(jit):
    # -0.0 and +0.0 are one value (the sampler's order): the tie goes to the lower id. Under jit
    # XLA drops an `x + 0.0`, which once left -0.0 ranked after +0.0 in the learner's rebuild.
    mask = jax.jit(support_mask_from_record) if jit else support_mask_from_record
    x = jnp.array([[-0.0, 0.0, -1.0], [0.0, -0.0, -1.0], [-1.0, -0.0, 0.0]])
    np.testing.assert_array_equal(mask(x, jnp.array([1, 1, 1])),
                                  [[True, False, False], [True, False, False],
                                   [False, True, False]])
    keys = (jax.jit(order_keys) if jit else order_keys)(jnp.array([-0.0, 0.0]))
    assert int(keys[0]) == int(keys[1])


def test_support_record_replays_the_sampler():
    logits = jax.random.normal(jax.random.key(1), (32, 50)) * 2.0
    temperature = jnp.full((32,), 0.7)
    keys = sampling_keys(jnp.arange(32), jnp.zeros(32, jnp.int32), jnp.zeros(32, jnp.int32))
    out = sample(logits, keys, temperature, jnp.full((32,), 0.9))
    scaled = logits / 0.7
    keep = support_mask_from_record(scaled, out.n_kept)
    assert np.all(np.asarray(keep)[np.arange(32), np.asarray(out.tokens)])
    logp = jax.nn.log_softmax(jnp.where(keep, scaled, -jnp.inf))  # the learner's replay
    lp = logp[jnp.arange(32), out.tokens]
    np.testing.assert_allclose(lp, out.logprobs, atol=1e-5)
    # The threshold is the smallest kept scaled logit.
    np.testing.assert_allclose(jnp.min(jnp.where(keep, scaled, jnp.inf), -1), out.threshold_logit)


def _fields(p=3, r=4, layers=2, k=2):
    return dict(prompt_ids=np.arange(p), response_ids=np.arange(r), logprobs=np.zeros(r),
                n_kept=np.ones(r), threshold_logit=np.zeros(r), loss_mask=np.ones(r),
                versions=np.zeros(r), finish_reason="stop",
                routing=np.zeros((layers, p + r - 1, k)))


def test_rollout_validation_names_the_field():
    r = Rollout(**_fields())
    assert r.input_len == 6 and r.prompt_ids.dtype == np.int32 and not r.aborted
    with pytest.raises(ValueError, match="logprobs shape \\(3,\\)"):
        Rollout(**{**_fields(), "logprobs": np.zeros(3)})
    with pytest.raises(ValueError, match="routing shape \\(2, 7, 2\\)"):
        Rollout(**{**_fields(), "routing": np.zeros((2, 7, 2))})
    with pytest.raises(ValueError, match="finish_reason='done'"):
        Rollout(**{**_fields(), "finish_reason": "done"})
    assert Rollout(**{**_fields(), "finish_reason": "aborted"}).aborted

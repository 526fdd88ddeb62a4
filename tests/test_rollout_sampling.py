"""Sampling with RL extras: kept set vs a numpy top-p reference, log-probs, keys, greedy; the
top-k candidate sampler against the full-sort reference, bit for bit, and its draw statistics."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcjax.rollout import sampling
from hcjax.rollout.sampling import SORT_UP_TO, sample_reference, sampling_keys, searched_rows
from hcjax.rollout.sampling import sample as sample_eager

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


# Candidate sampler vs full-sort reference --------------------------------------------------------


@functools.cache
def _fast(candidates, sort_up_to=0):
    """The candidate sampler with these levels (by default with the threshold search at every
    vocabulary, not the sort it uses up to SORT_UP_TO ids), one jitted function per setting so
    that tests of one setting and shape trace and compile it once."""
    return jax.jit(functools.partial(sample_eager, candidates=candidates, sort_up_to=sort_up_to))


def _both(candidates, sort_up_to=0):
    """`_fast(candidates, sort_up_to)` and the one-sort reference."""
    return _fast(candidates, sort_up_to), jax.jit(sample_reference)


def _assert_same(a, b):
    for name in ("tokens", "logprobs", "raw_logprobs", "n_kept", "threshold_logit"):
        np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)),
                                      err_msg=name)


def test_lax_top_k_breaks_ties_by_lower_index():
    # The kept-set definition (ties: lower id first) relies on this.
    vals, ids = jax.lax.top_k(jnp.array([[3.0, 1.0, 3.0, 3.0, 0.0, 3.0]]), 4)
    np.testing.assert_array_equal(np.asarray(ids), [[0, 2, 3, 5]])
    row = jnp.tile(jnp.array([1.0, 2.0, 2.0, 2.0]), 500)[None]
    _, ids = jax.lax.top_k(row, 6)
    np.testing.assert_array_equal(np.asarray(ids), [[1, 2, 3, 5, 6, 7]])


def test_blocked_top_k_is_lax_top_k_before_its_bound_and_first_argmax_is_argmax():
    """The ranking by blocks (used when 2 * 16 * m <= vocab: the m blocks with the largest maxima,
    by groups of 8 blocks when there are many, and the two largest entries of each) gives exactly
    lax.top_k's values and ids (ties: lower id) for every rank before its bound, and the bound is
    a token the candidates miss that lax.top_k ranks within the m: on continuous logits, heavy
    ties (where the bound falls early), sparse peaks among -inf, a head of tokens packed into a
    few blocks, and vocabularies that are not a multiple of the block (a padding block in the
    last group). The blocked argmax is jnp.argmax's first maximum."""
    from hcjax.rollout.records import order_keys
    from hcjax.rollout.sampling import _blocked_top_k, _first_argmax, _ranks_before

    rng = np.random.default_rng(11)
    blocked = jax.jit(_blocked_top_k, static_argnums=1)
    bounded = 0
    for v in (16384, 20001, 40000, 32 * 16 * 8 * 4 + 16 * 8 + 1):
        packed = rng.normal(size=(6, v))
        packed[:, 160:200] += 12.0  # 40 top tokens in 3 blocks (and 1 group)
        cases = [rng.normal(size=(6, v)), rng.integers(0, 4, size=(6, v)).astype(float),
                 np.where(rng.random((6, v)) < 2e-3, 3.0, -np.inf), packed]
        cases[2][:, -1] = 3.0  # a peak in the last, partial block
        for case, x in enumerate(cases):
            x = jnp.asarray(x, jnp.float32)
            for m in (1, 8, 32, 64):
                vals, ids, (bound_key, bound_id), lanes = blocked(x, m)
                ref_vals, ref_ids = jax.lax.top_k(x, m)
                # Each candidate's block, as the draw reads it (-inf past the vocabulary, also in
                # a padding block of the last group).
                padded = np.pad(np.asarray(x), ((0, 0), (0, -v % (16 * 8))),
                                constant_values=-np.inf)
                np.testing.assert_array_equal(
                    np.asarray(lanes), padded.reshape(6, -1, 16)[np.arange(6)[:, None],
                                                                 np.asarray(ids) // 16])
                before = np.asarray(_ranks_before(order_keys(vals), ids, bound_key[:, None],
                                                  bound_id[:, None]))
                # The exact ranks are a prefix, and the bound is a real token of the top m.
                assert np.all(before[:, :-1] >= before[:, 1:])
                np.testing.assert_array_equal(np.asarray(vals)[before], np.asarray(ref_vals)[before])
                np.testing.assert_array_equal(np.asarray(ids)[before], np.asarray(ref_ids)[before])
                for row in np.nonzero(~before.all(axis=1))[0]:
                    bounded += 1
                    first_missed = int(np.argmin(before[row]))
                    assert int(bound_id[row]) == int(ref_ids[row, first_missed]) or (
                        # a group's third block is bounded by its first id, at or before its
                        # first maximum
                        int(bound_id[row]) % 16 == 0
                        and int(bound_id[row]) <= int(ref_ids[row, first_missed]))
                if case == 0 and m <= 8:
                    assert before.all()  # continuous logits: 3 of the top 8 in a block is rare
            np.testing.assert_array_equal(np.asarray(jax.jit(_first_argmax)(x)),
                                          np.asarray(jnp.argmax(x, axis=-1)))
    assert bounded > 0  # the ties and the packed head did reach a bound


def test_top_indices_through_groups_equal_lax_top_k():
    """The m largest entries found through groups of 8 (recursively, when there are many) are
    lax.top_k's, ties to the lower index, in increasing index order: continuous values, heavy
    ties, -inf rows with few finite entries, and lengths that leave a partial last group."""
    from hcjax.rollout.sampling import _top_indices

    rng = np.random.default_rng(5)
    for n in (255, 256, 2048, 2053, 20001):
        cases = [rng.normal(size=(5, n)), rng.integers(0, 3, size=(5, n)).astype(float),
                 np.where(rng.random((5, n)) < 0.01, 1.0, -np.inf)]
        for x in cases:
            x = jnp.asarray(x, jnp.float32)
            for m in (1, 8, 32):
                got = np.asarray(jax.jit(_top_indices, static_argnums=1)(x, m))
                want = np.sort(np.asarray(jax.lax.top_k(x, m)[1]), axis=-1)
                np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_signed_zeros_tie_at_the_top_on_every_path():
    """-0.0 and +0.0 are one value in the kept-set order (the reference's sort), so a tie between
    them goes to the lower id, whichever path ranks them: `lax.top_k` alone orders +0.0 first."""
    b, v = 4, 5000
    x = np.full((b, v), -3.0, np.float32)
    x[:, 7], x[:, 40] = -0.0, 0.0  # the top two: -0.0 at the lower id
    x[1, 7], x[1, 40] = 0.0, -0.0
    x[2, 8:40] = -0.0  # a run of -0.0 after the first
    keys = _keys(b, seed=4)
    temperature = jnp.ones((b,))
    reference = jax.jit(sample_reference)
    fasts = [_both(candidates, sort_up_to)[0]  # one compile each, for both top_p
             for candidates, sort_up_to in [((1,), 0), ((4,), 0), ((32,), 0), ((1000,), 0),
                                            ((8,), 2 * v)]]
    for top_p in (1e-6, 0.5):
        p = jnp.full((b,), top_p)
        ref = reference(jnp.asarray(x), keys, temperature, p)
        for fast in fasts:
            _assert_same(fast(jnp.asarray(x), keys, temperature, p), ref)
        if top_p < 0.01:
            np.testing.assert_array_equal(np.asarray(ref.tokens), 7)
            np.testing.assert_array_equal(np.asarray(ref.n_kept), 1)


def test_first_argmax_from_given_block_maxima_and_logsumexp_from_the_row_maximum():
    """The greedy draw's argmax from `_prepare`'s 16-id block maxima (groups of 8 blocks, the
    last padded) equals jnp.argmax, ties and -inf rows included; the log-normaliser from the row
    maximum equals jax.nn.logsumexp to the bit, rows of -inf included."""
    from hcjax.rollout.sampling import _block_maxima, _first_argmax, _logsumexp

    rng = np.random.default_rng(5)
    for v in (129, 272, 3001, 32000):
        x = rng.integers(0, 5, size=(7, v)).astype(np.float32)
        x[1] = rng.normal(size=v)
        x[2, v // 3] = 7.0  # one peak, the rest tied
        x[3] = -np.inf
        x[4, -1] = 9.0  # in the last, partial block and group
        x = jnp.asarray(x)
        got = jax.jit(lambda x: _first_argmax(x, _block_maxima(x)))(x)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=-1)))
        lse = jax.jit(lambda x: _logsumexp(x, jnp.max(_block_maxima(x), axis=-1)))(x)
        np.testing.assert_array_equal(np.asarray(lse),
                                      np.asarray(jax.jit(jax.nn.logsumexp, static_argnums=1)(
                                          x, -1)))


def _mixed_batch(rng, b, v):
    """Rows of every kind: peaked (nucleus inside few candidates), flat (needs a wide set or the
    threshold search), quantised logits (many ties), greedy, top_p 1, tiny top_p."""
    scale = rng.choice([0.3, 1.0, 4.0, 12.0], size=(b, 1))
    logits = rng.normal(size=(b, v)) * scale
    logits[::3] = np.round(logits[::3] * 2.0) / 2.0  # ties
    temperature = rng.choice([0.0, 0.5, 1.0, 1.7], size=b)
    top_p = rng.choice([1e-6, 0.3, 0.8, 0.95, 0.999, 1.0], size=b)
    return (jnp.asarray(logits, jnp.float32), jnp.asarray(temperature, jnp.float32),
            jnp.asarray(top_p, jnp.float32))


# sort_up_to=0 forces the threshold search; SORT_UP_TO sorts the last level up to 4096 ids (at
# 20000 ids the default searches too, so that case is the first one's).
@pytest.mark.parametrize("v,candidates,sort_up_to", [
    *[(v, c, s) for v, c in [(7, (16,)), (50, (4, 16)), (300, (8, 64)), (3000, (64, 1024))]
      for s in (0, SORT_UP_TO)],
    (20000, (8, 64), 0)])
def test_candidate_sampler_equals_full_sort_reference(v, candidates, sort_up_to):
    fast, ref = _both(candidates, sort_up_to)
    rng = np.random.default_rng(v)
    b = 48
    for trial in range(4):
        logits, temperature, top_p = _mixed_batch(rng, b, v)
        keys = _keys(b, seed=trial)
        a, r = fast(logits, keys, temperature, top_p), ref(logits, keys, temperature, top_p)
        _assert_same(a, r)
        # The batch really mixes levels: some rows decided inside the first candidates, some not.
        n = np.asarray(r.n_kept)
        if v > candidates[-1]:
            assert n.min() <= candidates[0] < candidates[-1] < n.max()
    # Few rows past the first level (gathered into a small batch: 1 row, b/16 = 3 or b/4 = 12).
    for flat_rows in (1, 3, 8):
        logits, _, _ = _mixed_batch(rng, b, v)
        flat = np.arange(b) < flat_rows
        logits = jnp.where(flat[:, None], logits * 0.01, logits * 20.0)
        temperature = jnp.where(flat, 1.0, jnp.asarray(rng.choice([0.0, 1.0], size=b)))
        top_p = jnp.full((b,), 0.99, jnp.float32)  # not weakly typed: no second compile
        keys = _keys(b, seed=10 + flat_rows)
        a, r = fast(logits, keys, temperature, top_p), ref(logits, keys, temperature, top_p)
        _assert_same(a, r)
        if v > candidates[0]:
            assert np.all(np.asarray(r.n_kept)[:flat_rows] > candidates[0])


@pytest.mark.slow
def test_each_level_gives_the_same_row_result():
    """A row's draw does not depend on the candidate sizes, i.e. on which level (first
    candidates, wider, threshold search) decided it, nor on the other rows of its batch."""
    rng = np.random.default_rng(5)
    v, b = 400, 16
    logits, temperature, top_p = _mixed_batch(rng, b, v)
    keys = _keys(b, seed=3)
    outs = [_fast(c, s)(logits, keys, temperature, top_p)
            for c, s in [((4,), 0), ((4,), SORT_UP_TO), ((4, 32), 0), ((v,), SORT_UP_TO),
                         ((4, 32, 128), 0)]]
    for out in outs[1:]:
        # Fixed-point masses: the kept mass is the same integer whichever level summed it.
        _assert_same(out, outs[0])
    # Alone in its batch (the others greedy: no level runs for them), each row is bit-identical.
    one_level = _fast((4,), 0)  # outs[0]'s program
    for row in range(b):
        only = jnp.where(jnp.arange(b) == row, temperature, 0.0)
        alone = one_level(logits, keys, only, top_p)
        for name in ("tokens", "logprobs", "n_kept", "threshold_logit"):
            assert np.asarray(getattr(alone, name))[row] == np.asarray(getattr(outs[0], name))[row]


def test_defaults_follow_the_platform_tuning(monkeypatch):
    """`sample`'s candidates and sort_up_to default to `SAMPLER_TUNING` of the platform compiled
    for: a platform tuned otherwise sends other rows to the threshold search and draws the same."""
    rng = np.random.default_rng(5)
    logits, temperature, top_p = _mixed_batch(rng, 16, 400)
    keys = _keys(16, seed=3)
    args = (logits, keys, temperature, top_p)

    def traced_now(fn):
        """`fn` jitted through a new function, so traced under the tuning in force now:
        `jax.jit(fn)` again would reuse an earlier trace of `fn` for the same shapes."""
        return jax.jit(lambda *args: fn(*args))

    cpu_searched, cpu_out = traced_now(searched_rows)(*args), sample(*args)
    assert not np.any(cpu_searched)  # 400 ids <= SORT_UP_TO: the CPU's last level sorts
    monkeypatch.setattr(sampling, "backend", lambda: "gpu")
    monkeypatch.setitem(sampling.SAMPLER_TUNING, "gpu", ((4,), 0))
    gpu_searched = traced_now(searched_rows)(*args)
    searched_4 = jax.jit(functools.partial(searched_rows, candidates=(4,), sort_up_to=0))
    np.testing.assert_array_equal(gpu_searched, searched_4(*args))
    assert np.any(gpu_searched)
    _assert_same(traced_now(sample_eager)(*args), cpu_out)  # the "gpu" tuning's draw


def test_greedy_and_top_p_one_rows_match_reference_with_ties():
    logits = jnp.array([[0.0, 2.0, 2.0, -1.0, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0],
                        [5.0, 4.0, 5.0, 0.0, 0.0]])
    keys = _keys(3, seed=9)
    fast, ref = _both((2,))
    for temperature, top_p in [(0.0, 0.5), (1.0, 1.0), (0.8, 1e-6), (1.0, 0.5)]:
        t, p = jnp.full((3,), temperature), jnp.full((3,), top_p)
        a = fast(logits, keys, t, p)
        _assert_same(a, ref(logits, keys, t, p))
    greedy = sample(logits, keys, jnp.zeros((3,)), jnp.full((3,), 0.97))
    np.testing.assert_array_equal(np.asarray(greedy.tokens), [1, 0, 0])
    np.testing.assert_array_equal(np.asarray(greedy.threshold_logit), [2.0, 1.0, 5.0])
    whole = sample(logits, keys, jnp.ones((3,)), jnp.ones((3,)))
    np.testing.assert_array_equal(np.asarray(whole.n_kept), 5)
    np.testing.assert_array_equal(np.asarray(whole.threshold_logit), [-1.0, 1.0, 0.0])
    np.testing.assert_allclose(np.asarray(whole.logprobs), np.asarray(whole.raw_logprobs),
                               rtol=1e-6)


# Only the nucleus past the first candidates reaches the last level (sort or search): the others
# run once.
@pytest.mark.parametrize("top_p,n_range,sort_up_to", [
    (0.5, (1, 8), 0), (0.9, (9, 199), 0), (0.9, (9, 199), SORT_UP_TO), (1.0, (200, 200), 0)])
def test_candidate_sampler_frequencies_match_truncated_softmax(top_p, n_range, sort_up_to):
    """Empirical frequencies of one row drawn with many keys, with the nucleus inside the first
    candidates, past them (decided by the threshold search), and the whole vocabulary."""
    v, n = 200, 20000
    z = np.zeros(v)
    z[:3] = [6.0, 5.5, 5.0]
    z[3:] = np.linspace(1.0, 0.0, v - 3)
    z = z[np.random.default_rng(0).permutation(v)]
    keys = sampling_keys(jnp.full((n,), 7), jnp.arange(n), jnp.zeros((n,), jnp.int32))
    fn = _fast((8,), sort_up_to)
    # All 20000 rows at once: the threshold search takes them one at a time (all at once, its
    # two 65536-bin histograms per row came to 10 GB).
    rows = jnp.tile(jnp.asarray(z, jnp.float32), (n, 1))
    out = fn(rows, keys, jnp.ones((n,)), jnp.full((n,), top_p))
    kept, _ = reference_top_p(z, 1.0, top_p)
    np.testing.assert_array_equal(np.asarray(out.n_kept), len(kept))
    assert n_range[0] <= len(kept) <= n_range[1]
    p = np.zeros(v)
    p[kept] = np.exp(z[kept] - z[kept].max())
    p /= p.sum()
    freq = np.bincount(np.asarray(out.tokens), minlength=v) / n
    assert freq[p == 0].sum() == 0
    # Binomial standard error per token; 5 sigma plus a floor for the small ones.
    np.testing.assert_array_less(np.abs(freq - p), 5 * np.sqrt(p * (1 - p) / n) + 1e-3)
    np.testing.assert_allclose(np.exp(np.asarray(out.logprobs)), p[np.asarray(out.tokens)],
                               rtol=1e-4)


def test_threshold_search_on_ties_and_a_total_short_of_top_p():
    """The search's edge cases, against the sort and by hand: the threshold falls inside a run of
    tied logits (kept in id order while the mass before them is below top_p), and the rounded
    masses of the whole row sum to less than the largest float32 top_p below 1 (1001 equal
    logits: 1001 * round(2^30 / 1001) = 2^30 - 155), so the whole vocabulary is kept."""
    v = 1001
    logits = np.zeros((4, v), np.float32)
    logits[1, ::2] = 1.0  # two levels of ties
    logits[2, 500:] = -0.0  # signed zeros tie with +0.0
    logits[3, 700] = 3.0
    below_one = np.nextafter(np.float32(1.0), np.float32(0.0))
    fast, ref = _both((4,))
    keys = _keys(4, seed=21)
    outs = {}
    for top_p in (0.5, below_one):
        t, p = jnp.ones((4,)), jnp.full((4,), top_p, jnp.float32)
        outs[top_p] = fast(jnp.asarray(logits), keys, t, p)
        _assert_same(outs[top_p], ref(jnp.asarray(logits), keys, t, p))
    half, whole = outs[0.5], outs[below_one]
    # Uniform rows: mass before rank r is r/1001 < 0.5 for r <= 500; the lowest ids are kept.
    np.testing.assert_array_equal(np.asarray(half.n_kept)[[0, 2]], 501)
    assert int(half.tokens[0]) <= 500 and int(half.tokens[2]) <= 500
    np.testing.assert_array_equal(np.asarray(whole.n_kept)[[0, 2]], v)
    for row in (1, 3):  # no mass on the boundary: the float64 loop agrees
        kept, _ = reference_top_p(logits[row], 1.0, 0.5)
        assert int(half.n_kept[row]) == len(kept)
        assert int(half.tokens[row]) in kept


def test_threshold_search_row_by_row_equals_reference_and_bounds_memory():
    """However many rows reach the threshold search (one, a few, every row; flat rows anywhere in
    the batch, some at other temperatures), it searches them one at a time with the same results
    as the sort; and the compiled sampler's scratch memory stays a small multiple of the logits
    (a batched search held two 65536-bin histograms and several row-sized arrays per row)."""
    rng = np.random.default_rng(17)
    b, v = 40, 600
    ref = jax.jit(sample_reference)
    fast = _fast((8,), 0)
    for flat_rows in (1, 5, 13, 40):
        logits, _, _ = _mixed_batch(rng, b, v)
        flat = rng.permutation(np.arange(b) < flat_rows)
        logits = jnp.where(flat[:, None], logits * 0.01, logits * 20.0)
        temperature = jnp.where(flat, 1.0, jnp.asarray(rng.choice([0.0, 0.7, 1.0], size=b)))
        top_p = jnp.full((b,), 0.99)
        keys = _keys(b, seed=30 + flat_rows)
        r = ref(logits, keys, temperature, top_p)
        _assert_same(fast(logits, keys, temperature, top_p), r)
        assert np.all(np.asarray(r.n_kept)[flat] > 8)

    def scratch(rows):
        args = (jax.ShapeDtypeStruct((rows, 8192), jnp.float32), _keys(rows),
                jnp.ones((rows,)), jnp.ones((rows,)))
        return jax.jit(sample_eager).lower(*args).compile().memory_analysis().temp_size_in_bytes

    # Per row: the scaled copy (temperatures other than 0 and 1) and a few [rows, V / 16] block
    # arrays; the search's arrays and histograms are one row's, whatever the batch. (Searching
    # every row at once: 20x the logits.)
    row_bytes = 8192 * 4
    few, many = scratch(16), scratch(256)
    assert many < 1.5 * 256 * row_bytes, many
    assert many - few < 1.4 * 240 * row_bytes, (few, many)


def test_searched_rows_are_the_rows_past_the_candidates():
    """`searched_rows` names the rows that take the whole-row threshold search: a flat row's
    nucleus, wider than the 32 candidates, and a narrow nucleus the candidates miss part of (the
    third of three top tokens in one 16-id block ranks inside it, and the candidates hold only
    each block's two largest); not a confident row, that narrow row at a smaller top_p, a greedy
    row or a top_p = 1 row. The draws of all of them equal the full sort's."""
    rng = np.random.default_rng(5)
    b, v = 6, 2 * SORT_UP_TO  # above SORT_UP_TO: the search, not a sort, is the last resort
    logits = rng.normal(size=(b, v)).astype(np.float32) * 0.1
    logits[0, [7, 3000, 6000]] += 30.0  # confident: three tokens in three blocks
    logits[1] *= 0.01  # flat
    # Two tokens at 30 hold 99.2% (ids 160, 161), then id 162 at 25 in the same block, then four
    # tokens at 24 in other blocks: at top_p 0.996 the nucleus is 160, 161, 162 and the first at
    # 24; the candidates (160, 161 and the four) reach the target without 162 at their fifth, and
    # 162 ranks before it.
    for row in (2, 5):
        logits[row, [160, 161]] += 30.0
        logits[row, 162] += 25.0
        logits[row, [5000, 5100, 5200, 5300]] += 24.0
    logits[3] *= 0.01  # flat but greedy
    logits[4] *= 0.01  # flat with top_p = 1
    x = jnp.asarray(logits)
    temperature = jnp.asarray([1.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    top_p = jnp.asarray([0.97, 0.97, 0.996, 0.97, 1.0, 0.9])
    keys = _keys(b, seed=3)
    searched = np.asarray(jax.jit(searched_rows)(x, keys, temperature, top_p))
    np.testing.assert_array_equal(searched, [False, True, True, False, False, False])
    out, ref = sample(x, keys, temperature, top_p), jax.jit(sample_reference)(x, keys, temperature,
                                                                              top_p)
    _assert_same(out, ref)
    assert int(ref.n_kept[2]) == 4 and int(ref.n_kept[5]) == 2
    # Temperatures other than 0 and 1 take the dividing branch: the same rows are searched.
    np.testing.assert_array_equal(
        np.asarray(jax.jit(searched_rows)(x * 2.0, keys, temperature * 2.0, top_p)), searched)


def test_threefry_in_plain_arithmetic_equals_jax_primitive():
    from jax.extend.random import threefry2x32_p

    from hcjax.rollout.gumbel import threefry2x32

    words = jax.random.bits(jax.random.key(4), (4, 3, 1000), jnp.uint32)
    words = words.at[:, 0, :4].set(jnp.array([0, 0xFFFFFFFF, 1, 0x80000000], jnp.uint32))
    ours = jax.jit(threefry2x32)(*words)
    theirs = threefry2x32_p.bind(*words)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

"""pallas_kernels.batch_invariant: each form agrees with its plain reference to rounding, and a
row's result keeps its bits whatever else shares the call (row count, its place among the rows,
the length of the key buffer its query attends over)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import batch_invariant as bi
from pallas_kernels.self_attention import attention_mask, gqa_attention

ROW_COUNTS = (1, 2, 7, 8, 33, 130)


def _row_bits(fn, rows: np.ndarray, target: np.ndarray, dtype) -> set[bytes]:
    """The bits of fn's output row for `target`, placed first, in the middle and last among
    `ROW_COUNTS` rows (the others from `rows`)."""
    jitted = jax.jit(fn)
    seen = set()
    for m in ROW_COUNTS:
        for at in sorted({0, m // 2, m - 1}):
            x = rows[:m].copy()
            x[at] = target
            out = np.asarray(jitted(jnp.asarray(x, dtype)).astype(jnp.float32))
            seen.add(out[at].tobytes())
    return seen


def test_tree_sum_is_a_sum_whose_prefix_bits_ignore_trailing_zeros():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 37)).astype(np.float32)
    np.testing.assert_allclose(bi.tree_sum(jnp.asarray(x)), x.sum(-1), rtol=1e-5)
    # The sum of 37 entries equals, to the bit, the sum of them padded with zeros to 40, 64, 100.
    base = np.asarray(bi.tree_sum(jnp.asarray(x)))
    for n in (40, 64, 100):
        padded = np.pad(x, ((0, 0), (0, n - 37)))
        assert np.array_equal(np.asarray(bi.tree_sum(jnp.asarray(padded))), base)
    assert np.array_equal(np.asarray(bi.tree_sum(jnp.asarray(x.T), axis=0)), base)
    assert bi.tree_sum(jnp.zeros((2, 0))).shape == (2,)


def test_sums_of_an_aligned_span_keep_their_bits_among_zeros():
    """tree_sum and product_sum: 11 entries at offset 0 of 16 or 40, or at offset 16 (a multiple
    of their span, 16) of 64 with zeros around them, give one sum to the bit; product_sum is
    Σ a·b to rounding, with b broadcast along the summed axis or not."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 11)).astype(np.float32)
    y = rng.standard_normal((4, 11)).astype(np.float32)

    def placed(v, n, offset):
        return jnp.asarray(np.pad(v, ((0, 0), (offset, n - offset - 11))))

    for total in (bi.tree_sum, lambda v: bi.product_sum(v, placed(y, v.shape[1], 0))):
        outs = [np.asarray(total(placed(x, n, 0))) for n in (11, 16, 40)]
        if total is bi.tree_sum:
            outs.append(np.asarray(total(placed(x, 64, 16))))
        assert len({o.tobytes() for o in outs}) == 1
    spans = [np.asarray(bi.product_sum(placed(x, n, off), placed(y, n, off)))
             for n, off in ((16, 0), (64, 16), (64, 48))]
    assert len({o.tobytes() for o in spans}) == 1
    np.testing.assert_allclose(spans[0], np.sum(x * y, -1), rtol=1e-5, atol=1e-6)
    # b broadcast along the summed axis ([.., 1]) and a sum along a leading axis.
    np.testing.assert_allclose(bi.product_sum(jnp.asarray(x), jnp.asarray(y[:, :1])),
                               np.sum(x * y[:, :1], -1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bi.product_sum(jnp.asarray(x.T), jnp.asarray(y.T), axis=0),
                               np.sum(x * y, -1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", ["tiles", "pallas"])
def test_project_rows_keep_their_bits_whatever_the_batch(dtype, impl):
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((96, 40)) / 10, dtype)
    rows = rng.standard_normal((130, 96)).astype(np.float32)
    target = rng.standard_normal(96).astype(np.float32)
    seen = _row_bits(lambda x: bi.project(x, w, tile=8, impl=impl), rows, target, dtype)
    assert len(seen) == 1
    got = bi.project(jnp.asarray(rows, dtype), w, tile=8, impl=impl)
    want = jnp.asarray(rows, dtype).astype(jnp.float32) @ w.astype(jnp.float32)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=tol, atol=tol)


def test_project_heads_layout_fp32_out_and_its_gradient():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 5, 3, 4)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 4, 6)), jnp.float32)
    got = bi.project(x, w, 2, tile=4)
    np.testing.assert_allclose(got, jnp.einsum("btij,ijo->bto", x, w), rtol=1e-5, atol=1e-5)
    assert bi.project(x.astype(jnp.bfloat16), w, 2, tile=4,
                      out_dtype=jnp.float32).dtype == jnp.float32

    def loss(form):
        return lambda x, w: jnp.sum(jnp.sin(form(x, w)))

    exact = jax.grad(loss(lambda x, w: bi.project(x, w, 2, tile=4)), argnums=(0, 1))(x, w)
    plain = jax.grad(loss(lambda x, w: jnp.einsum("btij,ijo->bto", x, w)), argnums=(0, 1))(x, w)
    for a, b in zip(exact, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_bad_tile_and_shapes_are_named():
    x, w = jnp.ones((3, 4)), jnp.ones((4, 2))
    with pytest.raises(ValueError, match="tile=0"):
        bi.project(x, w, tile=0)
    with pytest.raises(ValueError, match=r"x.shape=\(3, 4\)"):
        bi.project(x, jnp.ones((5, 2)))
    with pytest.raises(ValueError, match="impl='nope'"):
        bi.project(x, w, impl="nope")
    q = jnp.ones((1, 2, 3, 4))
    with pytest.raises(ValueError, match="3 keys for 2 queries"):
        bi.attention(q, jnp.ones((1, 3, 3, 4)), jnp.ones((1, 3, 3, 4)),
                     jnp.ones((1, 2, 3), bool), causal=True)


def test_norm_logsumexp_and_softmax_rows_keep_their_bits():
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((130, 300)).astype(np.float32)
    target = rng.standard_normal(300).astype(np.float32)
    for fn in (lambda x: bi.rms_norm(x, 1e-6), bi.logsumexp, bi.softmax):
        assert len(_row_bits(fn, rows, target, jnp.float32)) == 1
    x = jnp.asarray(rows)
    np.testing.assert_allclose(bi.logsumexp(x), jax.nn.logsumexp(x, -1), rtol=1e-6)
    np.testing.assert_allclose(bi.softmax(x), jax.nn.softmax(x, -1), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(bi.rms_norm(x, 1e-6),
                               x / np.sqrt(np.mean(rows**2, -1, keepdims=True) + 1e-6), rtol=1e-5)
    masked = jnp.where(jnp.arange(300) < 3, x, -jnp.inf)
    np.testing.assert_allclose(bi.logsumexp(masked), jax.nn.logsumexp(masked, -1), rtol=1e-6)
    assert np.isneginf(np.asarray(bi.logsumexp(jnp.full((2, 5), -jnp.inf)))).all()


def _attention_inputs(rng, b, t, s, hq=4, hkv=2, d=8):
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.float32)
    return q, k, v


@pytest.mark.parametrize("window", [None, 5])
def test_attention_matches_gqa_attention_with_and_without_sinks(window):
    rng = np.random.default_rng(4)
    q, k, v = _attention_inputs(rng, 2, 19, 19)
    pos = jnp.broadcast_to(jnp.arange(19), (2, 19))
    mask = attention_mask(pos, pos, None, None, window)
    sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
    for s in (None, sinks):
        got = bi.attention(q, k, v, mask, sinks_h=s)
        np.testing.assert_allclose(got, gqa_attention(q, k, v, mask, sinks_h=s), rtol=1e-5,
                                   atol=1e-6)
    # The backward is gqa_attention's.
    def grads(form):
        return jax.grad(lambda q, k, v: jnp.sum(jnp.sin(form(q, k, v, mask))),
                        argnums=(0, 1, 2))(q, k, v)

    grads = [grads(bi.attention), grads(gqa_attention)]
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_query_gets_the_same_bits_in_a_cache_and_in_a_packed_row(dtype):
    """One sequence of 11 tokens: its last query attended over a decode cache of 16 or 40
    slots (index = position, the rest empty) and inside a packed training row where it starts
    at offset 16 (a multiple of its power-of-two span, 16) beside another sequence."""
    rng = np.random.default_rng(5)
    n, hq, hkv, d = 11, 4, 2, 8
    q_all, k_seq, v_seq = (x.astype(dtype) for x in _attention_inputs(rng, 1, n, n))
    q = q_all[:, -1:]
    outs = []
    for slots in (16, 40):
        k = jnp.zeros((1, slots, hkv, d), dtype).at[:, :n].set(k_seq)
        v = jnp.zeros((1, slots, hkv, d), dtype).at[:, :n].set(v_seq)
        k_pos = jnp.where(jnp.arange(slots) < n, jnp.arange(slots), -1)[None]
        mask = attention_mask(jnp.asarray([[n - 1]]), k_pos, None, None, None)
        outs.append(bi.attention(q, k, v, mask))
    # Packed row of 32: a 16-token segment at 0, ours at 16..26, padding after.
    other_q, other_k, other_v = (x.astype(dtype) for x in _attention_inputs(rng, 1, 16, 16))
    row_q = jnp.zeros((1, 32, hq, d), dtype).at[:, :16].set(other_q).at[:, 16:27].set(q_all)
    row_k = jnp.zeros((1, 32, hkv, d), dtype).at[:, :16].set(other_k).at[:, 16:27].set(k_seq)
    row_v = jnp.zeros((1, 32, hkv, d), dtype).at[:, :16].set(other_v).at[:, 16:27].set(v_seq)
    seg = jnp.asarray([[1] * 16 + [2] * 11 + [0] * 5])
    pos = jnp.asarray([list(range(16)) + list(range(11)) + [-1] * 5])
    mask = attention_mask(pos, pos, seg, seg, None)
    outs.append(bi.attention(row_q, row_k, row_v, mask)[:, 26:27])
    bits = {np.asarray(o.astype(jnp.float32)).tobytes() for o in outs}
    assert len(bits) == 1
    want = gqa_attention(q_all, k_seq, v_seq, attention_mask(
        jnp.arange(n)[None], jnp.arange(n)[None], None, None, None))[:, -1:]
    np.testing.assert_allclose(np.asarray(outs[0], np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2)


def test_grouped_project_rows_keep_their_bits_and_match_a_per_row_product():
    rng = np.random.default_rng(6)
    w = jnp.asarray(rng.standard_normal((5, 12, 7)), jnp.float32)
    x = rng.standard_normal((40, 12)).astype(np.float32)
    groups = rng.integers(0, 5, 40)
    want = np.einsum("ak,akn->an", x, np.asarray(w)[groups])

    def run(rows, grp):
        layout = bi.grouped_layout(jnp.asarray(grp), 5, 4)
        return np.asarray(bi.grouped_project(jnp.asarray(rows), w, layout, tile=4))

    got = run(x, groups)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Row 3 alone, and among the first 9 rows: the same bits as among all 40.
    assert np.array_equal(run(x[3:4], groups[3:4])[0], got[3])
    assert np.array_equal(run(x[:9], groups[:9])[3], got[3])

    def loss(x_, w_):
        layout = bi.grouped_layout(jnp.asarray(groups), 5, 4)
        return jnp.sum(jnp.sin(bi.grouped_project(x_, w_, layout, tile=4)))

    # The backward runs on the forward's tiles: both gradients against the per-row product's.
    grads = jax.grad(loss, argnums=(0, 1))(jnp.asarray(x), w)
    ref = jax.grad(lambda x_, w_: jnp.sum(jnp.sin(jnp.einsum("ak,akn->an", x_, w_[groups]))),
                   argnums=(0, 1))(jnp.asarray(x), w)
    for got_grad, want_grad in zip(grads, ref):
        np.testing.assert_allclose(got_grad, want_grad, rtol=1e-4, atol=1e-5)

"""Paged decode attention: the Pallas kernels (interpret mode) vs the jnp reference, and the
reference vs the full-cache decode reference on the same keys laid out in pages."""

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

B, D = 4, 16


def _paged_inputs(hq, hkv, page_size, max_pages, lengths, seed=0, dtype=jnp.float32):
    """Full caches [B, max_pages * page_size, Hkv, D] and the same keys scattered into a shuffled
    pool with a spare page; entries past a slot's pages point at page 0 (never read)."""
    rng = np.random.default_rng(seed)
    s = max_pages * page_size
    q = jnp.asarray(rng.standard_normal((B, hq, D)), dtype)
    k = rng.standard_normal((B, s, hkv, D)).astype(np.float32)
    v = rng.standard_normal((B, s, hkv, D)).astype(np.float32)
    num_pages = B * max_pages + 1
    order = rng.permutation(np.arange(1, num_pages))  # page 0 stays spare
    k_pages = rng.standard_normal((num_pages, page_size, hkv, D)).astype(np.float32)
    v_pages = rng.standard_normal((num_pages, page_size, hkv, D)).astype(np.float32)
    table = np.zeros((B, max_pages), np.int32)
    for b, n in enumerate(lengths):
        used = -(-n // page_size)
        for i in range(used):
            page = order[b * max_pages + i]
            table[b, i] = page
            k_pages[page] = k[b, i * page_size : (i + 1) * page_size]
            v_pages[page] = v[b, i * page_size : (i + 1) * page_size]
    as_dtype = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return (q, as_dtype(k), as_dtype(v), as_dtype(k_pages), as_dtype(v_pages),
            jnp.asarray(table), jnp.asarray(lengths, jnp.int32))


def _close(actual, expected, tol):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert actual.shape == expected.shape
    err = np.abs(actual - expected).max() / max(1.0, np.abs(expected).max())
    assert err <= tol, f"relative max error {err} > {tol}"


@pytest.mark.parametrize("window", [None, 5])
def test_reference_matches_full_cache_reference(window):
    q, k, v, kp, vp, table, lengths = _paged_inputs(4, 2, 8, 4, [0, 1, 17, 32])
    want = pk.decode_attention_reference(q, k, v, lengths, window=window, ring=False)
    got = pk.paged_decode_attention_reference(q, kp, vp, table, lengths, window=window)
    _close(got, want, 1e-6)
    assert np.all(np.asarray(got)[0] == 0)  # length 0: zeros


@pytest.mark.parametrize("lowering", ["gpu", "tpu"])
@pytest.mark.parametrize(
    "hq,hkv,page_size,max_pages,lengths,window",
    [
        (4, 2, 16, 4, [0, 1, 17, 64], None),  # GQA, ragged, one slot full
        (8, 1, 32, 3, [33, 5, 96, 64], None),  # multi-query, page boundary lengths
        (4, 4, 16, 5, [3, 80, 41, 16], 20),  # MHA with a window
    ],
)
def test_kernel_matches_reference(lowering, hq, hkv, page_size, max_pages, lengths, window):
    q, _, _, kp, vp, table, n = _paged_inputs(hq, hkv, page_size, max_pages, lengths, seed=1)
    want = pk.paged_decode_attention_reference(q, kp, vp, table, n, window=window)
    got = pk.paged_decode_attention(q, kp, vp, table, n, window=window, impl="pallas",
                                    interpret=True, lowering=lowering)
    _close(got, want, 2e-5)


def test_tpu_kernel_small_pages_bf16():
    """Pages of 8 (the TPU kernel takes any page size) and a bf16 pool."""
    q, _, _, kp, vp, table, n = _paged_inputs(4, 2, 8, 6, [7, 8, 9, 48], seed=2,
                                              dtype=jnp.bfloat16)
    want = pk.paged_decode_attention_reference(q, kp, vp, table, n)
    got = pk.paged_decode_attention(q, kp, vp, table, n, impl="pallas", interpret=True,
                                    lowering="tpu")
    _close(got, want, 2e-2)


def test_bad_shapes_raise_clear_errors():
    q, _, _, kp, vp, table, n = _paged_inputs(4, 2, 16, 2, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="page_table.shape"):
        pk.paged_decode_attention(q, kp, vp, table[:2], n)
    with pytest.raises(ValueError, match="page_size=8"):
        kp8 = kp.reshape(-1, 8, 2, D)
        pk.paged_decode_attention(q, kp8, kp8, table, n, impl="pallas", lowering="gpu")
    with pytest.raises(ValueError, match="impl='nope'"):
        pk.paged_decode_attention(q, kp, vp, table, n, impl="nope")

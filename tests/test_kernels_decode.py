"""Decode attention: Pallas kernel (interpret mode) vs the jnp reference, the reference vs numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

B, D, S = 4, 16, 48


def _inputs(hq, hkv, dtype, s=S, seed=0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (B, hq, D), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, s, hkv, D), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, s, hkv, D), jnp.float32).astype(dtype)
    return q, k, v


def _numpy_decode(q, k, v, lengths, window, ring):
    """Spells out both layouts: which cache slots hold positions the new token may see."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s, hkv = k.shape[1], k.shape[2]
    group = q.shape[1] // hkv
    out = np.zeros_like(q)
    for b, length in enumerate(np.asarray(lengths)):
        if ring:  # position p lives in slot p % s; the last min(length, s) positions are there
            slots = sorted({p % s for p in range(max(0, length - s), length)})
        else:
            first = 0 if window is None else max(0, length - window)
            slots = list(range(first, min(length, s)))
        if not slots:
            continue
        for h in range(q.shape[1]):
            scores = k[b, slots, h // group] @ q[b, h] / np.sqrt(q.shape[2])
            p = np.exp(scores - scores.max())
            out[b, h] = (p / p.sum()) @ v[b, slots, h // group]
    return out


def _close(actual, expected, tol):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert actual.shape == expected.shape
    err = np.abs(actual - expected).max() / max(1.0, np.abs(expected).max())
    assert err <= tol, f"relative max error {err} > {tol}"


@pytest.mark.parametrize(
    "lengths,window,ring",
    [
        ([0, 1, 30, 48], None, False),  # full cache, global layer
        ([0, 3, 30, 48], 7, False),  # full cache with a window
        ([0, 5, 48, 130], None, True),  # ring buffer past wrap-around
        ([2, 47, 48, 100], S, None),  # window == S: ring layout inferred
    ],
)
def test_reference_matches_numpy(lengths, window, ring):
    q, k, v = _inputs(4, 2, jnp.float32)
    lengths = jnp.asarray(lengths, jnp.int32)
    out = pk.decode_attention_reference(q, k, v, lengths, window=window, ring=ring)
    want = _numpy_decode(q, k, v, lengths, window, ring if ring is not None else window == S)
    np.testing.assert_allclose(out, want, atol=1e-5)
    assert not np.asarray(out)[np.asarray(lengths) == 0].any(), "empty slots must give zeros"


@pytest.mark.parametrize(
    "hq,hkv,lengths,window,ring,num_splits,dtype,tol",
    [
        (2, 2, [0, 1, 30, 48], None, None, 3, jnp.float32, 1e-5),  # GQA 1, ragged, empty slot
        (4, 2, [0, 3, 30, 48], 7, None, 2, jnp.float32, 1e-5),  # GQA 2, window in a full cache
        (8, 1, [1, 5, 48, 130], S, None, 1, jnp.bfloat16, 2e-2),  # GQA 8, ring buffer, bf16
        (6, 2, [4, 17, 33, 60], None, True, None, jnp.float32, 1e-5),  # group of 3 is padded
    ],
)
def test_gpu_kernel_matches_reference(hq, hkv, lengths, window, ring, num_splits, dtype, tol):
    q, k, v = _inputs(hq, hkv, dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    kw = dict(window=window, ring=ring)
    out = jax.jit(
        lambda q, k, v, n: pk.decode_attention(
            q, k, v, n, impl="pallas", interpret=True, block_k=16, num_splits=num_splits, **kw
        )
    )(q, k, v, lengths)
    want = pk.decode_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), lengths, **kw)
    assert out.dtype == dtype
    _close(out, want, tol)


def test_gpu_kernel_block_below_16_and_a_cache_in_another_dtype():
    # The kernel's matmuls need >= 16 keys a block (block_k=8 becomes 16) and compute in the wider
    # of q's and the cache's dtypes (fp32 q against a bf16 cache: the bf16 values, exactly).
    q, k, v = _inputs(4, 2, jnp.float32)
    k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    lengths = jnp.asarray([0, 9, 33, 48], jnp.int32)
    out = pk.decode_attention(q, k, v, lengths, impl="pallas", interpret=True, block_k=8)
    assert out.dtype == jnp.float32
    want = _numpy_decode(q, k.astype(jnp.float32), v.astype(jnp.float32), lengths, None, False)
    np.testing.assert_allclose(out, want, atol=1e-5)


def test_odd_cache_length_is_padded():
    q, k, v = _inputs(4, 2, jnp.float32, s=21)
    lengths = jnp.asarray([0, 4, 21, 9], jnp.int32)
    out = pk.decode_attention(q, k, v, lengths, impl="pallas", interpret=True, num_splits=2)
    np.testing.assert_allclose(out, _numpy_decode(q, k, v, lengths, None, False), atol=1e-5)


def test_auto_on_cpu_is_the_reference_and_bad_inputs_raise():
    q, k, v = _inputs(4, 2, jnp.float32)
    lengths = jnp.asarray([0, 1, 30, 48], jnp.int32)
    np.testing.assert_array_equal(
        pk.decode_attention(q, k, v, lengths),
        pk.decode_attention_reference(q, k, v, lengths),
    )
    with pytest.raises(ValueError, match="impl='gpu'"):
        pk.decode_attention(q, k, v, lengths, impl="gpu")
    with pytest.raises(ValueError, match="ring=True needs window == cache length 48"):
        pk.decode_attention(q, k, v, lengths, window=7, ring=True)
    with pytest.raises(ValueError, match="lengths.shape=\\(3,\\)"):
        pk.decode_attention(q, k, v, lengths[:3])
    q3, k3, v3 = _inputs(3, 2, jnp.float32)
    with pytest.raises(ValueError, match="q heads=3 is not a multiple of num kv heads=2"):
        pk.decode_attention(q3, k3, v3, lengths)


@pytest.mark.parametrize(
    "hq,hkv,lengths,window,ring,dtype,tol",
    [
        (4, 2, [0, 3, 30, 48], 7, None, jnp.float32, 1e-5),  # window in a full cache, empty slot
        (8, 1, [1, 5, 48, 130], S, None, jnp.bfloat16, 2e-2),  # ring buffer, GQA 8, bf16
    ],
)
def test_tpu_kernel_matches_reference(hq, hkv, lengths, window, ring, dtype, tol):
    q, k, v = _inputs(hq, hkv, dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    kw = dict(window=window, ring=ring)
    out = jax.jit(
        lambda q, k, v, n: pk.decode_attention(
            q, k, v, n, impl="pallas", lowering="tpu", interpret=True, block_k=16, **kw
        )
    )(q, k, v, lengths)
    want = pk.decode_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), lengths, **kw)
    assert out.dtype == dtype
    _close(out, want, tol)

"""Flash attention: Pallas kernels (interpret mode) vs the jnp reference, the reference vs numpy."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

# The package exports the function under the module's name, so fetch the module itself.
fa_module = importlib.import_module("pallas_kernels.flash_attention")


def _inputs(b, t, hq, hkv, d, dtype, seed=0):
    kq, kk, kv, kg = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(kq, (b, t, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, t, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, t, hkv, d), jnp.float32).astype(dtype)
    cotangent = jax.random.normal(kg, (b, t, hq, d), jnp.float32).astype(dtype)
    return q, k, v, cotangent


def _packed_segments(b, t):
    """Two packed sequences per row, split at a different place in each row."""
    pos = np.arange(t)[None, :]
    cut = np.array([t // 2 + 3 * i for i in range(b)])[:, None] % t
    return jnp.asarray((pos >= cut).astype(np.int32))


def _value_and_grads(fn, q, k, v, cotangent):
    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def _assert_close(actual, expected, tol):
    actual = np.asarray(actual, np.float32)
    expected = np.asarray(expected, np.float32)
    assert actual.shape == expected.shape
    err = np.abs(actual - expected).max() / max(1.0, np.abs(expected).max())
    assert err <= tol, f"relative max error {err} > {tol}"


def _numpy_attention(q, k, v, causal, window, seg, scale=None):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, hq, d = q.shape
    scale = 1 / np.sqrt(d) if scale is None else scale
    group = hq // k.shape[2]
    out = np.zeros((b, t, hq, v.shape[-1]))
    for bi in range(b):
        for h in range(hq):
            for i in range(t):
                keys = [
                    j
                    for j in range(t)
                    if (not causal or j <= i)
                    and (window is None or j > i - window)
                    and (seg is None or seg[bi, i] == seg[bi, j])
                ]
                s = k[bi, keys, h // group] @ q[bi, i, h] * scale
                p = np.exp(s - s.max())
                out[bi, i, h] = (p / p.sum()) @ v[bi, keys, h // group]
    return out


@pytest.mark.parametrize(
    "causal,window,use_seg", [(True, None, False), (True, 3, True), (False, None, True)]
)
def test_reference_matches_numpy(causal, window, use_seg):
    q, k, v, _ = _inputs(2, 9, 4, 2, 8, jnp.float32)
    seg = _packed_segments(2, 9) if use_seg else None
    out = pk.flash_attention_reference(q, k, v, causal=causal, window=window, segment_ids=seg)
    expected = _numpy_attention(q, k, v, causal, window, None if seg is None else np.asarray(seg))
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)


def _mla_inputs(b, t, hq, d, dv, dtype, seed=0):
    """MLA's shape: values narrower than queries and keys (DeepSeek-V3: 192 and 128)."""
    q, k, _, _ = _inputs(b, t, hq, hq, d, dtype, seed)
    _, _, v, cotangent = _inputs(b, t, hq, hq, dv, dtype, seed + 1)
    return q, k, v, cotangent


def test_reference_with_narrow_values_and_a_scale_matches_numpy():
    q, k, v, _ = _mla_inputs(2, 9, 4, 12, 8, jnp.float32)
    seg = _packed_segments(2, 9)
    out = pk.flash_attention_reference(q, k, v, window=4, segment_ids=seg, scale=0.41)
    assert out.shape == (2, 9, 4, 8)
    expected = _numpy_attention(q, k, v, True, 4, np.asarray(seg), scale=0.41)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)


# Odd lengths, windows below, at and above T, GQA ratios 1/2/8, packed segments, fp32 and bf16.
GPU_CASES = [
    # (t, hq, hkv, window, segments, causal, dtype, tol)
    (37, 4, 2, None, False, True, jnp.float32, 2e-5),
    (37, 8, 1, 5, False, True, jnp.float32, 2e-5),
    (33, 2, 2, 64, False, True, jnp.bfloat16, 3e-2),
    (37, 4, 2, 8, True, True, jnp.float32, 2e-5),
    (20, 4, 4, None, True, False, jnp.float32, 2e-5),
]


@pytest.mark.parametrize("t,hq,hkv,window,use_seg,causal,dtype,tol", GPU_CASES)
def test_gpu_kernel_matches_reference(t, hq, hkv, window, use_seg, causal, dtype, tol):
    q, k, v, cot = _inputs(2, t, hq, hkv, 16, dtype)
    seg = _packed_segments(2, t) if use_seg else None
    kw = dict(causal=causal, window=window, segment_ids=seg)
    out, grads = _value_and_grads(
        lambda q, k, v: pk.flash_attention(
            q, k, v, impl="pallas", lowering="gpu", interpret=True, block_q=16, block_k=16, **kw
        ),
        q,
        k,
        v,
        cot,
    )
    # The reference runs on the same (possibly bf16-rounded) inputs, in fp32.
    f32 = [x.astype(jnp.float32) for x in (q, k, v, cot)]
    ref_out, ref_grads = _value_and_grads(
        lambda q, k, v: pk.flash_attention(q, k, v, impl="reference", **kw), *f32
    )
    assert out.dtype == dtype
    _assert_close(out, ref_out, tol)
    for g, rg, x in zip(grads, ref_grads, (q, k, v)):
        assert g.dtype == x.dtype
        _assert_close(g, rg, tol * 2)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
def test_tpu_splash_path_matches_reference(dtype, tol):
    q, k, v, cot = _inputs(1, 45, 4, 2, 16, dtype)
    seg = _packed_segments(1, 45)
    kw = dict(window=6, segment_ids=seg)
    out, grads = _value_and_grads(
        lambda q, k, v: pk.flash_attention(
            q, k, v, impl="pallas", lowering="tpu", interpret=True, **kw
        ),
        q,
        k,
        v,
        cot,
    )
    f32 = [x.astype(jnp.float32) for x in (q, k, v, cot)]
    ref_out, ref_grads = _value_and_grads(
        lambda q, k, v: pk.flash_attention_reference(q, k, v, **kw), *f32
    )
    _assert_close(out, ref_out, tol)
    for g, rg in zip(grads, ref_grads):
        _assert_close(g, rg, tol * 2)


@pytest.mark.parametrize("window,use_seg", [(None, True), (7, False)])
def test_gpu_kernel_with_narrow_values_and_a_scale_matches_reference(window, use_seg):
    # MLA: q/k 24 wide (padded to 32 inside), v 16 wide, its own softmax scale.
    q, k, v, cot = _mla_inputs(2, 37, 4, 24, 16, jnp.float32)
    seg = _packed_segments(2, 37) if use_seg else None
    kw = dict(window=window, segment_ids=seg, scale=0.31)
    out, grads = _value_and_grads(
        lambda q, k, v: pk.flash_attention(
            q, k, v, impl="pallas", lowering="gpu", interpret=True, block_q=16, block_k=16, **kw
        ),
        q,
        k,
        v,
        cot,
    )
    ref_out, ref_grads = _value_and_grads(
        lambda q, k, v: pk.flash_attention_reference(q, k, v, **kw), q, k, v, cot
    )
    assert out.shape == (2, 37, 4, 16)
    _assert_close(out, ref_out, 2e-5)
    for g, rg in zip(grads, ref_grads):
        assert g.shape == rg.shape
        _assert_close(g, rg, 4e-5)


@pytest.mark.slow
def test_tpu_splash_path_with_narrow_values_and_a_scale_matches_reference():
    q, k, v, cot = _mla_inputs(1, 45, 2, 24, 16, jnp.float32)
    kw = dict(segment_ids=_packed_segments(1, 45), scale=0.31)
    out, grads = _value_and_grads(
        lambda q, k, v: pk.flash_attention(
            q, k, v, impl="pallas", lowering="tpu", interpret=True, **kw
        ),
        q,
        k,
        v,
        cot,
    )
    ref_out, ref_grads = _value_and_grads(
        lambda q, k, v: pk.flash_attention_reference(q, k, v, **kw), q, k, v, cot
    )
    _assert_close(out, ref_out, 2e-5)
    for g, rg in zip(grads, ref_grads):
        _assert_close(g, rg, 4e-5)


def _config(t, window, causal=True, bq=64, bk=64):
    return fa_module._Config(
        causal=causal,
        window=window,
        seq_len=t,
        block_q=bq,
        block_k=bk,
        scale=1.0,
        has_segments=False,
        interpret=True,
        num_warps=4,
        num_stages=2,
    )


@pytest.mark.parametrize(
    "t,window,bq,bk", [(1024, 64, 64, 64), (1000, 100, 32, 64), (300, None, 64, 32)]
)
def test_block_ranges_are_exactly_the_blocks_with_visible_keys(t, window, bq, bk):
    """The kernels loop over these ranges, so sliding-window cost is ~T*window, not T^2."""
    cfg = _config(t, window, bq=bq, bk=bk)
    pos = np.arange(t)
    visible = (pos[None, :] <= pos[:, None]) & (
        True if window is None else pos[None, :] > pos[:, None] - window
    )
    nq, nk = -(-t // bq), -(-t // bk)
    needed = np.zeros((nq, nk), bool)
    for i in range(nq):
        for j in range(nk):
            needed[i, j] = visible[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].any()
    for i in range(nq):
        lo, hi = (int(x) for x in cfg.kv_block_range(i * bq))
        assert list(range(lo, hi)) == list(np.flatnonzero(needed[i]))
    for j in range(nk):
        lo, hi = (int(x) for x in cfg.q_block_range(j * bk))
        assert list(range(lo, hi)) == list(np.flatnonzero(needed[:, j]))
    if window is not None:  # with the window, each query block visits at most 1 + window/bk + 1
        assert needed.sum(axis=1).max() <= window // bk + 2


def test_auto_on_cpu_is_the_reference():
    q, k, v, _ = _inputs(1, 7, 2, 1, 8, jnp.float32)
    np.testing.assert_array_equal(
        pk.flash_attention(q, k, v, window=3), pk.flash_attention_reference(q, k, v, window=3)
    )


def test_bad_inputs_raise_naming_the_value():
    q, k, v, _ = _inputs(1, 7, 3, 2, 8, jnp.float32)
    with pytest.raises(ValueError, match="q heads=3 is not a multiple of num kv heads=2"):
        pk.flash_attention(q, k, v)
    q, k, v, _ = _inputs(1, 7, 2, 1, 8, jnp.float32)
    with pytest.raises(ValueError, match="impl='triton'"):
        pk.flash_attention(q, k, v, impl="triton")
    with pytest.raises(ValueError, match="window=0"):
        pk.flash_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="window=4 needs causal=True"):
        pk.flash_attention(q, k, v, window=4, causal=False)
    with pytest.raises(ValueError, match=r"v.shape=\(1, 7, 2, 8\) is not \[batch=1, seq=7, kv_heads=1"):
        pk.flash_attention(q, k, jnp.zeros((1, 7, 2, 8)))
    with pytest.raises(ValueError, match="scale=-1.0"):
        pk.flash_attention(q, k, v, scale=-1.0)
    with pytest.raises(ValueError, match="lowering='cuda'"):
        pk.flash_attention(q, k, v, impl="pallas", lowering="cuda")

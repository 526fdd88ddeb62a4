"""Grouped matmul: Pallas kernels (interpret mode) vs jax.lax.ragged_dot, the references vs numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

# 45 rows, sum(group sizes) = 40: an empty group, groups starting inside tiles, 5 rows in no group.
M, K, N = 45, 24, 40
SIZES = np.array([10, 0, 23, 7], np.int32)
TILING = (16, 16, 16)


def _arrays(dtype, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    lhs = jax.random.normal(k1, (M, K), jnp.float32).astype(dtype)
    rhs = jax.random.normal(k2, (len(SIZES), K, N), jnp.float32).astype(dtype)
    grad = jax.random.normal(k3, (M, N), jnp.float32).astype(dtype)
    return lhs, rhs, grad


def _numpy_gmm(lhs, rhs, sizes, offset=0):
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    ends = np.cumsum(sizes)
    for g in range(rhs.shape[0]):
        start, end = ends[offset + g] - sizes[offset + g], ends[offset + g]
        out[start:end] = lhs[start:end] @ rhs[g]
    return out


def _numpy_tgmm(lhs, grad, sizes, offset, num_groups):
    lhs, grad = np.asarray(lhs, np.float64), np.asarray(grad, np.float64)
    ends = np.cumsum(sizes)
    rows = [slice(ends[g] - sizes[g], ends[g]) for g in range(offset, offset + num_groups)]
    return np.stack([lhs[r].T @ grad[r] for r in rows])


def _close(actual, expected, tol):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert actual.shape == expected.shape
    err = np.abs(actual - expected).max() / max(1.0, np.abs(expected).max())
    assert err <= tol, f"relative max error {err} > {tol}"


@pytest.mark.parametrize("offset,num_local", [(None, 4), (1, 2), (2, 2)])
def test_references_match_numpy(offset, num_local):
    lhs, rhs, grad = _arrays(jnp.float32)
    gs = jnp.asarray(SIZES)
    local = rhs[offset or 0 : (offset or 0) + num_local]
    out = pk.gmm_reference(lhs, local, gs, group_offset=offset)
    np.testing.assert_allclose(out, _numpy_gmm(lhs, local, SIZES, offset or 0), atol=1e-4)
    out = pk.tgmm_reference(lhs, grad, gs, group_offset=offset, num_groups=num_local)
    np.testing.assert_allclose(
        out, _numpy_tgmm(lhs, grad, SIZES, offset or 0, num_local), atol=1e-4
    )


def test_tgmm_reference_vjp_matches_masked_einsum():
    """tgmm_reference carries a hand-written VJP; check it against plain autodiff of an einsum."""
    lhs, _, grad = _arrays(jnp.float32)
    gs = jnp.asarray(SIZES)
    ends = np.cumsum(SIZES)
    onehot = jnp.asarray(
        (np.arange(M)[:, None] >= ends - SIZES) & (np.arange(M)[:, None] < ends), jnp.float32
    )
    cot = jax.random.normal(jax.random.PRNGKey(5), (len(SIZES), K, N))

    def einsum_tgmm(a, b):
        return jnp.einsum("mg,mk,mn->gkn", onehot, a, b)

    want = jax.grad(lambda a, b: jnp.sum(einsum_tgmm(a, b) * cot), argnums=(0, 1))(lhs, grad)
    got = jax.grad(lambda a, b: jnp.sum(pk.tgmm_reference(a, b, gs) * cot), argnums=(0, 1))(
        lhs, grad
    )
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-4)


def _gmm_value_and_grads(fn, lhs, rhs, cot):
    def loss(a, b):
        out = fn(a, b)
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(lhs, rhs)
    return out, grads


@pytest.mark.parametrize(
    "lowering,dtype,offset,tol",
    [
        ("gpu", jnp.float32, None, 1e-5),
        ("gpu", jnp.bfloat16, None, 2e-2),
        ("gpu", jnp.float32, 1, 1e-5),
        pytest.param("tpu", jnp.float32, 2, 1e-5, marks=pytest.mark.slow),
    ],
)
def test_gmm_kernel_matches_ragged_dot(lowering, dtype, offset, tol):
    lhs, rhs, cot = _arrays(dtype)
    gs = jnp.asarray(SIZES)
    if offset is not None:
        rhs = rhs[offset : offset + 2]
    kw = dict(group_offset=offset)
    out, grads = _gmm_value_and_grads(
        lambda a, b: pk.gmm(
            a, b, gs, impl="pallas", lowering=lowering, interpret=True, tiling=TILING, **kw
        ),
        lhs,
        rhs,
        cot,
    )
    ref_out, ref_grads = _gmm_value_and_grads(
        lambda a, b: pk.gmm(a, b, gs, impl="reference", **kw),
        *(x.astype(jnp.float32) for x in (lhs, rhs, cot)),
    )
    assert out.dtype == dtype
    _close(out, ref_out, tol)
    assert not np.asarray(out)[SIZES.sum() :].any(), "rows past sum(group_sizes) must be zero"
    for g, rg, x in zip(grads, ref_grads, (lhs, rhs)):
        assert g.dtype == x.dtype
        _close(g, rg, tol * 2)


def test_gmm_traced_offset_and_fp32_output_from_bf16():
    """group_offset may be a traced scalar (as inside shard_map); accumulation is fp32."""
    lhs, rhs, _ = _arrays(jnp.bfloat16)
    gs = jnp.asarray(SIZES)

    @jax.jit
    def run(offset):
        return pk.gmm(
            lhs,
            jax.lax.dynamic_slice_in_dim(rhs, offset, 2),
            gs,
            group_offset=offset,
            impl="pallas",
            interpret=True,
            tiling=TILING,
            preferred_element_type=jnp.float32,
        )

    for offset in (0, 2):
        out = run(jnp.int32(offset))
        assert out.dtype == jnp.float32
        want = _numpy_gmm(lhs.astype(jnp.float32), rhs[offset : offset + 2], SIZES, offset)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("offset,num_local", [(None, 4), (2, 2)])
def test_tgmm_kernel_matches_reference(offset, num_local):
    lhs, _, grad = _arrays(jnp.float32)
    gs = jnp.asarray(SIZES)
    cot = jax.random.normal(jax.random.PRNGKey(7), (num_local, K, N))
    kw = dict(group_offset=offset, num_groups=num_local)
    out, grads = _gmm_value_and_grads(
        lambda a, b: pk.tgmm(a, b, gs, impl="pallas", interpret=True, tiling=TILING, **kw),
        lhs,
        grad,
        cot,
    )
    ref_out, ref_grads = _gmm_value_and_grads(
        lambda a, b: pk.tgmm(a, b, gs, impl="reference", **kw), lhs, grad, cot
    )
    _close(out, ref_out, 1e-5)
    if offset is None:
        assert not np.asarray(out)[1].any(), "the empty group's matrix must be zero"
    for g, rg in zip(grads, ref_grads):
        _close(g, rg, 2e-5)


def test_auto_on_cpu_is_the_reference_and_bad_inputs_raise():
    lhs, rhs, _ = _arrays(jnp.float32)
    gs = jnp.asarray(SIZES)
    np.testing.assert_array_equal(pk.gmm(lhs, rhs, gs), jax.lax.ragged_dot(lhs, rhs, gs))
    with pytest.raises(ValueError, match="impl='fast'"):
        pk.gmm(lhs, rhs, gs, impl="fast")
    with pytest.raises(ValueError, match="rhs.shape=\\(4, 7, 40\\)"):
        pk.gmm(lhs, rhs[:, :7], gs)
    with pytest.raises(ValueError, match="pass group_offset"):
        pk.gmm(lhs, rhs[:2], gs)
    with pytest.raises(ValueError, match="tm=24 is not a power of 2"):
        pk.gmm(lhs, rhs, gs, impl="pallas", tiling=(24, 16, 16))
    with pytest.raises(ValueError, match="num_groups=5"):
        pk.tgmm(lhs, lhs, gs, num_groups=5)

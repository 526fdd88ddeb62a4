"""The batch-invariant matmul (pallas_kernels/invariant_matmul.py): both Pallas programs
(interpreted) equal the reference, which equals x @ w; a row's output bits do not depend on how
many rows the call has nor where the row sits; bad inputs are named; and the TPU program compiles
for real TPU topologies through libtpu."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

import pallas_kernels as pk
from hcjax.planner.tpu import tpu_devices

K, N = 256, 128
BLOCKS = {"block_m": 8, "block_n": 128, "block_k": 128}  # CPU-sized tiles, two K chunks
FORMS = {
    "pallas-gpu": {"impl": "pallas", "lowering": "gpu", "interpret": True},
    "pallas-tpu": {"impl": "pallas", "lowering": "tpu", "interpret": True},
    "reference": {"impl": "reference"},
}
DTYPES = [jnp.float32, jnp.bfloat16]


@functools.cache
def _matmul(form: str, out_dtype=None):
    return jax.jit(functools.partial(pk.invariant_matmul, **BLOCKS, **FORMS[form],
                                     out_dtype=out_dtype))


def _weights(dtype, seed=1):
    return jax.random.normal(jax.random.key(seed), (K, N), jnp.float32).astype(dtype)


def _rows(m, dtype, seed):
    return jax.random.normal(jax.random.key(seed), (m, K), jnp.float32).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_equal_the_reference_and_the_reference_equals_x_at_w(dtype):
    x, w = _rows(33, dtype, 0), _weights(dtype)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    ref = pk.invariant_matmul_reference(x, w, block_k=128)
    ref32 = pk.invariant_matmul_reference(x, w, block_k=128, out_dtype=jnp.float32)
    assert ref.dtype == dtype and ref32.dtype == jnp.float32
    np.testing.assert_allclose(ref32, exact, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ref, np.float32), jnp.dot(x, w), rtol=1e-2, atol=1e-2)
    for form in FORMS:
        assert _matmul(form)(x[:0], w).shape == (0, N)
    for form in ("pallas-gpu", "pallas-tpu"):
        out, out32 = _matmul(form)(x, w), _matmul(form, jnp.float32)(x, w)
        assert out.shape == (33, N) and out.dtype == dtype and out32.dtype == jnp.float32
        np.testing.assert_allclose(out32, ref32, rtol=1e-6, atol=1e-5)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                                   rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", list(FORMS))
def test_a_rows_bits_do_not_depend_on_the_other_rows(form, dtype):
    """One row at positions 0, 3 and last of calls with 1 to 130 rows, the others random: the same
    output bits every time (M = 130 pads to 17 row tiles; M = 1 is a decode step)."""
    w, row = _weights(dtype), _rows(1, dtype, 99)[0]
    seen = {}
    for m in (1, 7, 8, 33, 130):
        for pos in sorted({0, min(3, m - 1), m - 1}):
            x = _rows(m, dtype, seed=m).at[pos].set(row)
            seen[(m, pos)] = np.asarray(_matmul(form)(x, w)[pos])
    first = seen[(1, 0)]
    differ = [key for key, out in seen.items() if not np.array_equal(out, first)]
    assert not differ, f"{form} {dtype.__name__}: rows (M, position) {differ} differ from M=1"


def test_bad_inputs_are_named():
    x, w = jnp.ones((4, K)), jnp.ones((K, N))
    cases = [
        (dict(x=jnp.ones((4, 64))), r"x.shape=\(4, 64\) and w.shape=\(256, 128\) disagree on K"),
        (dict(x=jnp.ones((2, 4, K))), r"x.shape=\(2, 4, 256\) is not \[M, K\]"),
        (dict(w=jnp.ones((K,))), r"w.shape=\(256,\) is not \[K, N\]"),
        (dict(w=jnp.ones((K, N), jnp.bfloat16)), "x.dtype=float32 differs from w.dtype=bfloat16"),
        (dict(block_k=96), "K=256 is not a multiple of block_k=96"),
        (dict(block_n=96), "N=128 is not a multiple of block_n=96"),
        (dict(block_m=0), "block_m=0 is not a positive int"),
        (dict(impl="fast"), "invariant_matmul: impl='fast' is not one of"),
        (dict(lowering="cpu"), "invariant_matmul: lowering='cpu' is not one of"),
        # What the compilers accept, checked before lowering (interpret mode takes any tile).
        (dict(lowering="gpu", interpret=False), "lowering='gpu': block_m=8 is not a power of 2"),
        (dict(lowering="tpu", interpret=False, block_m=12),
         "lowering='tpu': block_m=12 is not a multiple of 8"),
        (dict(lowering="tpu", interpret=False, w=jnp.ones((K, 192)), block_n=64),
         "lowering='tpu': block_n=64 is neither a multiple of 128 nor all of N=192"),
    ]
    for overrides, message in cases:
        kw = {"x": x, "w": w, **BLOCKS, "interpret": True, **overrides}
        with pytest.raises(ValueError, match=message):
            pk.invariant_matmul(kw.pop("x"), kw.pop("w"), **kw)
    with pytest.raises(ValueError, match="K=256 is not a multiple of block_k=100"):
        pk.invariant_matmul_reference(x, w, block_k=100)


def test_tpu_program_compiles_for_v5e_and_v5p():
    """A full libtpu compile (Mosaic included) of the kernel for compile-only TPU devices: bf16 and
    fp32 with the default 128 tiles, and bf16 in 16-row tiles; about 1.5 s here."""
    for topology in ("v5e:2x2", "v5p:2x2x1"):
        try:
            device = tpu_devices(topology)[0][0]
        except ValueError as e:  # no libtpu on this platform
            pytest.skip(f"libtpu cannot build a TPU topology here: {e}")
        on = SingleDeviceSharding(device)
        for dtype, block_m in ((jnp.bfloat16, 128), (jnp.float32, 128), (jnp.bfloat16, 16)):
            x = jax.ShapeDtypeStruct((500, 512), dtype, sharding=on)
            w = jax.ShapeDtypeStruct((512, 256), dtype, sharding=on)
            fn = functools.partial(pk.invariant_matmul, block_m=block_m, interpret=False,
                                   lowering="tpu")
            text = jax.jit(fn).lower(x, w).compile().as_text()
            assert 'custom_call_target="tpu_custom_call"' in text
            assert "used_scoped_memory_configs" in text  # written by libtpu's Mosaic compile

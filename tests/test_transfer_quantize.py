"""Quantise-on-sync (hcjax.transfer.quantize): round-trip bounds per format against references
computed by hand in numpy, the scale math, zero blocks, non-finite blocks, option validation,
and the wire tree's layout and join."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from hcjax.transfer import quantize as qz


def _blocks_amax(x: np.ndarray, block: int) -> np.ndarray:
    n = x.shape[-1]
    nb = -(-n // block)
    pad = np.zeros((*x.shape[:-1], nb * block - n), x.dtype)
    return np.abs(np.concatenate([x, pad], -1)).reshape(*x.shape[:-1], nb, block).max(-1)


@pytest.mark.parametrize("fmt,qmax", [("fp8_e4m3", 448.0), ("int8", 127.0)])
def test_scales_are_block_max_over_grid_max(fmt, qmax):
    x = np.random.default_rng(0).normal(size=(3, 40)).astype(np.float32)
    x[1, 16:32] *= 100.0  # one block much larger than its neighbours
    q, scale = qz.quantize(jnp.asarray(x), fmt, block=16)
    assert q.shape == x.shape and q.dtype == qz.FORMATS[fmt][0]
    assert scale.shape == (3, 3) and scale.dtype == jnp.float32  # blocks of 16, 16, 8
    np.testing.assert_allclose(np.asarray(scale), _blocks_amax(x, 16) / np.float32(qmax),
                               rtol=2.5e-7)  # one ulp: XLA may divide by 1/qmax


def test_fp8_values_on_the_grid_are_exact_and_error_bound():
    # A block whose max is 448 s and whose values are s * (e4m3 values): exact round trip.
    grid = np.array([448.0, -448.0, 1.0, 1.125, -3.5, 0.0, 2.0 ** -6, 2.0 ** -9, 240.0, 0.5],
                    np.float32)
    s = np.float32(2.0 ** -7)
    x = (grid * s)[None]
    back = np.asarray(qz.round_trip(jnp.asarray(x), "fp8_e4m3", block=16))
    np.testing.assert_array_equal(back, x)
    # Random values: |err| <= 2^-4 |x| (3 mantissa bits, round to nearest) in the normal range,
    # <= 2^-10 s in the subnormal range (spacing 2^-9 s).
    x = np.random.default_rng(1).standard_t(3, size=(4, 256)).astype(np.float32)
    q, scale = qz.quantize(jnp.asarray(x), "fp8_e4m3", block=128)
    back = np.asarray(qz.dequantize(q, scale, block=128))
    s = np.repeat(np.asarray(scale), 128, axis=-1)
    err = np.abs(back - x)
    assert np.all(err <= np.maximum(2.0 ** -4 * np.abs(x), 2.0 ** -10 * s) * (1 + 1e-6))
    # The reference: ml_dtypes' e4m3 rounding of x / s, times s.
    ref = (x / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s
    np.testing.assert_allclose(back, ref, rtol=1e-6, atol=0)


def test_int8_round_to_nearest_and_error_bound():
    x = np.random.default_rng(2).normal(size=(5, 100)).astype(np.float32)
    q, scale = qz.quantize(jnp.asarray(x), "int8", block=32)
    s = np.repeat(np.asarray(scale), 32, axis=-1)[:, :100]
    np.testing.assert_array_equal(np.asarray(q), np.clip(np.round(x / s), -127, 127))
    back = np.asarray(qz.dequantize(q, scale, block=32))
    assert np.all(np.abs(back - x) <= s / 2 * (1 + 1e-6))
    assert np.max(np.abs(np.asarray(q))) == 127  # each block's max hits the grid's end
    # Values on the grid (integers times a power of two) come back exactly.
    on_grid = (np.arange(-127, 128, dtype=np.float32) * np.float32(0.25))[None]
    np.testing.assert_array_equal(np.asarray(qz.round_trip(jnp.asarray(on_grid), "int8", 255)),
                                  on_grid)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
def test_zero_block_and_nonfinite_block(fmt):
    x = np.ones((2, 8), np.float32)
    x[0, :4] = 0.0
    q, scale = qz.quantize(jnp.asarray(x), fmt, block=4)
    assert float(scale[0, 0]) == 0.0
    back = np.asarray(qz.dequantize(q, scale, block=4))
    np.testing.assert_array_equal(back[0, :4], 0.0)
    np.testing.assert_array_equal(back[:, 4:], 1.0)
    # A NaN or Inf in a block makes its scale non-finite, so the whole block dequantises to
    # non-finite values and the replica's finite check refuses the version; other blocks keep.
    for bad in (np.nan, np.inf):
        y = x.copy()
        y[1, 1] = bad
        back = np.asarray(qz.round_trip(jnp.asarray(y), fmt, block=4))
        assert not np.all(np.isfinite(back[1, :4]))
        np.testing.assert_array_equal(back[1, 4:], 1.0)


def test_bad_options_name_the_value():
    with pytest.raises(ValueError, match="'fp4'"):
        qz.check_format("fp4")
    with pytest.raises(ValueError, match="quant_block=0"):
        qz.check_format("int8", 0)
    assert qz.check_format(None) is None
    with pytest.raises(ValueError, match="scale shape"):
        qz.dequantize(jnp.zeros((2, 8), jnp.int8), jnp.zeros((2, 3)), block=4)


def test_wire_tree_layout_and_join():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    spec = jax.sharding.NamedSharding
    ps = jax.sharding.PartitionSpec
    rng = np.random.default_rng(3)
    tree = {
        "blocks": [{"attn": {"wq": {"value": jax.device_put(
                        rng.normal(size=(8, 4, 16)).astype(np.float32), spec(mesh, ps("x")))}},
                    "ffn": {"router": {"value": jnp.asarray(rng.normal(size=(8, 4)),
                                                            jnp.float32)}},
                    "norm": {"scale": {"value": jnp.ones((8,), jnp.float32)}}}],
        "embed": {"value": jnp.asarray(rng.normal(size=(10, 8)), jnp.float32)},
    }
    # Every leaf on one mesh (as a learner's are): wq split over it, the rest replicated.
    tree = jax.tree.map(lambda x: x if x.ndim == 3 else jax.device_put(x, spec(mesh, ps())), tree)
    assert qz.quantized_paths(tree) == ["blocks/0/attn/wq/value"]
    layout = qz.wire_layout(tree, "fp8_e4m3", block=8)
    assert layout["blocks/0/attn/wq/value"].dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    assert layout["blocks/0/attn/wq/value#scale"].shape == (8, 4, 2)
    assert layout["blocks/0/ffn/router/value"].dtype == np.float32
    # fp32 is 4 B per value; fp8 1 B plus 4 B per 8 values of scales.
    full = sum(x.size * 4 for x in jax.tree.leaves(tree))
    assert qz.wire_bytes(layout) == full - 8 * 4 * 16 * 3 + 8 * 4 * 2 * 4
    wire = qz.quantize_tree(tree, "fp8_e4m3", block=8)
    assert set(wire) == set(layout)
    for p, v in layout.items():
        assert wire[p].shape == v.shape and wire[p].dtype == v.dtype, p
        assert wire[p].sharding.is_equivalent_to(v.sharding, len(v.shape)), p
    served = qz.dequantize_tree(wire, tree, block=8)
    assert jax.tree.structure(served) == jax.tree.structure(tree)
    wq = tree["blocks"][0]["attn"]["wq"]["value"]
    got = served["blocks"][0]["attn"]["wq"]["value"]
    assert got.dtype == jnp.float32 and got.sharding.is_equivalent_to(wq.sharding, 3)
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(qz.round_trip(wq, "fp8_e4m3", block=8)))
    np.testing.assert_array_equal(np.asarray(served["embed"]["value"]),
                                  np.asarray(tree["embed"]["value"]))

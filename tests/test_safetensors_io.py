"""Safetensors reader/writer (cross-checked against the `safetensors` package) and dequantisers."""

import json

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from hcjax.model import quant
from hcjax.model.safetensors_io import (
    DTYPES,
    INDEX_FILE,
    SafetensorsCheckpoint,
    TensorSpec,
    array_specs,
    write_safetensors,
)
from tests import quantisers

# Dtypes `safetensors.numpy` can round-trip (its numpy API has no float8 dtypes).
PACKAGE_DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16",
                  "U8", "BOOL"]
FLOAT8 = ["F8_E4M3", "F8_E5M2", "F8_E8M0"]


def sample(code, shape, seed=0):
    rng = np.random.default_rng(seed)
    dtype = DTYPES[code]
    if code == "BOOL":
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        return rng.integers(0, 100, size=shape).astype(dtype)
    return rng.normal(size=shape).astype(dtype)


def raw_file(path, header, data=b""):
    """A hand-made safetensors file, for malformed inputs."""
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def data_layout(path):
    """(header dict, data buffer length) of a written file."""
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    return n, json.loads(blob[8:8 + n]), len(blob) - 8 - n


# --------------------------------------------------------------------------- reader and writer


def test_round_trip_every_dtype(tmp_path):
    arrays = {f"t_{code}": sample(code, (3, 5), seed=i) for i, code in enumerate(DTYPES)}
    arrays["scalar"] = np.array(2.5, dtype=np.float32)
    arrays["empty"] = np.zeros((0, 4), dtype=ml_dtypes.bfloat16)
    written = write_safetensors(tmp_path, array_specs(arrays))
    assert [p.name for p in written] == ["model.safetensors"]
    ckpt = SafetensorsCheckpoint.open(tmp_path)
    assert ckpt.names == list(arrays)
    for name, want in arrays.items():
        got = ckpt.read(name)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
        assert ckpt.nbytes(name) == want.nbytes
        code = name[2:] if name.startswith("t_") else {"scalar": "F32", "empty": "BF16"}[name]
        assert ckpt.info(name) == (tmp_path / "model.safetensors", code, want.shape)
    assert ckpt.info("t_F8_E4M3").np_dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    assert ckpt.metadata == {"format": "pt"}


def test_read_returns_an_owned_writable_copy(tmp_path):
    write_safetensors(tmp_path, array_specs({"a": np.arange(6, dtype=np.float32)}))
    ckpt = SafetensorsCheckpoint.open(tmp_path / "model.safetensors")
    a = ckpt.read("a")
    a[:] = -1  # must not reach the file
    np.testing.assert_array_equal(ckpt.read("a"), np.arange(6, dtype=np.float32))
    assert not isinstance(a.base, np.memmap)


def test_our_files_load_with_the_safetensors_package(tmp_path):
    arrays = {code: sample(code, (4, 3), seed=i) for i, code in enumerate(PACKAGE_DTYPES)}
    write_safetensors(tmp_path, array_specs(arrays), metadata={"source": "hcjax"})
    loaded = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    assert loaded.keys() == arrays.keys()
    for name, want in arrays.items():
        assert loaded[name].dtype == want.dtype
        np.testing.assert_array_equal(loaded[name], want)
    _, header, _ = data_layout(tmp_path / "model.safetensors")
    assert header["__metadata__"] == {"format": "pt", "source": "hcjax"}


def test_our_float8_files_pass_the_package_byte_level_parser(tmp_path):
    arrays = {code: sample("F32", (3, 2), seed=i).astype(DTYPES[code])
              for i, code in enumerate(FLOAT8)}
    write_safetensors(tmp_path, array_specs(arrays))
    parsed = dict(safetensors.deserialize((tmp_path / "model.safetensors").read_bytes()))
    assert parsed.keys() == arrays.keys()
    for code, want in arrays.items():
        assert parsed[code]["dtype"] == code and parsed[code]["shape"] == [3, 2]
        assert bytes(parsed[code]["data"]) == want.tobytes()


def test_package_files_read_identically(tmp_path):
    arrays = {code: sample(code, (2, 7), seed=i) for i, code in enumerate(PACKAGE_DTYPES)}
    path = tmp_path / "x.safetensors"
    safetensors.numpy.save_file(arrays, path, metadata={"format": "np"})
    ckpt = SafetensorsCheckpoint.open(path)
    assert sorted(ckpt.names) == sorted(arrays)
    assert ckpt.metadata == {"format": "np"}
    for name, want in arrays.items():
        got = ckpt.read(name)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_package_shards_with_an_index_read_identically(tmp_path):
    shards = {
        "model-00001-of-00002.safetensors": {"embed": sample("BF16", (8, 4)),
                                             "layers.0.w": sample("F32", (4, 4))},
        "model-00002-of-00002.safetensors": {"layers.1.w": sample("F16", (4, 4)),
                                             "step": sample("I64", ())},
    }
    weight_map = {}
    for file, arrays in shards.items():
        safetensors.numpy.save_file(arrays, tmp_path / file)
        weight_map.update(dict.fromkeys(arrays, file))
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "ignored.safetensors").write_bytes(b"not listed in the index")
    ckpt = SafetensorsCheckpoint.open(tmp_path)
    assert sorted(ckpt.names) == sorted(weight_map)
    for file, arrays in shards.items():
        for name, want in arrays.items():
            assert ckpt.info(name).file == tmp_path / file
            got = ckpt.read(name)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)


def test_sharded_write_layout_and_index(tmp_path):
    arrays = {"a": np.ones((10,), np.float32), "b": np.ones((10,), np.float32),   # 40 B each
              "big": np.ones((40,), np.float32),                                   # 160 B > limit
              "c": np.ones((5,), np.float32), "d": np.ones((20,), np.uint8)}
    written = write_safetensors(tmp_path, array_specs(arrays), max_shard_bytes=100)
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [p.name for p in written] == [*names, INDEX_FILE]
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"] == {"total_size": 40 + 40 + 160 + 20 + 20}
    assert index["weight_map"] == {"a": names[0], "b": names[0], "big": names[1],
                                   "c": names[2], "d": names[2]}
    for name in names:
        header_len, header, data_len = data_layout(tmp_path / name)
        assert header_len % 8 == 0
        assert header.pop("__metadata__") == {"format": "pt"}
        offsets = [spec["data_offsets"] for spec in header.values()]
        assert offsets[0][0] == 0 and offsets[-1][1] == data_len
        assert all(prev[1] == cur[0] for prev, cur in zip(offsets, offsets[1:]))
    ckpt = SafetensorsCheckpoint.open(tmp_path)
    assert ckpt.names == list(arrays)
    loaded = {}
    for name in names:
        loaded.update(safetensors.numpy.load_file(tmp_path / name))
    for name, want in arrays.items():
        np.testing.assert_array_equal(loaded[name], want)
        np.testing.assert_array_equal(ckpt.read(name), want)


def test_fetch_is_lazy_and_one_at_a_time(tmp_path):
    events = []

    def fetcher(name, value):
        def fetch():
            events.append(("fetch", name))
            return np.full((4,), value, np.float32)
        return fetch

    specs = [TensorSpec(n, (4,), "F32", fetcher(n, i)) for i, n in enumerate("xyz")]
    write_safetensors(tmp_path, specs, max_shard_bytes=32,
                      progress=lambda name, n: events.append(("done", name, n)))
    assert events == [("fetch", "x"), ("done", "x", 16), ("fetch", "y"), ("done", "y", 16),
                      ("fetch", "z"), ("done", "z", 16)]
    assert len(SafetensorsCheckpoint.open(tmp_path).files) == 2


@pytest.mark.parametrize("fetched", [np.zeros((3,), np.float32), np.zeros((2, 2), np.float16)])
def test_fetch_mismatch_names_the_tensor_and_leaves_no_file(tmp_path, fetched):
    specs = [TensorSpec("w", (2, 2), np.float32, lambda: fetched)]
    with pytest.raises(ValueError, match="tensor 'w'.*declared float32"):
        write_safetensors(tmp_path, specs)
    assert list(tmp_path.iterdir()) == []


def test_rewrite_removes_stale_files(tmp_path):
    arrays = {"a": np.ones(8, np.float32), "b": np.ones(8, np.float32)}
    write_safetensors(tmp_path, array_specs(arrays), max_shard_bytes=32)
    (tmp_path / "config.json").write_text("{}")
    write_safetensors(tmp_path, array_specs(arrays))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    write_safetensors(tmp_path, array_specs(arrays), max_shard_bytes=32)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        INDEX_FILE]


def test_writer_rejects_bad_specs(tmp_path):
    one = np.ones(2, np.float32)
    with pytest.raises(ValueError, match="'a' is repeated"):
        write_safetensors(tmp_path, array_specs({"a": one}) * 2)
    with pytest.raises(ValueError, match="no safetensors code"):
        write_safetensors(tmp_path, [("c", (2,), np.complex64, lambda: one)])
    with pytest.raises(ValueError, match="max_shard_bytes=0"):
        write_safetensors(tmp_path, array_specs({"a": one}), max_shard_bytes=0)


def test_reader_rejects_unknown_dtype_bad_offsets_and_sizes(tmp_path):
    path = tmp_path / "x.safetensors"
    raw_file(path, {"w": {"dtype": "I4", "shape": [2], "data_offsets": [0, 1]}}, b"\0")
    with pytest.raises(ValueError, match=r"'w' in .*x\.safetensors: unknown dtype 'I4'"):
        SafetensorsCheckpoint.open(path)
    raw_file(path, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4)
    with pytest.raises(ValueError, match=r"\[0, 8\] lie outside the 4-byte data buffer"):
        SafetensorsCheckpoint.open(path)
    raw_file(path, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4)
    with pytest.raises(ValueError, match="span 4 bytes but shape \\[2\\] of F32 needs 8"):
        SafetensorsCheckpoint.open(path)
    raw_file(path, {"u": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                    "v": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}, b"\0" * 3)
    with pytest.raises(ValueError, match="'u' and 'v' overlap"):
        SafetensorsCheckpoint.open(path)
    path.write_bytes((10**6).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="exceeds file size"):
        SafetensorsCheckpoint.open(path)
    with pytest.raises(FileNotFoundError, match="missing does not exist"):
        SafetensorsCheckpoint.open(tmp_path / "missing")
    raw_file(path, {"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"\7")
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        SafetensorsCheckpoint.open(path).read("nope")


def test_reader_rejects_a_name_in_two_files(tmp_path):
    for file in ("a.safetensors", "b.safetensors"):
        safetensors.numpy.save_file({"w": np.ones(2, np.float32)}, tmp_path / file)
    with pytest.raises(ValueError, match=r"'w' is in both .*a\.safetensors and .*b\.safetensors"):
        SafetensorsCheckpoint.open(tmp_path)


def test_reader_rejects_bad_index(tmp_path):
    safetensors.numpy.save_file({"w": np.ones(2, np.float32)}, tmp_path / "a.safetensors")
    index = tmp_path / INDEX_FILE
    index.write_text(json.dumps({"weight_map": {"w": "a.safetensors", "v": "gone.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="gone.safetensors"):
        SafetensorsCheckpoint.open(tmp_path)
    index.write_text(json.dumps({"weight_map": {"w": "a.safetensors", "v": "a.safetensors"}}))
    with pytest.raises(ValueError, match="maps 'v' to .*a.safetensors, which has no such tensor"):
        SafetensorsCheckpoint.open(index)


# --------------------------------------------------------------------------- FP8 block-scaled


def representable_fp8(shape, block, seed=0):
    """(w_f32, w_fp8, scale_inv) with every block's amax exactly 448 * a power-of-two scale."""
    rng = np.random.default_rng(seed)
    w_fp8 = rng.normal(scale=40.0, size=shape).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
    nbo, nbi = -(-shape[-2] // block[0]), -(-shape[-1] // block[1])
    for r in range(nbo):
        for c in range(nbi):
            w_fp8[..., r * block[0], c * block[1]] = 448.0
    scale_inv = np.ldexp(1.0, rng.integers(-12, 4, size=(*shape[:-2], nbo, nbi)))
    scale_inv = scale_inv.astype(np.float32)
    rows = np.arange(shape[-2]) // block[0]
    cols = np.arange(shape[-1]) // block[1]
    w_f32 = w_fp8.astype(np.float32) * scale_inv[..., rows[:, None], cols[None, :]]
    return w_f32, w_fp8, scale_inv


@pytest.mark.parametrize("shape,block", [((200, 130), (128, 128)), ((10, 13), (4, 8)),
                                         ((2, 9, 16), (4, 8))])
def test_fp8_exact_for_representable_values(shape, block):
    w_f32, w_fp8, scale_inv = representable_fp8(shape, block)
    np.testing.assert_array_equal(quant.dequant_fp8_blocks(w_fp8, scale_inv, block), w_f32)
    q, s = quantisers.quant_fp8_blocks(w_f32, block)
    np.testing.assert_array_equal(s, scale_inv)
    assert q.tobytes() == w_fp8.tobytes()


def test_fp8_round_trip_error_bound_and_partial_blocks():
    rng = np.random.default_rng(1)
    w = (rng.normal(size=(10, 13)) * np.exp(rng.normal(size=(10, 13)) * 3)).astype(np.float32)
    w[8:, 8:] = 0.0  # an all-zero (partial) edge block
    q, s = quantisers.quant_fp8_blocks(w, (4, 8))
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.shape == (3, 2) and s[2, 1] == 0
    np.testing.assert_allclose(s, [[np.abs(w[4 * r:4 * r + 4, 8 * c:8 * c + 8]).max() / 448
                                    for c in range(2)] for r in range(3)], rtol=1e-7)
    dq = quant.dequant_fp8_blocks(q, s, (4, 8))
    assert dq.dtype == np.float32
    s_full = np.repeat(np.repeat(s, 4, 0), 8, 1)[:10, :13]
    # E4M3: 3 mantissa bits -> half-ulp 2**-4 relative; subnormal step 2**-9 -> 2**-10 absolute.
    bound = np.maximum(2.0**-4 * np.abs(w), 2.0**-10 * s_full) * (1 + 1e-6)
    assert np.all(np.abs(dq - w) <= bound)
    np.testing.assert_array_equal(dq[8:, 8:], 0.0)


def test_fp8_dequant_matches_elementwise_definition():
    rng = np.random.default_rng(2)
    w = rng.normal(size=(7, 11)).astype(ml_dtypes.float8_e4m3fn)
    s = rng.random((3, 2)).astype(np.float32)
    want = np.array([[float(w[i, j]) * s[i // 3, j // 6] for j in range(11)] for i in range(7)],
                    dtype=np.float32)
    np.testing.assert_array_equal(quant.dequant_fp8_blocks(w, s, (3, 6)), want)
    bf16 = quant.dequant_fp8_blocks(w, s, (3, 6), dtype=ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bf16, want.astype(ml_dtypes.bfloat16))


def test_fp8_errors_and_config():
    w = np.zeros((200, 130), ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scale_inv shape \(1, 2\).*expected \(2, 2\)"):
        quant.dequant_fp8_blocks(w, np.ones((1, 2), np.float32))
    with pytest.raises(ValueError, match="integer dtype uint8"):
        quant.dequant_fp8_blocks(w.view(np.uint8), np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match=r"shape \(5,\) needs at least 2 dims"):
        quantisers.quant_fp8_blocks(np.ones(5, np.float32), (4, 8))
    with pytest.raises(ValueError, match="non-finite"):
        quantisers.quant_fp8_blocks(np.array([[np.inf]], np.float32), (4, 8))
    assert quant.fp8_block_size(None) == (128, 128)
    assert quant.fp8_block_size({"quant_method": "fp8", "weight_block_size": [64, 32]}) == (64, 32)
    with pytest.raises(ValueError, match="weight_block_size"):
        quant.fp8_block_size({"weight_block_size": [128]})


def test_fp8_checkpoint_through_the_reader(tmp_path):
    w_f32, w_fp8, scale_inv = representable_fp8((200, 130), (128, 128))
    write_safetensors(tmp_path, array_specs({"proj.weight": w_fp8,
                                             "proj.weight_scale_inv": scale_inv}))
    ckpt = SafetensorsCheckpoint.open(tmp_path)
    assert ckpt.info("proj.weight").dtype == "F8_E4M3"
    dq = quant.dequant_fp8_blocks(ckpt.read("proj.weight"), ckpt.read("proj.weight_scale_inv"))
    np.testing.assert_array_equal(dq, w_f32)


# --------------------------------------------------------------------------- MXFP4


def test_mxfp4_hand_computed_bytes():
    blocks = np.zeros((3, 16), np.uint8)
    blocks[0, 0] = 0x2F  # low nibble 0xF = -6.0 first, high nibble 0x2 = +1.0 second
    blocks[1, 0] = 0x71  # low 0x1 = +0.5, high 0x7 = +6.0
    blocks[2, :] = 0x9A  # low 0xA = -1.0, high 0x9 = -0.5
    scales = np.array([128, 126, 0], np.uint8)  # 2**1, 2**-1, 2**-127
    out = quant.dequant_mxfp4(blocks, scales)
    assert out.shape == (96,) and out.dtype == np.float32
    assert out[:2].tolist() == [-12.0, 2.0] and not out[2:32].any()
    assert out[32:34].tolist() == [0.25, 3.0]
    assert out[64:].tolist() == [-(2.0**-127), -(2.0**-128)] * 16
    assert np.isnan(quant.dequant_mxfp4(np.ones((1, 16), np.uint8), np.array([255], np.uint8))).all()


def test_mxfp4_matches_elementwise_definition_and_chunks(monkeypatch):
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, size=(3, 5, 4, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, size=(3, 5, 4), dtype=np.uint8)
    nibbles = np.stack([blocks & 0xF, blocks >> 4], axis=-1).reshape(3, 5, 4, 32)
    want = quant.E2M1_VALUES[nibbles] * 2.0 ** (scales.astype(np.float64) - 127)[..., None]
    want = want.reshape(3, 5, 128).astype(np.float32)
    np.testing.assert_array_equal(quant.dequant_mxfp4(blocks, scales), want)
    monkeypatch.setattr(quant, "_CHUNK_ELEMENTS", 200)  # 1 row per step instead of all 15
    np.testing.assert_array_equal(quant.dequant_mxfp4(blocks, scales), want)
    bf16 = quant.dequant_mxfp4(blocks, scales, dtype=ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bf16.astype(np.float32), want)  # exact in bf16


def test_mxfp4_exact_round_trip_for_representable_values():
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 16, size=(6, 3, 32)).astype(np.uint8)
    codes[..., 5] = rng.choice([7, 15], size=(6, 3))  # each group's max magnitude is 6
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    scales = rng.integers(1, 254, size=(6, 3), dtype=np.uint8)
    w = quant.dequant_mxfp4(blocks, scales)
    b2, s2 = quantisers.quant_mxfp4(w)
    np.testing.assert_array_equal(s2, scales)
    np.testing.assert_array_equal(b2, blocks)


def test_mxfp4_round_trip_error_and_rounding_rule():
    rng = np.random.default_rng(5)
    w = (rng.normal(size=(4, 128)) * np.exp(rng.normal(size=(4, 128)))).astype(np.float32)
    w[0, :32] = 0.0
    w[1, :32] = np.linspace(-6, 6, 32) * 0.75  # amax 4.5 -> e = 0, many exact ties
    blocks, scales = quantisers.quant_mxfp4(w)
    assert blocks.shape == (4, 4, 16) and scales.shape == (4, 4)
    assert scales[0, 0] == 127 and scales[1, 0] == 127
    e = scales.astype(np.int64) - 127
    amax = np.abs(w.reshape(4, 4, 32)).max(-1)
    nonzero = amax > 0
    assert np.all(amax[nonzero] <= 6 * 2.0 ** e[nonzero])     # nothing clips
    assert np.all(amax[nonzero] > 6 * 2.0 ** (e[nonzero] - 1))  # and e is the smallest such
    dq = quant.dequant_mxfp4(blocks, scales)
    step = np.repeat(2.0**e, 32, axis=-1)
    # E2M1: 1 mantissa bit -> half-ulp 2**-2 relative; subnormal step 0.5 -> 0.25 absolute.
    assert np.all(np.abs(dq - w) <= np.maximum(0.25 * np.abs(w), 0.25 * step))
    # Same rounding (nearest, ties to even) as ml_dtypes' float4_e2m1fn cast.
    ref = (w / step).astype(ml_dtypes.float4_e2m1fn).astype(np.float64) * step
    np.testing.assert_array_equal(dq, ref.astype(np.float32))


def test_mxfp4_errors():
    with pytest.raises(ValueError, match=r"blocks shape \(2, 15\) must end in 16 bytes"):
        quant.dequant_mxfp4(np.zeros((2, 15), np.uint8), np.zeros(2, np.uint8))
    with pytest.raises(ValueError, match=r"scales shape \(3,\) does not match.*expected \(2,\)"):
        quant.dequant_mxfp4(np.zeros((2, 16), np.uint8), np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="must be uint8, got int32"):
        quant.dequant_mxfp4(np.zeros((2, 16), np.int32), np.zeros(2, np.uint8))
    with pytest.raises(ValueError, match=r"shape \(2, 40\): last dim must be a multiple of 32"):
        quantisers.quant_mxfp4(np.zeros((2, 40), np.float32))
    with pytest.raises(ValueError, match="non-finite"):
        quantisers.quant_mxfp4(np.full(32, np.nan, np.float32))

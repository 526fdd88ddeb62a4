"""Streaming safetensors reader and sharded writer (numpy + ml_dtypes only).

Reading parses only the JSON headers up front and then reads one tensor's bytes at a time; writing
plans shards from shapes and dtypes and asks for each array only when it is written, so neither
direction ever holds more than one tensor (plus its copy) in host memory. No torch, no
`safetensors` package: that one is used in tests only, to cross-check the bytes.

File format: an 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`, then the
data buffer, offsets relative to its start. Sharded folders carry `model.safetensors.index.json`
with a `weight_map` {name: file}, the layout transformers reads and writes. All multi-byte values
are little-endian; like the rest of hcjax this assumes a little-endian host.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import ml_dtypes
import numpy as np
import numpy.typing as npt

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

# safetensors dtype code -> numpy dtype. Codes outside this table are rejected with the tensor name.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
_CODES: dict[np.dtype, str] = {dt: code for code, dt in DTYPES.items()}


def dtype_code(dtype: str | npt.DTypeLike) -> str:
    """The safetensors code ("BF16", "F8_E4M3", ...) for a code or anything `np.dtype` accepts.

    Codes are matched first, so "U8" means uint8 here, not numpy's 8-character unicode string.
    """
    if isinstance(dtype, str) and dtype in DTYPES:
        return dtype
    np_dtype = np.dtype(dtype)
    if np_dtype.byteorder == ">":
        np_dtype = np_dtype.newbyteorder("<")
    if np_dtype not in _CODES:
        raise ValueError(f"dtype {np_dtype} has no safetensors code; supported: {sorted(DTYPES)}")
    return _CODES[np_dtype]


class TensorInfo(NamedTuple):
    """Where a tensor lives and what it is; `dtype` is the safetensors code."""

    file: Path
    dtype: str
    shape: tuple[int, ...]

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


class _Entry(NamedTuple):
    info: TensorInfo
    begin: int  # absolute byte offsets in `info.file`
    end: int


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"duplicate keys {dup} in a safetensors header")
    return dict(pairs)


def _read_header(path: Path) -> tuple[list[tuple[str, _Entry]], dict[str, str]]:
    """Parse and validate one file's header; returns (name, entry) in offset order and metadata."""
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: {file_size} bytes is too short for a safetensors file")
        header_len = int.from_bytes(prefix, "little")
        if header_len > file_size - 8:
            raise ValueError(f"{path}: header length {header_len} exceeds file size {file_size}")
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: unreadable safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is a {type(header).__name__}, expected a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ValueError(f"{path}: __metadata__ must map str to str, got {metadata!r}")

    data_start = 8 + header_len
    data_len = file_size - data_start
    entries = []
    for name, spec in header.items():
        where = f"tensor {name!r} in {path}"
        if not isinstance(spec, dict) or {"dtype", "shape", "data_offsets"} - spec.keys():
            raise ValueError(f"{where}: expected dtype, shape and data_offsets, got {spec!r}")
        code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        if code not in DTYPES:
            raise ValueError(f"{where}: unknown dtype {code!r}; supported: {sorted(DTYPES)}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ValueError(f"{where}: shape {shape!r} is not a list of non-negative ints")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int for o in offsets)):
            raise ValueError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
        begin, end = offsets
        if not 0 <= begin <= end <= data_len:
            raise ValueError(f"{where}: data_offsets [{begin}, {end}] lie outside the "
                             f"{data_len}-byte data buffer")
        expected = math.prod(shape) * DTYPES[code].itemsize
        if end - begin != expected:
            raise ValueError(f"{where}: data_offsets span {end - begin} bytes but shape {shape} "
                             f"of {code} needs {expected}")
        info = TensorInfo(path, code, tuple(shape))
        entries.append((name, _Entry(info, data_start + begin, data_start + end)))
    entries.sort(key=lambda item: item[1].begin)
    for (prev_name, prev), (name, cur) in zip(entries, entries[1:]):
        if cur.begin < prev.end:
            raise ValueError(f"{path}: tensors {prev_name!r} and {name!r} overlap")
    return entries, metadata


class SafetensorsCheckpoint:
    """A single safetensors file or a (sharded) folder, opened by headers only.

    `read(name)` reads exactly that tensor's bytes into a fresh array owned by the caller.
    """

    def __init__(self, entries: Mapping[str, _Entry], metadata: dict[str, str], source: Path):
        self._entries = dict(entries)
        self.metadata = metadata
        self.source = source

    @classmethod
    def open(cls, path: str | os.PathLike) -> SafetensorsCheckpoint:
        """Open a `.safetensors` file, an index `.json`, or a folder holding either.

        A folder uses `model.safetensors.index.json` if present, else every `*.safetensors` in it.
        """
        path = Path(path)
        weight_map = None
        if path.is_dir():
            if (path / INDEX_FILE).is_file():
                weight_map, files = cls._read_index(path / INDEX_FILE)
            else:
                files = sorted(path.glob("*.safetensors"))
                if not files:
                    raise FileNotFoundError(f"no {INDEX_FILE} and no *.safetensors in {path}")
        elif path.suffix == ".json":
            weight_map, files = cls._read_index(path)
        elif path.is_file():
            files = [path]
        else:
            raise FileNotFoundError(f"{path} does not exist")

        entries: dict[str, _Entry] = {}
        metadata: dict[str, str] = {}
        for file in files:
            file_entries, file_metadata = _read_header(file)
            for name, entry in file_entries:
                if name in entries:
                    raise ValueError(f"tensor {name!r} is in both {entries[name].info.file} "
                                     f"and {file}")
                entries[name] = entry
            metadata.update(file_metadata)
        for name, file in (weight_map or {}).items():
            if name not in entries or entries[name].info.file != file:
                raise ValueError(f"{INDEX_FILE} maps {name!r} to {file}, which has no such tensor")
        return cls(entries, metadata, path)

    @staticmethod
    def _read_index(index_path: Path) -> tuple[dict[str, Path], list[Path]]:
        index = json.loads(index_path.read_text())
        raw_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(raw_map, dict):
            raise ValueError(f"{index_path}: no weight_map object")
        weight_map = {name: index_path.parent / file for name, file in raw_map.items()}
        files = list(dict.fromkeys(weight_map.values()))  # first-seen order, no repeats
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{index_path} names {file.name}, which does not exist")
        return weight_map, files

    @property
    def names(self) -> list[str]:
        """Tensor names, file by file in offset order."""
        return list(self._entries)

    @property
    def files(self) -> list[Path]:
        return list(dict.fromkeys(e.info.file for e in self._entries.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, name: str) -> _Entry:
        if name not in self._entries:
            raise KeyError(f"no tensor {name!r} in {self.source}")
        return self._entries[name]

    def info(self, name: str) -> TensorInfo:
        return self._entry(name).info

    def nbytes(self, name: str) -> int:
        entry = self._entry(name)
        return entry.end - entry.begin

    def read(self, name: str) -> np.ndarray:
        """Read one tensor from disk into a new array (no mmap stays alive behind it)."""
        entry = self._entry(name)
        buf = np.empty(entry.end - entry.begin, dtype=np.uint8)
        view = memoryview(buf)
        with open(entry.info.file, "rb", buffering=0) as f:
            f.seek(entry.begin)
            done = 0
            while done < len(buf):
                n = f.readinto(view[done:])
                if not n:
                    raise OSError(f"{entry.info.file}: file ended inside tensor {name!r}")
                done += n
        return buf.view(entry.info.np_dtype).reshape(entry.info.shape)

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        """(name, array) one tensor at a time, in `names` order."""
        for name in self._entries:
            yield name, self.read(name)


class TensorSpec(NamedTuple):
    """A tensor to write: `fetch()` is called once, when the tensor's bytes are written."""

    name: str
    shape: tuple[int, ...]
    dtype: str | npt.DTypeLike
    fetch: Callable[[], np.ndarray]


def array_specs(arrays: Mapping[str, np.ndarray]) -> list[TensorSpec]:
    """Specs for arrays already in host memory (tests, small checkpoints)."""
    return [TensorSpec(name, a.shape, a.dtype, lambda a=a: a) for name, a in arrays.items()]


def shard_file_names(num_shards: int) -> list[str]:
    """The file names transformers uses for `num_shards` shards."""
    if num_shards == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{num_shards:05d}.safetensors" for i in range(1, num_shards + 1)]


def plan_shards(nbytes: Sequence[int], max_shard_bytes: int) -> list[list[int]]:
    """Group tensor indices into shards, in order; a new shard when the next would not fit.

    A tensor larger than `max_shard_bytes` gets a shard of its own.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
    shards: list[list[int]] = [[]]
    size = 0
    for i, n in enumerate(nbytes):
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += n
    return shards


def _header_bytes(specs: Sequence[tuple[str, str, tuple[int, ...], int]],
                  metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, code, shape, n in specs:
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # pad so the data buffer starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


def _write_atomic(path: Path, write: Callable[[object], None]) -> None:
    """Write to a temporary name beside `path`, fsync, then rename over it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_safetensors(
    folder: str | os.PathLike,
    tensors: Sequence[TensorSpec | tuple],
    max_shard_bytes: int = 5 * 2**30,
    metadata: Mapping[str, str] | None = None,
    progress: Callable[[str, int], None] | None = None,
) -> list[Path]:
    """Write `tensors` [(name, shape, dtype, fetch)] as one file or shards plus an index.

    Returns the paths written (shards, then the index if any). Metadata always carries
    `"format": "pt"` unless `metadata` overrides it (transformers refuses files without a format).
    Stale `model.safetensors`, `model-*-of-*.safetensors` and index files from an earlier save
    into the same folder are removed afterwards, as transformers' `save_pretrained` does, because
    a stale single file would shadow the new shards in loaders that look for it first.
    """
    folder = Path(folder)
    specs = [TensorSpec(*t) for t in tensors]
    header_meta = {"format": "pt", **(metadata or {})}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in header_meta.items()):
        raise ValueError(f"metadata must map str to str, got {header_meta!r}")
    seen: set[str] = set()
    planned = []  # (name, code, shape, nbytes) per tensor
    for spec in specs:
        if spec.name in seen or spec.name == "__metadata__":
            raise ValueError(f"tensor name {spec.name!r} is repeated or reserved")
        seen.add(spec.name)
        shape = tuple(int(d) for d in spec.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"tensor {spec.name!r}: negative dimension in shape {shape}")
        code = dtype_code(spec.dtype)
        planned.append((spec.name, code, shape, math.prod(shape) * DTYPES[code].itemsize))

    shards = plan_shards([p[3] for p in planned], max_shard_bytes)
    file_names = shard_file_names(len(shards))
    folder.mkdir(parents=True, exist_ok=True)

    def write_shard(f, indices: list[int]) -> None:
        f.write(_header_bytes([planned[i] for i in indices], header_meta))
        for i in indices:
            name, code, shape, n = planned[i]
            array = np.asarray(specs[i].fetch())
            if array.dtype.byteorder == ">":
                array = array.astype(array.dtype.newbyteorder("<"))
            if array.shape != shape or array.dtype != DTYPES[code]:
                raise ValueError(f"tensor {name!r}: fetched {array.dtype}{list(array.shape)}, "
                                 f"declared {DTYPES[code]}{list(shape)}")
            f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
            del array
            if progress is not None:
                progress(name, n)

    written = []
    for file_name, indices in zip(file_names, shards):
        path = folder / file_name
        _write_atomic(path, lambda f, indices=indices: write_shard(f, indices))
        written.append(path)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(p[3] for p in planned)},
            "weight_map": {planned[i][0]: file_names[s]
                           for s, indices in enumerate(shards) for i in indices},
        }
        content = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")
        path = folder / INDEX_FILE
        _write_atomic(path, lambda f: f.write(content))
        written.append(path)

    keep = {p.name for p in written}
    for old in folder.iterdir():
        stale = old.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.fullmatch(old.name)
        if stale and old.name not in keep:
            old.unlink()
    return written

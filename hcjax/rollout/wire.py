"""Byte format of the rollout gRPC service: a JSON header plus raw numpy arrays, no protoc.

A message is b"HCJ1", a little-endian uint32 header length, the UTF-8 JSON header
{"meta": {...}, "arrays": [[name, dtype, shape], ...]}, then each array's C-order bytes in that
order. Records and token batches are flattened into named arrays with these helpers; a record's
fields come from its schema (hcjax.rollout.records.record_schema), never from a list kept here.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hcjax.rollout.records import record_schema, rollout_arrays, rollout_from_parts, rollout_scalars
from hcjax.rollout.request import SampledRollout, TokenEvent

__all__ = [
    "decode",
    "encode",
    "events_from_arrays",
    "events_to_arrays",
    "record_from_wire",
    "record_to_wire",
]

_MAGIC = b"HCJ1"
_ALLOWED_DTYPES = {"int32", "float32", "bool", "int64", "uint32"}


def encode(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None) -> bytes:
    arrays = arrays or {}
    spec, blobs = [], []
    for name, arr in arrays.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype.name not in _ALLOWED_DTYPES:
            raise ValueError(f"array {name!r} has dtype {arr.dtype}, not one of {_ALLOWED_DTYPES}")
        spec.append([name, arr.dtype.name, list(arr.shape)])
        blobs.append(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
    header = json.dumps({"meta": dict(meta), "arrays": spec}).encode()
    return b"".join([_MAGIC, struct.pack("<I", len(header)), header, *blobs])


_MAX_NDIM = 4


def decode(data: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Parse a message; ValueError naming the first thing that is malformed, whatever the bytes."""
    data = bytes(data)
    if data[:4] != _MAGIC:
        raise ValueError(f"not an hcjax rollout message (starts with {data[:4]!r})")
    if len(data) < 8:
        raise ValueError(f"message of {len(data)} bytes ends inside its header length")
    (n,) = struct.unpack("<I", data[4:8])
    if 8 + n > len(data):
        raise ValueError(f"header length {n} runs past the message's {len(data)} bytes")
    try:
        header = json.loads(data[8 : 8 + n])
    except RecursionError:
        raise ValueError("message header is nested too deeply") from None
    except ValueError as e:  # bad JSON or bad UTF-8
        raise ValueError(f"message header is not valid JSON: {e}") from None
    if not isinstance(header, dict) or set(header) - {"meta", "arrays"}:
        raise ValueError("message header must be an object with only 'meta' and 'arrays'")
    meta, specs = header.get("meta", {}), header.get("arrays", [])
    if not isinstance(meta, dict):
        raise ValueError(f"message 'meta' is a {type(meta).__name__}, not an object")
    if not isinstance(specs, list):
        raise ValueError(f"message 'arrays' is a {type(specs).__name__}, not a list")
    offset = 8 + n
    arrays = {}
    for spec in specs:
        name, dtype, shape = _array_spec(spec)
        if name in arrays:
            raise ValueError(f"array {name!r} appears twice")
        dt = np.dtype(dtype).newbyteorder("<")
        count = 1
        for d in shape:  # Python ints: a huge shape cannot overflow
            count *= d
        size = count * dt.itemsize
        if offset + size > len(data):
            raise ValueError(f"message truncated inside array {name!r} (shape {shape})")
        arrays[name] = np.frombuffer(data, dt, count, offset).reshape(shape)
        offset += size
    if offset != len(data):
        raise ValueError(f"{len(data) - offset} bytes follow the last array")
    return meta, arrays


def _array_spec(spec: Any) -> tuple[str, str, list[int]]:
    if not (isinstance(spec, list) and len(spec) == 3):
        raise ValueError(f"array spec {spec!r:.80} is not [name, dtype, shape]")
    name, dtype, shape = spec
    if not isinstance(name, str):
        raise ValueError(f"array name {name!r:.80} is not a string")
    if not isinstance(dtype, str) or dtype not in _ALLOWED_DTYPES:
        raise ValueError(f"array {name!r} has dtype {dtype!r:.40}, not one of "
                         f"{sorted(_ALLOWED_DTYPES)}")
    if not (isinstance(shape, list) and len(shape) <= _MAX_NDIM
            and all(type(d) is int and d >= 0 for d in shape)):
        raise ValueError(f"array {name!r} has shape {shape!r:.80}; expected a list of at most "
                         f"{_MAX_NDIM} non-negative integers")
    return name, dtype, shape


def record_to_wire(rec: SampledRollout, prefix: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, arrays) of one record: its non-array fields in `meta`, its arrays named
    `{prefix}.{field}`. Every field of the record's schema (hcjax.rollout.records) that the rollout
    service carries; graded fields (reward, advantage) are never on the wire."""
    specs = record_schema(type(rec), wire=True)
    arrays = {f"{prefix}.{name}": arr for name, arr in rollout_arrays(rec, specs).items()}
    return rollout_scalars(rec, specs), arrays


def record_from_wire(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray], prefix: str,
                     cls: type[SampledRollout] = SampledRollout) -> SampledRollout:
    """The record `prefix` of a message; ValueError naming the field when anything is off.

    Strict, as the peer may be hostile: every wire field of the schema must be in `meta` and
    nothing else, and each array must already have its schema dtype (no silent casts).
    """
    if not isinstance(meta, Mapping):
        raise ValueError(f"record {prefix} is a {type(meta).__name__}, not an object")
    specs = record_schema(cls, wire=True)
    own = {}
    for spec in specs:
        arr = arrays.get(f"{prefix}.{spec.name}") if spec.kind == "array" else None
        if arr is not None:
            if arr.dtype != spec.dtype:
                raise ValueError(f"record {prefix}: {spec.name} has dtype {arr.dtype.name}, "
                                 f"expected {spec.dtype.name}")
            own[spec.name] = arr
    try:
        return rollout_from_parts(meta, own, cls, specs=specs)
    except ValueError as e:
        raise ValueError(f"record {prefix}: {e}") from None


def events_to_arrays(events: Sequence[TokenEvent]) -> dict[str, np.ndarray]:
    """One array `t.{field}` per TokenEvent field (its schema dtype), stacked over `events`."""
    return {
        f"t.{spec.name}": np.asarray([getattr(e, spec.name) for e in events], spec.dtype)
        for spec in record_schema(TokenEvent)
    }


def events_from_arrays(arrays: Mapping[str, np.ndarray]) -> list[TokenEvent]:
    n = len(arrays.get("t.token", ()))
    if not n:
        return []
    columns = [(spec.name, arrays[f"t.{spec.name}"]) for spec in record_schema(TokenEvent)]
    return [
        TokenEvent(**{name: col[i].item() if col.ndim == 1 else col[i] for name, col in columns})
        for i in range(n)
    ]

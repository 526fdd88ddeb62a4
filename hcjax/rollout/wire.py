"""Byte format of the rollout gRPC service: a JSON header plus raw numpy arrays, no protoc.

A message is b"HCJ1", a little-endian uint32 header length, the UTF-8 JSON header
{"meta": {...}, "arrays": [[name, dtype, shape], ...]}, then each array's C-order bytes in that
order. Records and token batches are flattened into named arrays with these helpers.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

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


_RECORD_ARRAYS = (
    "prompt_ids response_ids logprobs n_kept threshold_logit loss_mask versions routing "
    "raw_logprobs"
).split()
_RECORD_SCALARS = (
    "finish_reason temperature group_id seed sample_index top_p max_tokens stop_tokens partial"
).split()


def record_to_wire(rec: SampledRollout, prefix: str) -> tuple[dict, dict[str, np.ndarray]]:
    meta = {name: getattr(rec, name) for name in _RECORD_SCALARS}
    meta["stop_tokens"] = list(rec.stop_tokens)
    arrays = {
        f"{prefix}.{name}": getattr(rec, name)
        for name in _RECORD_ARRAYS
        if getattr(rec, name) is not None
    }
    return meta, arrays


_RECORD_DTYPES = {
    "prompt_ids": "int32", "response_ids": "int32", "logprobs": "float32", "n_kept": "int32",
    "threshold_logit": "float32", "loss_mask": "bool", "versions": "int32", "routing": "int32",
    "raw_logprobs": "float32",
}
_OPTIONAL_ARRAYS = {"routing", "raw_logprobs"}


def record_from_wire(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
                     prefix: str) -> SampledRollout:
    """The record `prefix` of a message; ValueError naming the field when anything is off."""
    if not isinstance(meta, Mapping):
        raise ValueError(f"record {prefix} is a {type(meta).__name__}, not an object")
    missing = sorted(set(_RECORD_SCALARS) - set(meta))
    unknown = sorted(set(meta) - set(_RECORD_SCALARS))
    if missing or unknown:
        raise ValueError(f"record {prefix}: missing fields {missing}, unknown fields {unknown}")
    fields = {}
    for name in _RECORD_ARRAYS:
        arr = arrays.get(f"{prefix}.{name}")
        if arr is None and name not in _OPTIONAL_ARRAYS:
            raise ValueError(f"record {prefix} has no array {name!r}")
        if arr is not None and arr.dtype.name != _RECORD_DTYPES[name]:
            raise ValueError(f"record {prefix}: {name} has dtype {arr.dtype.name}, expected "
                             f"{_RECORD_DTYPES[name]}")
        fields[name] = arr
    scalars = {name: meta[name] for name in _RECORD_SCALARS}
    if not isinstance(scalars["stop_tokens"], list):
        raise ValueError(f"record {prefix}: stop_tokens={scalars['stop_tokens']!r:.80} is not "
                         "a list")
    scalars["stop_tokens"] = tuple(scalars["stop_tokens"])
    return SampledRollout(**fields, **scalars)


_EVENT_FIELDS = (
    ("sample_index", np.int32), ("token", np.int32), ("logprob", np.float32),
    ("raw_logprob", np.float32), ("n_kept", np.int32), ("threshold_logit", np.float32),
    ("position", np.int32), ("version", np.int32),
)


def events_to_arrays(events: Sequence[TokenEvent]) -> dict[str, np.ndarray]:
    out = {
        f"t.{name}": np.asarray([getattr(e, name) for e in events], dtype)
        for name, dtype in _EVENT_FIELDS
    }
    if events:
        out["t.routing"] = np.stack([np.asarray(e.routing, np.int32) for e in events])
    return out


def events_from_arrays(arrays: Mapping[str, np.ndarray]) -> list[TokenEvent]:
    n = len(arrays.get("t.token", ()))
    return [
        TokenEvent(
            **{name: arrays[f"t.{name}"][i].item() for name, _ in _EVENT_FIELDS},
            routing=arrays["t.routing"][i],
        )
        for i in range(n)
    ]

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


def decode(data: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    if data[:4] != _MAGIC:
        raise ValueError(f"not an hcjax rollout message (starts with {data[:4]!r})")
    (n,) = struct.unpack("<I", data[4:8])
    try:
        header = json.loads(data[8 : 8 + n])
    except json.JSONDecodeError as e:
        raise ValueError(f"message header is not valid JSON: {e}") from None
    offset = 8 + n
    arrays = {}
    for name, dtype, shape in header.get("arrays", []):
        if dtype not in _ALLOWED_DTYPES:
            raise ValueError(f"array {name!r} has dtype {dtype!r}, not one of {_ALLOWED_DTYPES}")
        dt = np.dtype(dtype).newbyteorder("<")
        size = int(np.prod(shape)) * dt.itemsize
        if offset + size > len(data):
            raise ValueError(f"message truncated inside array {name!r}")
        arrays[name] = np.frombuffer(data, dt, int(np.prod(shape)), offset).reshape(shape)
        offset += size
    return header.get("meta", {}), arrays


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


def record_from_wire(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
                     prefix: str) -> SampledRollout:
    fields = {name: arrays.get(f"{prefix}.{name}") for name in _RECORD_ARRAYS}
    scalars = {name: meta[name] for name in _RECORD_SCALARS}
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

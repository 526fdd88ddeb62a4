"""A GGUF file (llama.cpp's one-file format) as plain data: its metadata, its tensors decoded to
float32 by the `gguf` library's own dequantisers (we decode no quantisation ourselves), and the
Hugging Face tokenizer files its `tokenizer.ggml.*` metadata describes (byte-level BPE).

No JAX and no model here: `hcjax.model.gguf` maps the tensors and config onto our families, and
`HFTokenizer.from_gguf` builds the tokenizer from these files.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import numpy as np

__all__ = ["ARCHITECTURES", "SUPPORTED_TYPES", "GGUFFile", "is_gguf", "open_file",
           "tokenizer_files"]

GGUF_MAGIC = b"GGUF"
REQUIREMENT_HINT = "make real (or pip install -r requirements-real.txt)"

# The tensor encodings we read: the gguf library dequantises each of them (we decode none
# ourselves). Others (the IQ grids, ternary, MXFP4 of GPT-OSS files) are refused by name.
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)

# llama.cpp's token types (tokenizer.ggml.token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


class MissingDependency(ImportError):
    """An optional package a requested feature needs is not installed (reported by entry
    points as one `error:` line, like a configuration mistake)."""

    user_error = True


def _gguf_module():
    try:
        import gguf  # an optional dependency: only GGUF files need it
    except ImportError as e:
        raise MissingDependency(
            f"reading a .gguf file needs the gguf package: {REQUIREMENT_HINT}") from e
    return gguf


def is_gguf(path: str | os.PathLike) -> bool:
    """True when `path` is a file that starts with GGUF's magic bytes."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


# --- The file: metadata and tensors --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Architecture:
    """How one GGUF `general.architecture` maps onto a Hugging Face model_type."""

    model_type: str
    # llama.cpp's converter reorders each q/k head's rows from halves to interleaved pairs for
    # its NORM rope (Llama family); Qwen files keep the Hugging Face (NEOX) order.
    permuted_qk: bool
    qk_norm: bool = False
    moe: bool = False


ARCHITECTURES = {
    "llama": Architecture("llama", permuted_qk=True),
    "qwen3": Architecture("qwen3", permuted_qk=False, qk_norm=True),
    "qwen3moe": Architecture("qwen3_moe", permuted_qk=False, qk_norm=True, moe=True),
}


class GGUFFile:
    """One GGUF file's metadata (plain Python values) and tensors (memory-mapped, undecoded)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.path.abspath(os.fspath(path))
        if not is_gguf(self.path):
            raise ValueError(f"{self.path!r} is not a GGUF file (no 'GGUF' magic at its start)")
        gguf = _gguf_module()
        try:
            reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # the reader raises bare ValueErrors/struct errors on bad files
            raise ValueError(f"{self.path!r} could not be read as GGUF: {e}") from e
        self.meta: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            self.meta[key] = field.contents()
        self.tensors = {t.name: t for t in reader.tensors}
        self.arch_name = str(self.meta.get("general.architecture", ""))
        if self.arch_name not in ARCHITECTURES:
            raise ValueError(
                f"{self.path!r}: GGUF architecture {self.arch_name!r} is not supported "
                f"(supported: {', '.join(ARCHITECTURES)})"
            )
        self.arch = ARCHITECTURES[self.arch_name]
        for t in self.tensors.values():
            if t.tensor_type.name not in SUPPORTED_TYPES:
                raise ValueError(
                    f"{self.path!r}: tensor {t.name!r} is stored as {t.tensor_type.name}, which "
                    f"is not supported (supported: {', '.join(SUPPORTED_TYPES)})"
                )

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, {self.arch_name}, {len(self.tensors)} tensors)"

    def get(self, key: str, default: Any = None) -> Any:
        """An architecture key (`{arch}.` prefixed) or a global one."""
        return self.meta.get(f"{self.arch_name}.{key}", self.meta.get(key, default))

    def get_float(self, key: str, default: float | None = None) -> float | None:
        """A float32 metadata value as the decimal it was written from (1e-05, not
        9.999999747378752e-06): the shortest repr that rounds to the same float32."""
        value = self.get(key)
        return default if value is None else float(str(np.float32(value)))

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.path!r}: GGUF metadata {self.arch_name}.{key} is missing")
        return value

    def shape(self, name: str) -> tuple[int, ...]:
        """Row-major (numpy) shape: GGUF lists dimensions innermost first."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape))

    def dequantize(self, name: str, index: int | None = None) -> np.ndarray:
        """Tensor `name` (or its entry `index` along the first axis) as float32."""
        gguf = _gguf_module()
        t = self.tensors[name]
        data = t.data if index is None else t.data[index]
        out = gguf.quants.dequantize(np.asarray(data), t.tensor_type)
        return np.asarray(out, dtype=np.float32).reshape(
            self.shape(name) if index is None else self.shape(name)[1:])


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_file(path: str | os.PathLike) -> GGUFFile:
    """`GGUFFile(path)`, parsed once per process while the file is unchanged (the gguf reader
    takes seconds on a 49K-token vocabulary, and a job reads config, tokenizer and tensors)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    st = os.stat(path)
    return _open_cached(path, st.st_mtime_ns, st.st_size)


# --- Tokenizer files -----------------------------------------------------------------------------

# Pre-tokenizers of tokenizer.ggml.pre, as tokenizers' JSON. GPT-2's byte-level split is the
# default; SmolLM2 splits digits one by one first; Llama 3 and Qwen2/3 split by their own regex
# (digits in runs of up to three / one by one) before the byte-level mapping.
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
               "use_regex": True}
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(regex: str) -> dict[str, Any]:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {**_BYTE_LEVEL, "use_regex": False},
    ]}


PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "default": _BYTE_LEVEL,
    "gpt2": _BYTE_LEVEL,
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
    "llama-bpe": _split_then_bytes(_LLAMA3_REGEX),
    "llama3": _split_then_bytes(_LLAMA3_REGEX),
    "qwen2": _split_then_bytes(_QWEN2_REGEX),
}


def _tokenizer_json(f: GGUFFile) -> dict[str, Any]:
    model = f.meta.get("tokenizer.ggml.model")
    if model is None:
        raise ValueError(f"{f.path!r} has no tokenizer (no tokenizer.ggml.model in its metadata)")
    if model != "gpt2":
        raise ValueError(
            f"{f.path!r}: tokenizer.ggml.model={model!r} is not supported (supported: 'gpt2', "
            "byte-level BPE)"
        )
    pre = str(f.meta.get("tokenizer.ggml.pre") or "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{f.path!r}: tokenizer.ggml.pre={pre!r} is not supported (supported: "
            f"{', '.join(PRE_TOKENIZERS)})"
        )
    tokens = [str(t) for t in f.meta["tokenizer.ggml.tokens"]]
    types = list(f.meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    merges = [str(m) for m in f.meta.get("tokenizer.ggml.merges") or []]
    if len(types) != len(tokens):
        raise ValueError(f"{f.path!r}: {len(types)} token types for {len(tokens)} tokens")
    added = [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": types[i] != _CONTROL, "special": types[i] == _CONTROL}
        for i, tok in enumerate(tokens) if types[i] in (_CONTROL, _USER_DEFINED)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre],
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in merges],
        },
    }


def tokenizer_files(f: GGUFFile) -> dict[str, dict[str, Any]]:
    """tokenizer.json, tokenizer_config.json (special tokens, chat template) and
    generation_config.json (stop ids) as a Hugging Face folder would hold them, from the
    metadata; empty when the file carries no tokenizer."""
    tokens = f.meta.get("tokenizer.ggml.tokens")
    files: dict[str, dict[str, Any]] = {}
    if tokens is None:
        return files

    def token(key: str) -> str | None:
        i = f.meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is None:
            return None
        if not 0 <= int(i) < len(tokens):
            raise ValueError(f"{f.path!r}: tokenizer.ggml.{key}_token_id={int(i)} is outside the "
                             f"vocabulary of {len(tokens)}")
        return str(tokens[int(i)])

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"), "eos_token": token("eos"), "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "add_bos_token": bool(f.meta.get("tokenizer.ggml.add_bos_token", False)),
        "model_max_length": int(f.get("context_length") or 0) or None,
    }
    template = f.meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = str(template)
    files["tokenizer.json"] = _tokenizer_json(f)
    files["tokenizer_config.json"] = config
    stop = [int(f.meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                     "tokenizer.ggml.eom_token_id") if f.meta.get(k) is not None]
    if stop:
        gen: dict[str, Any] = {"eos_token_id": list(dict.fromkeys(stop))}
        if f.meta.get("tokenizer.ggml.bos_token_id") is not None:
            gen["bos_token_id"] = int(f.meta["tokenizer.ggml.bos_token_id"])
        files["generation_config.json"] = gen
    return files

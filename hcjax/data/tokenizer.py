"""Tokenizers: a built-in byte-level tokenizer (no files needed) with the special tokens of our
own chat template, and the loader that picks it or a local Hugging Face folder (`HFTokenizer`, in
hf_tokenizer.py), both exposing the same small interface."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

from hcjax.data.hf_tokenizer import HFTokenizer

# Special tokens of the chat / reasoning template (RECIPE §3). The byte tokenizer gives them the
# first ids so that id 0 is padding everywhere (segment id 0 is padding in the model too).
PAD = "<pad>"
BOS = "<bos>"
EOS = "<eos>"
THINK = "<think>"
END_THINK = "</think>"
ANSWER = "<answer>"
END_ANSWER = "</answer>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
TOOL = "<|tool|>"
END_TURN = "<|end|>"

SPECIAL_TOKENS: tuple[str, ...] = (
    PAD, BOS, EOS, THINK, END_THINK, ANSWER, END_ANSWER, SYSTEM, USER, ASSISTANT, TOOL, END_TURN,
    "<|reserved_0|>", "<|reserved_1|>", "<|reserved_2|>", "<|reserved_3|>",
)
NUM_SPECIAL = len(SPECIAL_TOKENS)  # 16
BYTE_OFFSET = NUM_SPECIAL


class Tokenizer(Protocol):
    """What the data pipeline, templates and samplers need from a tokenizer."""

    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str: ...
    def special_id(self, token: str) -> int: ...


class ByteTokenizer:
    """UTF-8 bytes shifted by `BYTE_OFFSET`; ids below it are the special tokens.

    `encode` never produces special ids from plain text (so a user cannot inject `<answer>`);
    templates add special tokens explicitly with `special_id`.
    """

    vocab_size: int = NUM_SPECIAL + 256  # 272
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    def __init__(self) -> None:
        self._special = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Bytes decode with replacement for invalid UTF-8; specials are spelled out unless
        `skip_special`."""
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside [0, {self.vocab_size})")
            if i >= BYTE_OFFSET:
                buf.append(i - BYTE_OFFSET)
                continue
            if buf:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
            if not skip_special:
                out.append(SPECIAL_TOKENS[i])
        if buf:
            out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def special_id(self, token: str) -> int:
        if token not in self._special:
            raise ValueError(f"special token {token!r} is not one of {SPECIAL_TOKENS}")
        return self._special[token]


def load_tokenizer(path: str | os.PathLike | None = None) -> ByteTokenizer | HFTokenizer:
    """The byte tokenizer when `path` is None or "byte", else the Hugging Face model folder at
    `path` (`HFTokenizer.from_pretrained`)."""
    if path is None or path == "byte":
        return ByteTokenizer()
    return HFTokenizer.from_pretrained(path)

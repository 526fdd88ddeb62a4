"""Tokenizers: a built-in byte-level tokenizer (no files needed) and a wrapper around a local
Hugging Face `tokenizer.json`, both exposing the same small interface and special-token ids."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

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


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a local `tokenizer.json`.

    The template's special tokens are added to the vocabulary if the file lacks them, so the
    same templates work with either tokenizer.
    """

    def __init__(self, path: str, pad: str = PAD, bos: str = BOS, eos: str = EOS) -> None:
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as _HFTok

        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file {path!r} does not exist")
        try:
            self._tok = _HFTok.from_file(path)
        except Exception as e:  # the library raises a bare Exception on bad JSON
            raise ValueError(f"tokenizer file {path!r} could not be parsed: {e}") from e
        missing = [t for t in SPECIAL_TOKENS if self._tok.token_to_id(t) is None]
        if missing:
            self._tok.add_special_tokens([AddedToken(t, special=True) for t in missing])
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.pad_id = self.special_id(pad)
        self.bos_id = self.special_id(bos)
        self.eos_id = self.special_id(eos)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def special_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(f"special token {token!r} is not in the tokenizer vocabulary")
        return i


def load_tokenizer(path: str | None = None) -> ByteTokenizer | HFTokenizer:
    """The byte tokenizer when `path` is None or "byte", else the `tokenizer.json` at `path`."""
    if path is None or path == "byte":
        return ByteTokenizer()
    return HFTokenizer(path)

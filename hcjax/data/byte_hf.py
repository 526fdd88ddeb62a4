"""The byte tokenizer (`ByteTokenizer`) and our chat template written as a Hugging Face tokenizer
folder, so a model trained on bytes exports as a folder `HFTokenizer` and transformers load with
the same ids. It only writes files; reading them back is `HFTokenizer.from_pretrained`.

What the folder reproduces, id for id:
  - `encode(text)`: UTF-8 bytes shifted by `BYTE_OFFSET` (a byte-level BPE with every byte in the
    vocabulary and no merges). Unlike `ByteTokenizer.encode`, special-token text inside `text`
    becomes its special id, as in any Hugging Face tokenizer; for the reasoning tags that is
    what our template does too (`template.encode_content`).
  - the 16 special tokens at ids 0..15, spelled out by `decode` unless `skip_special`.
  - `apply_chat_template(messages)`: `template.messages_prompt_ids` (`<bos>`, then per message
    its role marker, content and `<|end|>`, then `<|assistant|>`). Without the generation prompt
    it renders `template.encode_chat(messages, add_eos=False)`: like every chat template it ends
    a turn with the end-of-turn token and never writes `<eos>` itself, so a conversation's
    rendering always extends the rendering of its first turns.
  - stop ids (generation_config.json `eos_token_id`): `<eos>` then `<|end|>`, so `eos_id` is
    `ByteTokenizer.eos_id` and sampling stops at the end of the assistant turn.
"""

from __future__ import annotations

import json
import os

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from hcjax.data import tokenizer as T
from hcjax.data.hf_tokenizer import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    TEMPLATE_FILE,
    TOKENIZER_FILE,
)
from hcjax.data.template import ROLE_MARKERS

# One line, so that trim_blocks / lstrip_blocks (which transformers and HFTokenizer both set) have
# no whitespace to act on; every character it writes is a token.
CHAT_TEMPLATE = (
    "{%- set markers = {"
    + ", ".join(f"'{role}': '{marker}'" for role, marker in ROLE_MARKERS.items())
    + "} -%}"
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in markers -%}"
    "{{- raise_exception('role ' + message['role'] + ' is not one of "
    + ", ".join(sorted(ROLE_MARKERS))
    + "') -}}"
    "{%- endif -%}"
    "{{- markers[message['role']] + message['content'] + '" + T.END_TURN + "' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '" + T.ASSISTANT + "' -}}{%- endif -%}"
)

# Token ids of config.json / generation_config.json: what the byte tokenizer uses.
BYTE_TOKEN_IDS = {
    "bos_token_id": T.ByteTokenizer.bos_id,
    "eos_token_id": [T.ByteTokenizer.eos_id, T.SPECIAL_TOKENS.index(T.END_TURN)],
    "pad_token_id": T.ByteTokenizer.pad_id,
}


def byte_tokenizer_json() -> Tokenizer:
    """A `tokenizers.Tokenizer` whose ids are `ByteTokenizer`'s: the specials at 0..15 (added as
    special tokens, matched whole in text), byte b at `BYTE_OFFSET + b` under the printable
    character the ByteLevel pre-tokenizer writes for it (one token per byte: there are no
    merges)."""
    vocab = {tok: i for i, tok in enumerate(T.SPECIAL_TOKENS)}
    vocab.update({c: T.BYTE_OFFSET + b for b, c in enumerate(byte_chars())})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: the text is one piece, so no byte is ever grouped with a neighbour.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(s, special=True, normalized=False) for s in T.SPECIAL_TOKENS]
    )
    return tok


def byte_chars() -> list[str]:
    """The printable character standing for each byte 0..255 in byte-level BPE (GPT-2's
    `bytes_to_unicode`, which `pre_tokenizers.ByteLevel` uses): printable Latin-1 bytes stand
    for themselves, the others are numbered from U+0100 in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(0x100 + n) for n, b in enumerate(others)})
    return [chars[b] for b in range(256)]


def write_byte_tokenizer(folder: str | os.PathLike) -> list[str]:
    """Write tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json
    of the byte tokenizer into `folder` (created if needed); returns the file names written."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    byte_tokenizer_json().save(os.path.join(folder, TOKENIZER_FILE))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": T.BOS,
        "eos_token": T.EOS,
        "pad_token": T.PAD,
        "unk_token": None,
        "add_bos_token": False,  # the chat template writes <bos>
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }
    generation = dict(BYTE_TOKEN_IDS)
    for name, data in ((CONFIG_FILE, config), (GENERATION_CONFIG_FILE, generation)):
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    with open(os.path.join(folder, TEMPLATE_FILE), "w", encoding="utf-8") as f:
        f.write(CHAT_TEMPLATE)
    return [TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE, GENERATION_CONFIG_FILE]

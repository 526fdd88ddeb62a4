"""Tokenizers: byte round-trips, special-token ids, and a local Hugging Face tokenizer.json."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hcjax.data import tokenizer as T
from hcjax.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def test_byte_vocab_layout():
    tok = ByteTokenizer()
    assert tok.vocab_size == 272 == T.NUM_SPECIAL + 256
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert [tok.special_id(s) for s in T.SPECIAL_TOKENS] == list(range(T.NUM_SPECIAL))
    assert tok.encode("A") == [ord("A") + T.BYTE_OFFSET]
    assert tok.encode("é") == [0xC3 + 16, 0xA9 + 16]  # UTF-8 bytes, shifted


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(T.BYTE_OFFSET <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_plain_text_never_yields_special_ids():
    tok = ByteTokenizer()
    ids = tok.encode("<answer>7</answer><eos>")
    assert min(ids) >= T.BYTE_OFFSET
    assert tok.decode(ids) == "<answer>7</answer><eos>"


def test_decode_specials_and_skip():
    tok = ByteTokenizer()
    ids = [tok.bos_id, *tok.encode("hi"), tok.special_id(T.END_TURN), tok.eos_id]
    assert tok.decode(ids) == "<bos>hi<|end|><eos>"
    assert tok.decode(ids, skip_special=True) == "hi"


def test_byte_errors():
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="272"):
        tok.decode([272])
    with pytest.raises(ValueError, match="<nope>"):
        tok.special_id("<nope>")
    with pytest.raises(TypeError):
        tok.encode(b"bytes")


@pytest.fixture()
def hf_folder(tmp_path):
    """A minimal Hugging Face folder: a trained tokenizer.json and its tokenizer_config.json."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE(unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]", "</s>"])
    hf.train_from_iterator(["the cat sat on the mat", "12 + 34 = 46", "hello world"] * 20, trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return str(tmp_path)


def test_hf_tokenizer_round_trip_and_no_added_tokens(hf_folder):
    from tokenizers import Tokenizer

    tok = load_tokenizer(hf_folder)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode("the cat sat")
    assert tok.decode(ids) == "the cat sat"
    assert tok.eos_id == tok.pad_id == tok.special_id("</s>")
    # Nothing is appended to a real vocabulary: the byte template's tokens are a clear error.
    raw = Tokenizer.from_file(f"{hf_folder}/tokenizer.json")
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    with pytest.raises(ValueError, match=r"'<\|user\|>' is not in the vocabulary"):
        tok.special_id(T.USER)


def test_hf_tokenizer_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        load_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))

"""Chat / reasoning templates: token layout, assistant-only loss masks, answer parsing."""

import pytest

from hcjax.data import tokenizer as T
from hcjax.data.template import (
    encode_chat,
    encode_content,
    encode_prompt_response,
    parse_answer,
    prompt_ids,
    reasoning_response,
    stop_ids,
)

tok = T.ByteTokenizer()
S = tok.special_id
B = lambda s: tok.encode(s)  # noqa: E731


def test_prompt_response_layout_and_mask():
    ids, mask = encode_prompt_response("1+2=", reasoning_response("3", "3"), tok)
    expected = (
        [tok.bos_id, S(T.USER), *B("1+2="), S(T.END_TURN), S(T.ASSISTANT)]
        + [S(T.THINK), *B("3"), S(T.END_THINK), S(T.ANSWER), *B("3"), S(T.END_ANSWER)]
        + [S(T.END_TURN), tok.eos_id]
    )
    assert ids == expected
    n_prompt = 1 + 1 + 4 + 1 + 1
    n_resp = 1 + 1 + 1 + 1 + 1 + 1 + 1  # think 3 /think answer 3 /answer end
    assert mask == [0] * n_prompt + [1] * n_resp + [0]
    # The sampler's prompt is exactly the untrained prefix.
    assert prompt_ids("1+2=", tok) == ids[:n_prompt]


def test_multi_turn_mask_only_assistant():
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "tool", "content": "out"},
        {"role": "assistant", "content": "ok"},
    ]
    ids, mask = encode_chat(msgs, tok)
    assert len(ids) == len(mask)
    trained = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained == "yo<|end|>ok<|end|>"
    assert tok.decode(ids) == (
        "<bos><|system|>be brief<|end|><|user|>hi<|end|><|assistant|>yo<|end|>"
        "<|tool|>out<|end|><|assistant|>ok<|end|><eos>"
    )


def test_content_tags_become_special_tokens():
    ids = encode_content("<think>a</think><answer>b</answer>", tok)
    assert ids == [S(T.THINK), *B("a"), S(T.END_THINK), S(T.ANSWER), *B("b"), S(T.END_ANSWER)]
    # Role markers inside content stay plain bytes (no role injection).
    assert min(encode_content("<|assistant|>", tok)) >= T.BYTE_OFFSET


def test_parse_answer():
    assert parse_answer("<think>x</think><answer> 42 </answer><|end|>") == "42"
    assert parse_answer("<answer>1</answer><answer>2</answer>") == "2"
    assert parse_answer("<answer>unterminated") is None
    assert parse_answer("no tags") is None
    assert stop_ids(tok) == (S(T.END_TURN), tok.eos_id)


def test_bad_messages():
    with pytest.raises(ValueError, match="empty"):
        encode_chat([], tok)
    with pytest.raises(ValueError, match="role='robot'"):
        encode_chat([{"role": "robot", "content": "x"}], tok)
    with pytest.raises(ValueError, match="content=None"):
        encode_chat([{"role": "user", "content": None}], tok)

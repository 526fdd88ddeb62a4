"""Chat and reasoning templates: turn conversations into token ids plus a loss mask that is 1 only
on assistant tokens, and read the answer back out of a generated response (RECIPE §3 format).

Layout of one conversation (special tokens in angle brackets):

    <bos> <|user|> prompt <|end|> <|assistant|> <think> … </think> <answer> … </answer> <|end|> <eos>

Generation starts right after `<|assistant|>`; the assistant's `<|end|>` is trained so the model
learns to stop, and it is the stop token of samplers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from hcjax.data import tokenizer as T

ROLE_MARKERS = {"system": T.SYSTEM, "user": T.USER, "assistant": T.ASSISTANT, "tool": T.TOOL}
# Tags that may appear inside message content and become single special tokens.
CONTENT_SPECIALS = (T.THINK, T.END_THINK, T.ANSWER, T.END_ANSWER)
_CONTENT_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in CONTENT_SPECIALS) + ")")
_ANSWER_RE = re.compile(re.escape(T.ANSWER) + r"(.*?)" + re.escape(T.END_ANSWER), re.DOTALL)


def reasoning_response(thought: str, answer: str) -> str:
    """The assistant text of the reasoning template: `<think>thought</think><answer>answer</answer>`."""
    return f"{T.THINK}{thought}{T.END_THINK}{T.ANSWER}{answer}{T.END_ANSWER}"


def encode_content(text: str, tok: T.Tokenizer) -> list[int]:
    """Encode message text; the reasoning tags inside it become their special tokens."""
    ids: list[int] = []
    for piece in _CONTENT_SPLIT.split(text):
        if not piece:
            continue
        if piece in CONTENT_SPECIALS:
            ids.append(tok.special_id(piece))
        else:
            ids.extend(tok.encode(piece))
    return ids


def encode_chat(
    messages: Sequence[Mapping[str, str]], tok: T.Tokenizer, add_eos: bool = True
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 = train on this token) of a whole conversation."""
    if not messages:
        raise ValueError("messages is empty; a conversation needs at least one message")
    ids = [tok.bos_id]
    mask = [0]
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role not in ROLE_MARKERS:
            raise ValueError(
                f"message {i} has role={role!r}; expected one of {sorted(ROLE_MARKERS)}"
            )
        content = msg.get("content")
        if not isinstance(content, str):
            raise ValueError(f"message {i} has content={content!r}; expected a string")
        body = encode_content(content, tok) + [tok.special_id(T.END_TURN)]
        ids.append(tok.special_id(ROLE_MARKERS[role]))
        mask.append(0)
        ids.extend(body)
        mask.extend([1 if role == "assistant" else 0] * len(body))
    if add_eos:
        ids.append(tok.eos_id)
        mask.append(0)
    return ids, mask


def encode_prompt_response(
    prompt: str, response: str, tok: T.Tokenizer
) -> tuple[list[int], list[int]]:
    """A single-turn conversation; only `response` (and its end-of-turn) is trained."""
    return encode_chat(
        [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tok
    )


def prompt_ids(prompt: str, tok: T.Tokenizer) -> list[int]:
    """Ids a sampler starts from: the user turn followed by the assistant marker."""
    ids, _ = encode_chat([{"role": "user", "content": prompt}], tok, add_eos=False)
    return ids + [tok.special_id(T.ASSISTANT)]


def stop_ids(tok: T.Tokenizer) -> tuple[int, ...]:
    """Token ids that end a generated assistant turn."""
    return (tok.special_id(T.END_TURN), tok.eos_id)


def parse_answer(response_text: str) -> str | None:
    """The text inside the last `<answer>…</answer>` of a decoded response, stripped; None when
    the response has no complete answer block (wrong format)."""
    found = _ANSWER_RE.findall(response_text)
    if not found:
        return None
    return found[-1].strip()

"""Chat and reasoning templates: turn conversations into token ids plus a loss mask that is 1 only
on assistant tokens, and read the answer back out of a generated response (RECIPE §3 format).

Layout of one conversation (special tokens in angle brackets):

    <bos> <|user|> prompt <|end|> <|assistant|> <think> … </think> <answer> … </answer> <|end|> <eos>

Generation starts right after `<|assistant|>`; the assistant's `<|end|>` is trained so the model
learns to stop, and it is the stop token of samplers.

A Hugging Face tokenizer (`HFTokenizer`) brings its own chat template: given one,
`encode_conversation`, `encode_prompt_response`, `prompt_ids` and `stop_ids` render the folder's
Jinja template instead (`hf_encode_chat`: the tokens each assistant turn adds after the generation
prompt are trained) and stop on the tokenizer's eos ids; `encode_chat` is always ours.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from hcjax.data import tokenizer as T
from hcjax.data.hf_tokenizer import HFTokenizer

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
    """Token ids and loss mask (1 = train on this token) of a whole conversation in our template
    (`encode_conversation` picks a Hugging Face tokenizer's own template instead)."""
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


def encode_conversation(
    messages: Sequence[Mapping[str, str]], tok: T.Tokenizer
) -> tuple[list[int], list[int]]:
    """Ids and loss mask of a conversation in the tokenizer's template: its chat template for an
    `HFTokenizer` (`hf_encode_chat`, which writes its own end tokens), else ours (`encode_chat`)."""
    if isinstance(tok, HFTokenizer):
        return hf_encode_chat(messages, tok)
    return encode_chat(messages, tok)


def encode_prompt_response(
    prompt: str, response: str, tok: T.Tokenizer
) -> tuple[list[int], list[int]]:
    """A single-turn conversation in the tokenizer's template; only `response` (and its
    end-of-turn) is trained."""
    return encode_conversation(
        [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tok
    )


def prompt_ids(prompt: str, tok: T.Tokenizer) -> list[int]:
    """Ids a sampler starts from: the user turn followed by the assistant marker (with an
    `HFTokenizer`: its chat template with the generation prompt)."""
    return messages_prompt_ids([{"role": "user", "content": prompt}], tok)


def messages_prompt_ids(messages: Sequence[Mapping[str, str]], tok: T.Tokenizer) -> list[int]:
    """Ids a sampler starts from for a conversation so far (system / user / earlier turns),
    ending with the generation prompt: our assistant marker, or an `HFTokenizer`'s chat
    template with `add_generation_prompt`."""
    if isinstance(tok, HFTokenizer):
        return tok.apply_chat_template([dict(m) for m in messages])
    ids, _ = encode_chat(messages, tok, add_eos=False)
    return ids + [tok.special_id(T.ASSISTANT)]


def stop_ids(tok: T.Tokenizer) -> tuple[int, ...]:
    """Token ids that end a generated assistant turn (an `HFTokenizer`'s eos ids)."""
    if isinstance(tok, HFTokenizer):
        return tok.eos_ids
    return (tok.special_id(T.END_TURN), tok.eos_id)


def parse_answer(response_text: str) -> str | None:
    """The text inside the last `<answer>…</answer>` of a decoded response, stripped; None when
    the response has no complete answer block (wrong format)."""
    found = _ANSWER_RE.findall(response_text)
    if not found:
        return None
    return found[-1].strip()



def normalize_answer(text: str) -> str:
    """An answer as compared: whitespace collapsed; integers compare by value ("007" == "7",
    "1,000" == "1000")."""
    s = " ".join(text.split())
    try:
        return str(int(s.replace(",", "")))
    except ValueError:
        return s

# Hugging Face chat templates -------------------------------------------------------------------

_LAST_NUMBER_RE = re.compile(r"-?\d[\d,]*")
_BOXED_RE = re.compile(r"\\boxed\{([^{}]*)\}")


def hf_encode_chat(
    messages: Sequence[Mapping[str, str]], tok: HFTokenizer
) -> tuple[list[int], list[int]]:
    """Ids and loss mask of a conversation in `tok`'s chat template. The text is rendered turn by
    turn: before each assistant message with the generation prompt (mask 0: what a sampler is
    given), then with that message (mask 1: what it must generate). A reply is trained up to and
    including its last eos id; what the template writes after it (a newline) is not, since
    sampling stops at eos. Each piece is tokenized on its own, as a sampler sees it: the prompt
    alone, then the reply token by token."""
    if not messages:
        raise ValueError("messages is empty; a conversation needs at least one message")
    ids: list[int] = []
    mask: list[int] = []
    done = ""  # text rendered so far

    def extend(text: str, train: bool, what: str) -> None:
        nonlocal done
        if not text.startswith(done):
            raise ValueError(
                f"the chat template of {tok.name} renders {what} so that it does not extend the "
                f"conversation rendered before it ({done[-40:]!r} is not a prefix); it cannot "
                "be trained turn by turn"
            )
        piece = tok.encode(text[len(done):])
        done = text
        if not train:
            ids.extend(piece)
            mask.extend([0] * len(piece))
            return
        stops = [j for j, t in enumerate(piece) if t in tok.eos_ids]
        trained = stops[-1] + 1 if stops else len(piece)
        ids.extend(piece)
        mask.extend([1] * trained + [0] * (len(piece) - trained))

    for i, msg in enumerate(messages):
        if msg.get("role") == "assistant":
            if i:
                extend(tok.render_chat_template(messages[:i], add_generation_prompt=True), False,
                       f"the generation prompt before message {i}")
            extend(tok.render_chat_template(messages[: i + 1], add_generation_prompt=False), True,
                   f"assistant message {i}")
    extend(tok.render_chat_template(messages, add_generation_prompt=False), False,
           "the whole conversation")
    return ids, mask


def hf_answer(response_text: str) -> str | None:
    """The answer a Hugging Face chat model's response gives, which need not follow our
    reasoning template: the last `<answer>…</answer>` block if any, else the last `\\boxed{…}`,
    else the last number after the reasoning (after the last `</think>`; None while a `<think>`
    is still open)."""
    tagged = parse_answer(response_text)
    if tagged is not None:
        return tagged
    boxed = _BOXED_RE.findall(response_text)
    if boxed:
        return boxed[-1].strip()
    if T.END_THINK in response_text:
        response_text = response_text.rsplit(T.END_THINK, 1)[1]
    elif T.THINK in response_text:
        return None
    numbers = _LAST_NUMBER_RE.findall(response_text)
    return numbers[-1] if numbers else None


def response_answer(response_text: str, tok: T.Tokenizer) -> str | None:
    """The answer a decoded response gives: its `<answer>` block for our template
    (`parse_answer`), or `hf_answer` for a Hugging Face chat template."""
    return hf_answer(response_text) if isinstance(tok, HFTokenizer) else parse_answer(response_text)

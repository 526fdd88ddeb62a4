"""Readers of local JSONL files: (prompt, answer) problems and chat conversations. They validate
every line and name the file and line of anything malformed."""

from __future__ import annotations

import json
import os
from typing import Any

from hcjax.data.problem import TaskProblem
from hcjax.data.template import ROLE_MARKERS, reasoning_response


def read_jsonl(path: str) -> list[tuple[int, dict[str, Any]]]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from e
                if not isinstance(obj, dict):
                    raise ValueError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
                rows.append((n, obj))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"data file {path!r} could not be read: {e}") from e
    if not rows:
        raise ValueError(f"data file {path!r} holds no records (empty dataset)")
    return rows


def read_problems(
    path: str, prompt_key: str = "prompt", answer_key: str = "answer", thought_key: str = "thought"
) -> list[TaskProblem]:
    """Problems from a JSONL file with one {"prompt": ..., "answer": ...} object per line
    (optional "id" and "thought"): the answer is the reference, and the reasoning template's
    response of thought and answer the target (what SFT trains on)."""
    out = []
    for n, obj in read_jsonl(path):
        for key in (prompt_key, answer_key):
            if not isinstance(obj.get(key), str):
                raise ValueError(f"{path}:{n}: field {key!r} is missing or not a string")
        thought = obj.get(thought_key, "")
        if not isinstance(thought, str):
            raise ValueError(f"{path}:{n}: field {thought_key!r} is not a string")
        pid = str(obj.get("id", f"{os.path.basename(path)}-{n}"))
        answer = obj[answer_key]
        out.append(TaskProblem(pid, "jsonl", ({"role": "user", "content": obj[prompt_key]},),
                               reference=answer, target=reasoning_response(thought, answer),
                               meta={"kind": "jsonl"}))
    return out


def read_conversations(path: str, key: str = "messages") -> list[list[dict[str, str]]]:
    """Conversations from a JSONL file with one {"messages": [{"role", "content"}, ...]} per line."""
    out = []
    for n, obj in read_jsonl(path):
        msgs = obj.get(key)
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{path}:{n}: field {key!r} is missing or not a non-empty list")
        for i, m in enumerate(msgs):
            role = m.get("role") if isinstance(m, dict) else None
            if role not in ROLE_MARKERS:
                raise ValueError(
                    f"{path}:{n}: message {i} has role={role!r}; "
                    f"expected one of {sorted(ROLE_MARKERS)}"
                )
            if not isinstance(m.get("content"), str):
                raise ValueError(f"{path}:{n}: message {i} content is missing or not a string")
        if not any(m["role"] == "assistant" for m in msgs):
            raise ValueError(f"{path}:{n}: conversation has no assistant message to train on")
        out.append([{"role": m["role"], "content": m["content"]} for m in msgs])
    return out

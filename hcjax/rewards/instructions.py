"""Instruction-following grader: verifiable constraints checked by plain functions; the reward
is 1 only if every necessary constraint holds (RECIPE §6).  No JAX, no model judges here."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hcjax.rewards.types import Grade

_WORD = re.compile(r"\b\w+(?:[-']\w+)*\b")
_SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)")
_BULLET = re.compile(r"^\s*[*-]\s+\S", re.MULTILINE)
_HIGHLIGHT = re.compile(r"\*[^\n*]+\*")
_PLACEHOLDER = re.compile(r"\[[^\[\]\n]+\]")
_TITLE = re.compile(r"<<[^\n<>]+>>")


def words(text: str) -> list[str]:
    return _WORD.findall(text)


def sentences(text: str) -> list[str]:
    parts = _SENTENCE_END.split(text)
    return [p for p in parts if p.strip()]


def paragraphs(text: str) -> list[str]:
    """Paragraphs are separated by blank lines or by a line of three asterisks."""
    parts = re.split(r"\n\s*\n|^\s*\*\*\*\s*$", text, flags=re.MULTILINE)
    return [p.strip() for p in parts if p and p.strip()]


def _compare(count: int, relation: str, n: int) -> bool:
    if relation == "at_least":
        return count >= n
    if relation == "at_most":
        return count <= n
    if relation == "exactly":
        return count == n
    raise ValueError(f"relation={relation!r} is not one of 'at_least', 'at_most', 'exactly'")


def _count_check(what: str, count: int, relation: str, n: int) -> tuple[bool, str]:
    return _compare(count, relation, n), f"{count} {what} ({relation.replace('_', ' ')} {n})"


def _strip_fence(text: str) -> str:
    text = text.strip()
    match = re.fullmatch(r"```(?:json)?\s*\n?(.*?)\n?```", text, flags=re.DOTALL)
    return match.group(1) if match else text


def _word_count(r, relation, n):
    return _count_check("words", len(words(r)), relation, n)


def _sentence_count(r, relation, n):
    return _count_check("sentences", len(sentences(r)), relation, n)


def _paragraph_count(r, relation, n):
    return _count_check("paragraphs", len(paragraphs(r)), relation, n)


def _keywords_present(r, keywords):
    missing = [k for k in keywords if not re.search(rf"\b{re.escape(k)}\b", r, re.IGNORECASE)]
    return not missing, f"missing keywords {missing}" if missing else "all keywords present"


def _keywords_absent(r, keywords):
    found = [k for k in keywords if re.search(rf"\b{re.escape(k)}\b", r, re.IGNORECASE)]
    return not found, f"forbidden keywords present {found}" if found else "no forbidden keyword"


def _keyword_frequency(r, keyword, relation, n):
    count = len(re.findall(rf"\b{re.escape(keyword)}\b", r, re.IGNORECASE))
    return _count_check(f"times {keyword!r}", count, relation, n)


def _letter_frequency(r, letter, relation, n):
    if len(letter) != 1:
        raise ValueError(f"letter={letter!r} is not a single character")
    return _count_check(f"letters {letter!r}", r.lower().count(letter.lower()), relation, n)


def _json_format(r):
    try:
        json.loads(_strip_fence(r))
    except ValueError as e:
        return False, f"not valid JSON: {e}"
    return True, "valid JSON"


def _bullet_count(r, n):
    return _count_check("markdown bullets", len(_BULLET.findall(r)), "exactly", n)


def _highlighted_sections(r, n):
    return _count_check("*highlighted* sections", len(_HIGHLIGHT.findall(r)), "at_least", n)


def _sections(r, n, splitter="SECTION"):
    count = len(re.findall(rf"^\s*{re.escape(splitter)}\s+\d+", r, re.MULTILINE))
    return _count_check(f"'{splitter} X' sections", count, "exactly", n)


def _title(r):
    ok = bool(_TITLE.search(r))
    return ok, "has a <<title>>" if ok else "no <<title>>"


def _starts_with(r, phrase):
    ok = r.lstrip().lower().startswith(phrase.lower())
    return ok, f"{'starts' if ok else 'does not start'} with {phrase!r}"


def _ends_with(r, phrase):
    ok = r.rstrip().lower().endswith(phrase.lower())
    return ok, f"{'ends' if ok else 'does not end'} with {phrase!r}"


def _lowercase(r):
    ok = r == r.lower() and any(c.isalpha() for c in r)
    return ok, "all lowercase" if ok else "has uppercase letters"


def _uppercase(r):
    ok = r == r.upper() and any(c.isalpha() for c in r)
    return ok, "all uppercase" if ok else "has lowercase letters"


def _capital_words(r, relation, n):
    count = sum(1 for w in words(r) if w.isupper() and any(c.isalpha() for c in w))
    return _count_check("all-capital words", count, relation, n)


def _placeholders(r, n):
    return _count_check("[placeholders]", len(_PLACEHOLDER.findall(r)), "at_least", n)


def _postscript(r, marker="P.S."):
    ok = bool(re.search(rf"^\s*{re.escape(marker)}", r, re.MULTILINE))
    return ok, f"{'has' if ok else 'no'} postscript {marker!r}"


def _no_commas(r):
    return "," not in r, "no commas" if "," not in r else f"{r.count(',')} commas"


def _quoted(r):
    s = r.strip()
    ok = len(s) >= 2 and s[0] == '"' and s[-1] == '"'
    return ok, "wrapped in double quotes" if ok else "not wrapped in double quotes"


def _repeat_prompt(r, prompt):
    ok = r.lstrip().startswith(prompt.strip())
    return ok, "repeats the prompt first" if ok else "does not start by repeating the prompt"


def _two_responses(r, separator="******"):
    parts = [p for p in r.split(separator) if p.strip()]
    ok = len(parts) == 2 and parts[0].strip() != parts[1].strip()
    return ok, f"{len(parts)} distinct responses separated by {separator!r}"


CHECKS: dict[str, Callable[..., tuple[bool, str]]] = {
    "word_count": _word_count,
    "sentence_count": _sentence_count,
    "paragraph_count": _paragraph_count,
    "keywords_present": _keywords_present,
    "keywords_absent": _keywords_absent,
    "keyword_frequency": _keyword_frequency,
    "letter_frequency": _letter_frequency,
    "json_format": _json_format,
    "bullet_count": _bullet_count,
    "highlighted_sections": _highlighted_sections,
    "sections": _sections,
    "title": _title,
    "starts_with": _starts_with,
    "ends_with": _ends_with,
    "lowercase": _lowercase,
    "uppercase": _uppercase,
    "capital_words": _capital_words,
    "placeholders": _placeholders,
    "postscript": _postscript,
    "no_commas": _no_commas,
    "quoted": _quoted,
    "repeat_prompt": _repeat_prompt,
    "two_responses": _two_responses,
}


@dataclasses.dataclass(frozen=True)
class Constraint:
    """One verifiable instruction: `kind` names a CHECKS entry, `params` its keyword arguments.
    A constraint that is not `necessary` is reported but does not gate the reward."""

    kind: str
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    necessary: bool = True

    def __post_init__(self) -> None:
        if self.kind not in CHECKS:
            raise ValueError(f"kind={self.kind!r} is not a known constraint; "
                             f"expected one of {sorted(CHECKS)}")

    def check(self, response: str) -> tuple[bool, str]:
        try:
            return CHECKS[self.kind](response, **self.params)
        except TypeError as e:
            raise ValueError(f"params={dict(self.params)!r} do not fit {self.kind!r}: {e}") from e


def grade(response: str, constraints: Sequence[Constraint]) -> Grade:
    """1.0 when every necessary constraint holds, else 0.0; the reason lists each check."""
    if not constraints:
        raise ValueError("constraints=[] is empty")
    results = [(c, *c.check(response)) for c in constraints]
    failed = [c.kind for c, ok, _ in results if c.necessary and not ok]
    reason = "; ".join(f"{c.kind}: {'ok' if ok else 'FAIL'} ({why})" for c, ok, why in results)
    return Grade(0.0 if failed else 1.0, reason)

"""Math answer grader: extract the final answer (last `<answer>` block, then last `\\boxed{}`) and
decide equivalence with math-verify (sympy: fractions, decimals, radicals, intervals, sets,
equations, units stripped) under a wall-clock limit.  Must not import JAX."""

from __future__ import annotations

import functools
import logging
import re

from hcjax.rewards.timelimit import TimeLimitExceeded, call_with_time_limit
from hcjax.rewards.types import Grade

MAX_ANSWER_CHARS = 1000  # longer "answers" are not answers, and would only feed the parser
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


@functools.cache
def _verifier():
    """math-verify, imported on the first comparison: it brings in sympy (0.6 s and more of every
    process start), which a climb on arithmetic or code never uses."""
    # here, not at the top: sympy's import is most of a process start that never grades math
    import math_verify
    import math_verify.grader
    import math_verify.parser

    # We enforce our own limit around the whole comparison (math-verify's alarm-based one only
    # works in the main thread), so silence its "timeout disabled" warning.
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify


def before_time_limit() -> None:
    """Imports what a comparison needs, outside its time limit (hcjax.rewards.timelimit's helper
    process calls it once when it starts)."""
    _verifier()


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} with balanced braces, or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def extract_answer(response: str) -> str | None:
    """The final answer: inside the last <answer>...</answer>, the last \\boxed{} if any, else
    the whole block; without answer tags, the last \\boxed{} of the response; else None."""
    tagged = _ANSWER_TAG.findall(response)
    if tagged:
        block = tagged[-1]
        boxed = last_boxed(block)
        answer = boxed if boxed is not None else block
    else:
        answer = last_boxed(response)
    if answer is None:
        return None
    answer = answer.strip().strip("$").strip()
    return answer or None


def _parse(text: str) -> list:
    parsed = _verifier().parse(f"${text}$", parsing_timeout=None)
    if not parsed:  # plain expressions such as "1/2" or "sqrt(2)"
        parsed = _verifier().parse(text, parsing_timeout=None)
    return parsed


def _equivalent(answer: str, reference: str) -> bool:
    gold = _parse(reference)
    pred = _parse(answer)
    if not gold or not pred:
        return False
    return bool(_verifier().verify(gold, pred, timeout_seconds=None))


def grade(response: str, reference: str, *, timeout_s: float = 5.0) -> Grade:
    """1.0 when the response's final answer equals `reference` mathematically, else 0.0."""
    if not isinstance(reference, str) or not reference.strip():
        raise ValueError(f"reference={reference!r} is not a non-empty string")
    answer = extract_answer(response)
    if answer is None:
        return Grade(0.0, "no final answer (<answer> tags or \\boxed{})")
    if len(answer) > MAX_ANSWER_CHARS:
        return Grade(0.0, f"answer has {len(answer)} chars > {MAX_ANSWER_CHARS}")
    before_time_limit()  # the import is not the comparison's time
    try:
        same = call_with_time_limit(_equivalent, (answer, reference), timeout_s)
    except TimeLimitExceeded:
        return Grade(0.0, f"comparison exceeded {timeout_s} s")
    except Exception as e:  # malformed LaTeX that the parser chokes on is a wrong answer
        return Grade(0.0, f"could not compare: {type(e).__name__}: {e}")
    if same:
        return Grade(1.0, f"answer {answer!r} equals {reference!r}")
    return Grade(0.0, f"answer {answer!r} differs from {reference!r}")


def verify(response: str, reference: str, *, timeout_s: float = 5.0) -> bool:
    """True when the response's final answer is equivalent to `reference`."""
    return grade(response, reference, timeout_s=timeout_s).reward == 1.0

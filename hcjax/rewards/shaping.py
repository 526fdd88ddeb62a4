"""Reward shaping terms: language consistency R_lang (RECIPE eq. 11) and the three length
penalties (MAI pass-rate based, Kimi group length reward, Rufus shortest-correct).  No JAX."""

from __future__ import annotations

import re
from collections.abc import Sequence

# A "word" is a run of letters; CJK, kana and hangul have no spaces, so each character counts.
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_TOKEN = re.compile(rf"[{_CJK}]|[^\W\d_{_CJK}]+")
_ENGLISH = re.compile(r"[A-Za-z]+")


def count_non_english_words(text: str) -> int:
    """Words containing any letter outside A-Z/a-z (each CJK character is one word)."""
    return sum(1 for token in _TOKEN.findall(text) if not _ENGLISH.fullmatch(token))


def language_reward(cot: str, alpha: float = 0.005) -> float:
    """R_lang = max(1 - alpha * n_non_english_words(CoT), 0)  (RECIPE eq. 11)."""
    if alpha < 0:
        raise ValueError(f"alpha={alpha} is negative")
    return max(1.0 - alpha * count_non_english_words(cot), 0.0)


def mai_length_penalty(length: int, pass_rate: float, max_length: int) -> float:
    """R_len = rho_q * |y| / l_max: long answers cost more on problems the policy finds easy."""
    if max_length <= 0:
        raise ValueError(f"max_length={max_length} is not positive")
    if not 0.0 <= pass_rate <= 1.0:
        raise ValueError(f"pass_rate={pass_rate} is not in [0, 1]")
    if length < 0:
        raise ValueError(f"length={length} is negative")
    return pass_rate * length / max_length


def _check_group(lengths: Sequence[int], correct: Sequence[bool]) -> None:
    if len(lengths) != len(correct):
        raise ValueError(f"len(lengths)={len(lengths)} != len(correct)={len(correct)}")
    if not lengths:
        raise ValueError("lengths=[] is an empty group")


def kimi_length_rewards(lengths: Sequence[int], correct: Sequence[bool]) -> list[float]:
    """Kimi k1.5 group length reward: lambda_i = 0.5 - (len_i - min)/(max - min); correct
    responses get lambda_i, wrong ones min(0, lambda_i); all zero when max == min."""
    _check_group(lengths, correct)
    lo, hi = min(lengths), max(lengths)
    if hi == lo:
        return [0.0] * len(lengths)
    lams = [0.5 - (n - lo) / (hi - lo) for n in lengths]
    return [lam if ok else min(0.0, lam) for lam, ok in zip(lams, correct)]


def shortest_correct_penalties(lengths: Sequence[int], correct: Sequence[bool],
                               weight: float = 0.1) -> list[float]:
    """Rufus-style penalty relative to the group's shortest correct answer (to subtract).

    RECIPE §6 gives no formula; ours is weight * (1 - L_min / len_i) for correct responses (0 for
    the shortest, approaching `weight` as a response grows), 0 for wrong responses (they already
    earn nothing) and 0 for everyone when no response is correct.
    """
    _check_group(lengths, correct)
    if weight < 0:
        raise ValueError(f"weight={weight} is negative")
    correct_lengths = [n for n, ok in zip(lengths, correct) if ok]
    if not correct_lengths:
        return [0.0] * len(lengths)
    shortest = min(correct_lengths)
    if shortest <= 0:
        raise ValueError(f"shortest correct length={shortest} is not positive")
    return [weight * (1.0 - shortest / n) if ok else 0.0 for n, ok in zip(lengths, correct)]

"""The record every grader returns: a score, a human-readable reason, and an `aborted` flag for
infrastructure failures (which the RL side drops instead of scoring 0)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Grade:
    """score: the reward (binary graders use 0.0/1.0); reason: why, for logs and debugging."""

    score: float
    reason: str
    aborted: bool = False

    @property
    def passed(self) -> bool:
        return self.score > 0 and not self.aborted

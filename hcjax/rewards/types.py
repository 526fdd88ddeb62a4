"""The one record every grader returns, used end to end (rewards → envs → tasks → rl workers →
store): the reward, whether the response solved the task, a human-readable reason, named reward
parts, and an `aborted` flag for infrastructure failures (which the RL side retries or drops
instead of scoring 0)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Grade:
    """reward: the scalar reward (binary graders use 0.0/1.0); reason: why, for logs and
    debugging; aborted: the grader could not judge (sandbox failure, ...), not a wrong answer;
    correct: whether the task was solved (default: reward > 0 and not aborted); components: the
    reward's named parts (e.g. the correctness and length terms of a composed reward)."""

    reward: float
    reason: str = ""
    aborted: bool = False
    correct: bool | None = None
    components: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.correct is None:
            object.__setattr__(self, "correct", bool(self.reward > 0 and not self.aborted))

    @property
    def passed(self) -> bool:
        """Alias of `correct` (the graders' older name)."""
        return bool(self.correct)

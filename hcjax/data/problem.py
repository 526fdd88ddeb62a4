"""`TaskProblem`, the one problem record: what every task suite yields, what SFT documents are
encoded from and what evaluation grades. A plain record of chat messages and a reference; it
knows no grader (a suite grades its problems) and no tokenizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["TaskProblem", "user_prompt"]


@dataclasses.dataclass(frozen=True)
class TaskProblem:
    """One problem of a suite.

    id: unique within the suite (the climb prefixes the suite's name in mixtures).
    category: the sampling category (prioritised samplers draw per category; evaluation reports
      pass@1 per category), e.g. "add:2x1" or "gsm8k".
    messages: the prompt as chat messages ({"role", "content"}), rendered by the tokenizer's chat
      template (ours, or a Hugging Face folder's).
    reference: what the grader compares against (an answer string, unit tests, ...).
    target: a reference assistant response, for SFT of a base on the suite's format (None: the
      suite has no reference solution text).
    meta: anything else worth keeping with the rollouts (shown in the rollout store).
    """

    id: str
    category: str
    messages: tuple[Mapping[str, str], ...]
    reference: Any = None
    target: str | None = None
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", tuple(dict(m) for m in self.messages))
        if not self.messages:
            raise ValueError(f"problem {self.id!r} has no prompt messages")
        for i, m in enumerate(self.messages):
            if m.get("role") not in ("system", "user", "assistant", "tool") or not isinstance(
                    m.get("content"), str):
                raise ValueError(f"problem {self.id!r} message {i}={m!r} needs a role in "
                                 "system/user/assistant/tool and a string content")

    @property
    def prompt(self) -> str:
        """The last user message's text (for logs and the rollout store)."""
        return user_prompt(self.messages)

    def conversation(self) -> list[dict[str, str]]:
        """The prompt messages plus the reference response (SFT documents); needs `target`."""
        if self.target is None:
            raise ValueError(f"problem {self.id!r} has no reference response (target=None)")
        return [*map(dict, self.messages), {"role": "assistant", "content": self.target}]


def user_prompt(messages: Sequence[Mapping[str, str]]) -> str:
    """The text of the last user message (of the last message when none is a user's)."""
    users = [m["content"] for m in messages if m.get("role") == "user"]
    return users[-1] if users else messages[-1]["content"]

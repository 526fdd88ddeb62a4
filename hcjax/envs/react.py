"""The ReAct loop over token ids (RECIPE §3, agentic climb): the policy's tokens and the encoded
tool observations are appended to one growing sequence that is never re-tokenised, with a loss
mask of 1 on policy tokens and 0 on observations; budgets on steps, context and time.

Under a model's chat template (`ChatTemplateTurns`) an observation is the template's own wrapping
of a tool message plus the next assistant header, appended as tokens after the exact sampled
turn; earlier turns are never re-rendered. Whether re-rendering the whole conversation would
have given other tokens (real templates rewrite history: Qwen3's drops the `<think>` block of
assistant turns before the last user message and normalises the whitespace around it) is
checked after the episode and reported as `Trajectory.template_drift`, never substituted.
No JAX."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from hcjax.envs.tools import MalformedCall, ToolResult, parse_tool_calls

STOP = "stop"  # the model answered without a tool call
MAX_STEPS = "max_steps"
CONTEXT = "context"
TIME = "time"
ABORTED = "aborted"  # a tool's infrastructure failed: the rollout is dropped, never scored 0


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class Policy(Protocol):
    """Returns the new tokens of one model turn given the whole sequence so far."""

    def __call__(self, token_ids: Sequence[int]) -> list[int]: ...


class ToolRunner(Protocol):
    def __call__(self, call) -> ToolResult: ...


@dataclasses.dataclass(frozen=True)
class Budget:
    max_steps: int = 16  # model turns that call tools
    max_context: int = 32768  # prompt + response tokens
    max_time_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_steps <= 0 or self.max_context <= 0 or self.max_time_s <= 0:
            raise ValueError(f"budget={self!r} must be positive in every field")


def default_observation(results: Sequence[ToolResult]) -> str:
    body = "\n".join(r.output for r in results)
    return f"\n<tool_result>\n{body}\n</tool_result>\n"


@dataclasses.dataclass
class Trajectory:
    """prompt_ids + response_ids is the exact sequence the policy saw; loss_mask[i] is 1 where
    response_ids[i] came from the policy."""

    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str = ""
    num_tool_calls: int = 0
    num_malformed: int = 0
    num_successful: int = 0
    final_text: str = ""  # the last policy turn, decoded (where a final answer lives)
    turns: list[str] = dataclasses.field(default_factory=list)
    # Under a chat template only: the conversation as the template sees it (the prompt's
    # messages, each turn's text as an assistant message, each observation as messages), and
    # whether rendering it whole gives other tokens than prompt_ids + response_ids (None: not
    # checked), with the first position (into prompt + response) where they differ.
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    template_drift: bool | None = None
    template_drift_at: int | None = None

    @property
    def aborted(self) -> bool:
        return self.finish_reason == ABORTED

    def _append(self, ids: Sequence[int], from_policy: bool) -> None:
        self.response_ids.extend(ids)
        self.loss_mask.extend([1 if from_policy else 0] * len(ids))


_SENTINEL = "hcjax-turn-sentinel"  # stands for a turn's text when a template is rendered


class TemplateTokenizer(TokenizerLike, Protocol):
    """What `ChatTemplateTurns` needs: an `HFTokenizer` (hcjax.data.hf_tokenizer)."""

    eos_id: int

    def render_chat_template(self, messages: Sequence[Mapping[str, Any]],
                             add_generation_prompt: bool = True,
                             tools: Sequence[Mapping[str, Any]] | None = None,
                             **template_kwargs: Any) -> str: ...


@dataclasses.dataclass(frozen=True)
class ChatTemplateTurns:
    """Token-in / token-out turns under a Hugging Face chat template.

    messages: the prompt conversation (its templated ids, `prompt_ids()`, start the episode).
    tools: JSON-schema tool descriptions handed to the template (None: none).
    role: the role of observation messages: "tool" (one message per tool result), or e.g.
      "user" for an environment that answers as the user (one message, results joined by lines).
    end_of_turn: the text of the token that ends a sampled assistant turn (default: the first
      of the tokenizer's eos tokens that the template writes after an assistant message, e.g.
      Llama 3.1's <|eot_id|> among its three); a turn that ends without it gets it from the
      observation.
    template_kwargs: further template variables (e.g. enable_thinking).

    An observation's tokens are the template's rendering of the observation messages after an
    assistant turn, cut right after that turn's end-of-turn text, through the next assistant
    header: encoded on their own and appended to the sampled tokens, which are never decoded and
    re-encoded.
    """

    tokenizer: TemplateTokenizer
    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None
    role: str = "tool"
    end_of_turn: str | None = None
    template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.role, str) or not self.role or self.role == "assistant":
            raise ValueError(f"role={self.role!r}; expected a non-assistant role such as 'tool'")
        eot = self.end_of_turn
        if eot is None:  # the stop token whose text the template writes after an assistant turn
            tok = self.tokenizer
            stops = [tok.decode([i]) for i in getattr(tok, "eos_ids", None) or (tok.eos_id,)]
            turn = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}]
            after = self.render(turn, False).rpartition(_SENTINEL)[2]
            eot = next((t for t in stops if t and after.startswith(t)), stops[0])
        if not isinstance(eot, str) or not eot:
            raise ValueError(f"end_of_turn={self.end_of_turn!r}; expected a non-empty string")
        object.__setattr__(self, "end_of_turn", eot)
        object.__setattr__(self, "messages", [dict(m) for m in self.messages])

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.render_chat_template(
            messages, add_generation_prompt=add_generation_prompt,
            tools=None if self.tools is None else list(self.tools), **self.template_kwargs)

    def prompt_ids(self) -> list[int]:
        return self.tokenizer.encode(self.render(self.messages, True))

    def assistant_message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message of a decoded turn, and whether the turn sampled its
        end-of-turn token (which the template writes itself, so it is not content)."""
        closed = text.endswith(self.end_of_turn)
        content = text[: len(text) - len(self.end_of_turn)] if closed else text
        return {"role": "assistant", "content": content}, closed

    def observation_messages(self, outputs: Sequence[str]) -> list[dict[str, Any]]:
        if self.role == "tool":
            return [{"role": "tool", "content": o} for o in outputs]
        return [{"role": self.role, "content": "\n".join(outputs)}]

    def observation_ids(self, outputs: Sequence[str], closed: bool = True) -> list[int]:
        """Tokens that follow a sampled turn: the template's text after the turn's content (and
        its end-of-turn text when `closed`) for the observation messages and the next assistant
        header, rendered on a fixed one-question conversation."""
        turn = {"role": "assistant", "content": _SENTINEL}
        convo = [{"role": "user", "content": "?"}, turn, *self.observation_messages(outputs)]
        text = self.render(convo, True)
        if text.count(_SENTINEL) != 1:
            raise ValueError(
                f"the chat template of {getattr(self.tokenizer, 'name', self.tokenizer)!r} does "
                "not write an assistant message's content once, verbatim; its turns cannot be "
                "extended token by token")
        after = text[text.index(_SENTINEL) + len(_SENTINEL):]
        if closed:
            if not after.startswith(self.end_of_turn):
                raise ValueError(
                    f"end_of_turn={self.end_of_turn!r} is not what the chat template writes after "
                    f"an assistant message ({after[:40]!r}...); pass the stop token's text")
            after = after[len(self.end_of_turn):]
        return self.tokenizer.encode(after)

    def check_drift(self, traj: Trajectory) -> None:
        """Render `traj.messages` whole and compare with the sampled sequence: drift when the
        sampled ids are not a prefix of the rendered ids (the rendering may go on past them: the
        end of a last turn that was never sampled). Sets `template_drift`/`template_drift_at`;
        the trajectory's ids are left exactly as they were. A template that refuses to render the
        conversation (its raise_exception) is drift with no position."""
        ends_on_turn = traj.messages[-1]["role"] == "assistant"
        try:
            rendered = self.tokenizer.encode(self.render(traj.messages, not ends_on_turn))
        except ValueError:  # ChatTemplateError: the history cannot be re-rendered at all
            traj.template_drift, traj.template_drift_at = True, None
            return
        actual = traj.prompt_ids + traj.response_ids
        n = 0
        for a, b in zip(actual, rendered):
            if a != b:
                break
            n += 1
        traj.template_drift = n < len(actual)
        traj.template_drift_at = n if traj.template_drift else None


def run_episode(prompt_ids: Sequence[int], policy: Policy, tokenizer: TokenizerLike,
                tools: ToolRunner, budget: Budget = Budget(), *,
                observation: Callable[[Sequence[ToolResult]], str] = default_observation,
                clock: Callable[[], float] = time.monotonic,
                chat: ChatTemplateTurns | None = None) -> Trajectory:
    """Alternate policy turns and tool observations until the model stops calling tools or a
    budget runs out; the trajectory is graded afterwards by the environment.

    With `chat`, observations are the chat template's tool-message tokens (`observation` is not
    used) and the finished episode is checked for template drift (not for an aborted one)."""
    traj = Trajectory(prompt_ids=list(prompt_ids))
    if chat is not None:
        traj.messages = [dict(m) for m in chat.messages]
    _run(traj, policy, tokenizer, tools, budget, observation, clock, chat)
    if chat is not None and not traj.aborted:
        chat.check_drift(traj)
    return traj


def _run(traj: Trajectory, policy: Policy, tokenizer: TokenizerLike, tools: ToolRunner,
         budget: Budget, observation: Callable[[Sequence[ToolResult]], str],
         clock: Callable[[], float], chat: ChatTemplateTurns | None) -> None:
    if len(traj.prompt_ids) >= budget.max_context:
        traj.finish_reason = CONTEXT
        return
    deadline = clock() + budget.max_time_s
    steps = 0
    while True:
        room = budget.max_context - len(traj.prompt_ids) - len(traj.response_ids)
        if room <= 0:  # the observations filled the context: no room for another turn
            traj.finish_reason = CONTEXT
            return
        new = list(policy(traj.prompt_ids + traj.response_ids))
        cut = len(new) > room
        new = new[:room]
        traj._append(new, from_policy=True)
        text = tokenizer.decode(new)
        traj.turns.append(text)
        traj.final_text = text
        closed = True
        if chat is not None:
            message, closed = chat.assistant_message(text)
            traj.messages.append(message)
        if cut:
            traj.finish_reason = CONTEXT
            return
        calls = parse_tool_calls(text)
        if not calls:
            traj.finish_reason = STOP
            return
        if clock() >= deadline:
            traj.finish_reason = TIME
            return
        results = []
        for call in calls:
            result = tools(call)
            traj.num_tool_calls += 1
            traj.num_malformed += isinstance(call, MalformedCall) or result.malformed
            traj.num_successful += result.ok
            results.append(result)
            if result.aborted:
                traj.finish_reason = ABORTED
                return
        if chat is None:
            obs_ids = tokenizer.encode(observation(results))
        else:
            outputs = [r.output for r in results]
            traj.messages.extend(chat.observation_messages(outputs))
            obs_ids = chat.observation_ids(outputs, closed)
        room = budget.max_context - len(traj.prompt_ids) - len(traj.response_ids)
        traj._append(obs_ids[:room], from_policy=False)
        steps += 1
        if len(obs_ids) >= room:
            traj.finish_reason = CONTEXT
            return
        if steps >= budget.max_steps:
            traj.finish_reason = MAX_STEPS
            return
        if clock() >= deadline:
            traj.finish_reason = TIME
            return

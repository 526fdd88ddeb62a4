"""Tool calls for multi-turn environments: parsing `<tool_call>{json}</tool_call>` blocks with a
clear error for every malformed call, and a dispatching tool set.  Must not import JAX."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class MalformedCall:
    """A call the model tried to make but that cannot run; `error` is shown to the model."""

    text: str
    error: str


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What a tool returns: text for the observation; `ok` False for errors the model caused;
    `malformed` True when the call itself was unusable (bad JSON, unknown tool, bad arguments);
    `aborted` True for infrastructure failures (the rollout is then aborted, not scored)."""

    output: str
    ok: bool = True
    aborted: bool = False
    malformed: bool = False


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """Every `<tool_call>` block of a model turn, in order (an unclosed last block counts)."""
    calls: list[ToolCall | MalformedCall] = []
    for match in _CALL.finditer(text):
        body = match.group(1).strip()
        if not match.group(0).endswith(CALL_CLOSE):
            calls.append(MalformedCall(body, f"missing {CALL_CLOSE}"))
            continue
        try:
            obj = json.loads(body)
        except ValueError as e:
            calls.append(MalformedCall(body, f"the call is not valid JSON ({e})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(MalformedCall(body, 'expected {"name": str, "arguments": {...}}'))
            continue
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            calls.append(MalformedCall(body, f"arguments must be an object, got {args!r}"))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


@dataclasses.dataclass(frozen=True)
class Tool:
    """A named function with declared arguments: name -> Python type (required unless listed
    in `optional`)."""

    name: str
    description: str
    parameters: Mapping[str, type]
    fn: Callable[..., ToolResult]
    optional: frozenset[str] = frozenset()


class ToolSet:
    """Dispatches parsed calls to tools, turning every misuse into an error observation."""

    def __init__(self, tools: Sequence[Tool]) -> None:
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names={names} are not unique")
        self.tools = {t.name: t for t in tools}

    def describe(self) -> str:
        lines = []
        for t in self.tools.values():
            params = ", ".join(f"{k}: {v.__name__}" + ("?" if k in t.optional else "")
                               for k, v in t.parameters.items())
            lines.append(f"- {t.name}({params}): {t.description}")
        return "\n".join(lines)

    def validate(self, call: ToolCall) -> str | None:
        """None when the call fits a tool's signature, else the error to show."""
        tool = self.tools.get(call.name)
        if tool is None:
            return f"unknown tool {call.name!r}; available: {sorted(self.tools)}"
        missing = [k for k in tool.parameters if k not in call.arguments and k not in tool.optional]
        extra = [k for k in call.arguments if k not in tool.parameters]
        if missing or extra:
            return f"{call.name}: missing arguments {missing}, unexpected arguments {extra}"
        for key, value in call.arguments.items():
            want = tool.parameters[key]
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                return f"{call.name}: argument {key}={value!r} is not a {want.__name__}"
        return None

    def __call__(self, call: ToolCall | MalformedCall) -> ToolResult:
        if isinstance(call, MalformedCall):
            return ToolResult(f"error: malformed tool call: {call.error}", ok=False, malformed=True)
        error = self.validate(call)
        if error:
            return ToolResult(f"error: {error}", ok=False, malformed=True)
        return self.tools[call.name].fn(**call.arguments)

"""Tool calls for multi-turn environments: parsing `<tool_call>{json}</tool_call>` blocks with a
clear error for every malformed call, a dispatching tool set, and the SWE tools (`bash` and a
string-replace file editor) that act inside a sandbox workspace.  Must not import JAX."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hcjax import sandbox

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


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - limit} characters cut] ...\n{text[-half:]}"


def bash_tool(workspace: sandbox.Workspace, *, timeout_s: float = 30.0, memory_mb: int = 1024,
              max_chars: int = 8000) -> Tool:
    """`bash(command)`: a fresh networkless sandbox over the persistent workspace."""

    def bash(command: str) -> ToolResult:
        out = workspace.run(["/bin/bash", "-c", command] if os.path.exists("/bin/bash")
                            else command, timeout_s=timeout_s, memory_mb=memory_mb)
        if out.aborted:
            # Never retried blindly: the command may already have changed the workspace.
            return ToolResult(f"error: sandbox failure ({out.detail})", ok=False, aborted=True)
        text = out.stdout + (f"\n[stderr]\n{out.stderr}" if out.stderr else "")
        status = f"[exit code {out.returncode}]" if out.status in (sandbox.OK, sandbox.CRASH) \
            else f"[{out.status}: {out.detail}]"
        return ToolResult(_clip(f"{text}\n{status}".lstrip("\n"), max_chars),
                          ok=out.status == sandbox.OK)

    return Tool("bash", "run a bash command in the repository (no network)",
                {"command": str}, bash)


def editor_tool(workspace: sandbox.Workspace, *, max_chars: int = 8000) -> Tool:
    """`edit(command, path, ...)`: view / create / str_replace files of the workspace.

    Runs on the host against the workspace directory; every path is resolved (symlinks
    included) and must stay inside it, so the agent cannot reach outside its sandbox.
    """

    def edit(command: str, path: str, content: str = "", old: str = "", new: str = "",
             ) -> ToolResult:
        try:
            real = sandbox.resolve_inside(workspace.path, path)
        except ValueError as e:
            return ToolResult(f"error: {e}", ok=False)
        if os.path.exists(real) and os.stat(real).st_uid != workspace.uid:
            # A hard link the agent made to a host file would pass the path check; its owner
            # gives it away.
            return ToolResult(f"error: {path} is not a workspace file", ok=False)
        if command == "create":
            workspace.write({os.path.relpath(real, os.path.realpath(workspace.path)): content})
            return ToolResult(f"created {path} ({len(content)} characters)")
        if not os.path.isfile(real):
            return ToolResult(f"error: {path} is not a file", ok=False)
        with open(real, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if command == "view":
            numbered = "\n".join(f"{i + 1:5d}  {line}" for i, line in enumerate(text.split("\n")))
            return ToolResult(_clip(numbered, max_chars))
        if command == "str_replace":
            count = text.count(old) if old else 0
            if count != 1:
                return ToolResult(f"error: old string occurs {count} times in {path}; it must "
                                  "occur exactly once", ok=False)
            with open(real, "w", encoding="utf-8") as f:
                f.write(text.replace(old, new, 1))
            return ToolResult(f"edited {path}")
        return ToolResult(f"error: command={command!r} is not one of view, create, str_replace",
                          ok=False)

    return Tool("edit", "view, create or str_replace (exactly one match) a file",
                {"command": str, "path": str, "content": str, "old": str, "new": str}, edit,
                optional=frozenset({"content", "old", "new"}))

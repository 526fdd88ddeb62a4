"""ReAct loop over token ids with a byte-level tokenizer and a scripted policy: strict prefix,
loss mask, tool-call parsing and errors, budgets, aborts."""

import json

import pytest

from hcjax.envs import react
from hcjax.envs.tools import MalformedCall, Tool, ToolCall, ToolResult, ToolSet, parse_tool_calls


class Bytes:
    """Byte-level tokenizer: id = byte value."""

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode(errors="replace")


class Scripted:
    """Replays fixed turns and records the token ids it was shown each time."""

    def __init__(self, turns):
        self.turns = list(turns)
        self.seen = []

    def __call__(self, token_ids):
        self.seen.append(list(token_ids))
        return list(self.turns.pop(0).encode())


def call(name, **args):
    return f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>'


def echo_tools():
    return ToolSet([Tool("echo", "echo text", {"text": str}, lambda text: ToolResult(text))])


def test_parse_tool_calls_reports_each_malformation():
    text = (call("a", x=1) + "<tool_call>{not json}</tool_call>" + '<tool_call>[1]</tool_call>'
            + '<tool_call>{"name": "b", "arguments": 3}</tool_call><tool_call>{"name": "c"')
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("a", {"x": 1})
    assert [type(c) for c in calls[1:]] == [MalformedCall] * 4
    assert "not valid JSON" in calls[1].error and "expected" in calls[2].error
    assert "arguments must be an object" in calls[3].error and "missing" in calls[4].error
    assert parse_tool_calls("plain answer") == []


def test_toolset_validates_arguments():
    tools = echo_tools()
    assert tools(ToolCall("echo", {"text": "hi"})) == ToolResult("hi")
    for bad, why in [(ToolCall("nope", {}), "unknown tool 'nope'"),
                     (ToolCall("echo", {}), "missing arguments ['text']"),
                     (ToolCall("echo", {"text": "x", "y": 1}), "unexpected arguments ['y']"),
                     (ToolCall("echo", {"text": 3}), "text=3 is not a str")]:
        result = tools(bad)
        assert result.malformed and not result.ok and why in result.output


def test_trajectory_is_a_strict_prefix_with_a_loss_mask():
    tok = Bytes()
    prompt = tok.encode("Q: say hi\n")
    turns = ["think " + call("echo", text="hi"), "done: hi"]
    policy = Scripted(turns)
    traj = react.run_episode(prompt, policy, tok, echo_tools())
    assert traj.finish_reason == react.STOP and traj.final_text == "done: hi"
    obs = react.default_observation([ToolResult("hi")])
    assert obs == "\n<tool_result>\nhi\n</tool_result>\n"
    expected = tok.encode(turns[0]) + tok.encode(obs) + tok.encode(turns[1])
    assert traj.response_ids == expected
    assert traj.loss_mask == [1] * len(turns[0]) + [0] * len(obs) + [1] * len(turns[1])
    # Each turn saw exactly the earlier ids, unchanged (never re-tokenised).
    assert policy.seen == [prompt, prompt + expected[: len(turns[0]) + len(obs)]]
    assert (traj.num_tool_calls, traj.num_malformed, traj.num_successful) == (1, 0, 1)


def test_malformed_calls_get_error_observations_and_the_loop_continues():
    tok = Bytes()
    policy = Scripted(["<tool_call>{oops</tool_call>", call("missing"), "give up"])
    traj = react.run_episode(tok.encode("Q"), policy, tok, echo_tools())
    text = tok.decode(traj.response_ids)
    assert "error: malformed tool call: the call is not valid JSON" in text
    assert "error: unknown tool 'missing'" in text
    assert (traj.num_tool_calls, traj.num_malformed, traj.finish_reason) == (2, 2, react.STOP)


def test_step_budget():
    tok = Bytes()
    policy = Scripted([call("echo", text=str(i)) for i in range(10)])
    traj = react.run_episode([1], policy, tok, echo_tools(), react.Budget(max_steps=3))
    assert traj.finish_reason == react.MAX_STEPS and traj.num_tool_calls == 3


def test_context_budget_truncates_the_turn():
    tok = Bytes()
    traj = react.run_episode([1] * 10, Scripted(["x" * 50]), tok, echo_tools(),
                             react.Budget(max_context=30))
    assert traj.finish_reason == react.CONTEXT and len(traj.response_ids) == 20
    assert sum(traj.loss_mask) == 20
    traj = react.run_episode([1] * 10, Scripted([call("echo", text="y" * 100)]), tok,
                             echo_tools(), react.Budget(max_context=110))
    assert traj.finish_reason == react.CONTEXT and len(traj.response_ids) == 100


def test_time_budget_uses_the_clock():
    tok = Bytes()
    ticks = iter(range(0, 1000, 10))
    policy = Scripted([call("echo", text="a")] * 5)
    traj = react.run_episode([1], policy, tok, echo_tools(), react.Budget(max_time_s=25),
                             clock=lambda: next(ticks))
    # Clock reads: start 0 (deadline 25); turn 1: 10 before its tool, 20 after it; turn 2: 30
    # before its tool -> out of time with one call made and the second turn kept.
    assert traj.finish_reason == react.TIME and traj.num_tool_calls == 1
    assert len(traj.turns) == 2


def test_tool_infrastructure_failure_aborts_the_rollout():
    tools = ToolSet([Tool("bash", "x", {"command": str},
                          lambda command: ToolResult("error: sandbox failure", ok=False,
                                                     aborted=True))])
    tok = Bytes()
    traj = react.run_episode([1], Scripted([call("bash", command="ls"), "never"]), tok, tools)
    assert traj.aborted and traj.finish_reason == react.ABORTED


def test_budget_validation():
    with pytest.raises(ValueError, match="max_steps=0"):
        react.Budget(max_steps=0)

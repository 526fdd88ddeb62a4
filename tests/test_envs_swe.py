"""SWE tools and grading: bash and the editor act inside the sandbox workspace only; changed
test files are reset and hidden tests appear only at grading."""

import json
import os

import pytest

from hcjax.envs import react, sandbox, swe
from hcjax.envs.tools import ToolCall, bash_tool, editor_tool

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root namespaces")

REPO = {
    "calc.py": "def add(a, b):\n    return a - b\n",
    "test_calc.py": "from calc import add\n\nassert add(2, 2) == 4\nprint('visible ok')\n",
}
HIDDEN = {"hidden_test_calc.py": "from calc import add\nassert add(-1, 5) == 4\nprint('ok')\n"}
COMMAND = "python3 test_calc.py && python3 hidden_test_calc.py"


def task():
    return swe.SWETask("Fix add in calc.py.", REPO, HIDDEN, COMMAND, timeout_s=10,
                       memory_mb=256)


def test_editor_view_create_replace_and_containment():
    with sandbox.Workspace({"a.txt": "one\ntwo\n"}) as ws:
        edit = editor_tool(ws).fn
        assert "    2  two" in edit("view", "a.txt").output
        assert edit("str_replace", "a.txt", old="two", new="three").ok
        assert ws.read("a.txt") == "one\nthree\n"
        missing = edit("str_replace", "a.txt", old="zzz", new="y")
        assert not missing.ok and "occurs 0 times" in missing.output
        assert edit("create", "sub/b.txt", content="new").ok and ws.read("sub/b.txt") == "new"
        assert "outside the sandbox" in edit("view", "../../etc/passwd").output
        os.symlink("/etc/passwd", os.path.join(ws.path, "link"))
        assert "outside the sandbox" in edit("create", "link", content="x").output
        os.link(os.path.join(ws.path, "a.txt"), os.path.join(ws.path, "hard"))
        os.chown(os.path.join(ws.path, "hard"), 0, 0)  # as if it were a host file
        assert "not a workspace file" in edit("create", "hard", content="x").output


def test_bash_runs_in_the_workspace_without_network():
    with sandbox.Workspace({"a.txt": "hello"}) as ws:
        bash = bash_tool(ws, timeout_s=20, memory_mb=256).fn
        out = bash("cat a.txt; echo more > b.txt; exit 4")
        assert out.output.startswith("hello") and "[exit code 4]" in out.output and not out.ok
        assert ws.read("b.txt") == "more\n"
        slow = bash_tool(ws, timeout_s=1, memory_mb=256).fn("sleep 10")
        assert "[timeout" in slow.output
        net = bash("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), 1)\"")
        assert "unreachable" in net.output


def test_hidden_tests_are_absent_until_grading_and_fix_passes():
    env = swe.SWEEnvironment(task(), tool_timeout_s=10)
    try:
        assert not os.path.exists(os.path.join(env.workspace.path, "hidden_test_calc.py"))
        assert env.grade().reward == 0.0  # the bug is still there
        result = env.tools(ToolCall("edit", {"command": "str_replace", "path": "calc.py",
                                             "old": "a - b", "new": "a + b"}))
        assert result.ok
        grade = env.grade()
        assert grade.reward == 1.0, grade.reason
    finally:
        env.close()


def test_tampered_tests_are_reset_before_grading():
    env = swe.SWEEnvironment(task(), tool_timeout_s=10)
    try:
        # The agent "fixes" the visible test and plants a fake hidden test; both are undone.
        env.tools(ToolCall("bash", {"command": "echo 'print(1)' > test_calc.py; "
                                               "echo 'print(2)' > test_extra.py"}))
        grade = env.grade()
        assert grade.reward == 0.0
        assert "test_calc.py" in grade.reason and "test_extra.py" in grade.reason
        assert env.workspace.read("test_calc.py") == REPO["test_calc.py"]
        assert not os.path.exists(os.path.join(env.workspace.path, "test_extra.py"))
    finally:
        env.close()


def test_swe_episode_through_the_react_loop():
    env = swe.SWEEnvironment(task(), tool_timeout_s=10)

    class Bytes:
        def encode(self, text):
            return list(text.encode())

        def decode(self, ids):
            return bytes(ids).decode(errors="replace")

    def call(name, **args):
        return f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>'

    turns = iter([call("bash", command="python3 test_calc.py"),
                  call("edit", command="str_replace", path="calc.py", old="a - b", new="a + b"),
                  call("bash", command="python3 test_calc.py"), "Fixed."])
    try:
        traj = react.run_episode(Bytes().encode("fix it"), lambda ids: list(next(turns).encode()),
                                 Bytes(), env.tools)
        text = Bytes().decode(traj.response_ids)
        assert "AssertionError" in text and "visible ok" in text
        assert traj.finish_reason == react.STOP and env.grade().reward == 1.0
    finally:
        env.close()


def test_hidden_tests_may_not_shadow_repository_files():
    with pytest.raises(ValueError, match="hidden test paths"):
        swe.SWEEnvironment(swe.SWETask("x", REPO, {"calc.py": ""}, COMMAND))

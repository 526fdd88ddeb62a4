"""SWE-style episodes: a repository in a sandbox workspace with `bash` and the string-replace
editor; at grading, test files the agent changed are reset, new files in test locations are
removed, and the hidden tests are written in only then (RECIPE §3).  Must not import JAX."""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from collections.abc import Mapping, Sequence

from hcjax.envs import sandbox
from hcjax.envs.tools import ToolSet, bash_tool, editor_tool
from hcjax.rewards.types import Grade

DEFAULT_TEST_PATTERNS = ("test_*.py", "*_test.py", "tests/*", "*/tests/*")


@dataclasses.dataclass(frozen=True)
class SWETask:
    """files: the repository at its base commit (no history is copied, so none after it
    leaks); hidden_tests: written only at grading; test_command: passes => reward 1."""

    instruction: str
    files: Mapping[str, str]
    hidden_tests: Mapping[str, str]
    test_command: str
    test_patterns: Sequence[str] = DEFAULT_TEST_PATTERNS
    timeout_s: float = 60.0
    memory_mb: int = 1024


def _is_test_path(path: str, patterns: Sequence[str]) -> bool:
    name = os.path.basename(path)
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(name, p) for p in patterns)


class SWEEnvironment:
    """A workspace holding the task's repository, the SWE tools, and the grader."""

    def __init__(self, task: SWETask, *, tool_timeout_s: float = 30.0) -> None:
        leaked = [p for p in task.hidden_tests if p in task.files]
        if leaked:
            raise ValueError(f"hidden test paths {leaked} are also in the repository files")
        self.task = task
        self.workspace = sandbox.Workspace(task.files)
        self.tools = ToolSet([bash_tool(self.workspace, timeout_s=tool_timeout_s),
                              editor_tool(self.workspace)])

    def _reset_tests(self) -> list[str]:
        """Restore the original test files and delete new ones; returns what was touched."""
        touched = []
        root = self.workspace.path
        for dirpath, _, filenames in os.walk(root):
            for name in filenames:
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                if _is_test_path(rel, self.task.test_patterns) and rel not in self.task.files:
                    os.unlink(os.path.join(dirpath, name))
                    touched.append(rel)
        originals = {p: c for p, c in self.task.files.items()
                     if _is_test_path(p, self.task.test_patterns)}
        for rel, content in originals.items():
            path = os.path.join(root, rel)
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    same = f.read() == content
            except OSError:
                same = False
            if not same or os.path.islink(path):
                if os.path.lexists(path):
                    os.unlink(path)
                touched.append(rel)
        self.workspace.write(originals)
        return sorted(touched)

    def grade(self) -> Grade:
        try:
            touched = self._reset_tests()
            self.workspace.write(self.task.hidden_tests)
        except ValueError as e:  # e.g. a test directory replaced by a symlink out of the sandbox
            return Grade(0.0, f"cannot restore the tests: {e}")
        out = self.workspace.run(self.task.test_command, timeout_s=self.task.timeout_s,
                                 memory_mb=self.task.memory_mb)
        note = f"; reset test files {touched}" if touched else ""
        if out.aborted:
            return Grade(0.0, f"sandbox failure: {out.detail}", aborted=True)
        if out.ok:
            return Grade(1.0, "hidden tests pass" + note)
        tail = (out.stdout + out.stderr).strip().splitlines()[-1:] or [""]
        return Grade(0.0, f"hidden tests fail ({out.status}: {tail[0][:200]})" + note)

    def close(self) -> None:
        self.workspace.close()

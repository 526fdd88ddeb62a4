"""Imports run down the layers only (STYLE.md): leaves → model, data → model I/O, transfer,
rewards, envs → rollout, tasks → train → rl → distill → entry points → benchmarks. Every module
of hcjax and pallas_kernels has a layer; none imports from a layer above its own, and no modules
or layer entries import each other in a circle. Imports inside functions count. Also: kernels
import no hcjax, no production module imports tests/, transfer/ sees no model, the sandbox is a
leaf that the code reward uses, and those modules never import JAX. An import inside a function
says why on its line or the line above (after the flags, so --help stays fast; an optional
dependency; before JAX starts)."""

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Lower numbers are lower layers; entries on one level may import each other (never in a circle).
LAYERS = {
    # Leaves: kernels, gin plumbing, meshes, progress display and metrics, profiling, host memory,
    # the gRPC server and auth every service runs on, the NaN/Inf refusal of weights, the sandbox,
    # the table of chips and links.
    "pallas_kernels": 0, "hcjax.config": 0, "hcjax.sharding": 0, "hcjax.display": 0,
    "hcjax.metrics": 0, "hcjax.profiling": 0, "hcjax.host_memory": 0, "hcjax.rpc": 0,
    "hcjax.finite": 0, "hcjax.sandbox": 0, "hcjax.hardware": 0,
    "hcjax.model": 1, "hcjax.data": 1, "hcjax.checkpoint": 1,
    # Models in and out of run folders and Hugging Face folders (every job reads models through
    # it, the standalone server included); reshard plans and the weights service; graders; tools.
    "hcjax.model_io": 2, "hcjax.transfer": 2, "hcjax.rewards": 2, "hcjax.envs": 2,
    "hcjax.rollout": 3, "hcjax.tasks": 3,
    # The one train step, the SFT trainer and its input pipeline (which reads task suites).
    "hcjax.train": 4,
    "hcjax.rl": 5,
    "hcjax.distill": 6,
    # The planner: the learner's and the engine's steps compiled on abstract inputs and costed.
    "hcjax.planner": 6,
    # Entry points (`python -m hcjax.X`) and what only they use.
    "hcjax.climb": 7, "hcjax.serve": 7, "hcjax.sft": 7, "hcjax.convert": 7, "hcjax.plan": 7,
    "hcjax.consolidate": 7, "hcjax.long2short": 7, "hcjax.dpo": 7, "hcjax.merge": 7,
    "hcjax.rejection": 7, "hcjax.ray_placement": 7, "hcjax.generate": 7,
    "hcjax.cluster": 7,  # the launchers' Python: layouts, JobSet, readiness, storage
    "hcjax.bench": 8,
}


def layer_of(module: str) -> str | None:
    for name in sorted(LAYERS, key=len, reverse=True):
        if module == name or module.startswith(name + "."):
            return name
    return None


def modules() -> dict[str, Path]:
    """Every module of hcjax and pallas_kernels by dotted name (a package by its own name)."""
    out = {}
    for path in [*(REPO / "hcjax").rglob("*.py"), *(REPO / "pallas_kernels").rglob("*.py")]:
        parts = path.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported_modules(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from hcjax import sandbox` imports the module hcjax.sandbox.
            out.extend([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
    return out


def test_every_module_has_a_layer():
    missing = sorted(m for m in modules() if m != "hcjax" and layer_of(m) is None)
    assert not missing, f"modules with no layer in LAYERS: {missing}"


def test_no_module_imports_from_a_layer_above_it():
    upward = []
    for name, path in modules().items():
        me = layer_of(name)
        if me is None:
            continue
        for module in imported_modules(path):
            target = layer_of(module)
            if target is not None and LAYERS[target] > LAYERS[me]:
                upward.append(f"{path.relative_to(REPO)} imports {module} ({me} -> {target})")
    assert not upward, "\n".join(upward)


def test_kernels_import_nothing_of_hcjax():
    bad = [f"{path.relative_to(REPO)} imports {m}" for name, path in modules().items()
           if name.startswith("pallas_kernels")
           for m in imported_modules(path) if m == "hcjax" or m.startswith("hcjax.")]
    assert not bad, "\n".join(bad)


def test_production_imports_no_test_helpers():
    """Small test models, quantisers and bare services live in tests/; a module of hcjax or
    pallas_kernels that needs one is using a feature that should have a production name."""
    bad = [f"{path.relative_to(REPO)} imports {m}" for path in modules().values()
           for m in imported_modules(path) if m == "tests" or m.startswith("tests.")]
    assert not bad, "\n".join(bad)


def module_graph() -> dict[str, set[str]]:
    """Which module imports which (an import of `a.b.name` counts as one of module `a.b` when
    `name` is not a module itself)."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = set()
        for module in imported_modules(path):
            while module and module not in known:
                module = module.rpartition(".")[0]
            if module and module != name:
                targets.add(module)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def test_no_modules_import_each_other_in_a_circle():
    graph = module_graph()
    # A package's __init__ re-exporting its modules is not a circle with them.
    graph = {m: {t for t in ts if not (m.startswith(t + ".") and (REPO / t.replace(".", "/")).is_dir())}
             for m, ts in graph.items()}
    assert not circles(graph), circles(graph)


def test_no_layer_entries_import_each_other_in_a_circle():
    graph = unit_graph()
    assert not circles(graph), circles(graph)


def unit_graph() -> dict[str, set[str]]:
    """Which LAYERS entry imports which other (any import in any of its modules)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules().items():
        me = layer_of(name)
        for module in imported_modules(path):
            target = layer_of(module)
            if me is not None and target is not None and target != me:
                graph[me].add(target)
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), list(graph.get(start, ()))
    while todo:
        unit = todo.pop()
        if unit not in seen:
            seen.add(unit)
            todo.extend(graph.get(unit, ()))
    return seen


def test_the_sandbox_is_a_leaf_and_rewards_and_envs_form_no_circle():
    graph = unit_graph()
    assert not graph.get("hcjax.sandbox"), f"hcjax.sandbox imports {graph['hcjax.sandbox']}"
    assert "hcjax.sandbox" in graph["hcjax.rewards"]
    for unit in ("hcjax.rewards", "hcjax.envs", "hcjax.tasks"):
        assert unit not in reachable(graph, unit), f"{unit} reaches itself through its imports"


def test_transfer_sees_no_model_and_no_layer_that_does():
    """transfer/ (reshard plans, their executors, the weights service) moves pytrees of arrays:
    besides its own modules it reaches only the rpc, finite and hardware (the link table) leaves,
    never the model, rollout or RL layers."""
    reached = reachable(unit_graph(), "hcjax.transfer")
    assert reached <= {"hcjax.rpc", "hcjax.finite", "hcjax.hardware"}, sorted(reached)


def test_rewards_envs_the_sandbox_and_the_curriculum_import_no_jax():
    modules = sorted(".".join(p.relative_to(REPO).with_suffix("").parts)
                     for d in ("rewards", "envs") for p in (REPO / "hcjax" / d).glob("*.py"))
    modules += ["hcjax.sandbox", "hcjax.rl.curriculum", "hcjax.data.hygiene", "hcjax.bench.sandbox"]
    code = f"import sys\nfor m in {modules!r}:\n    __import__(m)\nprint('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO)
    assert out.stdout.strip() == "False", modules


# A pragma is not a reason: a noqa code alone says nothing about why the import waits.
_PRAGMA = re.compile(r"noqa(:\s*[A-Z]+[0-9]+(\s*,\s*[A-Z]+[0-9]+)*)?|type:\s*ignore\S*")


def _says_why(line: str, whole_line: bool) -> bool:
    """Whether `line` carries a comment beyond pragmas (`whole_line`: the line is only a comment)."""
    if whole_line and not line.lstrip().startswith("#"):
        return False
    _, hash_, comment = line.partition("#")
    return bool(hash_) and bool(_PRAGMA.sub("", comment).strip(" #"))


def unexplained_function_imports(tree: ast.Module, lines: list[str]) -> list[int]:
    """Lines of the imports inside functions (at any depth) that give no reason: neither the
    statement's lines nor the comment line just above it say why. Imports that follow one
    another in one block share the first one's reason. `if __name__ == "__main__":` blocks at
    module level are exempt (they import run_main and the module's own main)."""
    missing = []

    def explained(node: ast.stmt) -> bool:
        own = any(_says_why(lines[i - 1], False) for i in range(node.lineno, node.end_lineno + 1))
        return own or (node.lineno > 1 and _says_why(lines[node.lineno - 2], True))

    def visit(statements: list, in_function: bool) -> None:
        shared = False  # the previous statement of this block was an import with a reason
        for node in statements:
            if isinstance(node, ast.Import | ast.ImportFrom):
                if in_function:
                    shared = shared or explained(node)
                    if not shared:
                        missing.append(node.lineno)
                continue
            shared = False
            inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for field in ("body", "orelse", "finalbody"):
                visit(getattr(node, field, None) or [], inner)
            for handler in getattr(node, "handlers", None) or []:
                visit(handler.body, inner)
            for case in getattr(node, "cases", None) or []:
                visit(case.body, inner)

    def is_main_block(node: ast.stmt) -> bool:
        return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")

    visit([n for n in tree.body if not is_main_block(n)], False)
    return missing


def test_every_import_inside_a_function_says_why():
    """An import waits inside a function only to keep an entry point's --help fast (after the
    flags), to keep an optional dependency optional, or because it must run before JAX starts
    (or on a host without the requirements); its line or the line above says which. Anything
    else is imported at the top of the module."""
    bad = []
    for path in sorted((REPO / "hcjax").rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for lineno in unexplained_function_imports(ast.parse(text), lines):
            bad.append(f"{path.relative_to(REPO)}:{lineno}: {lines[lineno - 1].strip()}")
    assert not bad, ("imports inside functions with no comment saying why (move them to the top "
                     "of the module, or say which reason keeps them here):\n" + "\n".join(bad))


def test_the_function_import_check_reads_reasons_groups_and_pragmas():
    """The check above on a hand-written module: a reason on the line or above it, one shared by
    the imports that follow it, a pragma that is no reason, nested functions and main blocks."""
    source = """import os

def f():
    import json  # optional: json
    import re

    x = 1
    import sys

def g():
    # after the flags: --help stays fast
    from a import b

    from c import d
    import e  # noqa: F401
    if True:
        def h():
            import zlib
    y = 2  # a comment on code
    import gzip

if __name__ == "__main__":
    import io
"""
    lines = source.splitlines()
    assert unexplained_function_imports(ast.parse(source), lines) == [8, 18, 20]

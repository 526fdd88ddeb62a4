"""Imports run down the layers only (STYLE.md): kernels → model → rollout / transfer / rewards /
envs → tasks → rl → entry points. A module importing from a layer above it is a failure here.
Imports inside functions count. Also: the sandbox is a leaf that rewards and envs share without
importing each other in a circle, and those modules never import JAX."""

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Lower numbers are lower layers; packages on one level may import each other.
LAYERS = {
    "pallas_kernels": 0, "hcjax.sharding": 0, "hcjax.model": 1, "hcjax.data": 1,
    # Leaves: the gRPC server and auth every service runs on, the NaN/Inf refusal of weights.
    "hcjax.rpc": 0, "hcjax.finite": 0,
    "hcjax.sandbox": 1,
    "hcjax.rollout": 2, "hcjax.transfer": 2, "hcjax.rewards": 2, "hcjax.envs": 2,
    # Models in and out of run folders and Hugging Face folders: every job reads models through
    # it, the standalone server included.
    "hcjax.model_io": 2,
    "hcjax.tasks": 3, "hcjax.train": 3, "hcjax.rl": 4, "hcjax.distill": 4,
    # The SFT input pipeline turns task suites' reference responses into packed batches: it
    # reads hcjax.tasks, and only the trainers above read it.
    "hcjax.data.pipeline": 4,
    "hcjax.climb": 5, "hcjax.serve": 5, "hcjax.sft": 5, "hcjax.convert": 5, "hcjax.plan": 5,
    "hcjax.consolidate": 5, "hcjax.long2short": 5, "hcjax.ray_placement": 5,
    "hcjax.cluster": 5,  # the launchers' entry points: layouts, JobSet, readiness, storage
    "hcjax.dpo": 5, "hcjax.merge": 5, "hcjax.rejection": 5,
    "hcjax.bench": 6,
}


def layer_of(module: str) -> str | None:
    for name in sorted(LAYERS, key=len, reverse=True):
        if module == name or module.startswith(name + "."):
            return name
    return None


def imported_modules(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from hcjax import sandbox` imports the module hcjax.sandbox.
            out.extend([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
    return out


def test_no_module_imports_from_a_layer_above_it():
    upward = []
    for path in [*(REPO / "hcjax").rglob("*.py"), *(REPO / "pallas_kernels").rglob("*.py")]:
        me = layer_of(".".join(path.relative_to(REPO).with_suffix("").parts))
        if me is None:
            continue
        for module in imported_modules(path):
            target = layer_of(module)
            if target is not None and LAYERS[target] > LAYERS[me]:
                upward.append(f"{path.relative_to(REPO)} imports {module} ({me} -> {target})")
    assert not upward, "\n".join(upward)


def unit_graph() -> dict[str, set[str]]:
    """Which LAYERS entry imports which other (any import in any of its modules)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in (REPO / "hcjax").rglob("*.py"):
        me = layer_of(".".join(path.relative_to(REPO).with_suffix("").parts))
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
    assert "hcjax.sandbox" in graph["hcjax.rewards"] and "hcjax.sandbox" in graph["hcjax.envs"]
    for unit in ("hcjax.rewards", "hcjax.envs", "hcjax.tasks"):
        assert unit not in reachable(graph, unit), f"{unit} reaches itself through its imports"


def test_transfer_sees_no_model_and_no_layer_that_does():
    """transfer/ (reshard plans, their executors, the weights service) moves pytrees of arrays:
    besides its own modules it reaches only the rpc and finite leaves, never the model, rollout
    or RL layers."""
    reached = reachable(unit_graph(), "hcjax.transfer")
    assert reached <= {"hcjax.rpc", "hcjax.finite"}, sorted(reached)


def test_rewards_envs_the_sandbox_and_the_curriculum_import_no_jax():
    modules = sorted(".".join(p.relative_to(REPO).with_suffix("").parts)
                     for d in ("rewards", "envs") for p in (REPO / "hcjax" / d).glob("*.py"))
    modules += ["hcjax.sandbox", "hcjax.rl.curriculum", "hcjax.data.hygiene", "hcjax.bench.sandbox"]
    code = f"import sys\nfor m in {modules!r}:\n    __import__(m)\nprint('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO)
    assert out.stdout.strip() == "False", modules

"""Imports run down the layers only (STYLE.md): kernels → model → rollout / transfer / rewards /
envs → tasks → rl → entry points. A module importing from a layer above it is a failure here."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Lower numbers are lower layers; packages on one level may import each other.
LAYERS = {
    "pallas_kernels": 0, "hcjax.sharding": 0, "hcjax.model": 1, "hcjax.data": 1,
    "hcjax.rollout": 2, "hcjax.transfer": 2, "hcjax.rewards": 2, "hcjax.envs": 2,
    "hcjax.tasks": 3, "hcjax.train": 3, "hcjax.rl": 4, "hcjax.distill": 4,
    "hcjax.climb": 5, "hcjax.serve": 5, "hcjax.sft": 5, "hcjax.convert": 5, "hcjax.plan": 5,
    "hcjax.consolidate": 5, "hcjax.long2short": 5, "hcjax.ray_placement": 5,
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
            out.append(node.module)
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

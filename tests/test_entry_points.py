"""Every `python -m hcjax.X` entry point turns a configuration or input mistake into one `error:`
line and a non-zero exit, never a traceback (hcjax.config.run_main). Each entry point runs once
on a bad input, in this process (the same `main` its `__main__` block hands to `run_main`); the
Hugging Face cases the issue found (a truncated safetensors file, a config.json that disagrees
with the weights, a missing shard, NaN weights) also run as real `python -m` processes."""

import ast
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hcjax.config import cpu_xla_flags, run_main
from hcjax.model.safetensors_io import SafetensorsCheckpoint, array_specs, write_safetensors
from tests.hf_fixtures import fixture
from tests.test_finite import poison

REPO = Path(__file__).resolve().parent.parent


# Runs on the launchers' hosts with the system python3 before any install step (standard library
# only), so it prints its own errors instead of going through run_main.
_STDLIB_ONLY = {"hcjax/cluster/layout.py"}


def _main_block(tree: ast.Module) -> ast.If | None:
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
            return node
    return None


def test_every_entry_point_starts_one_way():
    """One entry-point style: imports at the top (no `noqa: E402` preamble that sets the process
    up before importing), and a last `__main__` block that hands `main` to run_main, which makes
    the process-wide settings (hcjax.config.setup_process) before main runs."""
    preambles = [f"{p.relative_to(REPO)}:{i}" for root in ("hcjax", "pallas_kernels")
                 for p in sorted((REPO / root).rglob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1) if "noqa: E402" in line]
    assert not preambles, preambles
    bad, entry_points = [], 0
    for path in sorted((REPO / "hcjax").rglob("*.py")):
        tree = ast.parse(path.read_text())
        block = _main_block(tree)
        if block is None or str(path.relative_to(REPO)) in _STDLIB_ONLY:
            continue
        entry_points += 1
        calls = [ast.unparse(n) for n in ast.walk(block) if isinstance(n, ast.Call)]
        if (tree.body[-1] is not block or len(calls) != 1
                or not calls[0].startswith("run_main(main")):
            bad.append(f"{path.relative_to(REPO)}: {calls}")
    assert entry_points >= 30 and not bad, bad


def _error_line(capsys, module: str, argv: list[str]) -> str:
    """Run `module`'s main on argv through run_main; its one error line (exit status 2)."""
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exit_:
        run_main(main, argv)
    assert exit_.value.code == 2, (module, exit_.value.code)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


@pytest.mark.parametrize("module, argv, says", [
    ("hcjax.climb", ["--gin_param", "ClimbConfig.group = 0"], "ClimbConfig.group=0 must be"),
    ("hcjax.serve", ["--gin_param", "MeshConfig.tensor = 3"], "cannot form the inference mesh"),
    ("hcjax.sft", ["--gin_param", "TrainerConfig.num_steps = 0"],
     "TrainerConfig.num_steps=0 must be"),
    ("hcjax.convert", ["--from_hf", "/nonexistent/hf"], "does not exist"),
    ("hcjax.plan", ["--gin_param", "PlanConfig.nonsense = 1"], "nonsense"),
    ("hcjax.consolidate", [], "the following arguments are required: --climb"),
    ("hcjax.long2short", [], "the following arguments are required: --checkpoint"),
    ("hcjax.dpo", [], "give at least one --climb or --samples"),
    ("hcjax.merge", [], "the following arguments are required: --checkpoint"),
    ("hcjax.generate", ["--message", "hi"], "one of the arguments --hf_checkpoint --checkpoint"),
    ("hcjax.generate", ["--hf_checkpoint", "package:no_such_model_pkg", "--message", "hi"],
     "'no_such_model_pkg' is not installed"),
    ("hcjax.rejection", [], "the following arguments are required: --checkpoint"),
    ("hcjax.data.hygiene", [], "the following arguments are required: --input"),
    ("hcjax.rl.store", [], "the following arguments are required: store, out"),
    ("hcjax.model.summary", ["--gin_param", "ModelConfig.num_heads = 3"],
     "num_heads=3 is not a multiple of num_kv_heads"),
    ("hcjax.cluster.layout", [], "the following arguments are required: platform"),
    ("hcjax.cluster.jobset", [], "the following arguments are required"),
    ("hcjax.cluster.wait_ready", [], "the following arguments are required: addresses"),
    ("hcjax.cluster.storage", [], "the following arguments are required: path"),
])
def test_a_bad_input_is_one_error_line(capsys, tmp_path, module, argv, says):
    if module in ("hcjax.climb", "hcjax.sft", "hcjax.convert", "hcjax.dpo"):
        argv = [*argv, "--output_dir", str(tmp_path / "out")]
    assert says in _error_line(capsys, module, argv)


def test_a_bug_keeps_its_traceback(capsys):
    def main(argv):
        raise KeyError("not a configuration mistake")

    with pytest.raises(KeyError):
        run_main(main, [])


def _truncated(tmp_path) -> str:
    folder = tmp_path / "truncated"
    shutil.copytree(fixture("qwen3"), folder)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return str(folder)


def _disagreeing(tmp_path) -> str:
    folder = tmp_path / "disagreeing"
    shutil.copytree(fixture("qwen3"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] *= 2
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _missing_shard(tmp_path) -> str:
    folder = tmp_path / "sharded"
    shutil.copytree(fixture("qwen3"), folder)
    ckpt = SafetensorsCheckpoint.open(folder)
    arrays = {name: ckpt.read(name) for name in ckpt.names}
    (folder / "model.safetensors").unlink()
    paths = write_safetensors(folder, array_specs(arrays), max_shard_bytes=64 << 10)
    assert len(paths) > 2  # shards and their index
    paths[1].unlink()
    return str(folder)


def _nan(tmp_path) -> str:
    folder = tmp_path / "nan"
    shutil.copytree(fixture("qwen3"), folder)
    poison(folder, "model.layers.1.self_attn.o_proj.weight", count=4)
    return str(folder)


@pytest.mark.parametrize("make, says", [
    (_truncated, "truncated"), (_disagreeing, "the config implies"), (_missing_shard, "00002"),
    (_nan, "model.layers.1.self_attn.o_proj.weight: 4 of"),
])
def test_a_broken_hugging_face_folder_is_one_error_line(capsys, tmp_path, make, says):
    folder = make(tmp_path)
    line = _error_line(capsys, "hcjax.convert",
                       ["--from_hf", folder, "--output_dir", str(tmp_path / "out")])
    assert says in line, line
    line = _error_line(capsys, "hcjax.serve", ["--hf_checkpoint", folder, "--no_warmup"])
    assert says in line, line


@pytest.mark.slow
def test_python_m_entry_points_print_one_error_line(tmp_path):
    """The real processes: `serve --hf_checkpoint` on a truncated file, `convert` on NaN
    weights: one error line each, exit status 2."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               XLA_FLAGS=cpu_xla_flags(1))
    for argv, says in [(["hcjax.serve", "--hf_checkpoint", _truncated(tmp_path)], "truncated"),
                       (["hcjax.convert", "--from_hf", _nan(tmp_path), "--output_dir",
                         str(tmp_path / "out")], "non-finite values")]:
        done = subprocess.run([sys.executable, "-m", *argv], env=env, cwd=REPO, text=True,
                              capture_output=True, timeout=300)
        assert done.returncode == 2, done.stderr[-3000:]
        assert "Traceback" not in done.stderr
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and says in errors[0], done.stderr[-3000:]

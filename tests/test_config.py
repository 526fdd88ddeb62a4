"""gin plumbing, model summary and the main entry point: clear errors, files written, counts right."""

import ast
import glob
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hcjax import config as hcfg
from hcjax.model.summary import main as summary_main

REPO = Path(__file__).resolve().parent.parent


def test_unknown_configurable_is_named():
    with pytest.raises(hcfg.ConfigError, match="NoSuchThing"):
        hcfg.bind(["tiny_cpu.gin"], ["NoSuchThing.size = 3"])


def test_unknown_parameter_is_named():
    with pytest.raises(hcfg.ConfigError, match="ModelConfig.num_layerz"):
        hcfg.bind(["tiny_cpu.gin"], ["ModelConfig.num_layerz = 3"])


def test_a_renamed_binding_names_its_new_name(tmp_path):
    import hcjax.rl.climber  # noqa: F401 - registers ClimbConfig and SamplingOptions
    import hcjax.train.loop  # noqa: F401 - registers TrainerConfig and AdamWConfig

    for old, new in [("ClimbConfig.max_tokens = 5", "ClimbConfig.max_tokens is now "
                      "SamplingOptions.max_tokens"),
                     ("SFTConfig.peak_lr = 1e-3", "SFTConfig.peak_lr is now AdamWConfig.peak_lr"),
                     ("SFTConfig.num_steps = 5", "SFTConfig.num_steps is now "
                      "TrainerConfig.num_steps"),
                     ("ClimbConfig.suite = None", "ClimbConfig.suite is now TaskConfig.suite")]:
        with pytest.raises(hcfg.ConfigError, match=re.escape(new)):
            hcfg.bind([], [old])
    old_file = tmp_path / "old.gin"
    old_file.write_text("ClimbConfig.top_p = 0.9\n")
    with pytest.raises(hcfg.ConfigError, match=re.escape(
            "ClimbConfig.top_p is now SamplingOptions.top_p")):
        hcfg.bind([str(old_file)], [])
    with pytest.raises(hcfg.ConfigError) as err:  # an unrelated mistake gets no hint
        hcfg.bind([], ["ModelConfig.num_layerz = 3"])
    assert "is now" not in str(err.value)


def test_malformed_binding_is_named():
    with pytest.raises(hcfg.ConfigError, match="ModelConfig.num_layers = = 3"):
        hcfg.bind(["tiny_cpu.gin"], ["ModelConfig.num_layers = = 3"])


def test_missing_gin_file():
    with pytest.raises(hcfg.ConfigError, match="no_such_file.gin"):
        hcfg.bind(["no_such_file.gin"], [])


def test_bad_value_fails_at_construction_naming_the_field():
    from hcjax.model import ModelConfig

    hcfg.bind(["tiny_cpu.gin"], ["ModelConfig.num_kv_heads = 3"])
    with pytest.raises(ValueError, match="num_heads=4 is not a multiple of num_kv_heads=3"):
        ModelConfig()


def test_bindings_apply_and_config_is_written(tmp_path):
    from hcjax.model import ModelConfig

    flags = hcfg.parse_flags(
        ["--gin_param", "ModelConfig.num_layers = 2", "--output_dir", str(tmp_path)],
        description="t",
        default_gin_files=["tiny_cpu.gin"],
    )
    hcfg.bind(flags.gin_files, flags.gin_params)
    assert ModelConfig().num_layers == 2 and ModelConfig().vocab_size == 272
    path = hcfg.write_config(tmp_path, flags)
    text = path.read_text()
    assert "ModelConfig.num_layers = 2" in text and "ModelConfig.vocab_size = 272" in text
    op = hcfg.write_operative_config(tmp_path).read_text()
    assert "ModelConfig.num_layers = 2" in op


def test_flagship_summary_is_about_1t_total_35b_active(capsys):
    s = summary_main(["--gin_file", "mai_base_1t_a35b.gin"])
    assert 0.95e12 <= s["total_params"] <= 1.05e12
    assert 33e9 <= s["active_params"] <= 37e9
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["total_params"] == s["total_params"]


def test_tiny_summary_counts_match_real_parameters():
    import jax
    from flax import nnx

    from hcjax.model import ModelConfig, Transformer

    s = summary_main(["--gin_file", "tiny_cpu.gin"])
    hcfg.bind(["tiny_cpu.gin"], [])
    model = Transformer(ModelConfig(), rngs=nnx.Rngs(0))
    assert s["total_params"] == sum(x.size for x in jax.tree.leaves(nnx.state(model)))


def test_cli_config_error_is_one_clear_line():
    proc = subprocess.run(
        [sys.executable, "-m", "hcjax.model.summary", "--gin_param", "ModelConfig.bogus = 1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "ModelConfig.bogus" in proc.stderr and "Traceback" not in proc.stderr


def test_another_jobs_binding_is_skipped_and_an_unknown_name_is_not():
    """Gin files are shared between jobs: a configurable hcjax defines but this process never
    imported is another job's setting and is skipped; a name hcjax does not define fails."""
    assert {"TrainerConfig", "AdamWConfig", "ClimbConfig", "PlanConfig",
            "run_sft"} <= hcfg.project_configurables()
    code = ("import sys\n"
            "from hcjax import config\n"
            "config.bind(['climb_tiny.gin'], ['ClimbConfig.group = 4'])\n"
            "print('hcjax.rl.climber' in sys.modules)\n"
            "try:\n"
            "    config.bind(['climb_tiny.gin'], ['ClimbConfg.group = 4'])\n"
            "except config.ConfigError as e:\n"
            "    print(' '.join(str(e).split()))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "False" and "No configurable matching 'ClimbConfg'" in lines[1], done.stdout


# Which hcjax modules a module imports: when it is imported (module level), and anywhere in it.
def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in (REPO / "hcjax").rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text(encoding="utf-8"))
    return out


def _imported(node: ast.AST, known: dict) -> list[str]:
    """The hcjax modules an import statement runs: each module it names and their packages."""
    names = []
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    elif isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    parts = [n.split(".") for n in names]
    return [m for p in parts for m in (".".join(p[:i]) for i in range(1, len(p) + 1))
            if m in known]


def _is_main_block(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def _module_level_imports(body: list) -> list[ast.AST]:
    out = []
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or _is_main_block(node):
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        for field in ("body", "orelse", "finalbody", "handlers"):
            out += _module_level_imports(getattr(node, field, None) or [])
    return out


def _closure(starts, graph: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), list(starts)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph.get(module, ())
    return seen


def _is_config_bind(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "bind" and isinstance(node.func.value, ast.Name)
            and node.func.value.id in ("config", "hcfg"))


def test_every_binding_entry_point_registers_what_it_can_reach_before_binding():
    """gin locks its registry when a config is bound: a module with configurables imported
    afterwards fails ("Attempted to add a new configurable after the config was locked"), and
    one not yet imported has its bindings skipped. So wherever hcjax binds (an entry point's
    main, a Ray actor, a benchmark), every gin-configurable module reachable from that module
    through any import is imported first: at module level, or in the binding function above the
    bind call."""
    modules = _modules()
    at_import = {name: {m for n in _module_level_imports(tree.body) for m in _imported(n, modules)}
                 for name, tree in modules.items()}
    anywhere = {name: {m for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)
                       for m in _imported(n, modules)} for name, tree in modules.items()}
    configurable = _configurable_modules()
    binders, unregistered = [], []
    for name, tree in modules.items():
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
        for fn, call in ((f, c) for f in functions for c in ast.walk(f) if _is_config_bind(c)):
            before = [m for n in ast.walk(fn) if isinstance(n, ast.Import | ast.ImportFrom)
                      and n.lineno < call.lineno for m in _imported(n, modules)]
            missing = (_closure([name], anywhere) & configurable) - _closure([name, *before],
                                                                                at_import)
            binders.append(f"{name}.{fn.name}")
            if missing:
                unregistered.append(f"{name}.{fn.name} (line {call.lineno}) binds before "
                                    f"importing {sorted(missing)}")
    assert {"hcjax.climb.main", "hcjax.serve.main", "hcjax.sft.main", "hcjax.dpo.main",
            "hcjax.merge.main", "hcjax.rejection.main", "hcjax.ray_placement.run"} <= set(binders)
    assert not unregistered, "\n".join(unregistered)


def test_a_configurable_a_gin_value_names_is_imported_with_the_one_it_configures():
    """A gin value may name another configurable (`TaskConfig.rewards = {"arithmetic":
    @RewardSpec()}`), built when the bound one is: the bound one's module imports its module, so
    it is registered wherever the bound one is (else that binding fails with "No configurable
    matching reference")."""
    modules = _modules()
    at_import = {name: {m for n in _module_level_imports(tree.body) for m in _imported(n, modules)}
                 for name, tree in modules.items()}
    defined_in = {}
    for name in _configurable_modules():
        for node in modules[name].body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef) and any(
                    "gin.configurable" in ast.unparse(d) for d in node.decorator_list):
                defined_in[node.name] = name
        for registered in re.findall(r"gin\.external_configurable\((\w+)",
                                     ast.unparse(modules[name])):
            defined_in[registered] = name
    binding = re.compile(r"^(?:[\w.]+/)*(\w+)\.\w+\s*=")
    pairs, unregistered = set(), []
    for path in sorted((REPO / "configs").rglob("*.gin")):
        bound = None
        for line in path.read_text(encoding="utf-8").splitlines():
            line = line.split("#", 1)[0]
            if match := binding.match(line):
                bound = match.group(1)
            for ref in re.findall(r"@(?:[\w.]+/)*(\w+)", line):
                pairs.add((bound, ref))
    for bound, ref in sorted(pairs):
        if defined_in[ref] not in _closure([defined_in[bound]], at_import):
            unregistered.append(f"gin binds {bound} (in {defined_in[bound]}) to @{ref}, but "
                                f"{defined_in[bound]} does not import {defined_in[ref]}")
    assert ("TaskConfig", "RewardSpec") in pairs and ("DataConfig", "MixtureSuite") in pairs
    assert not unregistered, "\n".join(unregistered)


def _configurable_modules() -> set[str]:
    return {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            for p in (REPO / "hcjax").rglob("*.py")
            if re.search(r"@gin\.configurable|gin\.external_configurable\(",
                         p.read_text(encoding="utf-8"))}


@pytest.mark.parametrize("name", sorted(str(p.relative_to(REPO / "configs"))
                                        for p in (REPO / "configs").rglob("*.gin")))
def test_every_config_binds(name):
    # Every shipped gin file parses and binds with every configurable registered, so that no
    # binding is skipped (a renamed field or a typo in a config nobody ran would otherwise
    # surface only when a user runs it).
    for module in sorted(_configurable_modules()):
        importlib.import_module(module)
    hcfg.bind([name], [])


def test_a_cpu_start_prints_no_libtpu_lines():
    """libtpu is installed for the planner only: an entry point on this TPU-less host runs JAX on
    CPU (run_main's setup_process) without initialising libtpu, so it prints none of its
    warnings."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    done = subprocess.run([sys.executable, "-m", "hcjax.model.summary"], env=env, text=True,
                          capture_output=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TPU" not in done.stderr and "E0000" not in done.stderr, done.stderr[-2000:]


# In a child without JAX_PLATFORMS, HCJAX_HOST_MALLOC or a device count: what importing the
# whole package changes in the environment and in malloc, then what setup_process does after
# JAX was imported (as an entry point's module imports it before run_main).
_IMPORT_ALL = """
import importlib, json, os, pkgutil, sys
before = dict(os.environ)
import hcjax
for m in pkgutil.walk_packages(hcjax.__path__, "hcjax."):
    importlib.import_module(m.name)
import jax
from jax._src import xla_bridge
from hcjax import config, host_memory
# (tensorboardX sets CRC32C_SW_MODE when imported: a third party's, not a process setting of ours)
changed = {k: v for k, v in os.environ.items() if before.get(k) != v and k != "CRC32C_SW_MODE"}
started, kept = xla_bridge.backends_are_initialized(), host_memory.kept()
config.setup_process(cpu_devices=3)
print(json.dumps({"changed": changed, "started": started, "kept": kept,
                  "platforms": os.environ.get("JAX_PLATFORMS"),
                  "devices": [d.platform for d in jax.devices()]}))
"""


@pytest.mark.skipif(bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")),
                    reason="a TPU host keeps JAX's own platform choice")
def test_importing_hcjax_sets_nothing_and_setup_process_sets_the_platform_and_devices():
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "HCJAX_HOST_MALLOC", "HCJAX_CPU_DEVICES", "XLA_FLAGS")}
    env["HCJAX_HOST_MALLOC"] = "keep"  # asked for, yet only setup_process may act on it
    done = subprocess.run([sys.executable, "-c", _IMPORT_ALL], env=env, text=True,
                          capture_output=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # No module starts JAX or changes the environment or malloc when imported ...
    assert out["changed"] == {} and not out["started"] and not out["kept"], out
    # ... and the set-up after `import jax` still takes effect: CPU (no GPU plugin here), 3 host
    # devices, and no libtpu line.
    assert out["platforms"] == hcfg.default_jax_platforms() == "cpu", out
    assert out["devices"] == ["cpu"] * 3, out
    assert "TPU" not in done.stderr and "E0000" not in done.stderr, done.stderr[-2000:]


def test_setup_process_keeps_the_users_platforms_and_refuses_to_come_late(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    hcfg.setup_process()  # the user's (here conftest's) choice: nothing to do, JAX running or not
    assert os.environ["JAX_PLATFORMS"] == "cpu"
    import jax

    jax.devices()  # this process's backends are up (tests/conftest.py's 8 CPU devices)
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(hcfg, "default_jax_platforms", lambda: "cpu")
    with pytest.raises(RuntimeError, match="backends started before JAX_PLATFORMS=cpu"):
        hcfg.setup_process()


def test_cpu_xla_flags_keep_the_parents_flags_and_replace_its_device_count():
    parent = "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8 --xla_foo=1"
    assert hcfg.cpu_xla_flags(2, parent) == (
        "--xla_dump_to=/tmp/d --xla_foo=1 --xla_force_host_platform_device_count=2")
    assert hcfg.cpu_xla_flags(1, "") == "--xla_force_host_platform_device_count=1"

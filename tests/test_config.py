"""gin plumbing, model summary and the main entry point: clear errors, files written, counts right."""

import json
import os
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


def test_every_gin_configurable_module_is_registered_for_binding():
    """A module with @gin.configurable missing from _CONFIGURABLE_MODULES would be imported only
    after the config is locked, and gin then refuses to register it at run time."""
    root = Path(hcfg.__file__).resolve().parent
    found = set()
    for path in root.rglob("*.py"):
        if "gin.configurable" in path.read_text(encoding="utf-8") and path.name != "config.py":
            rel = path.relative_to(root.parent).with_suffix("")
            found.add(".".join(rel.parts).removesuffix(".__init__"))
    assert found, "no gin-configurable module found under hcjax/"
    missing = sorted(found - set(hcfg._CONFIGURABLE_MODULES))
    assert not missing, f"add {missing} to hcjax.config._CONFIGURABLE_MODULES"


@pytest.mark.parametrize("name", sorted(p.name for p in
                                        (Path(__file__).parent.parent / "configs").glob("*.gin")))
def test_every_config_binds(name):
    # Every shipped gin file parses and binds against the registered configurables (a renamed
    # field or a typo in a config nobody ran would otherwise surface only when a user runs it).
    import hcjax.climb  # noqa: F401  (registers the climb's configurables)
    import hcjax.consolidate  # noqa: F401
    import hcjax.distill.dpo  # noqa: F401
    import hcjax.distill.rejection  # noqa: F401

    hcfg.bind([name], [])


def test_a_cpu_start_prints_no_libtpu_lines():
    """libtpu is installed for the planner only: an entry point on this TPU-less host runs JAX on
    CPU (hcjax/__init__.py) without initialising libtpu, so it prints none of its warnings."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    done = subprocess.run([sys.executable, "-m", "hcjax.model.summary"], env=env, text=True,
                          capture_output=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TPU" not in done.stderr and "E0000" not in done.stderr, done.stderr[-2000:]

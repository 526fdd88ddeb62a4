"""`python -m hcjax.bench.gpu --reduced` on CPU: every section (kernels in interpret mode, MoE
dispatch, learner MFU, decode) reports finite figures in the last-line JSON; a section that raises
is recorded and the others still run; the peak table knows its devices. No timing is asserted."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hcjax.bench.gpu import SECTIONS, peak_tflops, run_sections
from hcjax.display import Phases

REPO = Path(__file__).resolve().parent.parent


def _numbers(x, path=""):
    """Every (path, number) inside a JSON value; bools are not figures."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(x, int | float) and not isinstance(x, bool):
        yield path, x


@pytest.mark.slow
def test_gpu_bench_reduced_on_cpu(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    json_out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "hcjax.bench.gpu", "--reduced",
                           "--json_out", str(json_out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(json_out.read_text()) == out  # the file after the last section
    assert out["backend"] == "cpu" and out["sizes"] == "reduced" and out["jax_version"]
    assert out["peak_tflops"] == {"bfloat16": None, "tfloat32": None}  # no peak for a CPU
    for name in SECTIONS:
        section = out[name]
        assert "error" not in section, (name, section.get("traceback"))
        figures = list(_numbers(section))
        assert len(figures) > 3, (name, section)
        for path, value in figures:
            assert math.isfinite(value), (name, path, value)
    assert out["ceilings"]["matmul_bf16_tflops"] > 0 and out["ceilings"]["copy_gb_per_s"] > 0
    kernels = {e["kernel"] for e in out["kernels"]["results"]}
    assert kernels == {"flash_attention_fwd", "flash_attention_fwd_bwd", "gmm", "tgmm",
                       "decode_attention"}
    for entry in out["kernels"]["results"]:  # Pallas (interpreted) timed beside the reference
        assert entry["pallas_tflops"] >= 0 and entry["reference_tflops"] >= 0, entry
    case = out["moe"]["cases"][0]
    assert case["loss_rel_diff"] < 1e-4  # the dispatch forms compute the same function
    for variant in ("replay", "no_replay"):
        assert out["learner"][variant]["tokens_per_step"] > 0
        assert out["learner"][variant]["mfu"] is None
    assert out["decode"]["tokens"] > 0 and out["decode"]["tokens_per_s"] > 0


def test_a_failing_section_is_recorded_and_the_rest_run():
    def broken(phase):
        raise RuntimeError("no cuDNN here")

    seen = []
    out = run_sections({"first": broken, "second": lambda phase: {"x": 1.0}},
                       Phases("test", mode="off"), after_each=lambda r: seen.append(list(r)))
    assert seen == [["first"], ["first", "second"]]  # the partial results after each section
    assert out["first"]["error"] == "RuntimeError: no cuDNN here"
    assert "Traceback" in out["first"]["traceback"]
    assert out["second"]["x"] == 1.0 and out["second"]["section_s"] >= 0


def test_peak_table():
    assert peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "tfloat32") == 494.0
    assert peak_tflops("TPU v5 lite") == 197.0
    assert peak_tflops("cpu") is None and peak_tflops("Some Future GPU") is None


def test_help_ends_with_examples(capsys):
    from hcjax.bench.gpu import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    examples = out[out.index("examples:"):].splitlines()
    assert sum("python -m hcjax.bench.gpu" in line for line in examples) >= 2, out

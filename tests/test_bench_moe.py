"""`python -m hcjax.bench.moe` at toy sizes: every dispatch form agrees with the dense reference
inside the benchmark, and the JSON carries each form's time, the sweeps asked for and the
fractions of the roofline (timings themselves are not asserted)."""

import json
import math

import pytest

from hcjax.bench import moe


def test_bench_moe_runs_every_form_and_sweep(capsys):
    result = moe.main(["--tokens", "64", "--latent", "8", "--hidden", "16", "--repeats", "1",
                       "--tiles", "16", "--capacities", "1,1.5"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["matmul_roofline_gflops"] > 0
    assert [(c["experts"], c["k"]) for c in result["cases"]] == [(8, 2), (8, 8), (64, 2), (64, 8)]
    for case in result["cases"]:
        assert case["loss_rel_diff"] < 1e-5 and case["max_grad_abs_diff"] < 1e-3, case
        for form in ("ragged_dot", "blocked", "tiled", "capacity"):
            assert case[f"{form}_fraction_of_roofline"] > 0
        assert case["plain_matmuls_same_flops_s"] > 0 and case["capacity_over_plain_matmuls"] > 0
        assert list(case["tiled_ms_by_tile"]) == ["16"]
        mean = 64 * case["k"] / case["experts"]
        rows = [str(max(8, math.ceil(f * mean / 8) * 8)) for f in (1, 1.5)]
        assert list(case["capacity_ms_by_rows"]) == list(dict.fromkeys(rows))


def test_bench_moe_rejects_a_bad_sweep():
    with pytest.raises(SystemExit) as e:
        moe.main(["--tiles", "0"])
    assert e.value.code == 2

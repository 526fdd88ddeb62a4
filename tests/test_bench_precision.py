"""`python -m hcjax.bench.precision --reduced` on CPU: the gap table has every (sampler dtype,
learner dtype, routing replay, top-p replay) row with finite figures, matched dtypes with both
replays reproduce the sampler's log-probs, and dropping top-p replay costs exactly the mass
outside the nucleus; served fp8 / int8 weights (quantise-on-sync) add a gap of their own."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_precision_reduced():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # One quantised format (fp8, the coarser) keeps the run to one extra sampler; int8's
    # numerics are tests/test_transfer_quantize.py's.
    proc = subprocess.run([sys.executable, "-m", "hcjax.bench.precision", "--reduced",
                           "--quantize", "fp8_e4m3"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = {(r["sampler_dtype"], r["learner_dtype"], r["replay_routing"], r["replay_top_p"]): r
            for r in out["rows"]}
    pairs = [("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32")]
    assert set(rows) == {(*p, rr, rp) for p in pairs for rr in (True, False)
                         for rp in (True, False)}
    for key, row in rows.items():
        assert row["tokens"] > 0, key
        for name, value in row.items():
            if isinstance(value, float):
                assert math.isfinite(value), (key, name, value)

    # Engine and learner computing alike, routing and support replayed: Δ is rounding only. In
    # bf16 one rounding is coarse: a logit in [4, 8) is stored to 2^-5 = 0.031, so a token whose
    # logit the cached decode and the full forward round one step apart moves by about that
    # much (the reduced run's 48 tokens gave a largest Δ of 0.0045 with one draw and 0.033 with
    # another; the full bench has 0.24% of bf16 tokens outside [0.8, 1.2]).
    bounds = {"float32": (1e-3, 1e-2), "bfloat16": (5e-3, 0.1)}
    for dtype, (mean_bound, max_bound) in bounds.items():
        both = rows[(dtype, dtype, True, True)]
        assert both["mean_abs_dlogp"] < mean_bound and both["max_abs_dlogp"] < max_bound, both
        assert both["support_miss_frac"] == 0.0 and both["frac_outside_clip"] == 0.0, both
    fp32 = rows[("float32", "float32", True, True)]["mean_abs_dlogp"]
    # Smallest of every fp32-learner row (bf16/bf16 can tie or beat it on CPU: bf16 rounding
    # absorbs the sub-ulp differences of the two compute paths, so its Δ is mostly exactly 0).
    for key, row in rows.items():
        if key[1] == "float32":
            assert fp32 <= row["mean_abs_dlogp"] + 1e-7, (key, row)

    # Without top-p replay the learner normalises over the whole vocabulary: log π_full =
    # log π_nucleus + log(nucleus mass), and the mass is in [top_p, 1], so Δ ∈ [log top_p, 0].
    log_top_p = math.log(out["sampling"]["top_p"])
    for dtype in ("float32", "bfloat16"):
        row = rows[(dtype, dtype, True, False)]
        assert log_top_p - 1e-3 <= row["mean_dlogp"] < 0.0, row
        assert row["max_abs_dlogp"] <= -log_top_p + 1e-3, row

    # Quantise-on-sync rows: the engine serving each format's round trip of the matmul kernels
    # against the fp32 learner's masters, routing x top-p replay. The quantisation error is a
    # gap of its own: above the fp32 pair's rounding-only gap even with both replays.
    quantized = {(r["served"], r["replay_routing"], r["replay_top_p"]): r
                 for r in out["quantized"]}
    assert set(quantized) == {("fp8_e4m3", rr, rp) for rr in (True, False)
                              for rp in (True, False)}
    for key, row in quantized.items():
        assert row["tokens"] > 0 and row["learner_dtype"] == "float32", key
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
        assert row["mean_abs_dlogp"] > fp32, (key, row)

    # The rollout-correction table: bf16 sampler against an fp32 and a bf16 learner, replay x
    # TIS. |Δ| is the replay rows' (TIS leaves it alone); TIS leaves uncorrected only what lies
    # beyond its cap, and without TIS the loss sees all of |Δ|.
    cells = {(c["sampler_dtype"], c["learner_dtype"], c["replay"], c["tis"]): c
             for c in out["corrections"]}
    pairs = [("bfloat16", "float32"), ("bfloat16", "bfloat16")]
    assert set(cells) == {(*p, r, t) for p in pairs for r in (True, False) for t in (True, False)}
    cap = out["tis_cap"]
    for (s, lrn, replay, tis), c in cells.items():
        row = rows[(s, lrn, replay, replay)]  # replay = routing and top-p replay together
        assert c["mean_abs_dlogp"] == row["mean_abs_dlogp"], (c, row)
        if tis:
            assert c["uncorrected_abs_dlogp"] <= c["mean_abs_dlogp"] + 1e-6, c
            # Only a ratio above C is truncated: then some |Δ| exceeds log C.
            assert c["clip_frac"] == 0.0 or row["max_abs_dlogp"] > math.log(cap), (c, row)
        else:
            assert c["uncorrected_abs_dlogp"] == c["mean_abs_dlogp"]
            assert c["clip_frac"] == row["frac_outside_clip"], (c, row)


def test_help_ends_with_examples(capsys):
    from hcjax.bench.precision import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    examples = out[out.index("examples:"):].splitlines()
    assert sum("python -m hcjax.bench.precision" in line for line in examples) >= 2, out

"""`python -m hcjax.plan`: compile the learner train step and the rollout decode step for a real TPU
topology on this CPU host (libtpu's compile-only devices) and report per-chip memory, FLOPs,
collectives and roofline estimates. The entry point only: flags -> gin -> `hcjax.planner.plan`
-> the summary; the HLO reader, the cost model and the compiles live in hcjax/planner/, the chip
and link figures in hcjax/hardware.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from hcjax import config as hcfg
from hcjax.display import Phases
from hcjax.planner import PlanConfig, plan
from hcjax.transfer import network

__all__ = ["main", "summary_table"]


# Report ------------------------------------------------------------------------------------------


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def summary_table(result: dict) -> str:
    """The plan record as the lines `python -m hcjax.plan` prints (and writes to summary.txt)."""
    slices = result.get("num_slices", 1)
    lines = [f"topology {result['topology']}" + (f" x {slices} slices (DCN)" if slices > 1 else "")
             + f": {result['chips']} chips, "
             f"{_gb(result['hbm_bytes_per_chip'])} HBM per chip"]
    for name in ("train_step", "decode_step"):
        step = result.get(name)
        if step is None:
            continue
        b = step["bytes_per_chip"]
        lines += [
            f"\n{name} (mesh {step['mesh']}, compiled in {step['compile_s']} s)",
            f"  per chip: arguments {_gb(b['arguments'])}, outputs {_gb(b['outputs'])}, "
            f"temp {_gb(b['temp'])}, total {_gb(b['total'])} -> "
            + ("fits" if step["fits"] else f"DOES NOT FIT, {_gb(step['bytes_over'])} over"),
            f"  FLOPs per chip {step['flops_per_chip']:.3e} (XLA matmuls "
            f"{step['xla_flops_per_chip']:.3e} + Pallas kernels' model FLOPs); model FLOPs "
            f"{step['model_flops']:.3e} over all chips; XLA/model {step['flops_ratio']:.2f} beyond "
            f"remat x{step['remat_factor']:.2f}; HBM bytes {_gb(step['hbm_bytes_accessed_per_chip'])}"
            f" (upper bound {_gb(step['hbm_bytes_upper_bound_per_chip'])})",
            f"  collectives per chip {_gb(step['collective_bytes_per_chip'])}: "
            + ", ".join(f"{k} x{v['count']} {_gb(v['bytes'])}" for k, v in step["collectives"].items()),
            f"  roofline: compute {step['compute_s']:.4f} s, HBM {step['hbm_s']:.4f} s, "
            f"collectives {step['collective_s']:.4f} s -> step >= {step['bound_step_s']:.4f} s "
            f"(HBM upper bound {step['hbm_upper_s']:.4f} s) "
            f"({step['bound_by']}-bound), mfu_upper_bound {step['mfu_upper_bound']:.1%} (all "
            "three perfectly overlapped)",
            f"  estimate: compute + HBM + exposed collectives {step['exposed_collective_s']:.4f} s "
            f"(activation exchanges, and weight/gradient collectives beyond the compute time) = "
            f"{step['estimated_step_s']:.4f} s, MFU {step['estimated_mfu']:.1%}",
        ]
        if step.get("pallas_kernels"):
            lines.append("  Pallas kernels (Mosaic): " + ", ".join(
                f"{k} x{v}" for k, v in sorted(step["pallas_kernels"].items())))
        if "weight_all_gathers" in step:
            lines.append(f"  whole-weight all-gathers per step: {len(step['weight_all_gathers'])}")
        if "tokens_per_s_estimate" in step:
            lines.append(f"  decode: {step['tokens_per_s_estimate']:,.0f} tokens/s")
        if fit := step.get("kv_fit"):
            lines.append(
                f"  sequences that fit at {fit['max_len']} tokens max, {fit['mean_len']} mean "
                f"(weights {_gb(fit['weight_bytes_per_chip'])} a chip): slot caches "
                f"{fit['slot_sequences']:,}, paged (pages of {fit['page_size']}) "
                f"{fit['paged_sequences']:,} ({fit['paged_over_slot']:.1f}x)")
        for buf in step.get("largest_buffers", []):
            lines.append(f"    {_gb(buf['bytes'])}  {buf['shape']}  {buf['op_name']}")
    if "transfer" in result:
        t = result["transfer"]
        lines.append(f"\ntransfer: {_gb(t['bytes'])} of weights, ~{t['estimated_s']:.3f} s")
    if "weight_sync" in result:
        lines += ["", *network.summary_lines(result["weight_sync"])]
    lines.append(f"compile seconds: {result['compile_seconds']}")
    return "\n".join(lines)


EXAMPLES = """examples:
  python -m hcjax.plan                                            # the tiny model, in seconds
  python -m hcjax.plan --gin_file scale/flagship_v5p.gin          # v5p:8x8x16 learner, v5p:4x4x8 rollout
  python -m hcjax.plan --gin_file scale/qwen3_30b_a3b_v5p.gin --output_dir runs/plan_qwen3
"""


def _extra_flags(parser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    parser.add_argument("--topology", default=None, help="learner TPU topology, e.g. v5p:8x8x16")
    parser.add_argument("--inference_topology", default=None, help="e.g. v5p:4x4x8")
    for name in ("global_batch_tokens", "seq_len", "decode_batch", "kv_len", "num_slices",
                 "inference_num_slices"):
        parser.add_argument(f"--{name}", type=int, default=None)


def main(argv: Sequence[str] | None = None) -> dict:
    flags = hcfg.parse_flags(argv, description=__doc__.split("\n")[0],
                             default_gin_files=["tiny_cpu.gin"], extra_args=_extra_flags)
    hcfg.bind(flags.gin_files, flags.gin_params)
    overrides = {k: getattr(flags.extra, k) for k in
                 ("topology", "inference_topology", "global_batch_tokens", "seq_len",
                  "decode_batch", "kv_len", "num_slices", "inference_num_slices")
                 if getattr(flags.extra, k) is not None}
    pc = dataclasses.replace(PlanConfig(), **overrides)
    if flags.output_dir:
        hcfg.write_config(flags.output_dir, flags)
    result = plan(pc, phases=Phases("hcjax.plan"))
    table = summary_table(result)
    print(table)
    if flags.output_dir:
        out = Path(flags.output_dir)
        hcfg.write_operative_config(out)
        (out / "summary.txt").write_text(table + "\n")
        (out / "plan.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)

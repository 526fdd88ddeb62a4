"""`python -m hcjax.bench.climb`: the same tiny climb in on-policy (synchronous) and asynchronous
modes, side by side from one base: wall time to a fixed held-out pass@1 gain, rollout and learner
utilisation, final pass@1. Prints one JSON object last; never asserts timings."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Sequence

from hcjax import config
from hcjax.display import Phases


def _mode_figures(summary: dict) -> dict:
    reached = summary.get("reached_gain_at_wall")
    return {
        "time_to_target_s": reached,
        "reached_target": reached is not None,
        "final_pass_at_1": summary["final_pass_at_1"],
        "base_pass_at_1": summary["base_pass_at_1"],
        "steps": summary["steps"],
        "climb_wall_seconds": summary["climb_wall_seconds"],
        "learner_utilisation": summary["learner_utilisation"],
        "rollout_utilisation": summary["rollout_utilisation"],
        "rollouts": summary["rollouts"],
        "rollouts_per_s": summary["rollouts"] / max(summary["climb_wall_seconds"], 1e-9),
        "stale_rollouts_dropped": summary["stale_rollouts_dropped"],
    }


EXAMPLES = """examples:
  python -m hcjax.bench.climb                          # on-policy vs async from a fresh base
  python -m hcjax.bench.climb --base_checkpoint runs/sft --target_gain 0.15
  python -m hcjax.bench.climb --modes async | tail -1 | python -m json.tool

The last line on stdout is one JSON object; progress goes to stderr.
"""


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES)
    config.add_gin_flags(parser, ["climb_tiny.gin"])
    parser.add_argument("--base_checkpoint", default=None)
    parser.add_argument("--target_gain", type=float, default=0.1,
                        help="held-out pass@1 gain over the base that counts as reached")
    parser.add_argument("--modes", default="on_policy,async")
    args = parser.parse_args(argv)
    # After the flags, so --help stays fast; it registers what the climb reads before gin binds.
    from hcjax.rl.climber import run_climb
    from hcjax.train.sft import pretrain_base

    gin_files = args.gin_file or ["climb_tiny.gin"]
    config.bind(gin_files, args.gin_param)
    out = args.output_dir or tempfile.mkdtemp(prefix="bench_climb_")
    phases = Phases("hcjax.bench.climb")
    base = args.base_checkpoint
    if base is None:
        with phases.phase("pre-training the base"):
            base = pretrain_base(out)
    results = {}
    modes = args.modes.split(",")
    with phases.phase("climbing", total=len(modes)) as phase:
        for mode in modes:
            phase.now(mode)
            config.bind(gin_files, args.gin_param)
            summary = run_climb(os.path.join(out, mode), base_checkpoint=base, mode=mode,
                                progress=False, stop_at_gain=args.target_gain).summary
            results[mode] = _mode_figures(summary)
            print(json.dumps({"mode": mode, **results[mode]}), flush=True)
            phase.advance()
    report = {"bench": "climb", "target_gain": args.target_gain, "output_dir": out, **results}
    sync, asyn = results.get("on_policy"), results.get("async")
    if sync and asyn:
        ts, ta = sync["time_to_target_s"], asyn["time_to_target_s"]
        report["async_speedup_to_target"] = (ts / ta) if ts and ta else None
        report["async_rollout_throughput_ratio"] = asyn["rollouts_per_s"] / max(
            sync["rollouts_per_s"], 1e-9)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main, cpu_devices=2)

"""`python -m hcjax.dpo`: DPO after the climb (Kimi k1.5 long2short, RECIPE §5). Flags → gin →
preference pairs from climbs' rollout stores (`--climb`) and rejection samples (`--samples`) →
`hcjax.distill.dpo.run_dpo` from `--init_checkpoint` → its summary as one JSON line. OUT is a run
folder in the hcjax.sft layout (a `--base_checkpoint` of the climb).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from hcjax import config

__all__ = ["main"]

EXAMPLES = """examples:
  python -m hcjax.dpo --climb runs/climb --init_checkpoint runs/climb --output_dir runs/dpo
  python -m hcjax.dpo --gin_file long2short_dpo_tiny.gin --samples runs/l2s_rejection/samples.jsonl \\
      --init_checkpoint runs/long --output_dir runs/l2s_dpo
"""


def _extra_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--climb", action="append", default=[],
                        help="a climb's output folder (its rollouts/ store); repeatable")
    parser.add_argument("--samples", action="append", default=[],
                        help="a samples.jsonl of hcjax.rejection; repeatable")
    parser.add_argument("--init_checkpoint", default=None,
                        help="the starting params and the frozen reference (any hcjax run; "
                        "default: the optimiser's TrainerConfig.init_checkpoint)")
    parser.add_argument("--quiet", action="store_true")
    config.set_examples(parser, EXAMPLES)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """`python -m hcjax.dpo (--climb DIR | --samples FILE) [...] --init_checkpoint RUN
    --output_dir OUT [--gin_file F] [--gin_param B]`: pairs from each climb's rollout store and
    each rejection-sampling samples.jsonl; returns the run's summary."""
    flags = config.parse_flags(argv, description=__doc__.splitlines()[0],
                               extra_args=_extra_args)
    # After the flags, so --help stays fast; it registers DPOConfig, run_dpo, the loop's
    # TrainerConfig and AdamWConfig, and ModelConfig.
    from hcjax.distill.dpo import DPOConfig, pairs_from_samples, pairs_from_store, run_dpo

    config.bind(flags.gin_files, flags.gin_params)
    if not flags.output_dir:
        raise config.ConfigError("--output_dir is required")
    config.write_config(flags.output_dir, flags)
    args = flags.extra
    if not (args.climb or args.samples):
        raise config.ConfigError("give at least one --climb or --samples")
    cfg = DPOConfig()
    pairs = [p for i, d in enumerate(args.climb) for p in pairs_from_store(d, cfg, seed=i)]
    pairs += [p for i, f in enumerate(args.samples)
              for p in pairs_from_samples(f, cfg, seed=len(args.climb) + i)]
    summary = run_dpo(flags.output_dir, pairs, args.init_checkpoint, cfg,
                      progress=not args.quiet)
    config.write_operative_config(flags.output_dir)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("first",)}))
    return summary


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)

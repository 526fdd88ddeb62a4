"""`python -m hcjax.merge`: merge the latest params of hcjax runs of one architecture into a new
run folder (hcjax.distill.merge): their weighted average, or task vectors against `--base`. Flags
→ gin → `merge_checkpoints` → its summary as one JSON line; OUT/checkpoints is a
`--base_checkpoint` of the climb and an `TrainerConfig.init_checkpoint`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from hcjax import config
from hcjax.display import Phases

__all__ = ["main"]

EXAMPLES = """examples:
  python -m hcjax.merge --checkpoint runs/long --checkpoint runs/short --output_dir runs/merged
  python -m hcjax.merge --checkpoint runs/a --checkpoint runs/b --weights 0.7,0.3 --output_dir OUT
  python -m hcjax.merge --base runs/sft --checkpoint runs/add --checkpoint runs/sub \\
      --weights 1,1 --output_dir runs/task_vectors   # base + Σ λ_i (θ_i − base)
"""


def _extra_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", action="append", required=True,
                        help="an hcjax run (sft, climb, merge, convert, dpo) or its checkpoints/ "
                        "folder (repeatable; its latest step)")
    parser.add_argument("--weights", default=None,
                        help="comma-separated weights, one per --checkpoint (default equal); "
                        "with --base, the task-vector coefficients λ_i")
    parser.add_argument("--base", default=None,
                        help="the common base: merge by task vectors base + Σ λ_i (θ_i − base)")
    config.set_examples(parser, EXAMPLES)


def _parse_weights(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"--weights={text!r} is not a comma-separated list of numbers") from e


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """`python -m hcjax.merge --checkpoint A --checkpoint B [--weights 0.5,0.5] [--base BASE]
    --output_dir OUT [--gin_file F] [--gin_param B]`; returns the merge's summary."""
    flags = config.parse_flags(argv, description=__doc__.splitlines()[0],
                               extra_args=_extra_args)
    # After the flags, so --help stays fast; it registers what a merge reads from gin
    # (CheckpointConfig, and ModelConfig's kernel choices).
    from hcjax.distill.merge import merge_checkpoints

    config.bind(flags.gin_files, flags.gin_params)
    if not flags.output_dir:
        raise config.ConfigError("--output_dir is required")
    args = flags.extra
    weights = _parse_weights(args.weights)
    config.write_config(flags.output_dir, flags)
    summary = merge_checkpoints(args.checkpoint, flags.output_dir, weights=weights,
                                base=args.base, phases=Phases("hcjax.merge"))
    config.write_operative_config(flags.output_dir)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)

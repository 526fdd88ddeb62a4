"""`python -m hcjax.consolidate`: several specialist climbs into one model (RECIPE §3,
"consolidation"): one SFT of a base on the successful late rollouts of every climb, mixed by
per-climb weights, then one RL climb over the union of their task suites, and a report of
held-out pass@1 of the base, each specialist and the consolidated model on every suite.

The union suite is gin's `TaskConfig.suite`: a MixtureSuite whose i-th component is the suite of
the i-th `--climb` (a climb's own gin is not re-read: gin state is global, and the specialists'
suites usually share a name that a mixture must tell apart). Flags → gin → mix → SFT → climb →
report (hcjax.distill.consolidation: the SFT is `SFTTrainer`, the climb `hcjax.rl.climber.Climb`,
the evaluation `hcjax.rl.pass_at_1.ModelEvaluator`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from hcjax import config
from hcjax.display import Phases

__all__ = ["main"]

EXAMPLES = """examples:
  python -m hcjax.consolidate --climb runs/spec_add --climb runs/spec_sub \\
      --base_checkpoint runs/base --output_dir runs/consolidated
  python -m hcjax.consolidate --climb A --climb B --gin_param 'ConsolidateConfig.weights = [2.0, 1.0]'
"""


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    def extra(parser):
        parser.add_argument("--climb", action="append", required=True,
                            help="a specialist climb's output folder (repeatable, in the order "
                            "of TaskConfig.suite's component suites)")
        parser.add_argument("--base_checkpoint", default=None,
                            help="the SFT's starting checkpoint (any hcjax run); default: the "
                            "first climb's OUT/base")
        parser.add_argument("--quiet", action="store_true",
                            help="no phase line, no climb panel, no report on stdout")
        config.set_examples(parser, EXAMPLES)

    flags = config.parse_flags(argv, description=__doc__.splitlines()[0],
                               default_gin_files=["consolidate_tiny.gin"], extra_args=extra)
    # After the flags, so --help stays fast: what the consolidation runs (the SFT trainer, the
    # climb, the evaluation), so that every configurable it reads is registered when gin binds.
    from hcjax.distill.consolidation import run_consolidate

    config.bind(flags.gin_files, flags.gin_params)
    output_dir = flags.output_dir or os.path.join("runs", "consolidate")
    config.write_config(output_dir, flags)
    report = run_consolidate(output_dir, flags.extra.climb, flags.extra.base_checkpoint,
                             progress=not flags.extra.quiet,
                             phases=Phases("hcjax.consolidate",
                                           mode="off" if flags.extra.quiet else "auto"))
    config.write_operative_config(output_dir)
    return report


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main, cpu_devices=2)

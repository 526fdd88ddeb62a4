"""`python -m hcjax.long2short`: compare a long-response model with its shortened versions (Kimi
k1.5 long2short, RECIPE §5) on the held-out split of `TaskConfig.suite`: greedy pass@1, mean
response length, and whether each cuts the length by `--min_cut` at pass@1 within `--max_drop`
of the first (reference) model. The methods themselves are their own steps: merging
(hcjax.merge), shortest rejection sampling (hcjax.rejection, then hcjax.sft), DPO (hcjax.dpo)
and RL with the length reward (hcjax.climb --gin_file long2short_tiny.gin).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from hcjax import config
from hcjax.display import Phases

__all__ = ["main"]


EXAMPLES = """examples:
  python -m hcjax.long2short --checkpoint long=runs/long --checkpoint merge=runs/l2s_merge
  python -m hcjax.long2short --gin_file long2short_base_tiny.gin --checkpoint long=runs/long \\
      --checkpoint rl=runs/l2s_rl --checkpoint dpo=runs/l2s_dpo --output_dir runs/l2s_compare
"""


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """`python -m hcjax.long2short --checkpoint long=runs/long --checkpoint merge=runs/l2s_merge
    ... [--gin_file F] [--output_dir OUT]`; the first checkpoint is the reference."""
    def extra(parser):
        parser.add_argument("--checkpoint", action="append", required=True,
                            help="NAME=DIR of any hcjax run (repeatable; the first is the "
                            "long reference)")
        parser.add_argument("--eval_problems", type=int, default=200)
        parser.add_argument("--max_new_tokens", type=int, default=None,
                            help="default: the reference's budget, SamplingOptions.max_tokens")
        parser.add_argument("--min_cut", type=float, default=0.25)
        parser.add_argument("--max_drop", type=float, default=0.02)
        config.set_examples(parser, EXAMPLES)

    flags = config.parse_flags(argv, description=__doc__.splitlines()[0],
                               default_gin_files=["climb_tiny.gin"], extra_args=extra)
    # After the flags, so --help stays fast; they register TaskConfig, the task suites,
    # SamplingOptions (the token budget) and ModelConfig before gin binds.
    from hcjax.distill.shortening import compare, evaluate_runs
    from hcjax.rollout.request import sampling_options_from_gin
    from hcjax.tasks.task_config import TaskConfig

    config.bind(flags.gin_files, flags.gin_params)
    a = flags.extra
    suite = TaskConfig().make_suite()
    problems = list(suite.heldout())[: a.eval_problems]
    results = evaluate_runs(a.checkpoint, suite, problems,
                            max_tokens=a.max_new_tokens or sampling_options_from_gin().max_tokens,
                            phases=Phases("hcjax.long2short"))
    table = compare(results, min_cut=a.min_cut, max_drop=a.max_drop)
    for name, r in table.items():
        print(json.dumps({"model": name, **{k: round(v, 4) if isinstance(v, float) else v
                                            for k, v in r.items()}}))
    if flags.output_dir:
        os.makedirs(flags.output_dir, exist_ok=True)
        with open(os.path.join(flags.output_dir, "long2short.json"), "w", encoding="utf-8") as f:
            json.dump(table, f, indent=1)
    return table


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)

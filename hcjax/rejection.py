"""`python -m hcjax.rejection`: shortest rejection sampling (Kimi k1.5 long2short, RECIPE §5).
Flags → gin → `hcjax.distill.rejection.run_rejection` on `TaskConfig.suite`'s training problems
with the params of `--checkpoint` → its summary as one JSON line. OUT/rejection.jsonl is an SFT
set (DataConfig.source = "chat_jsonl"); OUT/samples.jsonl feeds `python -m hcjax.dpo --samples`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from hcjax import config

__all__ = ["main"]

EXAMPLES = """examples:
  python -m hcjax.rejection --checkpoint runs/long --k 8 --output_dir runs/l2s_samples
  python -m hcjax.rejection --gin_file long2short_base_tiny.gin --checkpoint runs/long \\
      --num_problems 512 --output_dir runs/l2s_samples
then SFT on OUT/rejection.jsonl (hcjax.sft --gin_file long2short_rejection_tiny.gin ...).
"""


def _extra_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="any hcjax run to sample from")
    parser.add_argument("--k", type=int, default=8, help="samples per problem (Kimi: 8)")
    parser.add_argument("--num_problems", type=int, default=256)
    parser.add_argument("--first_problem", type=int, default=0,
                        help="index of the first training problem sampled")
    parser.add_argument("--max_new_tokens", type=int, default=None,
                        help="default: SamplingOptions.max_tokens (the climb's budget)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    config.set_examples(parser, EXAMPLES)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """`python -m hcjax.rejection --checkpoint RUN --output_dir OUT [--k 8] [--num_problems N]
    [--gin_file F]`: the suite is TaskConfig.suite of the gin files; returns the summary."""
    flags = config.parse_flags(argv, description=__doc__.splitlines()[0],
                               default_gin_files=["climb_tiny.gin"], extra_args=_extra_args)
    # After the flags, so --help stays fast; they register TaskConfig, the task suites,
    # SamplingOptions (the token budget) and ModelConfig.
    from hcjax.distill.rejection import run_rejection
    from hcjax.rollout.request import sampling_options_from_gin
    from hcjax.tasks.task_config import TaskConfig

    config.bind(flags.gin_files, flags.gin_params)
    if not flags.output_dir:
        raise config.ConfigError("--output_dir is required")
    a = flags.extra
    summary = run_rejection(a.checkpoint, flags.output_dir, TaskConfig().make_suite(), k=a.k,
                            num_problems=a.num_problems, first_problem=a.first_problem,
                            max_new_tokens=a.max_new_tokens or sampling_options_from_gin().max_tokens,
                            temperature=a.temperature, seed=a.seed)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)

"""`python -m hcjax.sft`: SFT / pre-training / self-distillation of a language model. Flags → gin →
`hcjax.train.sft.run_sft` (the trainer) → the run's summary. A run resumes from its latest
checkpoint in OUTPUT_DIR; this module holds no training code.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from hcjax import config
from hcjax.display import resolve_format

__all__ = ["main"]

EXAMPLES = """examples:
  python -m hcjax.sft                                   # pre-train the tiny base into runs/sft
  python -m hcjax.sft --gin_file sft_self_distill.gin --output_dir runs/distill
  python -m hcjax.sft --hf_checkpoint DIR --output_dir runs/sft_hf   # fine-tune a HF folder

A run resumes from its latest checkpoint in OUTPUT_DIR; on a terminal a bar shows the step, loss,
tokens/s and the ETA; off a terminal (or with --log_format json) each logged step is one JSON line.
"""


def _extra_args(parser: argparse.ArgumentParser) -> None:
    config.add_hf_checkpoint_flag(parser)
    parser.add_argument("--log_format", choices=("auto", "json", "display"), default="auto",
                        help="display: the step bar; json: one JSON line per logged step on "
                             "stdout; auto: the bar on a terminal, JSON lines otherwise")
    config.set_examples(parser, EXAMPLES)


def main(argv: Sequence[str] | None = None):
    """`python -m hcjax.sft --gin_file tiny_cpu --output_dir DIR [--gin_param ...]`; returns the
    trainer's TrainResult."""
    flags = config.parse_flags(
        argv, description="hcjax SFT / pre-training", default_gin_files=["tiny_cpu.gin"],
        extra_args=_extra_args,
    )
    # After the flags, so --help stays fast; the trainer's modules import every configurable it
    # reads (TrainerConfig, AdamWConfig, run_sft, DataConfig and the task suites, ModelConfig,
    # CheckpointConfig), and TaskConfig names the suite its evaluation runs.
    from hcjax.rl.pass_at_1 import evaluate_model
    from hcjax.tasks.task_config import TaskConfig
    from hcjax.train.sft import run_sft

    config.bind(flags.gin_files, flags.gin_params)
    output_dir = flags.output_dir or os.path.join("runs", "sft")
    config.write_config(output_dir, flags)
    log_format = resolve_format(flags.extra.log_format)
    result = run_sft(output_dir, hf_checkpoint=flags.extra.hf_checkpoint,
                     progress=log_format == "display", json_lines=log_format == "json",
                     evaluate=evaluate_model, eval_suite=TaskConfig().make_suite())
    config.write_operative_config(output_dir)
    with open(os.path.join(output_dir, "summary.txt"), encoding="utf-8") as f:
        print(f.read())
    return result


if __name__ == "__main__":
    from hcjax.config import run_main

    # A process that only trains: freed heap pages stay with it (hcjax/host_memory.py).
    run_main(main, keep_freed_memory=True)

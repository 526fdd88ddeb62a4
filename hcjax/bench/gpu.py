"""`python -m hcjax.bench.gpu`: the one prepared script for a machine with a GPU. Pallas kernels
against their XLA references (and cuDNN attention), the MoE dispatch forms, learner MFU on a small
MoE and decode tokens/s, each with TFLOP/s and the fraction of the device's peak.

It reuses the figures of bench.kernels, bench.moe, bench.learner and bench.rollout (imported, not
copied) and only adds the peak table and the sizes. A section that raises records its error and the
others still run. Without a GPU, or with --reduced, every section runs tiny sizes on CPU (Pallas in
interpret mode): that checks the script, not the speed. Prints one JSON object as its last line;
asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels as pk
from hcjax import config as hcfg
from hcjax.bench import kernels as kbench
from hcjax.bench import learner as lbench
from hcjax.bench import moe as mbench
from hcjax.bench import rollout as rbench
from hcjax.display import Phases
from hcjax.model import ModelConfig, Transformer, add_weight_noise
from hcjax.rollout import Engine

# Dense (no sparsity) peak TFLOP/s by a substring of `device_kind`, first match wins. Vendor
# datasheet figures: H100/H200 SXM 989 bf16 / 494 tf32, H100 PCIe 756 / 378, A100 312 / 156,
# B200 2250 / 1100, L4 121 / 60, TPU v4 275, v5e 197, v5p 459, v6e 918 (bf16; no tf32 on TPU).
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bfloat16": 756.0, "tfloat32": 378.0}),
    ("H200", {"bfloat16": 989.0, "tfloat32": 494.0}),
    ("H100", {"bfloat16": 989.0, "tfloat32": 494.0}),
    ("B200", {"bfloat16": 2250.0, "tfloat32": 1100.0}),
    ("A100", {"bfloat16": 312.0, "tfloat32": 156.0}),
    ("L4", {"bfloat16": 121.0, "tfloat32": 60.0}),
    ("TPU v4", {"bfloat16": 275.0}),
    ("TPU v5 lite", {"bfloat16": 197.0}),
    ("TPU v5e", {"bfloat16": 197.0}),
    ("TPU v5p", {"bfloat16": 459.0}),
    ("TPU v5", {"bfloat16": 459.0}),
    ("TPU v6 lite", {"bfloat16": 918.0}),
    ("TPU v6e", {"bfloat16": 918.0}),
)


def peak_tflops(device_kind: str, dtype: str = "bfloat16") -> float | None:
    """The dense peak of `device_kind` for `dtype` ("bfloat16" or "tfloat32"); None if unknown."""
    for key, peaks in PEAK_TFLOPS:
        if key.lower() in device_kind.lower():
            return peaks.get(dtype)
    return None


def _fraction(tflops: float, peak: float | None) -> float | None:
    return None if peak is None else round(tflops / peak, 4)


def bench_tgmm(m, k, n, groups, impls, repeats) -> list[dict]:
    """gmm's weight gradient out[g] = lhs_g^T @ grad_g, timed like bench.kernels.bench_gmm."""
    keys = jax.random.split(jax.random.PRNGKey(3), 2)
    lhs = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    grad = jax.random.normal(keys[1], (m, n), jnp.bfloat16)
    sizes = np.full(groups, m // groups, np.int32)
    sizes[0] += m - sizes.sum()
    group_sizes = jnp.asarray(sizes)
    timings = {
        impl: kbench._time(
            jax.jit(lambda a, b, impl=impl: pk.tgmm(a, b, group_sizes, impl=impl)),
            lhs, grad, repeats=repeats)
        for impl in impls
    }
    return [kbench._entry("tgmm", dict(M=m, K=k, N=n, G=groups, dtype="bfloat16"),
                          2 * m * k * n, timings)]


def cudnn_attention_timings(b, t, hq, hkv, d, window, repeats) -> dict[str, float]:
    """cuDNN's fused attention (`jax.nn.dot_product_attention`), same inputs and window as
    bench.kernels.bench_attention: {"fwd": s, "fwd_bwd": s}."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (b, t, hq, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, hkv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, hkv, d), jnp.bfloat16)
    # Our window W sees keys i-W+1..i: W-1 to the left, none to the right.
    local = None if window is None else (window - 1, 0)

    def attn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local,
                                            implementation="cudnn")

    def loss(q, k, v):
        return attn(q, k, v).astype(jnp.float32).sum()

    return {
        "fwd": kbench._time(jax.jit(attn), q, k, v, repeats=repeats),
        "fwd_bwd": kbench._time(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v,
                                repeats=repeats),
    }


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every shape the script runs: FULL for a GPU (minutes in all), REDUCED for CPU (seconds)."""

    repeats: int
    ceiling_matmul_n: int
    ceiling_copy_mib: int
    # (label, fn(*shape, impls, repeats) -> kernels entries, shape)
    kernel_cases: tuple
    moe: dict  # bench.moe.bench_case shape: tokens, latent, hidden
    moe_grid: tuple  # (experts, k) pairs
    learner_model: ModelConfig
    learner_rollouts: tuple  # (count, prompt_len, response_len)
    learner_seq_len: int
    learner_steps: int
    decode_model: ModelConfig
    decode: dict  # requests, slots, max_prompt, max_response


# A small MoE with a real vocabulary, computing in bf16 as RECIPE §2 says.
GPU_MOE = ModelConfig(
    vocab_size=32768, d_model=1024, num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64,
    window=512, d_ff=4096, num_experts=16, experts_per_token=2, moe_latent_dim=512,
    moe_d_ff=1024, max_seq_len=2048, dtype="bfloat16", moe_impl="auto", attention_impl="auto",
)
CPU_MOE = dataclasses.replace(lbench.TINY, num_layers=2, max_seq_len=128)

FULL = Sizes(
    repeats=10,
    ceiling_matmul_n=8192,
    ceiling_copy_mib=4096,
    kernel_cases=(
        ("attention T=8192 window 512", kbench.bench_attention, (1, 8192, 32, 8, 128, 512)),
        ("attention T=8192 global", kbench.bench_attention, (1, 8192, 32, 8, 128, None)),
        ("gmm M=16384 G=64", kbench.bench_gmm, (16384, 2048, 1024, 64)),
        ("tgmm M=16384 G=64", bench_tgmm, (16384, 2048, 1024, 64)),
        ("decode S=8192 global", kbench.bench_decode, (64, 8192, 32, 8, 128, None)),
    ),
    moe=dict(num_tokens=4096, latent=256, hidden=512),
    moe_grid=((8, 2), (64, 2), (64, 8)),
    learner_model=GPU_MOE,
    learner_rollouts=(32, 128, 896),
    learner_seq_len=1024,
    learner_steps=5,
    decode_model=GPU_MOE,
    decode=dict(requests=128, slots=64, max_prompt=128, max_response=256),
)
REDUCED = Sizes(
    repeats=2,
    ceiling_matmul_n=256,
    ceiling_copy_mib=4,
    kernel_cases=(
        ("attention T=128 window 32", kbench.bench_attention, (1, 128, 2, 1, 32, 32)),
        ("gmm M=256 G=4", kbench.bench_gmm, (256, 64, 128, 4)),
        ("tgmm M=256 G=4", bench_tgmm, (256, 64, 128, 4)),
        ("decode S=128 global", kbench.bench_decode, (2, 128, 2, 1, 32, None)),
    ),
    moe=dict(num_tokens=128, latent=32, hidden=64),
    moe_grid=((8, 2),),
    learner_model=CPU_MOE,
    learner_rollouts=(4, 8, 24),
    learner_seq_len=64,
    learner_steps=2,
    decode_model=CPU_MOE,
    decode=dict(requests=4, slots=2, max_prompt=8, max_response=8),
)


def _add_tflops(entry: dict, peak: float | None) -> dict:
    """TFLOP/s and fraction of the bf16 peak beside every `<impl>_gflops` of a kernels entry."""
    for key in [k for k in entry if k.endswith("_gflops")]:
        impl = key[: -len("_gflops")]
        tflops = entry[key] / 1e3
        entry[f"{impl}_tflops"] = round(tflops, 4)
        entry[f"{impl}_fraction_of_peak"] = _fraction(tflops, peak)
    return entry


def section_ceilings(sizes: Sizes, peak: float | None, phase) -> dict:
    """What this device measurably reaches: a square bf16 matmul (fp32 accumulation) and a
    device-to-device copy, the ceilings the other sections' figures are read against."""
    n, copy_mib = sizes.ceiling_matmul_n, sizes.ceiling_copy_mib
    phase.now(f"ceilings: bf16 matmul {n}^3")
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    matmul_s = kbench._time(
        jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32)), a, b,
        repeats=sizes.repeats)
    phase.now(f"ceilings: copy of {copy_mib} MiB")
    x = jnp.zeros((copy_mib * 2**20 // 4,), jnp.float32)
    copy_s = kbench._time(jax.jit(lambda x: x + 1.0), x, repeats=sizes.repeats)
    matmul_tflops = 2 * n**3 / matmul_s / 1e12
    return {
        "matmul_bf16_n": n,
        "matmul_bf16_tflops": round(matmul_tflops, 2),
        "matmul_bf16_fraction_of_peak": _fraction(matmul_tflops, peak),
        "copy_mib": copy_mib,
        # x + 1 reads and writes every byte once.
        "copy_gb_per_s": round(2 * x.nbytes / copy_s / 1e9, 1),
    }


def section_kernels(sizes: Sizes, accelerated: bool, peak: float | None, phase) -> dict:
    # On CPU the Pallas kernels run in interpret mode (impl="pallas" interprets there).
    impls = ["reference", "pallas"]
    results = []
    for label, bench, shape in sizes.kernel_cases:
        phase.now(f"kernels: {label}")
        try:
            entries = bench(*shape, impls, sizes.repeats)
            if bench is kbench.bench_attention and jax.default_backend() == "gpu":
                b, t, hq, hkv, d, window = shape
                try:
                    cudnn = cudnn_attention_timings(b, t, hq, hkv, d, window, sizes.repeats)
                    for entry, mode in zip(entries, ("fwd", "fwd_bwd")):
                        flops = entry["gflop"] * 1e9
                        entry["cudnn_ms"] = round(cudnn[mode] * 1e3, 3)
                        entry["cudnn_gflops"] = round(flops / cudnn[mode] / 1e9, 1)
                        entry["pallas_vs_cudnn_time_ratio"] = round(
                            entry["pallas_ms"] / entry["cudnn_ms"], 2)
                except Exception as e:  # cuDNN may not support a shape: keep the rest
                    for entry in entries:
                        entry["cudnn_error"] = f"{type(e).__name__}: {e}"[:500]
            results += [_add_tflops(e, peak) for e in entries]
        except Exception as e:
            results.append({"kernel": label, "error": f"{type(e).__name__}: {e}"[:500]})
    return {
        "pallas_mode": "compiled" if accelerated else "interpret (CPU; its speed means nothing)",
        "flop_counting": kbench.FLOP_NOTE,
        "peak_dtype": "bfloat16",
        "results": results,
    }


def section_moe(sizes: Sizes, peak_tf32: float | None, phase) -> dict:
    roofline = mbench.matmul_roofline(n=256 if sizes is REDUCED else 4096)
    cases = []
    for experts, k in sizes.moe_grid:
        phase.now(f"moe: E={experts} k={k}")
        # Few repeats: the dense form computes every expert for every token (E/k times the work).
        case = mbench.bench_case(experts=experts, k=k, repeats=min(3, sizes.repeats),
                                 **sizes.moe)
        for form in ("ragged_dot", "blocked", "dense"):
            tflops = case[f"{form}_useful_gflops"] / 1e3
            case[f"{form}_useful_tflops"] = round(tflops, 4)
            case[f"{form}_fraction_of_peak"] = _fraction(tflops, peak_tf32)
            case[f"{form}_fraction_of_roofline"] = round(
                case[f"{form}_useful_gflops"] / roofline, 4)
        cases.append(case)
    return {
        "dtype": "float32 inputs (fp32 matmuls run as tf32 on GPU by default)",
        "peak_dtype": "tfloat32",
        "matmul_roofline_gflops": round(roofline, 1),
        "shape": sizes.moe,
        "cases": cases,
    }


def section_learner(sizes: Sizes, peak: float | None, phase) -> dict:
    cfg = sizes.learner_model
    rollouts = lbench.synthetic_rollouts(cfg, *sizes.learner_rollouts)
    runs = {}
    for variant in ("replay", "no_replay"):
        phase.now(f"learner: compiling {variant}")
        run, facts = lbench.prepare(cfg, rollouts, sizes.learner_seq_len, variant == "replay")
        phase.now(f"learner: timing {variant}")
        step_s = float(np.median([run() for _ in range(sizes.learner_steps)]))
        model_tflops = facts["model_flops_per_step"] / step_s / 1e12
        runs[variant] = dict(
            facts, step_s=round(step_s, 4),
            tokens_per_s=round(facts["tokens_per_step"] / step_s, 1),
            model_tflops=round(model_tflops, 4),
            xla_tflops=round(facts["xla_flops_per_step"] / step_s / 1e12, 4),
            mfu=_fraction(model_tflops, peak),
        )
    return {
        "model": _model_summary(cfg),
        "peak_dtype": "bfloat16",
        "mfu_counting": "bench.learner.model_flops (useful train-step FLOPs) / step time / peak",
        **runs,
    }


def section_decode(sizes: Sizes, phase) -> dict:
    cfg = sizes.decode_model
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    model = nnx.merge(graphdef, add_weight_noise(state, 1))
    d = sizes.decode
    engine = Engine(model, max_concurrent_decodes=d["slots"], max_prefill_length=d["max_prompt"],
                    max_target_length=cfg.max_seq_len)
    jobs = rbench.workload(np.random.default_rng(0), d["requests"], d["max_prompt"],
                           d["max_response"])
    phase.now("decode: compiling (one untimed pass)")
    rbench.run_continuous(engine, jobs, seed=1)
    phase.now("decode: timing")
    tokens, seconds = rbench.run_continuous(engine, jobs)
    return {
        "model": _model_summary(cfg),
        **d,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "note": "continuous batching through RolloutServer (bench.rollout.run_continuous), "
                "top-p 0.97; prefill included",
    }


def _model_summary(cfg: ModelConfig) -> dict:
    return {f: getattr(cfg, f) for f in ("vocab_size", "d_model", "num_layers", "num_experts",
                                         "experts_per_token", "dtype", "moe_impl",
                                         "attention_impl")}


def run_sections(sections: dict[str, Callable[[], dict]], phases: Phases,
                 after_each: Callable[[dict], None] | None = None) -> dict:
    """Runs each section in order; one that raises is recorded as {"error", "traceback"} and the
    next one runs. Every section's dict gets its wall time as "section_s". `after_each(results so
    far)` runs after every section (bench.gpu keeps a partial JSON file with it)."""
    out = {}
    with phases.phase("running sections", total=len(sections)) as phase:
        for name, fn in sections.items():
            phase.now(name)
            start = time.perf_counter()
            try:
                out[name] = fn(phase)
            except Exception as e:
                out[name] = {"error": f"{type(e).__name__}: {e}"[:2000],
                             "traceback": traceback.format_exc()[-4000:]}
            out[name]["section_s"] = round(time.perf_counter() - start, 2)
            if after_each is not None:
                after_each(out)
            phase.advance()
    return out


EXAMPLES = """examples:
  python -m hcjax.bench.gpu                            # on a GPU: every section, full sizes
  python -m hcjax.bench.gpu --reduced                  # tiny sizes on CPU, well under a minute
  python -m hcjax.bench.gpu --sections kernels,moe | tail -1
  python -m hcjax.bench.gpu --json_out gpu.json        # gpu.json holds each finished section

The last line on stdout is one JSON object; progress goes to stderr.
"""

SECTIONS = ("ceilings", "kernels", "moe", "learner", "decode")


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    hcfg.set_examples(parser, EXAMPLES)
    parser.add_argument("--reduced", action="store_true",
                        help="tiny sizes on CPU (also chosen when there is no GPU)")
    parser.add_argument("--json_out", default=None,
                        help="also write the JSON here, rewritten after every section (a run cut "
                             "short keeps the sections it finished)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    args = parser.parse_args(argv)
    chosen = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: {unknown} not in {SECTIONS}")
    if args.reduced:
        # Tiny sizes check the script, not the device: run them on the CPU (before JAX picks a
        # backend; an already started one keeps its platform).
        jax.config.update("jax_platforms", "cpu")
    backend = jax.default_backend()
    accelerated = backend in ("gpu", "tpu")
    reduced = args.reduced or backend != "gpu"
    sizes = REDUCED if reduced else FULL
    device_kind = str(jax.devices()[0].device_kind)
    peak_bf16 = peak_tflops(device_kind, "bfloat16") if accelerated else None
    peak_tf32 = peak_tflops(device_kind, "tfloat32") if accelerated else None
    sections = {
        "ceilings": lambda ph: section_ceilings(sizes, peak_bf16, ph),
        "kernels": lambda ph: section_kernels(sizes, accelerated, peak_bf16, ph),
        "moe": lambda ph: section_moe(sizes, peak_tf32, ph),
        "learner": lambda ph: section_learner(sizes, peak_bf16, ph),
        "decode": lambda ph: section_decode(sizes, ph),
    }
    header = {
        "bench": "gpu",
        "backend": backend,
        "device_kind": device_kind,
        "device_count": jax.device_count(),
        "jax_version": jax.__version__,
        "sizes": "reduced" if reduced else "full",
        "peak_tflops": {"bfloat16": peak_bf16, "tfloat32": peak_tf32},
    }

    def write_partial(results: dict) -> None:
        if args.json_out:
            path = Path(args.json_out)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps({**header, **results}))
            tmp.replace(path)

    results = run_sections({s: sections[s] for s in chosen}, Phases("hcjax.bench.gpu"),
                           after_each=write_partial)
    out = {**header, **results}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)

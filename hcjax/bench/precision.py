"""`python -m hcjax.bench.precision`: the train-inference log-prob gap, fp32 vs bf16 compute, with
and without routing replay and top-p replay, and the gap quantise-on-sync adds (served fp8 / int8
weights against the fp32 learner). With `--climb_minutes M`, also what each rollout correction
buys: one M-minute climb per (sampler / learner dtype) x (replay, TIS) cell from one base, each a
`python -m hcjax.climb` subprocess, with its held-out pass@1 gain and that gain's binomial noise.

Rollouts are sampled by the rollout engine (cached decode, top-p, routing and kept-set records);
the learner's log-probs of the same tokens are recomputed with its own forward (the packed batch,
`token_logprobs`, the recorded routing forced or not). Δ = learner logp − sampler logp is exactly
the log of the ratio the GRPO loss sees at the first step after sampling (RECIPE §3), so an ideal
pipeline has Δ = 0. Prints one JSON object as its last line; asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hcjax import config as hcfg
from hcjax.display import Phases
from hcjax.model import ModelConfig, Transformer, add_weight_noise
from hcjax.model_io import load_model
from hcjax.rl.batch import LearnerBatch, pack_rollouts
from hcjax.rl.learner import token_logprobs
from hcjax.rl.losses import LossConfig, rollout_correction
from hcjax.rl.report import NOISE_FORMULA, suite_gain
from hcjax.rollout import Engine, generate
from hcjax.rollout.request import SamplingOptions
from hcjax.transfer.quantize import DEFAULT_BLOCK, FORMATS, round_trip_tree

# (sampler compute dtype, learner compute dtype): RECIPE §3 runs both in bf16; bf16 inference
# against an fp32 learner is the other common setup.
PAIRS = (("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32"))
# Perturbation of the initial weights: large enough that the untrained policy is peaked (mean
# sampled log-prob around -1 on the tiny config) rather than nearly uniform over the vocabulary.
WEIGHT_NOISE = 2.0
# The rollout-correction table's pairs (bf16 inference against an fp32 or a bf16 learner).
CORRECTION_PAIRS = (("bfloat16", "float32"), ("bfloat16", "bfloat16"))
# |r - 1| above this counts as a visibly off-policy token; the loss's own clip interval
# [1 - ε, 1/(1 - ε)] (RECIPE §3, ε = LossConfig.eps) is the other threshold reported.
RATIO_TOLERANCE = 0.2
# Quantise-on-sync rows (hcjax.transfer.quantize): the sampler serves these formats' round trip of
# the fp32 masters (fp32 compute), the learner recomputes with the fp32 masters.
QUANT_FORMATS = ("fp8_e4m3", "int8")
# The climb column: (sampler compute dtype, learner compute dtype) x rollout correction, one climb
# per cell. A climb sets the sampler's dtype with ClimbConfig.sampler_dtype and the learner's with
# ModelConfig.dtype (fp32 master weights either way); "replay" is routing and top-p replay
# (LearnerConfig.replay_routing / replay_top_p), "tis" token-level truncated importance sampling
# (LossConfig.correction, cap LossConfig.is_cap).
CLIMB_DTYPES = {"bf16_fp32": ("bfloat16", "float32"), "bf16_bf16": ("bfloat16", "bfloat16")}
CLIMB_CORRECTIONS = {"replay": (True, "none"), "tis": (False, "tis"), "both": (True, "tis"),
                     "neither": (False, "none")}
CLIMB_CELLS = tuple(f"{d}.{c}" for d in CLIMB_DTYPES for c in CLIMB_CORRECTIONS)
CLIMB_GIN = "climb_tiny.gin"


def larger_config(cfg: ModelConfig) -> ModelConfig:
    """`cfg` widened to the size of bench.learner's larger model (still CPU-sized)."""
    return dataclasses.replace(
        cfg, d_model=256, num_heads=4, num_kv_heads=2, head_dim=64, window=128, d_ff=768,
        num_experts=16, experts_per_token=2, moe_latent_dim=128, moe_d_ff=256,
        max_seq_len=max(cfg.max_seq_len, 512),
    )


def make_learner_logprobs(model: Transformer):
    """jit fn(batch, replay_routing) -> (logp with top-p replay, support_miss, logp without,
    recomputed routing [L, b, T, k] or None), all [b, T].

    The learner's forward of one micro-batch (hcjax.train.step.model_forward, as rl/learner.py's
    `PolicyObjective` feeds it): the model on the packed rows, the sampler's expert choices
    forced when routing is replayed, then `token_logprobs` with the temperature, with and without
    the recorded top-p kept set.
    """
    graphdef, params = nnx.split(model)

    def fn(mb: LearnerBatch, replay_routing: bool):
        routing = None
        if replay_routing:
            routing = tuple(mb.routing[layer] for layer in range(mb.routing.shape[0]))
        out = nnx.merge(graphdef, params)(
            mb.tokens, positions=mb.positions, segment_ids=mb.segment_ids, routing=routing)
        args = (out.logits, mb.targets, mb.temperature, mb.n_kept)
        logp_top_p, miss = token_logprobs(*args, replay_top_p=True)
        logp_full, _ = token_logprobs(*args, replay_top_p=False)
        return logp_top_p, miss, logp_full, jnp.stack(out.routing) if out.routing else None

    return jax.jit(fn, static_argnums=1)


def _first_micro_batch(batch: LearnerBatch) -> LearnerBatch:
    """Micro-batch 0 of a one-micro-batch batch (leading axis dropped), as jnp arrays."""
    def take(name, x):
        if x is None or name in ("num_tokens", "num_sequences"):
            return x
        return jnp.asarray(x[0])

    return LearnerBatch(**{f.name: take(f.name, getattr(batch, f.name))
                           for f in dataclasses.fields(batch)})


def gap_stats(learner_logp: np.ndarray, sampler_logp: np.ndarray, eps: float) -> dict:
    """Statistics of Δ = learner − sampler log-prob over the loss tokens, and of r = exp(Δ)."""
    delta = np.asarray(learner_logp, np.float64) - np.asarray(sampler_logp, np.float64)
    ratio = np.exp(delta)
    low, high = 1.0 - eps, 1.0 / (1.0 - eps)
    return {
        "tokens": int(delta.size),
        "mean_sampler_logp": float(np.mean(sampler_logp)),  # how peaked the policy is
        "mean_abs_dlogp": float(np.mean(np.abs(delta))),
        "max_abs_dlogp": float(np.max(np.abs(delta))),
        "mean_dlogp": float(np.mean(delta)),
        "mean_ratio_minus_1": float(np.mean(ratio - 1.0)),
        "mean_abs_ratio_minus_1": float(np.mean(np.abs(ratio - 1.0))),
        f"frac_abs_ratio_minus_1_gt_{RATIO_TOLERANCE}": float(
            np.mean(np.abs(ratio - 1.0) > RATIO_TOLERANCE)),
        "frac_outside_clip": float(np.mean((ratio < low) | (ratio > high))),
    }


def correction_cells(logp_replay: np.ndarray, logp_plain: np.ndarray, sampler_logp: np.ndarray,
                     eps: float, cap: float) -> list[dict]:
    """Replay (routing and top-p) on/off x token-level TIS on/off, on the loss tokens given.

    mean_abs_dlogp: mean |Δ|, Δ = log π_learner − log π_samp (the mismatch itself; TIS does not
    change it). uncorrected_abs_dlogp: the part of it the loss still sees: without TIS the PPO
    ratio is e^Δ, so all of |Δ|; with TIS (hcjax.rl.losses.rollout_correction, w = min(e^Δ, C))
    the ratio is against the learner and w carries e^Δ, so only |Δ − log w| (tokens with
    e^Δ > C). clip_frac: tokens the loss cuts: with TIS those truncated at C; without, those
    whose ratio e^Δ leaves the PPO interval [1 − ε, 1/(1 − ε)] (k = 0).
    """
    rows = []
    for replay, logp in ((True, logp_replay), (False, logp_plain)):
        delta = np.asarray(logp, np.float64) - np.asarray(sampler_logp, np.float64)
        mean_abs = float(np.mean(np.abs(delta)))
        ratio = np.exp(delta)
        outside = float(np.mean((ratio < 1.0 - eps) | (ratio > 1.0 / (1.0 - eps))))
        rows.append({"replay": replay, "tis": False, "mean_abs_dlogp": mean_abs,
                     "uncorrected_abs_dlogp": mean_abs, "clip_frac": outside})
        mask = np.ones(delta.shape, bool)
        w, m = rollout_correction(jnp.asarray(logp, jnp.float32)[None],
                                  jnp.asarray(sampler_logp, jnp.float32)[None], mask[None],
                                  kind="tis", cap=cap, low=0.5, high=2.0,
                                  num_tokens=float(delta.size))
        log_w = np.log(np.maximum(np.asarray(w[0], np.float64), 1e-30))
        rows.append({"replay": replay, "tis": True, "mean_abs_dlogp": mean_abs,
                     "uncorrected_abs_dlogp": float(np.mean(np.abs(delta - log_w))),
                     "clip_frac": float(m["is_clip_frac"])})
    return rows


def _routing_mismatch(recomputed_lbtk, recorded_lbtk, valid_bt) -> float:
    """Fraction of (MoE layer, fed token) whose expert set differs from the sampler's record."""
    a = np.sort(np.asarray(recomputed_lbtk), -1)
    b = np.sort(np.asarray(recorded_lbtk), -1)
    differ = np.any(a != b, -1)  # [L, b, T]
    return float(np.mean(differ[:, np.asarray(valid_bt)])) if differ.size else 0.0


def sample_rollouts(model: Transformer, *, prompts: int, prompt_len: int, samples: int,
                    max_tokens: int, temperature: float, top_p: float, slots: int, seed: int):
    """Rollouts sampled by the rollout engine (continuous batching over `slots` decode slots)."""
    cfg = model.config
    if prompt_len + max_tokens > cfg.max_seq_len:
        raise ValueError(f"prompt_len={prompt_len} + max_tokens={max_tokens} exceeds "
                         f"max_seq_len={cfg.max_seq_len}")
    engine = Engine(model, max_concurrent_decodes=slots, max_prefill_length=prompt_len,
                    max_target_length=cfg.max_seq_len)
    rng = np.random.default_rng(seed)
    prompt_ids = rng.integers(1, cfg.vocab_size, (prompts, prompt_len)).tolist()
    options = SamplingOptions(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              seed=seed)
    recs = generate(None, prompt_ids, options, n=samples, engine=engine)
    # Only the log-probs matter here; an advantage is what packing asks of every rollout.
    return [dataclasses.replace(r, reward=0.0, advantage=0.0) for r in recs]


def with_dtype(cfg: ModelConfig, state: nnx.State, dtype: str) -> Transformer:
    """The model of `cfg` with the weights `state` (fp32 masters) computing in `dtype`: the
    ModelConfig.dtype knob, so parameters stay fp32 and activations and matmuls run in `dtype`."""
    shaped = nnx.eval_shape(lambda: Transformer(dataclasses.replace(cfg, dtype=dtype),
                                                rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(shaped)
    return nnx.merge(graphdef, state)


def logprob_gap(
    cfg: ModelConfig,
    *,
    pairs: Sequence[tuple[str, str]] = PAIRS,
    prompts: int = 8,
    prompt_len: int = 16,
    samples: int = 2,
    max_tokens: int = 48,
    temperature: float = 1.0,
    top_p: float = 0.97,
    slots: int = 8,
    seed: int = 0,
    weight_noise: float = WEIGHT_NOISE,
    quant_formats: Sequence[str] = QUANT_FORMATS,
    quant_block: int = DEFAULT_BLOCK,
    state: nnx.State | None = None,
    phases: Phases | None = None,
) -> dict:
    """Train-inference gap table. For each (sampler dtype, learner dtype) pair, same fp32 master
    weights: rollouts from the engine computing in the first, then the learner's log-probs
    computing in the second, with routing replay on/off x top-p replay on/off.

    `weight_noise` perturbs the freshly initialised weights (as the rollout tests do): at init
    the attention output gains are 0 and the next-token distribution is nearly uniform.
    `quant_formats`: per format, rollouts from the engine serving the round trip of the matmul
    kernels (hcjax.transfer.quantize, blocks of `quant_block`) in fp32 compute, against the fp32
    learner on the unquantised masters: the gap quantise-on-sync adds ("quantized" rows).
    `state`: fp32 weights to use (e.g. a trained checkpoint's) instead of perturbed init ones.
    Returns {"rows": [one dict per (pair, replay_routing, replay_top_p)], "quantized": [...],
    ...}.
    """
    phases = phases or Phases("hcjax.bench.precision", mode="off")
    eps = LossConfig().eps
    noise = weight_noise if state is None else None  # None: given (e.g. trained) weights
    if state is None:
        _, state = nnx.split(Transformer(dataclasses.replace(cfg, dtype="float32"),
                                         rngs=nnx.Rngs(seed)))
        state = add_weight_noise(state, seed + 1, weight_noise)
    models = {dtype: with_dtype(cfg, state, dtype) for pair in pairs for dtype in pair}
    recompute = {dtype: make_learner_logprobs(model) for dtype, model in models.items()}
    sampled: dict[str, tuple] = {}
    rows, corrections = [], []
    cap = LossConfig().is_cap
    for fmt in quant_formats:
        if fmt not in FORMATS:
            raise ValueError(f"quant_formats entry {fmt!r} is not one of {sorted(FORMATS)}")
    if quant_formats and "float32" not in recompute:
        recompute["float32"] = make_learner_logprobs(with_dtype(cfg, state, "float32"))
    steps = len(set(s for s, _ in pairs)) + 2 * len(pairs) + 3 * len(quant_formats)
    with phases.phase("sampling and recomputing", total=steps) as ph:
        for sampler_dtype, learner_dtype in pairs:
            if sampler_dtype not in sampled:
                ph.now(f"sampling in {sampler_dtype}")
                t0 = time.perf_counter()
                rollouts = sample_rollouts(
                    models[sampler_dtype], prompts=prompts, prompt_len=prompt_len,
                    samples=samples, max_tokens=max_tokens, temperature=temperature,
                    top_p=top_p, slots=slots, seed=seed)
                packed = pack_rollouts(rollouts, seq_len=max(r.input_len for r in rollouts),
                                       micro_batches=1, with_routing=True, mask_truncated=False)
                sampled[sampler_dtype] = (_first_micro_batch(packed), len(rollouts),
                                          time.perf_counter() - t0)
                ph.advance()
            mb, _, _ = sampled[sampler_dtype]
            mask = np.asarray(mb.loss_mask)
            valid = np.asarray(mb.segment_ids) > 0
            old = np.asarray(mb.old_logp)[mask]
            both_replays = neither = None
            for replay_routing in (True, False):
                ph.now(f"{sampler_dtype} sampler, {learner_dtype} learner, "
                       f"routing replay {replay_routing}")
                with_top_p, miss, without_top_p, routing = jax.device_get(
                    recompute[learner_dtype](mb, replay_routing))
                if replay_routing:
                    both_replays = with_top_p[mask]
                else:
                    neither = without_top_p[mask]
                for replay_top_p, logp in ((True, with_top_p), (False, without_top_p)):
                    row = {"sampler_dtype": sampler_dtype, "learner_dtype": learner_dtype,
                           "replay_routing": replay_routing, "replay_top_p": replay_top_p,
                           **gap_stats(logp[mask], old, eps)}
                    if replay_top_p:
                        # Sampled tokens outside the learner's own top-n_kept (kept anyway).
                        row["support_miss_frac"] = float(np.mean(miss[mask]))
                    if not replay_routing and routing is not None:
                        row["routing_mismatch_frac"] = _routing_mismatch(routing, mb.routing,
                                                                         valid)
                    rows.append(row)
                ph.advance()
            if (sampler_dtype, learner_dtype) in CORRECTION_PAIRS:
                corrections += [{"sampler_dtype": sampler_dtype, "learner_dtype": learner_dtype,
                                 **cell}
                                for cell in correction_cells(both_replays, neither, old, eps, cap)]
        quantized = []
        for fmt in quant_formats:
            ph.now(f"sampling from {fmt} served weights")
            served = with_dtype(cfg, round_trip_tree(state, fmt, quant_block), "float32")
            t0 = time.perf_counter()
            rollouts = sample_rollouts(served, prompts=prompts, prompt_len=prompt_len,
                                       samples=samples, max_tokens=max_tokens,
                                       temperature=temperature, top_p=top_p, slots=slots,
                                       seed=seed)
            packed = pack_rollouts(rollouts, seq_len=max(r.input_len for r in rollouts),
                                   micro_batches=1, with_routing=True, mask_truncated=False)
            mb = _first_micro_batch(packed)
            sampled[f"{fmt} served"] = (mb, len(rollouts), time.perf_counter() - t0)
            ph.advance()
            mask, valid = np.asarray(mb.loss_mask), np.asarray(mb.segment_ids) > 0
            old = np.asarray(mb.old_logp)[mask]
            for replay_routing in (True, False):
                ph.now(f"{fmt} served, fp32 learner, routing replay {replay_routing}")
                with_top_p, miss, without_top_p, routing = jax.device_get(
                    recompute["float32"](mb, replay_routing))
                for replay_top_p, logp in ((True, with_top_p), (False, without_top_p)):
                    row = {"served": fmt, "block": quant_block, "sampler_dtype": "float32",
                           "learner_dtype": "float32", "replay_routing": replay_routing,
                           "replay_top_p": replay_top_p, **gap_stats(logp[mask], old, eps)}
                    if replay_top_p:
                        row["support_miss_frac"] = float(np.mean(miss[mask]))
                    if not replay_routing and routing is not None:
                        row["routing_mismatch_frac"] = _routing_mismatch(routing, mb.routing,
                                                                         valid)
                    quantized.append(row)
                ph.advance()
    return {
        "rows": rows,
        # Quantise-on-sync: served fmt weights (fp32 compute) vs the fp32 learner's masters.
        "quantized": quantized,
        # Replay only / TIS only / both / neither (correction_cells), C = LossConfig.is_cap.
        "corrections": corrections,
        "tis_cap": cap,
        "rollouts_per_sampler": {d: n for d, (_, n, _) in sampled.items()},
        "sample_s": {d: round(t, 3) for d, (_, _, t) in sampled.items()},
        "weight_noise": noise,
        "ratio_tolerance": RATIO_TOLERANCE,
        "clip_interval": [1.0 - eps, 1.0 / (1.0 - eps)],
        "sampling": {"prompts": prompts, "prompt_len": prompt_len, "samples": samples,
                     "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p},
    }


def climb_bindings(cell: str) -> list[str]:
    """The gin bindings of one climb cell ("bf16_fp32.replay", ...: one of CLIMB_CELLS)."""
    dtypes, _, correction = cell.partition(".")
    if dtypes not in CLIMB_DTYPES or correction not in CLIMB_CORRECTIONS:
        raise ValueError(f"climb cell {cell!r} is not one of {list(CLIMB_CELLS)}")
    sampler, learner = CLIMB_DTYPES[dtypes]
    replay, kind = CLIMB_CORRECTIONS[correction]
    return [f'ModelConfig.dtype = "{learner}"', f'ClimbConfig.sampler_dtype = "{sampler}"',
            f"LearnerConfig.replay_routing = {replay}", f"LearnerConfig.replay_top_p = {replay}",
            f'LossConfig.correction = "{kind}"']


def _log(message: str) -> None:
    print(f"hcjax.bench.precision: {message}", file=sys.stderr, flush=True)


def _run(command: list[str], timeout: float) -> tuple[int, str]:
    """(return code, stderr tail) of a subprocess; its stdout is dropped, and a timeout or a
    launch failure is a return code of -1 with the reason."""
    try:
        proc = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        return -1, f"{type(err).__name__}: {err}"
    return proc.returncode, proc.stderr[-3000:]


def make_climb_base(output_dir: str, gin_files: Sequence[str], gin_params: Sequence[str],
                    timeout: float) -> str:
    """Pre-train the climbs' one base with `python -m hcjax.sft` into OUTPUT_DIR/base, as
    `python -m hcjax.climb` does without --base_checkpoint (resumes a previous run there)."""
    base = os.path.join(output_dir, "base")
    command = [sys.executable, "-m", "hcjax.sft", "--output_dir", base, "--log_format", "json"]
    for f in gin_files:
        command += ["--gin_file", f]
    for p in [*gin_params, "run_sft.eval_problems = 0"]:
        command += ["--gin_param", p]
    _log(f"pre-training the climbs' base into {base} (hcjax.sft)")
    rc, err = _run(command, timeout)
    if rc != 0:
        raise RuntimeError(f"hcjax.sft for the climbs' base failed (exit {rc}): {err}")
    return base


def climb_cell(cell: str, base: str, output_dir: str, minutes: float, *,
               gin_files: Sequence[str] = (CLIMB_GIN,), gin_params: Sequence[str] = (),
               timeout: float | None = None) -> dict:
    """One climb of `cell` from `base` for `minutes` (ClimbConfig.max_minutes) in
    OUTPUT_DIR/<cell>, a `python -m hcjax.climb` subprocess: the climb's gin files, then
    `gin_params`, then the cell's bindings. Returns the cell's figures from the climb's
    summary.json, or {"ok": False, "error": ...} when the climb failed (the others still run)."""
    sampler, learner = CLIMB_DTYPES[cell.partition(".")[0]]
    replay, kind = CLIMB_CORRECTIONS[cell.partition(".")[2]]
    bindings = climb_bindings(cell)
    out_dir = os.path.join(output_dir, cell)
    row = {"cell": cell, "sampler_dtype": sampler, "learner_dtype": learner, "replay": replay,
           "tis": kind == "tis", "bindings": bindings, "output_dir": out_dir}
    if os.path.exists(out_dir):  # a climb resumes from its folder: a stale one would be measured
        return {**row, "ok": False, "error": f"{out_dir} exists (an earlier climb; remove it or "
                "choose another --climb_dir)"}
    command = [sys.executable, "-m", "hcjax.climb", "--base_checkpoint", base, "--output_dir",
               out_dir, "--quiet", "--log_format", "json"]
    for f in gin_files:
        command += ["--gin_file", f]
    for p in [f"ClimbConfig.max_minutes = {minutes}", *gin_params, *bindings]:
        command += ["--gin_param", p]
    t0 = time.perf_counter()
    rc, err = _run(command, timeout if timeout is not None else 60 * minutes + 900)
    path = os.path.join(out_dir, "summary.json")
    if rc != 0 or not os.path.isfile(path):
        return {**row, "ok": False, "returncode": rc, "error": err,
                "wall_seconds": time.perf_counter() - t0}
    with open(path, encoding="utf-8") as f:
        s = json.load(f)
    n = sum(int(c.get("problems") or 0) for c in s["categories"].values())
    g = suite_gain(s["base_pass_at_1"], s["final_pass_at_1"], n)
    return {**row, "ok": True, "base_pass_at_1": g["base"], "final_pass_at_1": g["final"],
            "gain": g["gain"], "heldout_problems": n, "noise": g["noise"],
            "gain_over_noise": g["gain_over_noise"], "steps": s["steps"],
            "climb_wall_seconds": s["climb_wall_seconds"], "logp_gap_mean": s["logp_gap_mean"],
            "wall_seconds": time.perf_counter() - t0}


def climb_column(cells: Sequence[str], minutes: float, output_dir: str, *,
                 base: str | None = None, gin_files: Sequence[str] = (CLIMB_GIN,),
                 gin_params: Sequence[str] = (), timeout: float | None = None) -> dict:
    """One `minutes`-minute climb per cell, all from `base` (None: pre-trained once into
    OUTPUT_DIR/base by hcjax.sft with the climbs' gin), run one after the other."""
    for cell in cells:
        climb_bindings(cell)  # a bad name fails before any climb
    if base is None:
        base = make_climb_base(output_dir, gin_files, gin_params,
                               timeout if timeout is not None else 3600)
    rows = []
    for i, cell in enumerate(cells):
        _log(f"climb {i + 1}/{len(cells)}: {cell} for {minutes} min")
        row = climb_cell(cell, base, output_dir, minutes, gin_files=gin_files,
                         gin_params=gin_params, timeout=timeout)
        if row["ok"]:
            _log(f"  {cell}: held-out pass@1 {row['base_pass_at_1']:.3f} -> "
                 f"{row['final_pass_at_1']:.3f} (gain {row['gain']:+.3f} +- {row['noise']:.3f}) "
                 f"in {row['steps']} steps")
        else:
            _log(f"  {cell} FAILED: {row['error'][-500:]}")
        rows.append(row)
    return {"minutes": minutes, "base_checkpoint": base, "gin_files": list(gin_files),
            "gin_params": list(gin_params), "noise_formula": NOISE_FORMULA, "cells": rows}


EXAMPLES = """examples:
  python -m hcjax.bench.precision                      # tiny_cpu.gin model, fp32 and bf16
  python -m hcjax.bench.precision --larger --max_tokens 96
  python -m hcjax.bench.precision --reduced            # a few short rollouts (the test's run)
  python -m hcjax.bench.precision --quantize int8      # served int8 rows only (default fp8, int8)
  python -m hcjax.bench.precision --base_checkpoint runs/base   # a trained base's weights
  python -m hcjax.bench.precision --climb_minutes 5 --base_checkpoint runs/base
      # + one 5-minute climb per (dtype pair x replay/TIS) cell from that base (8 climbs)
  python -m hcjax.bench.precision --climb_minutes 1 --climb_only --climb_cells bf16_fp32.replay
      # one cell only, base pre-trained by hcjax.sft into --climb_dir/base

The last line on stdout is one JSON object; progress goes to stderr.
"""


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    hcfg.set_examples(parser, EXAMPLES)
    parser.add_argument("--gin_file", action="append", default=None,
                        help="model config (default tiny_cpu.gin)")
    parser.add_argument("--larger", action="store_true",
                        help="the gin model widened to bench.learner's larger size")
    parser.add_argument("--reduced", action="store_true",
                        help="4 prompts x 2 samples x 16 tokens: well under a minute on CPU")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--top_p", type=float, default=0.97)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weight_noise", type=float, default=WEIGHT_NOISE)
    parser.add_argument("--quantize", action="append", default=None, choices=sorted(FORMATS),
                        help="served-weight formats of the quantise-on-sync rows (repeatable; "
                        f"default {' and '.join(QUANT_FORMATS)})")
    parser.add_argument("--quant_block", type=int, default=DEFAULT_BLOCK,
                        help="values per scale along the last axis")
    parser.add_argument("--base_checkpoint", default=None,
                        help="run folder of trained weights (e.g. an hcjax.sft base) to measure "
                        "instead of perturbed initial weights")
    climb = parser.add_argument_group(
        "climbs", "one climb per (sampler / learner dtype) x (replay, TIS) cell, each a "
        "`python -m hcjax.climb` subprocess from --base_checkpoint (default: pre-train one base "
        "with hcjax.sft into CLIMB_DIR/base); cells: " + ", ".join(CLIMB_CELLS))
    climb.add_argument("--climb_minutes", type=float, default=None,
                       help="climb each cell this many minutes (ClimbConfig.max_minutes); "
                       "default: no climbs")
    climb.add_argument("--climb_cells", default="all",
                       help="comma-separated cells (default all 8)")
    climb.add_argument("--climb_dir", default=os.path.join("runs", "bench_precision_climbs"),
                       help="one output folder per cell under it (must not exist yet)")
    climb.add_argument("--climb_gin_file", action="append", default=None,
                       help=f"the climbs' gin files (default {CLIMB_GIN})")
    climb.add_argument("--climb_gin_param", action="append", default=[],
                       help="more climb bindings, before the cell's own (repeatable)")
    climb.add_argument("--climb_timeout", type=float, default=None,
                       help="seconds before a climb is stopped and reported failed (default "
                       "60 x minutes + 900)")
    climb.add_argument("--climb_only", action="store_true",
                       help="skip the log-prob gap tables")
    args = parser.parse_args(argv)
    if args.climb_only and args.climb_minutes is None:
        parser.error("--climb_only needs --climb_minutes")
    if args.climb_minutes is not None and args.climb_minutes <= 0:
        parser.error(f"--climb_minutes={args.climb_minutes} must be > 0")
    cells = CLIMB_CELLS if args.climb_cells == "all" else tuple(
        c.strip() for c in args.climb_cells.split(",") if c.strip())
    for cell in cells:
        if cell not in CLIMB_CELLS:
            parser.error(f"--climb_cells has {cell!r}; the cells are {', '.join(CLIMB_CELLS)}")
    if args.larger and (args.base_checkpoint or args.climb_minutes is not None):
        parser.error("--larger excludes --base_checkpoint and --climb_minutes (a checkpoint's "
                     "model is measured)")
    climb_gin = args.climb_gin_file or [CLIMB_GIN]
    if args.climb_minutes is not None and args.base_checkpoint is None:
        # One base for the gap tables and every climb.
        args.base_checkpoint = make_climb_base(args.climb_dir, climb_gin, args.climb_gin_param,
                                               args.climb_timeout or 3600)
    hcfg.bind(args.gin_file or ["tiny_cpu.gin"], [])
    cfg, state = ModelConfig(), None
    if args.larger:
        cfg = larger_config(cfg)
    if args.base_checkpoint:
        model, cfg = load_model(args.base_checkpoint)
        cfg = dataclasses.replace(cfg, dtype="float32")
        state = nnx.state(model)
    sizes = dict(prompts=args.prompts, prompt_len=args.prompt_len, samples=args.samples,
                 max_tokens=args.max_tokens)
    if args.reduced:
        sizes = dict(prompts=2, prompt_len=8, samples=2, max_tokens=12)
    table = {}
    if not args.climb_only:
        table = logprob_gap(cfg, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            weight_noise=args.weight_noise,
                            phases=Phases("hcjax.bench.precision"),
                            quant_formats=tuple(args.quantize or QUANT_FORMATS),
                            quant_block=args.quant_block, state=state, **sizes)
    if args.climb_minutes is not None:
        table["climbs"] = climb_column(cells, args.climb_minutes, args.climb_dir,
                                       base=args.base_checkpoint, gin_files=climb_gin,
                                       gin_params=args.climb_gin_param,
                                       timeout=args.climb_timeout)
    out = {
        "bench": "precision",
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "jax_version": jax.__version__,
        "config": {"d_model": cfg.d_model, "num_layers": cfg.num_layers,
                   "num_experts": cfg.num_experts, "experts_per_token": cfg.experts_per_token,
                   "vocab_size": cfg.vocab_size, "larger": args.larger,
                   "base_checkpoint": args.base_checkpoint},
        "dtype_knob": "ModelConfig.dtype (compute dtype; fp32 master parameters in both)",
        **table,
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)

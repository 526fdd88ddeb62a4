"""The sampler/learner mismatch gate: a few GRPO steps with the rollout engine as the sampler,
measuring after each sampling how far the learner's log-probs of the sampled tokens are from the
sampler's, with and without replay (routing and top-p replay together).

Per step the engine samples from the learner's current weights (so the only gap is numerics and
replay: no staleness), the learner recomputes log π of every loss token, then takes one GRPO
step on the batch (with replay) so the next step samples from moved weights. Reported per
(sampler dtype, replay): the mean over tokens and steps of |Δ| with Δ = log π_learner − log
π_samp, the largest |Δ|, and the k3 estimate of KL(π_samp ‖ π_learner) = E_samp[ρ − 1 − log ρ],
ρ = e^Δ (non-negative; exact in expectation over the sampler's tokens). `check` fails a table
whose fp32 row with replay exceeds `BOUNDS`. Used by tests/test_families.py on the five HF
fixtures and by `python -m hcjax.climb --check_mismatch` on any checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hcjax.model import Transformer
from hcjax.rl.advantages import assign_advantages
from hcjax.rl.batch import pack_rollouts
from hcjax.rl.learner import Learner, LearnerConfig, token_logprobs
from hcjax.rollout import Engine, generate
from hcjax.rollout.request import SamplingOptions
from hcjax.sharding import MeshConfig, make_mesh
from hcjax.train.step import model_forward

__all__ = ["BOUNDS", "MismatchConfig", "check", "format_table", "logprob_gaps",
           "measure_mismatch"]

# The gate on the fp32 sampler with replay (engine and learner both fp32, routing and top-p
# replayed): only the cached decode's and the full forward's different summation orders remain.
# Measured on the five HF fixtures (20 steps, tests/test_families.py): mean |Δ| 6.1e-7 to
# 7.9e-7, max |Δ| at most 6.2e-6, KL k3 at most 5.5e-13 (docs/measurements.md; with 3 steps, two
# runs: up to 1.2e-6, 5.3e-6, 1.2e-12). The bounds leave about 8x, 16x and 80x of margin (KL ≈ Δ²/2, so its bound matches a mean |Δ| of 1.4e-5)
# and sit four orders of magnitude below the rows without replay (mean |Δ| 0.1 to 0.4 on the
# fixtures, mostly the lost top-p support).
BOUNDS = {"mean_abs_dlogp": 1e-5, "max_abs_dlogp": 1e-4, "kl": 1e-10}


@dataclasses.dataclass(frozen=True)
class MismatchConfig:
    """Sizes of the gate: `steps` GRPO steps of `prompts` x `samples` rollouts of `max_tokens`
    (random prompts of `prompt_len` tokens), sampled at `temperature` / `top_p`."""

    steps: int = 20
    prompts: int = 2
    samples: int = 2
    prompt_len: int = 8
    max_tokens: int = 8
    temperature: float = 0.9
    top_p: float = 0.9
    learning_rate: float = 1e-3
    seed: int = 0
    sampler_dtypes: tuple[str, ...] = ("float32",)

    def __post_init__(self) -> None:
        for name in ("steps", "prompts", "samples", "prompt_len", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"MismatchConfig.{name}={getattr(self, name)} must be >= 1")
        if self.samples < 2:
            raise ValueError(f"MismatchConfig.samples={self.samples} must be >= 2 (GRPO groups)")
        for d in self.sampler_dtypes:
            if d not in ("float32", "bfloat16"):
                raise ValueError(f"MismatchConfig.sampler_dtypes has {d!r}: float32 or bfloat16")


@functools.cache
def _learner_logprobs(graphdef: nnx.GraphDef, exact: bool = False,
                      replays: tuple[bool, ...] = (True, False)):
    """jit fn(params, micro-batch 0 of a LearnerBatch) -> learner log π [b, T] with replay (the
    routing record forced, the top-p support replayed) and without either (`replays`): the
    learner's forward (train.step.model_forward) and `token_logprobs`, as PolicyObjective
    computes them."""
    forward = model_forward(graphdef)

    def fn(params, mb):
        inputs = {"tokens": mb["tokens"], "positions": mb["positions"],
                  "segment_ids": mb["segment_ids"]}
        out = {}
        for replay in replays:
            x = dict(inputs, routing=mb["routing"]) if replay and mb["routing"] is not None \
                else inputs
            logits = forward(params, x, None).logits
            out[replay], _ = token_logprobs(logits, mb["targets"], mb["temperature"], mb["n_kept"],
                                            replay, exact=exact)
        return out

    return jax.jit(fn)


def logprob_gaps(model: Transformer, rollouts: Sequence) -> np.ndarray:
    """Δ = log π_learner − log π_samp for every loss token of `rollouts` sampled from `model`'s
    weights as they are: the learner's forward and `token_logprobs` with routing and top-p
    replay, over the rollouts packed as the learner packs them (aligned in exact mode, one
    micro-batch). No training. In exact mode (ModelConfig.batch_invariant) every Δ is 0."""
    graphdef, params = nnx.split(model)
    mcfg = model.config
    rollouts = [dataclasses.replace(r, advantage=0.0 if r.advantage is None else r.advantage)
                for r in rollouts]
    seq_len = max(r.input_len for r in rollouts)
    batch = pack_rollouts(rollouts, seq_len=seq_len, with_routing=mcfg.num_moe_layers > 0,
                          mask_truncated=False, align_segments=mcfg.batch_invariant)
    mb = {f.name: None if getattr(batch, f.name) is None else jnp.asarray(getattr(batch, f.name)[0])
          for f in dataclasses.fields(batch) if f.name not in ("num_tokens", "num_sequences")}
    logp = _learner_logprobs(graphdef, mcfg.batch_invariant, (True,))(params, mb)[True]
    mask = np.asarray(batch.loss_mask[0])
    return np.asarray(logp, np.float64)[mask] - np.asarray(batch.old_logp[0], np.float64)[mask]


def _reward(rollout) -> float:
    """A made-up, learnable reward: the fraction of even token ids in the response."""
    ids = np.asarray(rollout.response_ids)
    return float(np.mean(ids % 2 == 0)) if ids.size else 0.0


def measure_mismatch(model: Transformer, cfg: MismatchConfig = MismatchConfig(), *,
                     engine: Engine | None = None, learner: Learner | None = None) -> list[dict]:
    """The gate's table for `model` (fp32 parameters): one row per (sampler dtype, replay).

    `engine`: an Engine already built for `model` (reused: its compiled decode), for the sampler
    computing in the model's dtype; other sampler dtypes get their own engine over the same
    weights. `learner`: a Learner of `model` to train with (reused: its compiled step; it must
    replay routing and top-p), else one on one device with rows of prompt_len + max_tokens,
    `cfg.learning_rate` and a global-norm clip of 1. Samples that hit max_tokens count as
    complete (the gate measures log-probs, not rewards).
    """
    mcfg = model.config
    need = cfg.prompt_len + cfg.max_tokens
    if need > mcfg.max_seq_len:
        raise ValueError(f"MismatchConfig prompt_len={cfg.prompt_len} + max_tokens="
                         f"{cfg.max_tokens} exceeds the model's max_seq_len={mcfg.max_seq_len}")
    if learner is None:
        mesh = make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1])
        learner = Learner(model, LearnerConfig(seq_len=need, learning_rate=cfg.learning_rate,
                                               max_grad_norm=1.0), mesh)
    if not (learner.cfg.replay_routing and learner.cfg.replay_top_p):
        raise ValueError("measure_mismatch trains with replay: the learner has replay_routing="
                         f"{learner.cfg.replay_routing}, replay_top_p={learner.cfg.replay_top_p}")
    if learner.cfg.seq_len < need - 1:
        raise ValueError(f"learner seq_len={learner.cfg.seq_len} is shorter than a rollout "
                         f"(prompt_len + max_tokens - 1 = {need - 1})")
    logprobs = _learner_logprobs(learner.graphdef, mcfg.batch_invariant)
    rng = np.random.default_rng(cfg.seed)
    prompts = rng.integers(1, mcfg.vocab_size, (cfg.prompts, cfg.prompt_len)).tolist()
    # One rollout per packed row, a fixed number of rows: one batch shape, one compile.
    rows = -(-cfg.prompts * cfg.samples // learner.data_parallel_size) * learner.data_parallel_size
    engines, graphdefs = {}, {}
    for dtype in cfg.sampler_dtypes:
        scfg = dataclasses.replace(mcfg, dtype=dtype)
        graphdefs[dtype] = nnx.split(nnx.eval_shape(lambda c=scfg: Transformer(c, rngs=nnx.Rngs(0))))[0]
        if dtype == mcfg.dtype and engine is not None:
            engines[dtype] = engine
        else:
            engines[dtype] = Engine(nnx.merge(graphdefs[dtype], learner.params()),
                                    max_concurrent_decodes=rows, max_prefill_length=cfg.prompt_len,
                                    max_target_length=need)
    acc = {(d, r): [] for d in cfg.sampler_dtypes for r in (True, False)}
    for step in range(cfg.steps):
        options = SamplingOptions(max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                                  top_p=cfg.top_p, seed=cfg.seed + step)
        train_batch = None
        for dtype in cfg.sampler_dtypes:
            # The weight push: the learner's parameters placed as the engine holds its own (the
            # same shardings, so the engine's compiled decode is reused).
            pushed = jax.tree.map(lambda x, e: jax.device_put(x, e.sharding), learner.params(),
                                  engines[dtype].load_params())
            sampler = nnx.merge(graphdefs[dtype], pushed)
            recs = generate(sampler, prompts, options, n=cfg.samples, engine=engines[dtype])
            rollouts = assign_advantages([
                dataclasses.replace(r, reward=_reward(r), finish_reason="stop"
                                    if r.finish_reason == "length" else r.finish_reason)
                for r in recs])
            batch = learner.pack(rollouts, num_rows=rows)
            mb = {f.name: None if getattr(batch, f.name) is None
                  else jnp.asarray(getattr(batch, f.name)[0])
                  for f in dataclasses.fields(batch) if f.name not in ("num_tokens", "num_sequences")}
            mask = np.asarray(batch.loss_mask[0])
            sampler_logp = np.asarray(batch.old_logp[0], np.float64)[mask]
            for replay, logp in jax.device_get(logprobs(learner.params(), mb)).items():
                acc[(dtype, replay)].append(np.asarray(logp, np.float64)[mask] - sampler_logp)
            if dtype == mcfg.dtype or train_batch is None:
                train_batch = batch
        learner.step(train_batch)  # GRPO with replay: the next step samples moved weights
    table = []
    for (dtype, replay), deltas in acc.items():
        delta = np.concatenate(deltas)
        kl = np.expm1(delta) - delta  # ρ - 1 - log ρ, accurate near 0
        table.append({"sampler_dtype": dtype, "learner_dtype": mcfg.dtype, "replay": replay,
                      "steps": cfg.steps, "tokens": int(delta.size),
                      "mean_abs_dlogp": float(np.mean(np.abs(delta))),
                      "max_abs_dlogp": float(np.max(np.abs(delta))),
                      "exact_share": float(np.mean(delta == 0.0)),
                      "kl": float(np.mean(kl))})
    return table


def check(table: Sequence[dict], bounds: dict | None = None) -> list[str]:
    """Violations of `bounds` (default BOUNDS) by the fp32-sampler rows with replay; [] = pass."""
    bounds = BOUNDS if bounds is None else bounds
    bad = []
    for row in table:
        if row["replay"] and row["sampler_dtype"] == "float32":
            for name, bound in bounds.items():
                if not row[name] <= bound:  # NaN fails too
                    bad.append(f"{row.get('family', 'model')}: {name}={row[name]:.3g} > {bound:g} "
                               f"(sampler {row['sampler_dtype']}, learner {row['learner_dtype']}, "
                               "replay on)")
    return bad


def format_table(table: Sequence[dict]) -> str:
    """The table as aligned text (one line per row)."""
    head = f"{'family':<12} {'sampler':<9} {'learner':<9} {'replay':<6} {'tokens':>6} " \
           f"{'mean|dlogp|':>11} {'max|dlogp|':>10} {'KL(s||l)':>9} {'exact':>6}"
    lines = [head]
    for r in table:
        lines.append(f"{r.get('family', 'model'):<12} {r['sampler_dtype']:<9} "
                     f"{r['learner_dtype']:<9} {str(r['replay']):<6} {r['tokens']:>6} "
                     f"{r['mean_abs_dlogp']:>11.3g} {r['max_abs_dlogp']:>10.3g} {r['kl']:>9.3g} "
                     f"{r['exact_share']:>6.3f}")
    return "\n".join(lines)

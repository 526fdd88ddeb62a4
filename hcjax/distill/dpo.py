"""DPO after the climb (Kimi k1.5 long2short, RECIPE §5): preference pairs from a climb's rollout
store — within a group, the shortest correct response is chosen and a correct one at least 1.5×
longer, or a wrong one, is rejected — and `run_dpo`, which fits `hcjax.rl.losses.dpo_loss` against
the frozen starting params on the one training loop (hcjax.train.loop: `PreferenceObjective`, the
pairs as a batch source and the reference's log-probs are all DPO adds), with the starting run's
tokenizer.

`run_dpo` writes OUT/checkpoints in the layout of every hcjax run (a `--base_checkpoint` of the
climb); `pairs_from_samples` takes the pairs from the k samples per problem that shortest
rejection sampling wrote (OUT/samples.jsonl) instead of a rollout store. `python -m hcjax.dpo` is
the command line; this module parses no flags. The pair selection is a pure function; the loss
lives with the other losses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from collections.abc import Sequence
from typing import Any

import gin
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hcjax.checkpoint import CheckpointConfig
from hcjax.data.template import encode_conversation
from hcjax.model_io import load_model, run_tokenizer
from hcjax.rl.losses import dpo_loss
from hcjax.rl.store import read_groups
from hcjax.sharding import MeshConfig, make_mesh
from hcjax.train.loop import AdamWConfig, Trainer, TrainerConfig
from hcjax.train.sft import MODEL_INPUTS, target_weights, token_nll
from hcjax.train.step import Objective, model_forward

__all__ = [
    "DPOConfig",
    "PairBatches",
    "PreferenceObjective",
    "PreferencePair",
    "batch_indices",
    "encode_pairs",
    "pairs_from_samples",
    "pairs_from_store",
    "preference_inputs",
    "reference_logprobs",
    "run_dpo",
    "select_pairs",
    "sequence_logprobs",
]


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DPOConfig:
    """beta, label_smoothing, nll_weight (RPO's per-token NLL of the chosen response): of
    `dpo_loss`. Pairs (`select_pairs`): min_ratio (a correct
    response at least this many times the shortest correct one's length is rejected),
    long_pairs / wrong_pairs (which rejections to use), max_pairs_per_group, and the store
    filter min_step_fraction (rollouts of learner steps >= this fraction of the last).
    row_len: tokens per encoded sequence (longer pairs are dropped).
    trainer, optimizer: the loop's settings (num_steps, batch_size = pairs per step, seed,
    log_every, init_checkpoint, ...) and its AdamW schedule (hcjax.train.loop); None: gin's
    TrainerConfig / AdamWConfig under the scope `dpo` (`dpo/TrainerConfig.num_steps = ...`), so
    DPO's settings stay apart from those of a fine-tuning or pre-training in the same gin files."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    nll_weight: float = 0.0
    min_ratio: float = 1.5
    long_pairs: bool = True
    wrong_pairs: bool = True
    max_pairs_per_group: int | None = None
    min_step_fraction: float = 0.0
    row_len: int = 128
    trainer: TrainerConfig | None = None
    optimizer: AdamWConfig | None = None

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"DPOConfig.beta={self.beta} must be > 0")
        if self.nll_weight < 0:
            raise ValueError(f"DPOConfig.nll_weight={self.nll_weight} must be >= 0")
        if self.min_ratio < 1.0:
            raise ValueError(f"DPOConfig.min_ratio={self.min_ratio} must be >= 1")
        if not (self.long_pairs or self.wrong_pairs):
            raise ValueError("DPOConfig: long_pairs and wrong_pairs are both False; no pair "
                             "could be formed")
        if self.row_len < 2:
            raise ValueError(f"DPOConfig.row_len={self.row_len} must be >= 2")

    def loop(self) -> tuple[TrainerConfig, AdamWConfig]:
        """(trainer, optimizer): the given ones, else gin's under the scope `dpo`."""
        with gin.config_scope("dpo"):
            return self.trainer or TrainerConfig(), self.optimizer or AdamWConfig()


# Pairs ------------------------------------------------------------------------------------------
def select_pairs(lengths: Sequence[int], correct: Sequence[bool], *, min_ratio: float = 1.5,
                 long_pairs: bool = True, wrong_pairs: bool = True) -> list[tuple[int, int]]:
    """(chosen, rejected) indices within one group: the chosen one is the shortest correct
    response (the first of equals); rejected are the correct responses at least `min_ratio`×
    its length (long_pairs) and the wrong ones (wrong_pairs), in index order. No correct
    response: no pair."""
    if len(lengths) != len(correct):
        raise ValueError(f"len(lengths)={len(lengths)} != len(correct)={len(correct)}")
    ok = [i for i, c in enumerate(correct) if c]
    if not ok:
        return []
    best = min(ok, key=lambda i: (lengths[i], i))
    pairs = []
    for i, (n, c) in enumerate(zip(lengths, correct, strict=True)):
        if i == best:
            continue
        if c and long_pairs and n >= min_ratio * lengths[best]:
            pairs.append((best, i))
        elif not c and wrong_pairs:
            pairs.append((best, i))
    return pairs


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    prompt: tuple[dict[str, str], ...]  # the prompt messages
    chosen: str
    rejected: str
    chosen_len: int
    rejected_len: int
    task_id: str = ""


def pairs_from_store(path: str, cfg: DPOConfig | None = None, *, seed: int = 0
                     ) -> list[PreferencePair]:
    """Preference pairs of a climb's rollout store (a run folder, its rollouts/ folder or the
    file): per group, `select_pairs` on response token counts and correctness, aborted and
    empty responses left out; at most `max_pairs_per_group` per group (uniformly drawn)."""
    cfg = cfg or DPOConfig()
    if os.path.isdir(os.path.join(path, "rollouts")):
        path = os.path.join(path, "rollouts")
    groups = read_groups(path)
    if not groups:
        return []
    cutoff = cfg.min_step_fraction * max(g.step for g in groups)
    rng = random.Random(seed)
    out = []
    for g in groups:
        if g.step < cutoff or not g.prompt_text:
            continue
        keep = [i for i, (r, t) in enumerate(zip(g.rollouts, g.response_texts, strict=False))
                if not r.aborted and t]
        lengths = [int(g.rollouts[i].loss_mask.sum()) for i in keep]
        correct = [g.rollouts[i].reward_components.get("correct", 0.0) > 0 for i in keep]
        pairs = select_pairs(lengths, correct, min_ratio=cfg.min_ratio,
                             long_pairs=cfg.long_pairs, wrong_pairs=cfg.wrong_pairs)
        if cfg.max_pairs_per_group is not None and len(pairs) > cfg.max_pairs_per_group:
            pairs = rng.sample(pairs, cfg.max_pairs_per_group)
        prompt = ({"role": "user", "content": g.prompt_text},)
        out += [PreferencePair(prompt, g.response_texts[keep[c]], g.response_texts[keep[r]],
                               lengths[c], lengths[r], g.task_id) for c, r in pairs]
    return out


def pairs_from_samples(path: str, cfg: DPOConfig | None = None, *, seed: int = 0
                       ) -> list[PreferencePair]:
    """Preference pairs of `hcjax.distill.rejection`'s samples.jsonl (one problem per line: its
    prompt "messages" and k graded "samples"): per problem, `select_pairs` on the samples'
    token counts and correctness, empty responses left out; at most `max_pairs_per_group` per
    problem (uniformly drawn)."""
    cfg = cfg or DPOConfig()
    rng = random.Random(seed)
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if not isinstance(rec.get("messages"), list) or not isinstance(
                    rec.get("samples"), list):
                raise ValueError(f"{path}:{n}: expected {{'messages': [...], 'samples': [...]}}")
            samples = [s for s in rec["samples"] if s["text"]]
            pairs = select_pairs([int(s["length"]) for s in samples],
                                 [bool(s["correct"]) for s in samples], min_ratio=cfg.min_ratio,
                                 long_pairs=cfg.long_pairs, wrong_pairs=cfg.wrong_pairs)
            if cfg.max_pairs_per_group is not None and len(pairs) > cfg.max_pairs_per_group:
                pairs = rng.sample(pairs, cfg.max_pairs_per_group)
            prompt = tuple(dict(m) for m in rec["messages"])
            out += [PreferencePair(prompt, samples[c]["text"], samples[r]["text"],
                                   int(samples[c]["length"]), int(samples[r]["length"]),
                                   str(rec.get("id", ""))) for c, r in pairs]
    return out


def encode_pairs(pairs: Sequence[PreferencePair], tok: Any, row_len: int
                 ) -> tuple[dict[str, np.ndarray], int]:
    """Padded rows for P pairs: rows [0, P) the chosen conversations, rows [P, 2P) the rejected
    ones ({"tokens", "positions", "segment_ids", "loss_mask"} int32 [2P', row_len]); pairs with
    a conversation longer than row_len are dropped. Returns (arrays, number dropped)."""
    chosen, rejected, dropped = [], [], 0
    for p in pairs:
        c = encode_conversation([*p.prompt, {"role": "assistant", "content": p.chosen}], tok)
        r = encode_conversation([*p.prompt, {"role": "assistant", "content": p.rejected}], tok)
        if max(len(c[0]), len(r[0])) > row_len:
            dropped += 1
            continue
        chosen.append(c)
        rejected.append(r)
    rows = chosen + rejected
    n = len(rows)
    out = {k: np.zeros((n, row_len), np.int32)
           for k in ("tokens", "positions", "segment_ids", "loss_mask")}
    for i, (ids, mask) in enumerate(rows):
        out["tokens"][i, : len(ids)] = ids
        out["positions"][i, : len(ids)] = np.arange(len(ids))
        out["segment_ids"][i, : len(ids)] = 1
        out["loss_mask"][i, : len(ids)] = mask
    return out, dropped


# Training ---------------------------------------------------------------------------------------
def sequence_logprobs(logits_btv: jax.Array, batch: dict) -> jax.Array:
    """[rows] Σ log π(token) over each row's response (loss-mask) tokens, from the model's
    logits on `batch`'s rows."""
    nll, _ = token_nll(logits_btv, batch["tokens"])
    return -jnp.sum(nll * target_weights(batch), axis=1)


def reference_logprobs(graphdef: Any, rest: Any, ref_params: Any, batch: dict) -> jax.Array:
    """`sequence_logprobs` under the frozen reference: the `ref_logp` a DPO batch carries."""
    inputs = {name: batch[name] for name in MODEL_INPUTS}
    return sequence_logprobs(model_forward(graphdef, rest)(ref_params, inputs, None).logits, batch)


@dataclasses.dataclass(frozen=True)
class PreferenceObjective(Objective):
    """DPO's loss (`hcjax.rl.losses.dpo_loss`) on a batch as `encode_pairs` lays it out — rows
    [0, P) the chosen conversations, [P, 2P) the rejected ones — plus `ref_logp` [2P], the
    frozen reference's `sequence_logprobs` of every row. Micro-batches keep each pair together
    (chosen and rejected rows of the same pairs); each is the mean over its pairs weighted by its
    share of the pairs."""

    cfg: DPOConfig
    num_microbatches: int = 1

    def split(self, batch):
        m = self.num_microbatches

        def split(x):  # [2P, ...] -> [M, 2P/M, ...]: chosen then rejected rows of P/M pairs
            half = x.shape[0] // 2
            chosen = x[:half].reshape(m, half // m, *x.shape[1:])
            rejected = x[half:].reshape(m, half // m, *x.shape[1:])
            return jnp.concatenate([chosen, rejected], axis=1)

        inputs = {name: split(batch[name]) for name in MODEL_INPUTS}
        return inputs, {"weights": split(target_weights(batch)), "ref_logp": split(batch["ref_logp"])}

    def context(self, batch, loss_state):
        return {"pairs": batch["tokens"].shape[0] // 2}

    def loss(self, out, inputs, data, ctx):
        logp = -jnp.sum(token_nll(out.logits, inputs["tokens"])[0] * data["weights"], axis=1)
        ref, half = data["ref_logp"], logp.shape[0] // 2
        loss, metrics = dpo_loss(logp[:half], logp[half:], ref[:half], ref[half:],
                                 beta=self.cfg.beta, label_smoothing=self.cfg.label_smoothing,
                                 chosen_lengths=jnp.sum(data["weights"], axis=1)[:half],
                                 nll_weight=self.cfg.nll_weight)
        if half == ctx["pairs"]:  # one micro-batch: the mean over its pairs is the loss
            return loss, metrics
        share = half / ctx["pairs"]
        return loss * share, {name: x * share for name, x in metrics.items()}


def preference_inputs(graphdef: Any, rest: Any) -> Any:
    """fn(ref_params, batch) -> the batch with `ref_logp`, the frozen reference's
    `sequence_logprobs` of every row: what a DPO batch carries into `PreferenceObjective`,
    computed inside the train step (the loop's `prepare`)."""

    def prepare(ref_params, batch):
        ref = reference_logprobs(graphdef, rest, jax.lax.stop_gradient(ref_params), batch)
        return {**batch, "ref_logp": ref}

    return prepare


def batch_indices(step: int, num_pairs: int, batch: int, seed: int) -> np.ndarray:
    """The pairs of learner step `step`: consecutive slices of one permutation per epoch
    (deterministic in the step, so a resumed run sees the same batches)."""
    idx = []
    pos = step * batch
    while len(idx) < batch:
        epoch, offset = divmod(pos, num_pairs)
        perm = np.random.default_rng([seed, epoch]).permutation(num_pairs)
        take = min(batch - len(idx), num_pairs - offset)
        idx.extend(perm[offset: offset + take].tolist())
        pos += take
    return np.asarray(idx)


class PairBatches:
    """DPO's batch source for the loop: step s takes the pairs `batch_indices(s, ...)` of the
    `encode_pairs` rows, chosen rows then rejected rows; its state is the next step."""

    def __init__(self, data: dict[str, np.ndarray], batch_size: int, seed: int) -> None:
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.num_pairs = data["tokens"].shape[0] // 2
        self.step = 0

    def __next__(self) -> dict[str, np.ndarray]:
        idx = batch_indices(self.step, self.num_pairs, self.batch_size, self.seed)
        rows = np.concatenate([idx, idx + self.num_pairs])
        self.step += 1
        return {k: v[rows] for k, v in self.data.items()}

    def get_state(self) -> dict[str, Any]:
        return {"step": self.step}

    def set_state(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


@gin.configurable
def run_dpo(output_dir: str, pairs: Sequence[PreferencePair], init_checkpoint: str | None = None,
            cfg: DPOConfig | None = None, progress: bool = True) -> dict[str, Any]:
    """Train DPO on `pairs` from `init_checkpoint` (any hcjax run; also the frozen reference;
    None: the loop config's init_checkpoint) into OUTPUT_DIR on one device, with that run's
    tokenizer; resumes from its checkpoints. Returns the summary (also OUTPUT_DIR/summary.json).
    progress: one JSON line per logged step."""
    cfg = cfg or DPOConfig()
    loop, optim = cfg.loop()
    init_checkpoint = init_checkpoint or loop.init_checkpoint
    if init_checkpoint is None:
        raise ValueError("run_dpo needs init_checkpoint: the policy's (and reference's) start")
    if not pairs:
        raise ValueError("run_dpo: no preference pairs")
    t0 = time.perf_counter()
    tok = run_tokenizer(init_checkpoint)
    mesh = make_mesh(MeshConfig(num_devices=1))
    model, model_cfg = load_model(init_checkpoint, mesh)
    if tok.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"the tokenizer of {init_checkpoint!r} has {tok.vocab_size} ids; the "
                         f"model's vocab_size is {model_cfg.vocab_size}")
    data, dropped = encode_pairs(pairs, tok, cfg.row_len)
    num_pairs = data["tokens"].shape[0] // 2
    if num_pairs == 0:
        raise ValueError(f"every pair is longer than DPOConfig.row_len={cfg.row_len}")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ref_params = jax.tree.map(jnp.copy, nnx.to_pure_dict(params))
    # The starting params are already the model's: the loop reads no init_checkpoint again.
    loop = dataclasses.replace(loop, init_checkpoint=None)
    trainer = Trainer(
        output_dir, model_cfg, PreferenceObjective(cfg, loop.num_microbatches),
        PairBatches(data, loop.batch_size, loop.seed), loop, optim, mesh,
        # Saved once, at the end.
        ckpt_cfg=CheckpointConfig(async_save=False, save_every=10**9, keep=1),
        model=model, dropout=False, reference=ref_params,
        prepare=preference_inputs(graphdef, rest), json_lines=progress,
        log_keys=("reward_accuracy", "reward_margin"), name="hcjax.dpo")
    try:
        result = trainer.train()
    finally:
        trainer.close()
    summary = {"pairs": num_pairs, "pairs_dropped_overlong": dropped,
               "steps": result.steps, "init_checkpoint": os.path.abspath(init_checkpoint),
               "beta": cfg.beta, "label_smoothing": cfg.label_smoothing,
               "first": result.first, "last": result.last,
               "wall_seconds": time.perf_counter() - t0}
    with open(os.path.join(output_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    return summary

"""SFT on the one training loop (hcjax.train.loop): the next-token objective on packed rows with
loss masks (the global-batch load-balance loss, exact gradient accumulation and dropout come
with the shared train step), the trainer of an SFT run and `run_sft`, the run behind
`python -m hcjax.sft` with its evaluation, summary and loss curve.

With `hf_checkpoint` the run starts from a Hugging Face folder's weights, config and tokenizer
(its chat template encodes the data and the evaluation prompts). The command line lives in
hcjax/sft.py; this module parses no flags, knows no task suite (the job hands it the one to
evaluate), and reads and writes models through hcjax.model_io.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

import gin
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from hcjax import sharding as shd
from hcjax.checkpoint import CheckpointConfig
from hcjax.data.tokenizer import Tokenizer, load_tokenizer
from hcjax.metrics import plot_curves, read_metrics, write_summary
from hcjax.model import ModelConfig
from hcjax.model_io import hf_source_meta, load_hf_model
from hcjax.train.loop import AdamWConfig, Trainer, TrainerConfig, TrainResult, make_run_step
from hcjax.train.pipeline import DataConfig, make_batch_iterator
from hcjax.train.step import Objective


def target_weights(batch: dict[str, jax.Array]) -> jax.Array:
    """[B, T] float32: 1 where position t is trained to predict token t+1 — the target is a
    loss-mask token of the same (non-padding) document. The last column has no target."""
    seg, mask = batch["segment_ids"], batch["loss_mask"]
    same_doc = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0)
    w = same_doc & (mask[:, 1:] > 0)
    return jnp.pad(w, ((0, 0), (0, 1))).astype(jnp.float32)


def token_nll(logits_btv: jax.Array, tokens_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-position negative log-likelihood of the next token and whether argmax hits it."""
    targets = jnp.pad(tokens_bt[:, 1:], ((0, 0), (0, 1)))
    logp = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    hit = (jnp.argmax(logits_btv, axis=-1) == targets).astype(jnp.float32)
    return nll, hit


MODEL_INPUTS = ("tokens", "positions", "segment_ids")


@dataclasses.dataclass(frozen=True)
class NextTokenObjective(Objective):
    """SFT's loss: Σ nll·w / Σ w over the whole batch (w = `target_weights`), its rows split into
    `num_microbatches` consecutive blocks. Metrics: `loss` (the NLL alone, the run's figure of
    merit; the optimised total adds the load-balance term), `token_accuracy`, `loss_tokens`,
    `tokens`, `load_balance_loss`."""

    num_microbatches: int = 1

    def split(self, batch):
        m = self.num_microbatches
        split = lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:])
        inputs = {name: split(batch[name]) for name in MODEL_INPUTS}
        return inputs, {"weights": split(target_weights(batch))}

    def context(self, batch, loss_state):
        weights = target_weights(batch)
        return {"total_w": jnp.maximum(jnp.sum(weights), 1.0), "loss_tokens": jnp.sum(weights),
                "tokens": jnp.sum(batch["segment_ids"] > 0).astype(jnp.float32)}

    def loss(self, out, inputs, data, ctx):
        nll, hit = token_nll(out.logits, inputs["tokens"])
        nll_sum = jnp.sum(nll * data["weights"])
        return nll_sum / ctx["total_w"], {"nll_sum": nll_sum,
                                          "hits": jnp.sum(hit * data["weights"])}

    def summarise(self, parts, ctx):
        return {
            "loss": jnp.sum(parts["nll_sum"]) / ctx["total_w"],
            "load_balance_loss": jnp.sum(parts["load_balance_loss"]),
            "token_accuracy": jnp.sum(parts["hits"]) / ctx["total_w"],
            "loss_tokens": ctx["loss_tokens"],
            "tokens": ctx["tokens"],
        }


def make_sft_step(
    graphdef: nnx.GraphDef,
    rest: Any,
    tx: optax.GradientTransformation,
    cfg: TrainerConfig,
    model_cfg: ModelConfig,
) -> Callable[[dict, dict], tuple[dict, dict]]:
    """`step(state, batch) -> (state, metrics)` of SFT on the loop's state {"params", "opt",
    "step"}: Σ nll·w / Σ w  +  coef · LB, both over the whole global batch, however many
    micro-batches it is split into (hcjax.train.step: the accumulated gradient is the full
    batch's, dropout aside: its masks are drawn per micro-batch from (seed, step))."""
    return make_run_step(graphdef, rest, tx, model_cfg, NextTokenObjective(cfg.num_microbatches),
                         load_balance_coef=cfg.load_balance_coef, dropout_seed=cfg.seed)


def sft_trainer(
    output_dir: str,
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    mesh: Mesh,
    *,
    cfg: TrainerConfig | None = None,
    optim: AdamWConfig | None = None,
    ckpt_cfg: CheckpointConfig | None = None,
    model: nnx.Module | None = None,
    tok: Tokenizer | None = None,
    hf_checkpoint: str | None = None,
    **options: Any,
) -> Trainer:
    """The loop (hcjax.train.loop.Trainer) of an SFT run: the next-token objective on packed
    documents of `data_cfg`, each process loading its own rows. cfg / optim / ckpt_cfg: None
    takes gin's TrainerConfig, AdamWConfig and CheckpointConfig. model: the starting weights
    (None: a fresh seeded initialisation); tok: the data's tokenizer (None: DataConfig's).
    hf_checkpoint: the folder `model` came from, recorded in the checkpoints' meta and under
    OUTPUT_DIR/hf (`hf_source_meta`: a run is not resumed from another source's checkpoints,
    and exports back with `python -m hcjax.convert --to_hf`). options: the Trainer's (profile,
    progress, json_lines)."""
    cfg = cfg or TrainerConfig()
    if data_cfg.row_len > model_cfg.max_seq_len:
        raise ValueError(
            f"DataConfig.row_len={data_cfg.row_len} exceeds ModelConfig.max_seq_len="
            f"{model_cfg.max_seq_len}"
        )
    # Each process loads its own rows; put_on_mesh assembles the global batch.
    if cfg.batch_size % jax.process_count():
        raise ValueError(
            f"TrainerConfig.batch_size={cfg.batch_size} is not a multiple of the "
            f"{jax.process_count()} processes"
        )
    meta: dict[str, Any] = {"row_len": data_cfg.row_len, "batch_size": cfg.batch_size}
    if hf_checkpoint is not None:
        meta.update(hf_source_meta(hf_checkpoint, os.path.abspath(output_dir)))
    source = make_batch_iterator(data_cfg, cfg.batch_size // jax.process_count(), tok=tok,
                                 shard_index=jax.process_index(),
                                 num_shards=jax.process_count())
    return Trainer(output_dir, model_cfg, NextTokenObjective(cfg.num_microbatches), source, cfg,
                   optim or AdamWConfig(), mesh, ckpt_cfg=ckpt_cfg or CheckpointConfig(),
                   meta=meta, model=model, name="hcjax.sft", **options)


def pretrain_base(output_dir: str, progress: bool = False) -> str:
    """Pre-train the tiny base (gin's ModelConfig, DataConfig and loop configs) into
    OUTPUT_DIR/base, resuming a previous run there, for a job that starts from it (the climb's
    default); no evaluation. progress: its step bar with the ETA. Returns the base's folder."""
    base_dir = os.path.join(output_dir, "base")
    # Exact mode changes arithmetic, not weights: the base is pre-trained in the default mode,
    # so a climb in exact mode starts from the same base as a default one.
    cfg = dataclasses.replace(ModelConfig(), batch_invariant=False)
    run_sft(base_dir, model_cfg=cfg, progress=progress, eval_problems=0)
    return base_dir


@gin.configurable
def run_sft(
    output_dir: str,
    model_cfg: ModelConfig | None = None,
    mesh_cfg: shd.MeshConfig | None = None,
    profile_start: int = -1,
    profile_stop: int = -1,
    progress: bool = True,
    json_lines: bool = False,
    stop_after: int | None = None,
    eval_problems: int = 200,
    eval_max_new_tokens: int = 32,
    hf_checkpoint: str | None = None,
    evaluate: Callable[..., dict] | None = None,
    eval_suite: Any = None,
) -> TrainResult:
    """Train (or resume) a run in `output_dir`, then evaluate and write summary and loss curve.

    progress: the step bar on a terminal; json_lines: one JSON object per logged step on stdout.
    stop_after: run at most this many steps now (checkpointed), leaving the rest for a resume.
    eval_problems: held-out problems of `eval_suite` evaluated (greedy pass@1) at the end of a
    run on the arithmetic data (DataConfig.source "arithmetic"), by `evaluate(model, suite,
    problems, tok=, max_tokens=) -> dict`; the job passes both (hcjax.sft: its task's suite and
    `hcjax.rl.pass_at_1.evaluate_model`; the trainer does not know tasks or how models are
    evaluated); None: no evaluation.
    hf_checkpoint: a Hugging Face folder to start from: its weights and config replace the fresh
    gin ModelConfig model (`model_cfg` must then be None), and its tokenizer, with its chat
    template, encodes the data and the evaluation (unless DataConfig.tokenizer names another).
    """
    cfg = TrainerConfig()
    data_cfg = DataConfig()
    mesh = shd.make_mesh(mesh_cfg or shd.MeshConfig())
    model = None
    if hf_checkpoint is not None:
        if model_cfg is not None:
            raise ValueError("run_sft: pass model_cfg or hf_checkpoint, not both")
        if data_cfg.tokenizer == "byte":
            data_cfg = dataclasses.replace(data_cfg, tokenizer=hf_checkpoint)
        model, model_cfg = load_hf_model(hf_checkpoint, mesh)
    model_cfg = model_cfg or ModelConfig()
    tok = load_tokenizer(data_cfg.tokenizer)
    if tok.vocab_size > model_cfg.vocab_size:
        raise ValueError(
            f"tokenizer {data_cfg.tokenizer!r} has {tok.vocab_size} ids; the model's vocab_size "
            f"is {model_cfg.vocab_size}"
        )
    trainer = sft_trainer(output_dir, model_cfg, data_cfg, mesh, cfg=cfg, model=model, tok=tok,
                          hf_checkpoint=hf_checkpoint, profile=(profile_start, profile_stop),
                          progress=progress, json_lines=json_lines)
    try:
        result = trainer.train(stop_after)
    finally:
        trainer.close()
    finished = result.steps >= cfg.num_steps  # a run stopped early is evaluated when resumed
    if (evaluate is not None and eval_suite is not None and eval_problems
            and data_cfg.source == "arithmetic" and finished):
        t = time.perf_counter()
        result.eval = evaluate(trainer.model(), eval_suite, eval_suite.heldout()[:eval_problems],
                               tok=tok, max_tokens=eval_max_new_tokens)
        result.eval["eval_wall_s"] = time.perf_counter() - t
        with open(os.path.join(output_dir, "eval.json"), "w", encoding="utf-8") as f:
            json.dump(result.eval, f, indent=1)
    records = read_metrics(os.path.join(output_dir, "metrics.jsonl"))
    plot_curves(records, os.path.join(output_dir, "loss_curve.png"), keys=("loss",))
    items: dict[str, Any] = {
        "steps": result.steps,
        "resumed_from_step": trainer.resumed_from,
        "final_loss": result.final_loss,
        "train_wall_s": result.wall_s,
        "tokens_per_s": result.tokens_per_s,
        "batch_size": cfg.batch_size,
        "row_len": data_cfg.row_len,
        "num_params": trainer.num_params(),
    }
    if hf_checkpoint is not None:
        items["hf_checkpoint"] = os.path.abspath(hf_checkpoint)
    if result.eval:
        items.update({f"eval_{k}": v for k, v in result.eval.items()
                      if isinstance(v, int | float)})
        items.update({f"eval_pass_at_1/{c}": v for c, v in result.eval["by_category"].items()})
    write_summary(output_dir, "hcjax.sft run summary", items)
    return result

"""The language-model trainer behind `python -m hcjax.sft`: next-token loss on packed rows with loss
masks, the global-batch load-balance loss, AdamW with warm-up + cosine decay, gradient clipping,
exact gradient accumulation, dropout, Orbax checkpoints with exact resume, metrics and traces.

Defaults are the self-distillation values of RECIPE §3 (cosine LR 1.7e-5 → 5.2e-6, 2% warm-up,
weight decay 0.001, load-balance coefficient 1e-2); the tiny base binds its own in gin.
With `hf_checkpoint` the run starts from a Hugging Face folder's weights, config and tokenizer
(its chat template encodes the data and the evaluation prompts). The command line lives in
hcjax/sft.py; this module parses no flags, and reads and writes models through hcjax.model_io.
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
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hcjax import sharding as shd
from hcjax.checkpoint import CheckpointConfig, Checkpointer
from hcjax.data.tokenizer import Tokenizer, load_tokenizer
from hcjax.metrics import MetricsWriter, Progress, plot_curves, read_metrics, write_summary
from hcjax.model import ModelConfig, create_sharded
from hcjax.model_io import hf_source_meta, load_hf_model, model_identity, read_checkpoint
from hcjax.profiling import StepTracer
from hcjax.tasks.arithmetic import ArithmeticSuite
from hcjax.train.pipeline import DataConfig, make_batch_iterator, put_on_mesh
from hcjax.train.step import (
    Objective,
    OptimizerConfig,
    make_optimizer,
    make_train_step,
    model_forward,
)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Optimisation settings. `batch_size` is global rows per step, split into
    `num_microbatches` whose accumulated gradient equals the full batch's."""

    num_steps: int = 1000
    batch_size: int = 32
    num_microbatches: int = 1
    peak_lr: float = 1.7e-5
    end_lr: float = 5.2e-6
    warmup_fraction: float = 0.02
    weight_decay: float = 0.001
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    load_balance_coef: float = 1e-2
    seed: int = 0
    log_every: int = 10
    init_checkpoint: str | None = None  # start from another run's latest params (fresh optimiser)

    def __post_init__(self) -> None:
        for name in ("num_steps", "batch_size", "num_microbatches", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"SFTConfig.{name}={getattr(self, name)} must be >= 1")
        if self.batch_size % self.num_microbatches:
            raise ValueError(
                f"SFTConfig.batch_size={self.batch_size} is not a multiple of "
                f"num_microbatches={self.num_microbatches}"
            )
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"SFTConfig.warmup_fraction={self.warmup_fraction} not in [0, 1)")
        if self.peak_lr <= 0 or self.end_lr < 0:
            raise ValueError(f"SFTConfig peak_lr={self.peak_lr}, end_lr={self.end_lr} invalid")
        if self.grad_clip <= 0:
            raise ValueError(f"SFTConfig.grad_clip={self.grad_clip} must be > 0")

    def optimizer(self) -> OptimizerConfig:
        """Global-norm clipping then AdamW; linear warm-up over `warmup_fraction` of the steps,
        then cosine from peak to end LR; weight decay only on matrices (not norm gains)."""
        return OptimizerConfig(
            learning_rate=self.peak_lr, end_learning_rate=self.end_lr,
            warmup_steps=int(round(self.warmup_fraction * self.num_steps)),
            total_steps=self.num_steps, b1=self.b1, b2=self.b2, eps=self.eps,
            weight_decay=self.weight_decay, decay_matrices_only=True,
            max_grad_norm=self.grad_clip,
        )


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


def make_run_step(
    graphdef: nnx.GraphDef,
    rest: Any,
    tx: optax.GradientTransformation,
    model_cfg: ModelConfig,
    objective: Objective,
    *,
    load_balance_coef: float,
    dropout_seed: int | None = None,
) -> Callable[[dict, Any], tuple[dict, dict]]:
    """`step(state, batch) -> (state, metrics)` of the shared train step (hcjax.train.step) on
    the run state of hcjax.sft and DPO checkpoints, {"params", "opt", "step"}."""
    train_step = make_train_step(model_forward(graphdef, rest), objective, tx,
                                 model_cfg=model_cfg, load_balance_coef=load_balance_coef,
                                 dropout_seed=dropout_seed)

    def step(state, batch):
        params, opt, metrics = train_step(state["params"], state["opt"], state["step"], batch)
        return {"params": params, "opt": opt, "step": state["step"] + 1}, metrics

    return step


def make_sft_step(
    graphdef: nnx.GraphDef,
    rest: Any,
    tx: optax.GradientTransformation,
    cfg: SFTConfig,
    model_cfg: ModelConfig,
) -> Callable[[dict, dict], tuple[dict, dict]]:
    """`step(state, batch) -> (state, metrics)`; state = {"params", "opt", "step"}.

    Loss = Σ nll·w / Σ w  +  coef · LB, both over the whole global batch, however many
    micro-batches it is split into (hcjax.train.step: the accumulated gradient is the full
    batch's, dropout aside: its masks are drawn per micro-batch from (seed, step)).
    """
    return make_run_step(graphdef, rest, tx, model_cfg, NextTokenObjective(cfg.num_microbatches),
                         load_balance_coef=cfg.load_balance_coef, dropout_seed=cfg.seed)


def _to_pure(params: nnx.State) -> dict:
    return nnx.to_pure_dict(params)


_STEP_CACHE: dict[tuple, Callable] = {}


@dataclasses.dataclass
class TrainResult:
    steps: int
    final_loss: float
    wall_s: float
    tokens_per_s: float
    eval: dict[str, Any] | None
    output_dir: str


class SFTTrainer:
    """Owns the model state, optimiser, data iterator, checkpointer and writers of one run."""

    def __init__(
        self,
        output_dir: str,
        model_cfg: ModelConfig,
        cfg: SFTConfig,
        data_cfg: DataConfig,
        ckpt_cfg: CheckpointConfig,
        mesh: Mesh,
        profile: tuple[int, int] = (-1, -1),
        progress: bool = True,
        json_lines: bool = False,
        model: nnx.Module | None = None,
        tok: Tokenizer | None = None,
        hf_checkpoint: str | None = None,
    ) -> None:
        """model: the starting weights (on `mesh`, of `model_cfg`), e.g. a Hugging Face model;
        None: a fresh seeded initialisation. tok: the data's tokenizer (None: DataConfig's).
        hf_checkpoint: the folder `model` came from, recorded in the checkpoints' meta and under
        OUTPUT_DIR/hf (`hf_source_meta`: a run is not resumed from another source's checkpoints,
        and exports back with `python -m hcjax.convert --to_hf`)."""
        self.output_dir = os.path.abspath(output_dir)
        os.makedirs(self.output_dir, exist_ok=True)
        self.model_cfg, self.cfg, self.data_cfg, self.mesh = model_cfg, cfg, data_cfg, mesh
        if data_cfg.row_len > model_cfg.max_seq_len:
            raise ValueError(
                f"DataConfig.row_len={data_cfg.row_len} exceeds ModelConfig.max_seq_len="
                f"{model_cfg.max_seq_len}"
            )
        meta = {
            "model_config": model_identity(model_cfg),
            "row_len": data_cfg.row_len,
            "batch_size": cfg.batch_size,
        }
        if hf_checkpoint is not None:
            meta.update(hf_source_meta(hf_checkpoint, self.output_dir))
        self.ckpt = Checkpointer(os.path.join(self.output_dir, "checkpoints"), ckpt_cfg, meta)
        # Refuse a checkpoint folder of another configuration before building anything.
        latest = self.ckpt.latest_step()
        if latest is not None:
            try:
                self.ckpt.check_compatible(latest)
            except ValueError:
                self.ckpt.close()
                raise
        # Each process loads its own rows; put_on_mesh assembles the global batch.
        if cfg.batch_size % jax.process_count():
            raise ValueError(
                f"SFTConfig.batch_size={cfg.batch_size} is not a multiple of the "
                f"{jax.process_count()} processes"
            )
        self.data = make_batch_iterator(
            data_cfg,
            cfg.batch_size // jax.process_count(),
            tok=tok,
            shard_index=jax.process_index(),
            num_shards=jax.process_count(),
        )
        self.batch_sharding = shd.batch_sharding(mesh)
        if model is None:
            model = create_sharded(model_cfg, mesh, seed=cfg.seed)
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self.opt_cfg = cfg.optimizer()
        self.tx = make_optimizer(self.opt_cfg)
        params = _to_pure(params)
        # Born on the mesh (moments sharded like their params, scalars replicated): moving
        # one-device arrays onto a mesh over several processes is not a supported transfer.
        state = {
            "params": params,
            "opt": shd.optimizer_state_on_mesh(self.tx, params, mesh),
            "step": shd.replicated_scalar(np.int32(0), mesh),
        }
        # Pin every leaf's sharding (scalars replicated) and use the same shardings for the
        # step's inputs and outputs, so the second call does not recompile.
        replicated = NamedSharding(mesh, PartitionSpec())
        self.state_shardings = jax.tree.map(
            lambda x: x.sharding
            if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
            else replicated,
            state,
        )
        self.state = jax.device_put(state, self.state_shardings)
        # A trainer re-created in the same process (resume, tests, repeated distillation
        # rounds) reuses the compiled step when nothing it closes over differs.
        key = (cfg, model_cfg, mesh, self.batch_sharding)
        self._step_fn = _STEP_CACHE.get(key) if not jax.tree.leaves(self.rest) else None
        if self._step_fn is None:
            self._step_fn = jax.jit(
                make_sft_step(self.graphdef, self.rest, self.tx, cfg, model_cfg),
                in_shardings=(self.state_shardings, self.batch_sharding),
                out_shardings=(self.state_shardings, replicated),
                donate_argnums=0,
            )
            _STEP_CACHE[key] = self._step_fn
        self.tracer = StepTracer(os.path.join(self.output_dir, "profile"), *profile)
        self.progress_enabled = progress
        self.json_lines = json_lines  # one JSON object per logged step on stdout
        self.resumed_from: int | None = None
        self._restore_or_init()

    def _restore_or_init(self) -> None:
        latest = self.ckpt.latest_step()
        if latest is not None:
            self.state, data_state = self.ckpt.restore(latest, self.state)
            if data_state:
                self.data.set_state(data_state)
            self.resumed_from = latest
        elif self.cfg.init_checkpoint:
            # Any hcjax run's params (sft, convert, merge, dpo or climb layout), read into this
            # run's shardings after checking they were written for this model.
            self.state["params"] = read_checkpoint(
                self.cfg.init_checkpoint, model_cfg=self.model_cfg, target=self.state["params"]
            ).params

    @property
    def step(self) -> int:
        return int(self.state["step"])

    def model(self) -> nnx.Module:
        """The current model (shares the trainer's arrays; do not train it)."""
        return nnx.merge(self.graphdef, self.state["params"], self.rest)

    def train(self, stop_after: int | None = None) -> TrainResult:
        """Run to `num_steps` (or only `stop_after` more steps, e.g. to end within a time slot;
        the last step run is checkpointed either way)."""
        start_step = self.step
        total = self.cfg.num_steps
        end = total if stop_after is None else min(total, start_step + stop_after)
        writer = MetricsWriter(self.output_dir)
        bar = Progress(total, initial=start_step, disable=not self.progress_enabled)
        t0 = time.perf_counter()
        tokens_seen = 0
        last_loss = float("nan")
        saved_at = start_step
        try:
            for step in range(start_step, end):
                try:
                    host = next(self.data)
                except StopIteration:
                    print(f"hcjax.sft: data exhausted after {step} steps; stopping there")
                    break
                step_tokens = int(np.sum(host["segment_ids"] > 0))
                tokens_seen += step_tokens
                batch = put_on_mesh(host, self.batch_sharding)
                self.tracer.before_step(step)
                self.state, metrics = self._step_fn(self.state, batch)
                self.tracer.after_step(step, self.state["params"])
                done = step + 1
                last = done == end
                save_due = last or done % self.ckpt.cfg.save_every == 0
                synced = done % self.cfg.log_every == 0 or last or save_due
                synced = synced or done == start_step + 1
                if synced:
                    m = jax.device_get(metrics)
                    m["lr"] = self.opt_cfg.learning_rate_at(step)
                    last_loss = float(m["loss"])
                    # Checked before any save, so a diverged run never overwrites good weights.
                    if not np.isfinite(last_loss):
                        raise FloatingPointError(f"loss={last_loss} at step {done}; stopping")
                    writer.write(done, m)
                tokens_per_s = bar.update(last_loss, step_tokens, synced=synced)
                if synced and self.json_lines:
                    print(json.dumps({"step": done, "loss": last_loss, "lr": float(m["lr"]),
                                      "tokens_per_s": round(tokens_per_s, 1)}), flush=True)
                if save_due:
                    self.ckpt.save(done, self.state, self.data.get_state(), force=True)
                    saved_at = done
            if self.step != saved_at:  # ended early (data exhausted): keep the last step too
                self.ckpt.save(self.step, self.state, self.data.get_state(), force=True)
        finally:
            self.tracer.close()
            bar.close()
            writer.close()
            self.ckpt.wait()
        jax.block_until_ready(self.state)
        wall = time.perf_counter() - t0
        return TrainResult(
            steps=self.step,
            final_loss=last_loss,
            wall_s=wall,
            tokens_per_s=tokens_seen / max(wall, 1e-9),
            eval=None,
            output_dir=self.output_dir,
        )

    def close(self) -> None:
        self.ckpt.close()


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
) -> TrainResult:
    """Train (or resume) a run in `output_dir`, then evaluate and write summary and loss curve.

    progress: the step bar on a terminal; json_lines: one JSON object per logged step on stdout.
    stop_after: run at most this many steps now (checkpointed), leaving the rest for a resume.
    eval_problems: held-out problems of the arithmetic suite evaluated (greedy pass@1) at the end,
    by `evaluate(model, suite, problems, tok=, max_tokens=) -> dict` (the job passes
    `hcjax.rl.pass_at_1.evaluate_model`; the trainer does not know how models are evaluated);
    None: no evaluation.
    hf_checkpoint: a Hugging Face folder to start from: its weights and config replace the fresh
    gin ModelConfig model (`model_cfg` must then be None), and its tokenizer, with its chat
    template, encodes the data and the evaluation (unless DataConfig.tokenizer names another).
    """
    cfg = SFTConfig()
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
    trainer = SFTTrainer(
        output_dir,
        model_cfg,
        cfg,
        data_cfg,
        CheckpointConfig(),
        mesh,
        profile=(profile_start, profile_stop),
        progress=progress,
        json_lines=json_lines,
        model=model,
        tok=tok,
        hf_checkpoint=hf_checkpoint,
    )
    try:
        result = trainer.train(stop_after)
    finally:
        trainer.close()
    finished = result.steps >= cfg.num_steps  # a run stopped early is evaluated when resumed
    if evaluate is not None and eval_problems and data_cfg.source == "arithmetic" and finished:
        suite = ArithmeticSuite()
        t = time.perf_counter()
        result.eval = evaluate(trainer.model(), suite, suite.heldout()[:eval_problems],
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
        "num_params": sum(x.size for x in jax.tree.leaves(trainer.state["params"])),
    }
    if hf_checkpoint is not None:
        items["hf_checkpoint"] = os.path.abspath(hf_checkpoint)
    if result.eval:
        items.update({f"eval_{k}": v for k, v in result.eval.items()
                      if isinstance(v, int | float)})
        items.update({f"eval_pass_at_1/{c}": v for c, v in result.eval["by_category"].items()})
    write_summary(output_dir, "hcjax.sft run summary", items)
    return result

"""The one training loop that SFT, DPO and whatever trains next share: a model, an `Objective`,
a batch source and two configs, the loop's (`TrainerConfig`) and the optimiser's (`AdamWConfig`),
run for `num_steps` with Orbax checkpoints and exact resume, metrics, traces and progress.

A job is what it passes in (SFT: packed documents and the next-token objective; DPO: preference
pairs, the preference objective and its frozen reference). This module parses no flags, knows no
job's data or loss, and reads other runs' models only through hcjax.model_io. (The RL learner is
driven step by step by the climb's controller, hcjax.rl, on the same train step.)
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import gin
import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hcjax import sharding as shd
from hcjax.checkpoint import CheckpointConfig, Checkpointer
from hcjax.metrics import MetricsWriter, Progress
from hcjax.model import ModelConfig, create_sharded
from hcjax.model_io import model_identity, read_checkpoint
from hcjax.profiling import StepTracer
from hcjax.train.pipeline import put_on_mesh
from hcjax.train.step import (
    Objective,
    OptimizerConfig,
    make_optimizer,
    make_train_step,
    model_forward,
)

__all__ = ["AdamWConfig", "BatchSource", "TrainResult", "Trainer", "TrainerConfig",
           "make_run_step"]


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """The loop's settings. `batch_size` is global rows (DPO: pairs) per step, split into
    `num_microbatches` whose accumulated gradient equals the full batch's. seed: a fresh model's
    initialisation, dropout masks and the order of DPO's pairs. init_checkpoint: start from
    another run's latest params (any hcjax run; fresh optimiser) when this run has no checkpoint
    of its own. load_balance_coef: the MoE load-balance loss's weight in the optimised total."""

    num_steps: int = 1000
    batch_size: int = 32
    num_microbatches: int = 1
    load_balance_coef: float = 1e-2
    seed: int = 0
    log_every: int = 10
    init_checkpoint: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_steps", "batch_size", "num_microbatches", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainerConfig.{name}={getattr(self, name)} must be >= 1")
        if self.batch_size % self.num_microbatches:
            raise ValueError(
                f"TrainerConfig.batch_size={self.batch_size} is not a multiple of "
                f"num_microbatches={self.num_microbatches}"
            )
        if self.load_balance_coef < 0:
            raise ValueError(f"TrainerConfig.load_balance_coef={self.load_balance_coef} must "
                             "be >= 0")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class AdamWConfig:
    """The loop's optimiser: global-norm clipping, then AdamW with weight decay on matrices only
    (not norm gains), its learning rate warmed up linearly over `warmup_fraction` of the steps
    and then decayed by a cosine from `peak_lr` to `end_lr`. Defaults are the self-distillation
    values of RECIPE §3 (cosine LR 1.7e-5 → 5.2e-6, 2% warm-up, weight decay 0.001); the RL
    learner's constant-LR AdamW is LearnerConfig's."""

    peak_lr: float = 1.7e-5
    end_lr: float = 5.2e-6
    warmup_fraction: float = 0.02
    weight_decay: float = 0.001
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"AdamWConfig.warmup_fraction={self.warmup_fraction} not in [0, 1)")
        if self.peak_lr <= 0 or self.end_lr < 0:
            raise ValueError(f"AdamWConfig peak_lr={self.peak_lr}, end_lr={self.end_lr} invalid")
        if self.grad_clip <= 0:
            raise ValueError(f"AdamWConfig.grad_clip={self.grad_clip} must be > 0")

    def optimizer(self, num_steps: int) -> OptimizerConfig:
        """The schedule over a run of `num_steps` steps, as the train step's OptimizerConfig."""
        return OptimizerConfig(
            learning_rate=self.peak_lr, end_learning_rate=self.end_lr,
            warmup_steps=int(round(self.warmup_fraction * num_steps)),
            total_steps=num_steps, b1=self.b1, b2=self.b2, eps=self.eps,
            weight_decay=self.weight_decay, decay_matrices_only=True,
            max_grad_norm=self.grad_clip,
        )


class BatchSource(Protocol):
    """Host batches for the loop: `next()` gives this process's rows as int32 arrays
    ({"tokens", "positions", "segment_ids", "loss_mask", ...}, what the objective splits);
    StopIteration ends the run early. Its state is checkpointed with the model's, so a resumed
    run sees the batches an uninterrupted one would have."""

    def __next__(self) -> dict[str, np.ndarray]: ...

    def get_state(self) -> dict[str, Any]: ...

    def set_state(self, state: dict[str, Any]) -> None: ...


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
    the loop's run state {"params", "opt", "step"}: the loss is the objective's over the whole
    global batch plus load_balance_coef times the global load-balance loss, however many
    micro-batches it is split into. dropout_seed: dropout masks from (seed, step, micro-batch)
    when the model has dropout; None runs it deterministically."""
    train_step = make_train_step(model_forward(graphdef, rest), objective, tx,
                                 model_cfg=model_cfg, load_balance_coef=load_balance_coef,
                                 dropout_seed=dropout_seed)

    def step(state, batch):
        params, opt, metrics = train_step(state["params"], state["opt"], state["step"], batch)
        return {"params": params, "opt": opt, "step": state["step"] + 1}, metrics

    return step


@dataclasses.dataclass
class TrainResult:
    steps: int
    final_loss: float
    wall_s: float
    tokens_per_s: float
    eval: dict[str, Any] | None
    output_dir: str
    first: dict[str, float] | None = None  # the metrics of the first and last logged steps
    last: dict[str, float] | None = None


# A trainer re-created in the same process (resume, tests, repeated distillation rounds) reuses
# the compiled step when nothing it closes over differs.
_STEP_CACHE: dict[tuple, Callable] = {}


class Trainer:
    """Owns one run's state, optimiser, batch source, checkpointer and writers.

    model: the starting weights (on `mesh`, of `model_cfg`); None: a fresh initialisation seeded
    by TrainerConfig.seed. meta: checkpoint meta beside the model's identity; a checkpoint folder
    whose meta differs is refused before anything is built. dropout: draw dropout masks (when
    the model has dropout); False runs the model deterministically (DPO scores policy and
    reference by the same forward). reference, prepare: a frozen pytree on `mesh` and
    `prepare(reference, batch) -> batch`, run inside the compiled step before the objective
    sees the batch (DPO: the reference's log-probs of every row). progress: a step bar;
    json_lines: one JSON line per logged step on stdout ({"step", "loss", "lr", "tokens_per_s"}
    and `log_keys`). name: how notes name the job."""

    def __init__(
        self,
        output_dir: str,
        model_cfg: ModelConfig,
        objective: Objective,
        source: BatchSource,
        cfg: TrainerConfig,
        optim: AdamWConfig,
        mesh: Mesh,
        *,
        ckpt_cfg: CheckpointConfig,
        meta: Mapping[str, Any] | None = None,
        model: nnx.Module | None = None,
        dropout: bool = True,
        reference: Any = None,
        prepare: Callable[[Any, dict], dict] | None = None,
        profile: tuple[int, int] = (-1, -1),
        progress: bool = False,
        json_lines: bool = False,
        log_keys: Sequence[str] = (),
        name: str = "hcjax.train",
    ) -> None:
        self.output_dir = os.path.abspath(output_dir)
        os.makedirs(self.output_dir, exist_ok=True)
        self.model_cfg, self.cfg, self.mesh, self.name = model_cfg, cfg, mesh, name
        self.ckpt = Checkpointer(os.path.join(self.output_dir, "checkpoints"), ckpt_cfg,
                                 {"model_config": model_identity(model_cfg), **(meta or {})})
        # Refuse a checkpoint folder of another configuration before building anything.
        latest = self.ckpt.latest_step()
        if latest is not None:
            try:
                self.ckpt.check_compatible(latest)
            except ValueError:
                self.ckpt.close()
                raise
        self.data = source
        self.batch_sharding = shd.batch_sharding(mesh)
        if model is None:
            model = create_sharded(model_cfg, mesh, seed=cfg.seed)
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self.opt_cfg = optim.optimizer(cfg.num_steps)
        self.tx = make_optimizer(self.opt_cfg)
        params = nnx.to_pure_dict(params)
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
        self._step_fn = self._compile(objective, dropout, reference, prepare, replicated)
        self.tracer = StepTracer(os.path.join(self.output_dir, "profile"), *profile)
        self.progress_enabled = progress
        self.json_lines = json_lines
        self.log_keys = tuple(log_keys)
        self.resumed_from: int | None = None
        self._restore_or_init()

    def _compile(self, objective: Objective, dropout: bool, reference: Any,
                 prepare: Callable | None, replicated: NamedSharding) -> Callable:
        """fn(state, batch) -> (state, metrics), jitted with the run's shardings."""
        cfg = self.cfg
        dropout_seed = cfg.seed if dropout else None
        step = make_run_step(self.graphdef, self.rest, self.tx, self.model_cfg, objective,
                             load_balance_coef=cfg.load_balance_coef, dropout_seed=dropout_seed)
        outs = dict(out_shardings=(self.state_shardings, replicated), donate_argnums=0)
        if prepare is not None:
            with_reference = jax.jit(
                lambda state, batch, ref: step(state, prepare(ref, batch)),
                in_shardings=(self.state_shardings, self.batch_sharding,
                              jax.tree.map(lambda x: x.sharding, reference)), **outs)
            return lambda state, batch: with_reference(state, batch, reference)
        key = (cfg, self.opt_cfg, objective, dropout_seed, self.model_cfg, self.mesh,
               self.batch_sharding)
        cached = _STEP_CACHE.get(key) if not jax.tree.leaves(self.rest) else None
        if cached is None:
            cached = jax.jit(step, in_shardings=(self.state_shardings, self.batch_sharding),
                             **outs)
            _STEP_CACHE[key] = cached
        return cached

    def _restore_or_init(self) -> None:
        latest = self.ckpt.latest_step()
        if latest is not None:
            self.state, data_state = self.ckpt.restore(latest, self.state)
            if data_state:
                self.data.set_state(data_state)
            self.resumed_from = latest
        elif self.cfg.init_checkpoint:
            # Any hcjax run's params, read into this run's shardings after checking they were
            # written for this model.
            self.state["params"] = read_checkpoint(
                self.cfg.init_checkpoint, model_cfg=self.model_cfg, target=self.state["params"]
            ).params

    @property
    def step(self) -> int:
        return int(self.state["step"])

    def model(self) -> nnx.Module:
        """The current model (shares the trainer's arrays; do not train it)."""
        return nnx.merge(self.graphdef, self.state["params"], self.rest)

    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(self.state["params"]))

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
        first = last = None
        saved_at = start_step
        try:
            for step in range(start_step, end):
                try:
                    host = next(self.data)
                except StopIteration:
                    print(f"{self.name}: data exhausted after {step} steps; stopping there")
                    break
                step_tokens = int(np.sum(host["segment_ids"] > 0))
                tokens_seen += step_tokens
                batch = put_on_mesh(host, self.batch_sharding)
                self.tracer.before_step(step)
                self.state, metrics = self._step_fn(self.state, batch)
                self.tracer.after_step(step, self.state["params"])
                done = step + 1
                save_due = done == end or done % self.ckpt.cfg.save_every == 0
                synced = done % self.cfg.log_every == 0 or save_due or done == start_step + 1
                if synced:
                    m = jax.device_get(metrics)
                    m["lr"] = self.opt_cfg.learning_rate_at(step)
                    last_loss = float(m["loss"])
                    # Checked before any save, so a diverged run never overwrites good weights.
                    if not np.isfinite(last_loss):
                        raise FloatingPointError(f"loss={last_loss} at step {done}; stopping")
                    writer.write(done, m)
                    last = {k: float(v) for k, v in m.items() if np.ndim(v) == 0}
                    first = first or last
                tokens_per_s = bar.update(last_loss, step_tokens, synced=synced)
                if synced and self.json_lines:
                    print(json.dumps({"step": done, "loss": last_loss, "lr": last["lr"],
                                      "tokens_per_s": round(tokens_per_s, 1),
                                      **{k: last[k] for k in self.log_keys}}), flush=True)
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
        return TrainResult(steps=self.step, final_loss=last_loss, wall_s=wall,
                           tokens_per_s=tokens_seen / max(wall, 1e-9), eval=None,
                           output_dir=self.output_dir, first=first, last=last)

    def close(self) -> None:
        self.ckpt.close()

"""The sharded RL learner: GRPO (or any loss of `LOSSES`) on packed rollouts through the shared
train step (hcjax.train.step), with the sampler's routing and top-p support replayed.

Per micro-batch the model runs with the sampler's expert routing forced (routing replay: the
batch's routing record), the learner rebuilds the sampler's top-p support and masks every other
logit to -inf (top-p replay), and the chosen loss is normalised by the *global* token count; the
shared step accumulates gradients, adds the global-batch load-balance loss and applies AdamW
(RECIPE §3); then the entropy controller updates k. `Learner` is the controller's learner
(`train(rollouts)`). It uses the model only through its public forward.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh

from hcjax import sharding as shd
from hcjax.model import ModelConfig, Transformer, head_logits, shard_state, update_correction_bias
from hcjax.model_io import resumed_layout_wrapped
from hcjax.rl import batch as batch_lib
from hcjax.rl.batch import LearnerBatch
from hcjax.rl.entropy import EntropyController
from hcjax.rl.losses import LossConfig
from hcjax.rollout.records import (
    Rollout,
    order_keys,
    support_mask_from_record,
    support_mask_from_thresholds,
    support_thresholds,
)
from hcjax.sharding import optimizer_state_on_mesh, replicated_scalar
from hcjax.train.step import (
    Objective,
    OptimizerConfig,
    combine_metrics,
    make_loss_and_grad,
    make_optimizer,
    make_train_step,
    model_forward,
)
from pallas_kernels import batch_invariant as bi

__all__ = [
    "Learner",
    "LearnerConfig",
    "LearnerState",
    "PolicyObjective",
    "chunked_token_logprobs",
    "make_learner_step",
    "state_from_disk",
    "state_on_disk",
    "token_logprobs",
]


@gin.configurable
@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """Optimiser and objective of the RL learner; defaults are RECIPE §3's."""

    learning_rate: float = 1e-6
    b1: float = 0.95
    b2: float = 0.95
    adam_eps: float = 1e-15
    weight_decay: float = 0.0
    max_grad_norm: float | None = None  # None = no gradient clipping
    load_balance_coef: float = 1e-5
    micro_batches: int = 1
    seq_len: int = 256  # packed row length
    replay_top_p: bool = True
    replay_routing: bool = True
    mask_truncated: bool = True
    # DeepSeek-V3 auxiliary-loss-free balancing: after each step every MoE layer's router
    # correction bias moves by ± this rate towards the mean load (0: off; DeepSeek-V3 used 1e-3).
    router_bias_rate: float = 0.0
    # Tokens of a row whose logits are formed at once (`chunked_token_logprobs`): the step never
    # holds a [T, V] array per row, only [logprob_chunk, V / tensor] per device. 0: whole rows
    # (`token_logprobs` on the model's logits). Each slice gathers the head and reduces its
    # gradient once (Qwen3-30B-A3B on v5p:4x4x4, 8K rows: 1024 costs +25 GB of collectives a
    # step, 4096 about +4 GB, against 0.6 GB more of logits held per device).
    logprob_chunk: int = 4096
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    entropy: EntropyController = dataclasses.field(default_factory=EntropyController)

    def __post_init__(self) -> None:
        if self.learning_rate < 0:
            raise ValueError(f"LearnerConfig.learning_rate={self.learning_rate} must be >= 0")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ValueError(f"LearnerConfig b1={self.b1}, b2={self.b2} must be in [0, 1)")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"LearnerConfig.max_grad_norm={self.max_grad_norm} must be > 0 or None")
        if self.load_balance_coef < 0:
            raise ValueError(f"LearnerConfig.load_balance_coef={self.load_balance_coef} must be >= 0")
        if self.micro_batches < 1:
            raise ValueError(f"LearnerConfig.micro_batches={self.micro_batches} must be >= 1")
        if self.seq_len < 2:
            raise ValueError(f"LearnerConfig.seq_len={self.seq_len} must be >= 2")
        if self.router_bias_rate < 0:
            raise ValueError(f"LearnerConfig.router_bias_rate={self.router_bias_rate} must be >= 0")
        if self.logprob_chunk < 0:
            raise ValueError(f"LearnerConfig.logprob_chunk={self.logprob_chunk} must be >= 0")

    def optimizer(self) -> OptimizerConfig:
        """AdamW (β1 = β2 = 0.95, eps 1e-15, no weight decay, constant LR), optional global clip."""
        return OptimizerConfig(learning_rate=self.learning_rate, b1=self.b1, b2=self.b2,
                               eps=self.adam_eps, weight_decay=self.weight_decay,
                               max_grad_norm=self.max_grad_norm)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LearnerState:
    """Everything a checkpoint needs: parameters, optimiser state, controller state, step."""

    params: nnx.State
    opt_state: optax.OptState
    entropy: dict  # {"k": float32 scalar}
    step: jax.Array


def _is_state(x: Any) -> bool:
    return isinstance(x, nnx.State)


def state_on_disk(state: LearnerState) -> dict[str, Any]:
    """The learner state as checkpoints hold it, in the one layout every hcjax run writes: a dict
    of its fields with the parameters and the optimiser's moments as plain dicts of arrays
    (`nnx.to_pure_dict`), so hcjax.model_io reads a climb's params as it reads any job's. The
    arrays are the state's own (no copy)."""
    return {f.name: jax.tree.map(lambda x: nnx.to_pure_dict(x) if _is_state(x) else x,
                                 getattr(state, f.name), is_leaf=_is_state)
            for f in dataclasses.fields(state)}


def state_from_disk(like: LearnerState, saved: dict[str, Any]) -> LearnerState:
    """`state_on_disk`'s inverse: `saved`'s arrays in the structure of `like` (its nnx.States
    rebuilt from the plain dicts)."""
    def back(template: Any, plain: Any) -> Any:
        if not _is_state(template):
            return plain
        state = jax.tree.map(lambda x: x, template)  # a fresh State of the same variables
        nnx.replace_by_pure_dict(state, plain)
        return state

    return LearnerState(**{f.name: jax.tree.map(back, getattr(like, f.name), saved[f.name],
                                                 is_leaf=_is_state)
                           for f in dataclasses.fields(like)})


def token_logprobs(logits_btv, targets_bt, temperature_bt, n_kept_bt, replay_top_p: bool,
                   exact: bool = False):
    """log π(target) under the sampler's distribution: temperature, then the replayed support.

    Returns (logp [B, T], support_miss [B, T] bool). The target is always kept in the support: if
    learner and sampler rank the logits differently enough that the sampled token falls outside
    the learner's top-n_kept, a -inf log-prob would poison the step, so we keep it and count it.
    `exact` (exact mode): the normaliser is the batch-invariant one the engine records with
    (`hcjax.rollout.sampling.exact_logprobs`).
    """
    logsumexp = bi.logsumexp if exact else jax.nn.logsumexp
    # Divide (not multiply by 1/T) exactly as the sampler does, so ranks and ties match bit for bit.
    logits = logits_btv / temperature_bt[..., None]
    target_logit = jnp.take_along_axis(logits, targets_bt[..., None], axis=-1)[..., 0]
    if not replay_top_p:
        return target_logit - logsumexp(logits, axis=-1), jnp.zeros(targets_bt.shape, bool)
    keep = support_mask_from_record(jax.lax.stop_gradient(logits), n_kept_bt)
    is_target = jnp.arange(logits.shape[-1]) == targets_bt[..., None]
    miss = ~jnp.any(keep & is_target, axis=-1)
    logits = jnp.where(keep | is_target, logits, -jnp.inf)
    return target_logit - logsumexp(logits, axis=-1), miss


def _chunk_logprobs(head_vd, hidden_bcd, targets_bc, temperature_bc, n_kept_bc,
                    replay_top_p: bool, exact_tile: int | None = None):
    """`token_logprobs` of one slice of tokens, from the head's input and weight; the kept set
    as thresholds (`support_thresholds`), named so a remat keeps them instead of recounting."""
    # The head gathered over the batch axes, split over the vocabulary only (as the logits are),
    # and the slice's input whole in the width: the product needs no collective.
    head_vd = shd.constrain(head_vd.astype(hidden_bcd.dtype), ("activation_vocab", None))
    hidden_bcd = shd.constrain(hidden_bcd, ("activation_batch", "activation_length", None))
    logsumexp = jax.nn.logsumexp if exact_tile is None else bi.logsumexp
    logits = head_logits(hidden_bcd, head_vd, exact_tile) / temperature_bc[..., None]
    target_logit = jnp.take_along_axis(logits, targets_bc[..., None], axis=-1)[..., 0]
    if not replay_top_p:
        return target_logit - logsumexp(logits, axis=-1), jnp.zeros(targets_bc.shape, bool)
    v, cut = support_thresholds(jax.lax.stop_gradient(logits), n_kept_bc)
    v, cut = checkpoint_name(v, "support_v"), checkpoint_name(cut, "support_cut")
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    keep = support_mask_from_thresholds(order_keys(jax.lax.stop_gradient(logits)), ids, v, cut)
    keep = keep | (ids == targets_bc[..., None])
    hit = support_mask_from_thresholds(order_keys(jax.lax.stop_gradient(target_logit))[..., None],
                                       targets_bc[..., None], v, cut)[..., 0]
    logits = jnp.where(keep, logits, -jnp.inf)
    return target_logit - logsumexp(logits, axis=-1), ~hit


def chunked_token_logprobs(hidden_btd, head_vd, targets_bt, temperature_bt, n_kept_bt,
                           replay_top_p: bool, chunk: int, exact_tile: int | None = None):
    """`token_logprobs` from the head's input [B, T, D] and weight [V, D] (`ModelOutput.hidden`,
    `head_weight`), `chunk` tokens of every row at a time: the same values, but no [B, T, V] array.

    A scan over slices of the sequence; each slice's logits (sharded over the vocabulary like the
    head) are formed, reduced to (log-prob, miss) and dropped; its backward forms them again
    (remat) with the kept set's two thresholds saved, so the 32 counting passes of the top-p
    replay run once. Rows are padded to a multiple of `chunk` (the padding is sliced off).
    """
    b, t, _ = hidden_btd.shape
    c = max(1, min(chunk, t))
    pad = -t % c
    if pad:
        widen = lambda a, value: jnp.pad(  # noqa: E731
            a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2), constant_values=value)
        hidden_btd, targets_bt = widen(hidden_btd, 0), widen(targets_bt, 0)
        temperature_bt, n_kept_bt = widen(temperature_bt, 1), widen(n_kept_bt, 0)
    n = (t + pad) // c

    def slices(a):  # [B, n·c, ...] -> [n, B, c, ...]
        return jnp.moveaxis(a.reshape(b, n, c, *a.shape[2:]), 1, 0)

    one = jax.checkpoint(
        functools.partial(_chunk_logprobs, replay_top_p=replay_top_p, exact_tile=exact_tile),
        policy=jax.checkpoint_policies.save_only_these_names("support_v", "support_cut"))

    def body(_, xs):
        h, tg, tmp, nk = xs
        return None, one(head_vd, h, tg, tmp, nk)

    _, (logp, miss) = jax.lax.scan(
        body, None, tuple(slices(a) for a in (hidden_btd, targets_bt, temperature_bt, n_kept_bt)))
    unslice = lambda a: jnp.moveaxis(a, 0, 1).reshape(b, n * c)[:, :t]  # noqa: E731
    return unslice(logp), unslice(miss)


# Measured on the first micro-batch only, where θ is the sampling policy (see `summarise`).
_FIRST = ("first_gap_sum", "first_gap_max", "first_tokens", "first_exact", "first_fresh")
_LOSS_FIELDS = ("targets", "loss_mask", "old_logp", "advantages", "n_kept", "temperature",
                "fresh")


@dataclasses.dataclass(frozen=True)
class PolicyObjective(Objective):
    """The policy loss (`cfg.loss`, from `LOSSES`) of a `LearnerBatch`, with the sampler's top-p
    support replayed (`token_logprobs`) and, when `cfg.replay_routing`, its routing record fed
    to the forward. loss_state: the clip offset k."""

    cfg: LearnerConfig
    exact_tile: int | None = None  # the model's ModelConfig.exact_tile (exact mode)

    def split(self, batch: LearnerBatch):
        inputs = {"tokens": batch.tokens, "positions": batch.positions,
                  "segment_ids": batch.segment_ids}
        if self.cfg.replay_routing and batch.routing is not None:
            inputs["routing"] = batch.routing
        return inputs, {name: getattr(batch, name) for name in _LOSS_FIELDS}

    def context(self, batch: LearnerBatch, k):
        return {"k": k, "num_tokens": batch.num_tokens, "num_sequences": batch.num_sequences}

    def loss(self, out, inputs, d, ctx):
        if out.logits is None:
            logp, miss = chunked_token_logprobs(
                out.hidden, out.head_weight, d["targets"], d["temperature"], d["n_kept"],
                self.cfg.replay_top_p, self.cfg.logprob_chunk, self.exact_tile)
        else:
            logp, miss = token_logprobs(out.logits, d["targets"], d["temperature"], d["n_kept"],
                                        self.cfg.replay_top_p, exact=self.exact_tile is not None)
        policy_loss, metrics = self.cfg.loss.make()(
            logp, d["old_logp"], d["advantages"], d["loss_mask"], k=ctx["k"],
            num_tokens=ctx["num_tokens"], num_sequences=ctx["num_sequences"],
            segment_ids=inputs["segment_ids"],
        )
        mask = d["loss_mask"]
        fresh = mask if d["fresh"] is None else mask & d["fresh"]
        m = mask.astype(jnp.float32)
        gap = jnp.abs(jax.lax.stop_gradient(logp) - d["old_logp"])
        if self.cfg.router_bias_rate > 0 and out.moe_stats:
            # [L, E] tokens per expert (the replayed routing when replay is on): the load the
            # correction-bias rule reads; the learner step takes it out of the metrics.
            metrics = dict(metrics, router_load=jnp.stack([s[0] for s in out.moe_stats]))
        return policy_loss, dict(
            metrics,
            policy_loss=policy_loss,
            support_miss_frac=jnp.sum(jnp.where(mask & miss, 1.0, 0.0)) / ctx["num_tokens"],
            first_gap_sum=jnp.sum(m * gap),
            first_gap_max=jnp.max(jnp.where(mask, gap, 0.0)),
            first_tokens=jnp.sum(m),
            first_exact=jnp.sum(jnp.where(fresh & (jax.lax.stop_gradient(logp) == d["old_logp"]),
                                          1.0, 0.0)),
            first_fresh=jnp.sum(jnp.where(fresh, 1.0, 0.0)),
        )

    def summarise(self, parts, ctx):
        parts = dict(parts)
        gap_sum, gap_max, tokens, exact, fresh = (parts.pop(name)[0] for name in _FIRST)
        metrics = combine_metrics(parts)
        # Train-inference log-prob gap on the first micro-batch: θ is the sampling policy there.
        metrics["logp_gap_mean"] = gap_sum / jnp.maximum(tokens, 1.0)
        metrics["logp_gap_max"] = gap_max
        # Of those tokens, the ones the learner's own weights sampled (`fresh`, all when the
        # batch does not say), and their share whose log-prob equals the sampler's to the bit
        # (1 in exact mode, ModelConfig.batch_invariant).
        metrics["fresh_token_share"] = fresh / jnp.maximum(tokens, 1.0)
        metrics["logp_exact_share"] = jnp.where(fresh > 0, exact / jnp.maximum(fresh, 1.0),
                                                jnp.nan)
        return metrics


def make_learner_step(graphdef: nnx.GraphDef, cfg: LearnerConfig, model_config: ModelConfig
                      ) -> Callable[[LearnerState, LearnerBatch], tuple[LearnerState, dict]]:
    """The pure step fn(state, batch) -> (state, metrics) that `Learner` jits on its mesh: the
    shared train step on `PolicyObjective`, then k ← the entropy controller's next k.

    A module-level function (not a method) so `hcjax.plan` can lower it on abstract inputs
    without building a Learner, whose constructor allocates the parameters.
    """
    train_step = make_train_step(
        model_forward(graphdef, head=not cfg.logprob_chunk), PolicyObjective(cfg, model_config.exact_tile),
        make_optimizer(cfg.optimizer()),
        model_cfg=model_config, load_balance_coef=cfg.load_balance_coef,
    )

    if cfg.router_bias_rate > 0 and not model_config.router_correction_bias:
        raise ValueError(f"LearnerConfig.router_bias_rate={cfg.router_bias_rate} needs a model "
                         "with a router correction bias (DeepSeek-V3 / Kimi families)")

    def learner_step(state: LearnerState, batch: LearnerBatch):
        k = state.entropy["k"]
        params, opt_state, metrics = train_step(state.params, state.opt_state, state.step, batch, k)
        if cfg.router_bias_rate > 0:
            load = metrics.pop("router_load")
            params = update_correction_bias(params, load, model_config, cfg.router_bias_rate)
            metrics["router_load_imbalance_max"] = jnp.max(
                jnp.max(load, -1) / jnp.maximum(jnp.mean(load, -1), 1e-9))
        k_next = cfg.entropy.next_k(k, metrics["entropy"])
        new_state = LearnerState(params=params, opt_state=opt_state, entropy={"k": k_next},
                                 step=state.step + 1)
        return new_state, dict(metrics, k=k, k_next=k_next)

    return learner_step


class Learner:
    """Holds the learner state on its mesh and runs jitted train steps on packed rollouts; the
    controller's learner (hcjax.rl.controller.Learner): `train(rollouts)` is one step."""

    def __init__(self, model: Transformer, cfg: LearnerConfig, mesh: Mesh):
        self.cfg = cfg
        self.mesh = mesh
        self.model_config = model.config
        self.graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise ValueError(f"the model holds non-parameter state {list(rest.keys())}; the "
                             "learner only trains nnx.Param variables")
        # Own copy, placed on the mesh: train steps donate the state, which must not delete the
        # arrays of the model passed in (callers keep using it, e.g. as the sampling policy).
        params = jax.tree.map(jnp.copy, shard_state(params, mesh))
        self.optimizer = make_optimizer(cfg.optimizer())
        # Born on the mesh (moments sharded like their params): see optimizer_state_on_mesh.
        opt_state = optimizer_state_on_mesh(self.optimizer, params, mesh)
        self.state = LearnerState(
            params=params,
            opt_state=opt_state,
            entropy={"k": replicated_scalar(np.float32(cfg.entropy.k), mesh)},
            step=replicated_scalar(np.int32(0), mesh),
        )
        self._state_sharding = jax.tree.map(lambda x: x.sharding, self.state)
        # fn(params, batch, k) -> (loss, grads, metrics) of the parameters given (no update).
        self.loss_and_grad = jax.jit(make_loss_and_grad(
            model_forward(self.graphdef, head=not cfg.logprob_chunk),
            PolicyObjective(cfg, model.config.exact_tile),
            model_cfg=model.config,
            load_balance_coef=cfg.load_balance_coef))
        self._step = jax.jit(make_learner_step(self.graphdef, cfg, model.config),
                             donate_argnums=0, out_shardings=(self._state_sharding, None))

    @property
    def data_parallel_size(self) -> int:
        return int(np.prod([self.mesh.shape[a] for a in batch_lib.BATCH_AXES
                            if a in self.mesh.axis_names]))

    def pack(self, rollouts: Sequence[Rollout], num_rows: int | None = None,
             policy_version: int | None = None) -> LearnerBatch:
        """Pack rollouts into a host (numpy) batch laid out for this learner: rows padded to a
        multiple of the micro-batch x data-parallel step, or `num_rows`. `policy_version`: the
        version the learner's weights were served as (`LearnerBatch.fresh`)."""
        cfg = self.cfg
        return batch_lib.pack_rollouts(
            rollouts, seq_len=cfg.seq_len, micro_batches=cfg.micro_batches,
            row_multiple=self.data_parallel_size, num_rows=num_rows,
            with_routing=cfg.replay_routing, mask_truncated=cfg.mask_truncated,
            align_segments=self.model_config.batch_invariant, fresh_version=policy_version,
        )

    def pack_bucketed(self, rollouts: Sequence[Rollout], policy_version: int | None = None
                      ) -> LearnerBatch | None:
        """`pack` with the rows padded by `batch.bucket_rows`, so only a handful of batch shapes
        is ever compiled; None when no rollout is usable (`batch.usable_rollouts`)."""
        cfg = self.cfg
        usable = batch_lib.usable_rollouts(rollouts, mask_truncated=cfg.mask_truncated)
        if not usable:
            return None
        probe = batch_lib.pack_rollouts(usable, seq_len=cfg.seq_len, with_routing=False,
                                        mask_truncated=cfg.mask_truncated,
                                        align_segments=self.model_config.batch_invariant)
        step = cfg.micro_batches * self.data_parallel_size
        return self.pack(usable, batch_lib.bucket_rows(max(1, probe.tokens.shape[1]), step),
                         policy_version)

    def make_batch(self, rollouts: Sequence[Rollout], num_rows: int | None = None) -> LearnerBatch:
        """`pack`, placed on this learner's mesh."""
        return batch_lib.to_device(self.pack(rollouts, num_rows), self.mesh)

    def step(self, batch: LearnerBatch | Sequence[Rollout]) -> dict[str, float]:
        """One optimiser step on a batch (host or device), or on rollouts packed here; host
        metrics."""
        if not isinstance(batch, LearnerBatch):
            batch = self.make_batch(batch)
        elif isinstance(batch.tokens, np.ndarray):
            batch = batch_lib.to_device(batch, self.mesh)
        self.state, metrics = self._step(self.state, batch)
        return {name: float(v) for name, v in jax.device_get(metrics).items()}

    def train(self, rollouts: Sequence[Rollout], policy_version: int | None = None
              ) -> Mapping[str, float]:
        """The controller's step: `pack_bucketed`, then `step`; {"skipped": 1.0} when no
        rollout is usable. `policy_version`: the version this learner's weights were served as
        (`controller.UNSERVED`, -1: not served; None: every token counts as sampled by them)."""
        batch = self.pack_bucketed(rollouts, policy_version)
        if batch is None:
            return {"skipped": 1.0}
        return {**self.step(batch), "rows": float(batch.rows),
                "train_rollouts": float(batch.num_sequences)}

    def model(self) -> Transformer:
        """The current model (sharing the learner's parameter arrays)."""
        return nnx.merge(self.graphdef, self.state.params)

    def params(self) -> Any:
        """The current parameter tree (what a weight push sends to inference)."""
        return self.state.params

    def restore(self, checkpointer, step: int) -> dict[str, Any]:
        """Restore `step` (or, if it is corrupt, the newest good step before it: see
        `checkpointer.restored_step`) into the learner state; returns the data state."""
        if resumed_layout_wrapped(checkpointer, step):
            # A climb saved before every job wrote plain dicts: its layout is the in-memory one.
            self.state, data = checkpointer.restore(step, self.state)
            return data
        saved, data = checkpointer.restore(step, state_on_disk(self.state))
        self.state = state_from_disk(self.state, saved)
        return data

    def save(self, checkpointer, step: int, data_state: dict[str, Any] | None = None,
             force: bool = False) -> bool:
        """`checkpointer.save(step, state, data_state, force)` of the state's on-disk form
        (`state_on_disk`); True when a save started."""
        return checkpointer.save(step, state_on_disk(self.state), data_state, force=force)

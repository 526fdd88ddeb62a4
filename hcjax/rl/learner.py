"""The sharded GRPO learner: replayed forward, micro-batched exact global loss, AdamW step.

The train step is one jit on the learner mesh. Per micro-batch it runs the model with the sampler's
expert routing forced (routing replay), rebuilds the sampler's top-p support and masks every other
logit to -inf (top-p replay), computes the chosen loss normalised by the *global* token count, and
accumulates gradients; then AdamW (RECIPE §3) and the entropy controller update k. It uses the
model only through its public forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from hcjax.model import Transformer, load_balance_loss, shard_state
from hcjax.rl import batch as batch_lib
from hcjax.rl.batch import LearnerBatch
from hcjax.rl.entropy import EntropyController, update_k
from hcjax.rl.losses import LossConfig, combine_metrics
from hcjax.rollout.records import Rollout, support_mask_from_record
from hcjax.sharding import optimizer_state_on_mesh, replicated_scalar

__all__ = [
    "Learner",
    "LearnerConfig",
    "LearnerState",
    "make_loss_and_grad",
    "make_optimizer",
    "make_train_step",
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LearnerState:
    """Everything a checkpoint needs: parameters, optimiser state, controller state, step."""

    params: nnx.State
    opt_state: optax.OptState
    entropy: dict  # {"k": float32 scalar}
    step: jax.Array


def make_optimizer(cfg: LearnerConfig) -> optax.GradientTransformation:
    """AdamW (β1 = β2 = 0.95, eps 1e-15, no weight decay, constant LR), optional global clip."""
    adamw = optax.adamw(
        cfg.learning_rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.adam_eps, weight_decay=cfg.weight_decay
    )
    if cfg.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)


def token_logprobs(logits_btv, targets_bt, temperature_bt, n_kept_bt, replay_top_p: bool):
    """log π(target) under the sampler's distribution: temperature, then the replayed support.

    Returns (logp [B, T], support_miss [B, T] bool). The target is always kept in the support: if
    learner and sampler rank the logits differently enough that the sampled token falls outside
    the learner's top-n_kept, a -inf log-prob would poison the step, so we keep it and count it.
    """
    # Divide (not multiply by 1/T) exactly as the sampler does, so ranks and ties match bit for bit.
    logits = logits_btv / temperature_bt[..., None]
    target_logit = jnp.take_along_axis(logits, targets_bt[..., None], axis=-1)[..., 0]
    if not replay_top_p:
        return target_logit - jax.nn.logsumexp(logits, axis=-1), jnp.zeros(targets_bt.shape, bool)
    keep = support_mask_from_record(jax.lax.stop_gradient(logits), n_kept_bt)
    is_target = jnp.arange(logits.shape[-1]) == targets_bt[..., None]
    miss = ~jnp.any(keep & is_target, axis=-1)
    logits = jnp.where(keep | is_target, logits, -jnp.inf)
    return target_logit - jax.nn.logsumexp(logits, axis=-1), miss


def _micro(batch: LearnerBatch, i) -> LearnerBatch:
    """The i-th micro-batch (leading axis dropped); totals stay global."""

    def take(name, x):
        if x is None or name in ("num_tokens", "num_sequences"):
            return x
        return x[i]

    return LearnerBatch(**{f.name: take(f.name, getattr(batch, f.name))
                           for f in dataclasses.fields(batch)})


def _routing_counts(routing_mlbtk, segment_ids_mbt, num_experts: int):
    """[L, E] expert assignment counts over valid tokens of all micro-batches, from the record."""
    valid = (segment_ids_mbt > 0).astype(jnp.float32)
    weight = jnp.broadcast_to(valid[:, None, :, :, None], routing_mlbtk.shape)
    layer = jnp.broadcast_to(
        jnp.arange(routing_mlbtk.shape[1])[None, :, None, None, None], routing_mlbtk.shape
    )
    # A scatter-add, not a one-hot: [M, L, b, T, k, E] would not fit at 512 experts.
    counts = jnp.zeros((routing_mlbtk.shape[1], num_experts), jnp.float32)
    return counts.at[layer, routing_mlbtk].add(weight)


def make_loss_and_grad(
    graphdef: nnx.GraphDef, cfg: LearnerConfig, *, num_experts: int, experts_per_token: int
) -> Callable:
    """fn(params, batch, k) -> (total_loss, grads, metrics) over all micro-batches of `batch`.

    Every micro-batch's loss is its share of the global objective (global token counts; for the
    load-balance loss, the global expert counts), so the sum over micro-batches is exactly the
    loss of the whole batch in one pass, whatever the split.
    """
    loss_fn = cfg.loss.make()

    def forward(params, mb: LearnerBatch):
        model = nnx.merge(graphdef, params)
        routing = None
        if cfg.replay_routing and mb.routing is not None:
            routing = tuple(mb.routing[layer] for layer in range(mb.routing.shape[0]))
        return model(mb.tokens, positions=mb.positions, segment_ids=mb.segment_ids, routing=routing)

    def global_expert_counts(params, batch: LearnerBatch):
        """[L, E] counts over the whole batch, needed before any micro-batch's LB gradient.

        None for a single micro-batch: its own counts are the global ones.
        """
        if batch.micro_batches == 1:
            return None
        if cfg.replay_routing and batch.routing is not None:
            return _routing_counts(batch.routing, batch.segment_ids, num_experts)

        def count(_, i):  # no routing record: a forward-only pass finds the experts
            stats = forward(params, _micro(batch, i)).moe_stats
            return None, jnp.stack([s[0] for s in stats]) if stats else jnp.zeros((0, num_experts))

        _, counts = jax.lax.scan(count, None, jnp.arange(batch.micro_batches))
        return jnp.sum(jax.lax.stop_gradient(counts), axis=0)

    def micro_loss(params, mb: LearnerBatch, k, counts, num_valid):
        out = forward(params, mb)
        logp, miss = token_logprobs(
            out.logits, mb.targets, mb.temperature, mb.n_kept, cfg.replay_top_p
        )
        policy_loss, metrics = loss_fn(
            logp, mb.old_logp, mb.advantages, mb.loss_mask, k=k, num_tokens=mb.num_tokens,
            num_sequences=mb.num_sequences, segment_ids=mb.segment_ids,
        )
        # This micro-batch's share of the global-batch LB loss E·Σ f_e·P_e: f_e from the global
        # counts, P_e from its own router probabilities over the global token count.
        if out.moe_stats:
            if counts is None:
                counts = jnp.stack([stats[0] for stats in out.moe_stats])
            lb = jnp.mean(jnp.stack([
                load_balance_loss(counts[layer], stats[1], num_valid, experts_per_token)
                for layer, stats in enumerate(out.moe_stats)
            ]))
        else:
            lb = jnp.zeros((), jnp.float32)
        m = mb.loss_mask.astype(jnp.float32)
        gap = jnp.abs(jax.lax.stop_gradient(logp) - mb.old_logp)
        metrics = dict(
            metrics,
            policy_loss=policy_loss,
            load_balance_loss=lb,
            support_miss_frac=jnp.sum(jnp.where(mb.loss_mask & miss, 1.0, 0.0)) / mb.num_tokens,
        )
        first = dict(
            gap_sum=jnp.sum(m * gap), gap_max=jnp.max(jnp.where(mb.loss_mask, gap, 0.0)),
            tokens=jnp.sum(m),
        )
        return policy_loss + cfg.load_balance_coef * lb, (metrics, first)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def loss_and_grad(params, batch: LearnerBatch, k):
        counts = global_expert_counts(params, batch)
        num_valid = jnp.sum((batch.segment_ids > 0).astype(jnp.float32))
        zeros = jax.tree.map(jnp.zeros_like, params)

        def body(acc, i):
            (loss, (metrics, first)), grads = grad_fn(params, _micro(batch, i), k, counts, num_valid)
            acc = jax.tree.map(jnp.add, acc, grads)
            return acc, (loss, metrics, first)

        grads, (losses, metrics, first) = jax.lax.scan(body, zeros, jnp.arange(batch.micro_batches))
        parts = [jax.tree.map(lambda x, j=j: x[j], metrics) for j in range(batch.micro_batches)]
        metrics = combine_metrics(parts)
        # Train-inference log-prob gap on the first micro-batch: θ is the sampling policy there.
        metrics["logp_gap_mean"] = first["gap_sum"][0] / jnp.maximum(first["tokens"][0], 1.0)
        metrics["logp_gap_max"] = first["gap_max"][0]
        return jnp.sum(losses), grads, metrics

    return loss_and_grad


def make_train_step(graphdef: nnx.GraphDef, cfg: LearnerConfig, model_config) -> Callable:
    """The pure step fn(state, batch) -> (state, metrics) that `Learner` jits on its mesh.

    A module-level function (not a method) so `hcjax.plan` can lower it on abstract inputs
    without building a Learner, whose constructor allocates the parameters.
    """
    optimizer = make_optimizer(cfg)
    loss_and_grad = make_loss_and_grad(
        graphdef, cfg, num_experts=model_config.num_experts,
        experts_per_token=model_config.experts_per_token,
    )

    def train_step(state: LearnerState, batch: LearnerBatch):
        k = state.entropy["k"]
        loss, grads, metrics = loss_and_grad(state.params, batch, k)
        grad_norm = optax.global_norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        ent = cfg.entropy
        k_next = update_k(k, metrics["entropy"], target=ent.target, delta=ent.delta,
                          k_max=ent.k_max)
        metrics = dict(metrics, loss=loss, grad_norm=grad_norm, k=k, k_next=k_next)
        new_state = LearnerState(params=params, opt_state=opt_state, entropy={"k": k_next},
                                 step=state.step + 1)
        return new_state, metrics

    return train_step


class Learner:
    """Holds the learner state on its mesh and runs jitted train steps on packed rollouts."""

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
        self.optimizer = make_optimizer(cfg)
        # Born on the mesh (moments sharded like their params): see optimizer_state_on_mesh.
        opt_state = optimizer_state_on_mesh(self.optimizer, params, mesh)
        self.state = LearnerState(
            params=params,
            opt_state=opt_state,
            entropy={"k": replicated_scalar(np.float32(cfg.entropy.k), mesh)},
            step=replicated_scalar(np.int32(0), mesh),
        )
        self._state_sharding = jax.tree.map(lambda x: x.sharding, self.state)
        mc = model.config
        self._loss_and_grad = make_loss_and_grad(
            self.graphdef, cfg, num_experts=mc.num_experts, experts_per_token=mc.experts_per_token
        )
        self.loss_and_grad = jax.jit(self._loss_and_grad)
        self._train_step = make_train_step(self.graphdef, cfg, mc)
        self._step = jax.jit(self._train_step, donate_argnums=0,
                             out_shardings=(self._state_sharding, None))

    @property
    def data_parallel_size(self) -> int:
        return int(np.prod([self.mesh.shape[a] for a in batch_lib.BATCH_AXES
                            if a in self.mesh.axis_names]))

    def make_batch(self, rollouts: Sequence[Rollout], num_rows: int | None = None) -> LearnerBatch:
        """Pack rollouts into a device batch laid out for this learner's mesh and config."""
        packed = batch_lib.pack_rollouts(
            rollouts, seq_len=self.cfg.seq_len, micro_batches=self.cfg.micro_batches,
            row_multiple=self.data_parallel_size, num_rows=num_rows,
            with_routing=self.cfg.replay_routing, mask_truncated=self.cfg.mask_truncated,
        )
        return batch_lib.to_device(packed, self.mesh)

    def step(self, batch: LearnerBatch | Sequence[Rollout]) -> dict[str, float]:
        """One optimiser step on a device batch (or rollouts, packed here); host metrics."""
        if not isinstance(batch, LearnerBatch):
            batch = self.make_batch(batch)
        self.state, metrics = self._step(self.state, batch)
        return {name: float(v) for name, v in jax.device_get(metrics).items()}

    def model(self) -> Transformer:
        """The current model (sharing the learner's parameter arrays)."""
        return nnx.merge(self.graphdef, self.state.params)

    def params(self) -> Any:
        """The current parameter tree (what a weight push sends to inference)."""
        return self.state.params

    def restore(self, checkpointer, step: int) -> dict[str, Any]:
        """Restore `step` (or, if it is corrupt, the newest good step before it: see
        `checkpointer.restored_step`) into the learner state; returns the data state."""
        self.state, data = checkpointer.restore(step, self.state)
        return data

    def save(self, checkpointer, step: int, data_state: dict[str, Any] | None = None,
             force: bool = False) -> bool:
        """`checkpointer.save(step, state, data_state, force)`; True when a save started."""
        return checkpointer.save(step, self.state, data_state, force=force)

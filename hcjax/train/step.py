"""The train step every job shares (SFT, DPO, RL): AdamW built from one optimiser config, the
micro-batch loop with exact gradient accumulation, the exact global-batch load-balance loss, and
the update. A job differs only by its `Objective` (its loss and how its batch splits into
micro-batches); this module knows no job, no loss and no batch layout, and holds no state.

Exactness under micro-batches: every micro-batch's loss is its share of the loss of the whole
batch (global normalisers), so the accumulated gradient is the whole batch's. The load-balance
loss E·Σ_e f_e·P_e (RECIPE §2: statistics over the global batch) is linear in each micro-batch's
router probabilities P once the expert counts f, which carry no gradient, are known for the whole
batch; they come from the batch's routing record when it carries one, else from a forward-only
pass over the micro-batches before the gradient pass.

Memory: with scanned layers rematerialised "full" or "full_compute" (`ModelConfig.
accumulate_in_scan`), each micro-batch's backward adds the scanned layers' gradients into the
running sum in place, layer by layer (`Transformer(grad_accumulator=...)`), instead of producing
a second gradient-sized buffer that is added after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from hcjax.model import ModelConfig, load_balance_loss
from hcjax.model.config import FULL_REMAT

__all__ = [
    "Objective",
    "OptimizerConfig",
    "combine_metrics",
    "expert_counts_from_record",
    "make_loss_and_grad",
    "make_optimizer",
    "make_train_step",
    "model_forward",
]

Metrics = dict[str, jax.Array]
# fn(params, inputs, dropout_rng) -> the model's output (hcjax.model.ModelOutput).
Forward = Callable[[Any, Mapping[str, jax.Array], jax.Array | None], Any]


# The optimiser ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW, optionally after global-norm gradient clipping, at a constant learning rate or on a
    linear warm-up then cosine schedule. The jobs derive theirs from their gin configs
    (`LearnerConfig.optimizer()`: RECIPE §3's constant-LR AdamW; the training loop's
    `AdamWConfig.optimizer(num_steps)`: the self-distillation schedule with weight decay on
    matrices only).

    end_learning_rate: None for a constant `learning_rate`; else the schedule warms up linearly
    from 0 over `warmup_steps` (none: it starts at the peak) to `learning_rate`, then decays by a
    cosine to `end_learning_rate` at `total_steps` (warm-up included).
    decay_matrices_only: weight decay on parameters of rank >= 2 only (not norm gains).
    """

    learning_rate: float
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decay_matrices_only: bool = False
    max_grad_norm: float | None = None  # None: no clipping
    end_learning_rate: float | None = None
    warmup_steps: int = 0
    total_steps: int = 0

    def __post_init__(self) -> None:
        if self.learning_rate < 0:
            raise ValueError(f"OptimizerConfig.learning_rate={self.learning_rate} must be >= 0")
        if self.end_learning_rate is not None and self.end_learning_rate < 0:
            raise ValueError(f"OptimizerConfig.end_learning_rate={self.end_learning_rate} must "
                             "be >= 0 or None")
        if self.warmup_steps < 0 or self.total_steps < 0:
            raise ValueError(f"OptimizerConfig warmup_steps={self.warmup_steps}, total_steps="
                             f"{self.total_steps} must be >= 0")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"OptimizerConfig.max_grad_norm={self.max_grad_norm} must be > 0 "
                             "or None")

    def schedule(self) -> float | optax.Schedule:
        """The learning rate: a float (constant) or a function of the step."""
        if self.end_learning_rate is None:
            return self.learning_rate
        warmup = self.warmup_steps
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0 if warmup else self.learning_rate,
            peak_value=self.learning_rate,
            warmup_steps=warmup,
            decay_steps=max(self.total_steps, warmup + 1),
            end_value=self.end_learning_rate,
        )

    def learning_rate_at(self, step: int) -> float:
        schedule = self.schedule()
        return float(schedule(step)) if callable(schedule) else float(schedule)


def _matrices(params: Any) -> Any:
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """AdamW after `clip_by_global_norm` when `cfg.max_grad_norm` is set (a bare AdamW when not:
    its state is then AdamW's own, as checkpoints of either layout expect)."""
    adamw = optax.adamw(cfg.schedule(), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay,
                        mask=_matrices if cfg.decay_matrices_only else None)
    if cfg.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)


# What a job supplies -----------------------------------------------------------------------------
class Objective:
    """What one kind of training optimises; SFT, DPO and RL each subclass it.

    `split(batch)` gives (inputs, data), every leaf with a leading micro-batch axis M: `inputs`
    are what the model reads (tokens, positions, segment_ids [M, b, T]; optionally routing
    [M, L, b, T, k], a routing record the forward replays and the load-balance counts come
    from); `data` is whatever `loss` needs beside the model's output. `context(batch,
    loss_state)` computes once per step what every micro-batch's loss shares (global totals;
    `loss_state` is the loss's own state, e.g. GRPO's clip offset k). `loss(out, inputs, data,
    ctx)` returns this micro-batch's *share* of the whole batch's loss, and metrics that are
    shares too. `summarise(parts, ctx)` turns the per-micro-batch metrics ([M] each, the step's
    `loss` and `load_balance_loss` among them) into the step's.
    """

    def split(self, batch: Any) -> tuple[dict[str, jax.Array], Any]:
        raise NotImplementedError

    def context(self, batch: Any, loss_state: Any) -> Any:
        return None

    def loss(self, out: Any, inputs: Mapping[str, jax.Array], data: Any, ctx: Any
             ) -> tuple[jax.Array, Metrics]:
        raise NotImplementedError

    def summarise(self, parts: Metrics, ctx: Any) -> Metrics:
        return combine_metrics(parts)


def combine_metrics(parts: Mapping[str, jax.Array]) -> Metrics:
    """Per-part metrics stacked on a leading axis -> the whole batch's: each is the part's share
    of a global figure and adds up, except those named `*_max`, which combine by max."""
    return {name: jnp.max(x, axis=0) if name.endswith("_max") else jnp.sum(x, axis=0)
            for name, x in parts.items()}


def model_forward(graphdef: nnx.GraphDef, rest: Any = None, *, head: bool = True) -> Forward:
    """fn(params, inputs, dropout_rng) -> the model's output on one micro-batch's `inputs` (see
    `Objective.split`), replaying `inputs["routing"]` when it is there. `rest`: the model's
    non-parameter state, if any. head=False: no logits, the head's input and weight instead
    (`ModelOutput.hidden`, `head_weight`), for an objective that forms them in slices."""

    def forward(params, inputs, dropout_rng):
        model = nnx.merge(graphdef, params) if rest is None else nnx.merge(graphdef, params, rest)
        routing = inputs.get("routing")
        if routing is not None:
            routing = tuple(routing[layer] for layer in range(routing.shape[0]))
        acc = inputs.get("grad_accumulator")
        return model(inputs["tokens"], positions=inputs["positions"],
                     segment_ids=inputs["segment_ids"], routing=routing, dropout_rng=dropout_rng,
                     head=head, grad_accumulator=None if acc is None else acc["scan_blocks"])

    return forward


def expert_counts_from_record(routing_mlbtk: jax.Array, segment_ids_mbt: jax.Array,
                              num_experts: int) -> jax.Array:
    """[L, E] expert assignment counts over the valid tokens of all micro-batches, read from a
    routing record [M, L, b, T, k]."""
    valid = (segment_ids_mbt > 0).astype(jnp.float32)
    weight = jnp.broadcast_to(valid[..., None], routing_mlbtk[:, 0].shape).reshape(-1)

    # One layer at a time, a scatter-add (not a one-hot: [M, L, b, T, k, E] would not fit at 512
    # experts): whole-record index arrays [M, L, b, T, k] with k minor were held padded 16x in
    # TPU tiles (6 GB each for Qwen3-30B-A3B at 8 x 16 x 8192 on v5p:4x4x4).
    def layer(i, counts):
        chosen = jax.lax.dynamic_index_in_dim(routing_mlbtk, i, axis=1, keepdims=False)
        one = jnp.zeros((num_experts,), jnp.float32).at[chosen.reshape(-1)].add(weight)
        return counts.at[i].set(one)

    num_layers = routing_mlbtk.shape[1]
    return jax.lax.fori_loop(0, num_layers, layer,
                             jnp.zeros((num_layers, num_experts), jnp.float32))


def _in_scan(path) -> bool:
    """Whether a params-tree path is inside the scanned layers (`Transformer.scan_blocks`)."""
    return bool(path) and getattr(path[0], "key", None) == "scan_blocks"


# The step --------------------------------------------------------------------------------------
def make_loss_and_grad(forward: Forward, objective: Objective, *, model_cfg: ModelConfig,
                       load_balance_coef: float, dropout_seed: int | None = None) -> Callable:
    """fn(params, batch, loss_state=None, step=0) -> (loss, grads, metrics) over every
    micro-batch of `batch`: the loss and gradient of the whole batch in one pass, whatever the
    split. Each micro-batch's loss is `objective.loss` plus load_balance_coef times its share of
    the global load-balance loss. dropout_seed: dropout masks from (seed, step, micro-batch) when
    the model has dropout; None runs the model deterministically (DPO and RL)."""
    num_experts, top_k = model_cfg.num_experts, model_cfg.experts_per_token
    has_moe = model_cfg.num_moe_layers > 0
    use_dropout = dropout_seed is not None and model_cfg.dropout_rate > 0
    base_key = jax.random.key(dropout_seed) if use_dropout else None

    def accumulate_in_scan(params):
        return (model_cfg.scan_layers and model_cfg.accumulate_in_scan
                and model_cfg.remat_policy in FULL_REMAT
                and any(_in_scan(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)))

    def global_expert_counts(params, inputs, keys, m):
        """[L, E] counts over the whole batch, needed before any micro-batch's LB gradient; None
        for one micro-batch, whose own counts are the global ones."""
        if m == 1 or not has_moe:
            return None
        if "routing" in inputs:
            return expert_counts_from_record(inputs["routing"], inputs["segment_ids"],
                                             num_experts)

        def count(acc, xs):  # no routing record: a forward-only pass finds the experts
            x, key = xs
            stats = forward(params, x, key).moe_stats
            return acc + jnp.stack([s[0] for s in stats]), None

        zero = jnp.zeros((model_cfg.num_moe_layers, num_experts), jnp.float32)
        counts, _ = jax.lax.scan(count, zero, (inputs, keys))
        return jax.lax.stop_gradient(counts)

    def load_balance_share(moe_stats, counts, num_valid):
        """This micro-batch's share of the global LB loss E·Σ f_e·P_e: f_e from the global
        counts, P_e from its own router probabilities over the global token count."""
        if not moe_stats:
            return jnp.zeros((), jnp.float32)
        if counts is None:
            counts = jnp.stack([s[0] for s in moe_stats])
        return jnp.mean(jnp.stack([load_balance_loss(counts[layer], s[1], num_valid, top_k)
                                   for layer, s in enumerate(moe_stats)]))

    def loss_and_grad(params, batch, loss_state=None, step=0):
        inputs, data = objective.split(batch)
        ctx = objective.context(batch, loss_state)
        m = inputs["tokens"].shape[0]
        keys = None
        if use_dropout:
            keys = jax.random.split(jax.random.fold_in(base_key, step), m)
        counts = global_expert_counts(params, inputs, keys, m)
        num_valid = jnp.sum((inputs["segment_ids"] > 0).astype(jnp.float32))

        def micro_loss(params, x, d, key):
            out = forward(params, x, key)
            loss, metrics = objective.loss(out, x, d, ctx)
            lb = load_balance_share(out.moe_stats, counts, num_valid)
            total = loss + load_balance_coef * lb
            return total, dict(metrics, loss=total, load_balance_loss=lb)

        grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
        if m > 1 and accumulate_in_scan(params):
            # The scanned layers' gradients are added into the running sum inside the backward
            # (Transformer(grad_accumulator=...)): the gradient with respect to the sum is the
            # new sum for those leaves; the rest add theirs as usual.
            def micro_loss_into(params, acc, x, d, key):
                return micro_loss(params, dict(x, grad_accumulator=acc), d, key)

            grad_into = jax.value_and_grad(micro_loss_into, argnums=(0, 1), has_aux=True)

            def body(acc, xs):
                x, d, key = xs
                (_, metrics), (g, g_acc) = grad_into(params, acc, x, d, key)
                return jax.tree_util.tree_map_with_path(
                    lambda path, a, g, s: s if _in_scan(path) else a + g, acc, g, g_acc), metrics

            zeros = jax.tree.map(jnp.zeros_like, params)
            grads, parts = jax.lax.scan(body, zeros, (inputs, data, keys))
        elif m == 1:
            first = lambda tree: jax.tree.map(lambda x: x[0], tree)
            (_, parts), grads = grad_fn(params, first(inputs), first(data), first(keys))
            parts = jax.tree.map(lambda x: x[None], parts)
        else:

            def body(acc, xs):
                x, d, key = xs
                (_, metrics), g = grad_fn(params, x, d, key)
                return jax.tree.map(jnp.add, acc, g), metrics

            zeros = jax.tree.map(jnp.zeros_like, params)
            grads, parts = jax.lax.scan(body, zeros, (inputs, data, keys))
        return jnp.sum(parts["loss"]), grads, objective.summarise(parts, ctx)

    return loss_and_grad


def make_train_step(forward: Forward, objective: Objective,
                    optimizer: optax.GradientTransformation, *, model_cfg: ModelConfig,
                    load_balance_coef: float, dropout_seed: int | None = None) -> Callable:
    """fn(params, opt_state, step, batch, loss_state=None) -> (params, opt_state, metrics): one
    optimiser step on the whole batch (`make_loss_and_grad`), metrics of the parameters before
    it plus `grad_norm`. Jobs keep their own state containers around it (their checkpoints'
    layouts) and jit it with their shardings."""
    loss_and_grad = make_loss_and_grad(forward, objective, model_cfg=model_cfg,
                                       load_balance_coef=load_balance_coef,
                                       dropout_seed=dropout_seed)

    def train_step(params, opt_state, step, batch, loss_state=None):
        _, grads, metrics = loss_and_grad(params, batch, loss_state, step)
        grad_norm = optax.global_norm(grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, dict(metrics, grad_norm=grad_norm)

    return train_step
